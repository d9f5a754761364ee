"""Typed settings from any config source: one reader for the sidecar (TOML, environment, flags) and the vLLM
connector (``kv_connector_extra_config``), so that a value means the same wherever it is written."""

from __future__ import annotations

from dataclasses import Field, fields
from typing import Any

from kvferry.common.errors import InvalidInput

TRUE = ("true", "1", "yes", "on")
FALSE = ("false", "0", "no", "off")


def read_setting(name: str, kind: str, raw: Any) -> bool | int | float | str:
    """``raw`` as ``kind`` ("bool", "int", "float" or "str"). Text is read as config files and environments write
    it; a boolean is one of TRUE or FALSE (any case), never a guess: "flase" is refused, not read as false."""
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text not in TRUE + FALSE:
            raise InvalidInput(
                f"{name}: expected true or false (or {'/'.join(TRUE[1:])}, {'/'.join(FALSE[1:])}), got {raw!r}"
            )
        return text in TRUE
    if kind in ("int", "float"):
        if isinstance(raw, bool):  # int(True) is 1: a boolean where a number belongs is a mistake
            raise InvalidInput(f"{name}: expected a number, got {raw!r}")
        try:
            value = int(raw) if kind == "int" else float(raw)
        except (TypeError, ValueError, OverflowError):
            raise InvalidInput(f"{name}: cannot read {raw!r} as {kind}") from None
        if value != value:
            raise InvalidInput(f"{name}: expected a number, got {raw!r}")
        return value
    return str(raw)


def check_range(name: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    """Refuse ``value`` outside [low, high] ((low, high] with ``low_open``), NaN and infinities included, naming the
    accepted range."""
    ok = value == value and (low < value if low_open else low <= value) and value <= high
    if not ok:
        raise InvalidInput(f"{name} must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value!r}")


def read_settings(cls: type, values: dict[str, Any], what: str) -> dict[str, Any]:
    """``values`` typed by the fields of the dataclass ``cls``; an unknown name is refused, naming ``what``."""
    known: dict[str, Field] = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise InvalidInput(f"unknown {what}: {', '.join(unknown)}")
    return {k: read_setting(k, str(known[k].type), v) for k, v in values.items()}
