"""What the vLLM connector's scheduler side hands its worker side each step (inside vLLM's connector metadata):
the translations to load and the prompts to publish. Plain data, no vLLM types."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MapSource:
    """The source model a map version reads, as the sidecar lists it: its geometry and tokenizer fingerprints name
    the prefix-store namespace its published KV lives in."""

    geometry: str
    tokenizer: str


@dataclass
class Load:
    """One request's translation to load into vLLM's pages."""

    req_id: str
    version: str
    """The map version the scheduler's rollout plan chose."""
    source: MapSource | None
    """The version's source, so the worker asks for the right prefix key without asking the sidecar again (None:
    vLLM allocated tokens the scheduler side never matched; the worker reports them as a load error)."""
    token_ids: list[int]
    """The prefix to translate: whole prefix blocks."""
    block_ids: list[int]
    """vLLM's blocks of the request, in order."""
    start: int
    """The first token not already in vLLM's own cache."""
    asynchronous: bool = False
    """Loaded off the engine's step, and reported by get_finished."""


@dataclass
class Save:
    """One prompt to publish (a producer)."""

    req_id: str
    token_ids: list[int]
    """The prompt while it prefills; its whole prefix blocks once in the metadata."""
    block_ids: list[int]
    """vLLM's blocks that hold them."""


@dataclass
class Steps:
    """One step's work for the worker side."""

    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)
