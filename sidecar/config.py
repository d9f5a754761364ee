"""The sidecar's one typed config. CLI flags, environment (KVFERRY_*) and an optional TOML file
only fill it in; every field is validated here, once."""

from __future__ import annotations

import argparse
import itertools
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from kvferry.common.channel import MAX_MESSAGE_BYTES
from kvferry.common.errors import InvalidInput
from kvferry.common.files import read_secret_text
from kvferry.common.settings import check_range, read_settings
from kvferry.common.stores import STORE_SCHEMES
from kvferry.common.urls import check_store_url
from kvferry.mappings.gate_bars import GATE_ARM, MARGINAL, MAX_COMPLETION_DROP, MAX_KL, MIN_COPY_RETENTION, MIN_TOP10

if TYPE_CHECKING:
    from kvferry.mappings.gates import Gates

    from .limits import Limits

HOUR, DAY, YEAR = 3600.0, 86400.0, 365 * 86400.0
"""Upper bounds of the durations below: a value past them is a typo, not a setting."""


@dataclass(frozen=True)
class SidecarConfig:
    """Everything ``kvferry serve`` needs."""

    maps_dir: str = "maps"
    """Registry root: <maps_dir>/<source>__<target>/<version>/."""
    host: str = "127.0.0.1"
    """Address to bind the gRPC server to (0.0.0.0 in a pod)."""
    port: int = 50551
    """gRPC port; 0 picks a free one."""
    metrics_port: int = -1
    """Prometheus /metrics port on the same host; -1 disables it, 0 picks a free one."""
    max_message_bytes: int = MAX_MESSAGE_BYTES
    """gRPC max send/receive message size (the 4 MiB default is too small for KV chunks)."""
    max_streams: int = 64
    """Concurrent Translate streams; past this, RESOURCE_EXHAUSTED with a retry hint."""
    max_tokens: int = 131072
    """Most tokens one request may translate."""
    max_request_bytes: int = 2 << 30
    """Most source KV bytes one request may declare."""
    gate_arm: str = GATE_ARM
    """Which evaluated arm the serving gates read."""
    gate_min_top10: float = MIN_TOP10
    """Serving gate: minimum top-10 overlap of that arm."""
    gate_max_kl: float = MAX_KL
    """Serving gate: maximum KL of that arm."""
    gate_min_copy_retention: float = MIN_COPY_RETENTION
    """Long-range serving gate: share of the target's own copy-probe accuracy the arm must keep at every gap
    (0 turns it off; a map without copy-probe evidence does not serve while it is on)."""
    gate_marginal: str = MARGINAL
    """What a marginal gated measure does (its bar inside its 95% interval over prompts): "refuse" blocks the map,
    "serve" lets it pass (kvferry.mappings.gates.Gates.marginal)."""
    gate_max_completion_drop: float = MAX_COMPLETION_DROP
    """Downstream serving gate: how far below the target's own exact-match rate on the completion task the arm may
    fall, where the evidence has that task."""
    force_maps: bool = False
    """Serve maps whose evidence fails the gates (testing only)."""
    reload_seconds: float = 10.0
    """How often the map directory is rescanned for new versions; 0 disables rescans."""
    drain_seconds: float = 20.0
    """On SIGTERM: how long in-flight streams get to finish before the server stops."""
    drain_notice_seconds: float = 2.0
    """On SIGTERM: how long health reports NOT_SERVING (new streams get UNAVAILABLE) before the listener closes."""
    device: str = "cpu"
    """Torch device the maps run on ("cpu", "cuda", "cuda:1")."""
    threads: int = 0
    """Torch CPU threads; 0 leaves torch's default."""
    map_threads: int = 0
    """Token lanes a translation is mapped in, each a thread running torch on one core (compute.py, lanes.py); 0: as
    many as torch has CPU threads (``threads`` or torch's default); 1: the compute thread alone, on torch's intra-op
    pool. Lanes stall less than torch's pool while transfers share the cores.
    Off a CPU, 1."""
    tls_cert: str = ""
    """PEM server certificate; with tls_key, serve TLS."""
    tls_key: str = ""
    """PEM server private key."""
    tls_client_ca: str = ""
    """PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS)."""
    auth_tokens_file: str = ""
    """File of '<tenant> <token>' lines (a mounted Secret); when set, kvferry calls need 'authorization: Bearer <token>'
    and the token's tenant is the caller's prefix-store namespace."""
    auth_mtls_tenant: bool = False
    """With mutual TLS and no tokens: the client certificate's common name is the caller's tenant."""
    max_stream_seconds: float = 300.0
    """Server-side deadline of one Translate stream, on top of the client's; past it, DEADLINE_EXCEEDED."""
    redis_url: str = ""
    """Shared prefix store: redis://[user@]host:port/db or rediss:// (TLS); empty uses the in-process store."""
    redis_password: str = ""
    """Redis password (prefer redis_password_file, or the env KVFERRY_REDIS_PASSWORD, over a flag)."""
    redis_password_file: str = ""
    """File holding the Redis password (a mounted Secret)."""
    prefix_cache: bool = True
    """Reuse and publish mapped prefix blocks (needs token_ids in requests)."""
    prefix_secret: str = ""
    """HMAC key of prefix block hashes; required (or prefix_secret_file) with redis_url so every pod derives the same
    keys."""
    prefix_secret_file: str = ""
    """File holding the prefix HMAC key (a mounted Secret)."""
    prefix_write_back: bool = False
    """Write a *streamed* translation's mapped blocks to the prefix store. Off by default: a streamed request's
    source KV is the caller's own claim, and stored under its token ids it would become the answer of every later
    caller of the tenant asking for the same tokens (cache poisoning). Turn it on only where every caller that
    can reach the sidecar is trusted to publish. Key-only translations (mapped from source blocks published
    under the prefix secret) are always written back; streamed requests always read stored blocks."""
    prefix_block_size: int = 256
    """Tokens per prefix block."""
    prefix_ttl_seconds: float = 3600.0
    """Lifetime of a stored block."""
    prefix_store_timeout_seconds: float = 1.0
    """How long one call to the prefix store may take: a store that does not answer in time counts as down (a miss
    for streamed requests, UNAVAILABLE for key-only ones)."""
    prefix_probe_seconds: float = 0.1
    """The most a streamed request waits on the prefix store: for its first answer (which of the request's blocks are
    stored, one EXISTS round trip). A store that answers in time is alive, and its stored blocks are then read within
    prefix_store_timeout_seconds; a store that does not is a miss for this request (the probe still ends on the
    store's own timeout, which opens the circuit). A streamed request carries its source KV, so a hung store costs it
    this long at most. 0: streamed requests never consult the store. At most prefix_store_timeout_seconds."""
    prefix_store_cooldown_seconds: float = 10.0
    """After the prefix store fails, how long it is not called at all (its circuit is open: metrics
    kvferry_prefix_store_open, health service kvferry.v1.PrefixStore NOT_SERVING); 0 calls it every time."""
    prefix_max_blob_bytes: int = 64 << 20
    """Largest block blob written to the store."""
    prefix_memory_bytes: int = 512 << 20
    """Byte budget of the in-process prefix store (used without redis_url)."""
    shm_dir: str = ""
    """A folder shared with the model server's container alone (a memory-backed volume): a caller may name a file
    there (TranslateHeader.response_region) for the response's tensor bytes, which then skip gRPC's copies. Empty:
    such requests are answered in the messages."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535 or not -1 <= self.metrics_port <= 65535:
            raise InvalidInput("port must be in [0, 65535] and metrics_port in [-1, 65535]")
        if self.max_message_bytes < 1 << 20:
            raise InvalidInput("max_message_bytes must be at least 1 MiB")
        if self.threads < 0 or self.map_threads < 0:
            raise InvalidInput("threads and map_threads must be >= 0 (0: torch's CPU thread count)")
        if self.max_streams < 1:
            raise InvalidInput("max_streams must be >= 1")
        check_range("reload_seconds", self.reload_seconds, 0, DAY)
        check_range("drain_seconds", self.drain_seconds, 0, HOUR)
        check_range("drain_notice_seconds", self.drain_notice_seconds, 0, HOUR)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidInput("tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise InvalidInput("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        if self.auth_mtls_tenant and not self.tls_client_ca:
            raise InvalidInput(
                "auth_mtls_tenant takes the tenant from client certificates: set tls_client_ca (mutual TLS)"
            )
        check_range("max_stream_seconds", self.max_stream_seconds, 0, DAY, low_open=True)
        if self.redis_url and not self.redis_url.startswith(STORE_SCHEMES):
            raise InvalidInput(f"redis_url must start with one of {', '.join(STORE_SCHEMES)}")
        if self.redis_url:
            try:
                check_store_url(self.redis_url)
            except ValueError as e:
                raise InvalidInput(f"redis_url: {e}") from None
        if self.redis_url and self.prefix_cache and not (self.prefix_secret or self.prefix_secret_file):
            raise InvalidInput(
                "a shared prefix store needs prefix_secret (env KVFERRY_PREFIX_SECRET): every pod must "
                "derive the same keys, and nobody else should"
            )
        if self.prefix_block_size < 1 or self.prefix_memory_bytes < 1:
            raise InvalidInput("prefix_block_size and prefix_memory_bytes must be positive")
        check_range("prefix_ttl_seconds", self.prefix_ttl_seconds, 0, YEAR, low_open=True)
        check_range("prefix_store_timeout_seconds", self.prefix_store_timeout_seconds, 0, 60, low_open=True)
        check_range("prefix_probe_seconds", self.prefix_probe_seconds, 0, self.prefix_store_timeout_seconds)
        check_range("prefix_store_cooldown_seconds", self.prefix_store_cooldown_seconds, 0, HOUR)
        if self.shm_dir and not os.path.isabs(self.shm_dir):
            raise InvalidInput(f"shm_dir {self.shm_dir} must be an absolute path (the folder both containers mount)")
        _ = (self.gates, self.limits)  # built once here, so a bad gate or limit field fails at construction

    def resolved_map_threads(self) -> int:
        """How many token lanes a translation is mapped in: map_threads, or (0) torch's CPU threads; 1 off a CPU."""
        if self.device != "cpu":
            return 1
        if self.map_threads:
            return self.map_threads
        import torch

        return self.threads or torch.get_num_threads()

    def secret(self, name: str) -> str:
        """A secret's value: from ``<name>_file`` when set (surrounding whitespace stripped), else ``<name>``."""
        path = getattr(self, f"{name}_file")
        if path:
            return read_secret_text(path, f"{name}_file")
        return getattr(self, name)

    def authenticator(self):
        """The configured caller authentication (reads auth_tokens_file), or None when calls are not authenticated."""
        from .auth import Authenticator

        if self.auth_tokens_file:
            return Authenticator.from_file(self.auth_tokens_file, self.auth_mtls_tenant)
        return Authenticator(mtls_identity=True) if self.auth_mtls_tenant else None

    @property
    def gates(self) -> Gates:
        from kvferry.mappings.gates import Gates  # imported when used: `kvferry --help` builds this config's flags

        return Gates(
            arm=self.gate_arm,
            min_top10=self.gate_min_top10,
            max_kl=self.gate_max_kl,
            min_copy_retention=self.gate_min_copy_retention,
            max_completion_drop=self.gate_max_completion_drop,
            marginal=self.gate_marginal,
        )

    @property
    def limits(self) -> Limits:
        from .limits import Limits

        return Limits(
            max_tokens=self.max_tokens,
            max_request_bytes=self.max_request_bytes,
            max_message_bytes=self.max_message_bytes,
        )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """One flag per field, help text from the field's docstring (parsed from this module's source)."""
    docs = _field_docs()
    ap.add_argument("--config", default=None, help="TOML file with any of the fields below (flags and env override it)")
    for f in fields(SidecarConfig):
        text = docs.get(f.name, "") + f" (env KVFERRY_{f.name.upper()}; default {f.default})"
        kw = {"default": None, "help": text.replace("%", "%%")}  # argparse formats help with %: a docstring's % is text
        if f.type in ("bool", bool):
            ap.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, **kw)
        else:
            ap.add_argument(_flag(f.name), type={"int": int, "float": float}.get(str(f.type), str), **kw)


def from_sources(args: argparse.Namespace | None = None, env: dict | None = None) -> SidecarConfig:
    """Defaults < TOML file < environment < flags."""
    env = os.environ if env is None else env
    values: dict = {}
    path = getattr(args, "config", None) or env.get("KVFERRY_CONFIG")
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise InvalidInput(f"cannot read config file {path}: {e}") from None
        data = data.get("sidecar", data)
        known = {f.name for f in fields(SidecarConfig)}
        unknown = set(data) - known
        if unknown:
            raise InvalidInput(f"unknown config keys in {path}: {', '.join(sorted(unknown))}")
        values.update(data)
    for f in fields(SidecarConfig):
        if f"KVFERRY_{f.name.upper()}" in env:
            values[f.name] = env[f"KVFERRY_{f.name.upper()}"]
        if args is not None and getattr(args, f.name, None) is not None:
            values[f.name] = getattr(args, f.name)
    return SidecarConfig(**read_settings(SidecarConfig, values, "sidecar settings"))


def _field_docs() -> dict[str, str]:
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(SidecarConfig))
    body = tree.body[0].body
    docs = {}
    for a, b in itertools.pairwise(body):
        if (
            isinstance(a, ast.AnnAssign)
            and isinstance(b, ast.Expr)
            and isinstance(getattr(b, "value", None), ast.Constant)
        ):
            docs[a.target.id] = str(b.value.value).strip()
    return docs
