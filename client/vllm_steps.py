"""What the vLLM connector's scheduler side hands its worker side each step (inside vLLM's connector metadata):
the translations to load, the prompts to publish and the comparisons to take; and what the worker side hands back
(its live-quality samples). Plain data, no vLLM types."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.mappings.drift import Drift


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
    check: int = 0
    """The last ``check`` of ``token_ids`` (a prefix block inside the refreshed tail) are translated but not loaded:
    the engine computes them, and the worker compares its K/V with the translation's (the drift sample)."""


@dataclass
class Check:
    """One comparison of a request's translation with the engine's own K/V of the same tokens, taken in the step
    whose forward writes the last of them (the connector's live-quality sample, client/monitor.py)."""

    req_id: str
    version: str
    signal: str
    """"drift": tokens of the refreshed tail, translated with the request's load; "shadow": the whole published
    prefix of a request the engine prefilled itself (the worker translates it for the comparison alone)."""
    token_ids: list[int]
    """The request's prompt through the last compared token (whole prefix blocks: what is translated)."""
    start: int
    """The first compared token (the last is ``len(token_ids) - 1``)."""
    block_ids: list[int] = field(default_factory=list)
    """vLLM's blocks of the request, in order, as of the comparison's step."""
    source: MapSource | None = None
    """The version's source (a shadow check's translation asks by its prefix key)."""


@dataclass(frozen=True)
class Sample:
    """One comparison's result, from the worker side to the scheduler side's quality monitor."""

    version: str
    signal: str
    drift: Drift


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
    checks: list[Check] = field(default_factory=list)
