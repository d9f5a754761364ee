"""What ListMappings says of each map, as the package's own dataclasses (callers never handle protobuf messages)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvferry.common import wire
from kvferry.v1 import translate_pb2 as pb


@dataclass(frozen=True)
class ModelGeometry:
    """One side of a map: what the model's KV cache looks like, and its geometry fingerprint."""

    architecture: str
    layers: int
    kv_heads: int
    head_dim: int
    fingerprint: str
    rope_type: str
    rope_theta: float


@dataclass(frozen=True)
class MapEvidence:
    """The served arm's offline evidence: agreement with the target's own prefill, and the drift signal's baseline."""

    arm: str
    top1: float
    top10: float
    kl: float
    attn_cos: float
    recommended_refresh: int
    """Tokens the target should recompute itself at the end of the prompt (0: not measured)."""
    drift_attn_cos: float
    drift_rel_err: float


@dataclass(frozen=True)
class MappingInfo:
    """A map the sidecar knows, and whether it serves."""

    name: str
    version: str
    source: ModelGeometry
    target: ModelGeometry
    tokenizer_fingerprint: str
    content_sha256: str
    servable: bool
    """Whether the map passes the serving gates (or is forced on)."""
    gate_reason: str
    """Why not, when it does not serve."""
    evidence: MapEvidence
    context_tokens: int
    """Source tokens before each token the map reads (0: a per-token map; otherwise it translates from position 0)."""
    dtype: torch.dtype | None
    """The map's weights' dtype, the precision of its stored blocks (None from a sidecar that does not say)."""


def geometry_from_pb(g: pb.Geometry) -> ModelGeometry:
    return ModelGeometry(g.architecture, g.layers, g.kv_heads, g.head_dim, g.fingerprint, g.rope_type, g.rope_theta)


def mapping_from_pb(m: pb.MappingInfo) -> MappingInfo:
    e = m.evidence
    return MappingInfo(
        name=m.name,
        version=m.version,
        source=geometry_from_pb(m.source),
        target=geometry_from_pb(m.target),
        tokenizer_fingerprint=m.tokenizer_fingerprint,
        content_sha256=m.content_sha256,
        servable=m.servable,
        gate_reason=m.gate_reason,
        context_tokens=m.context_tokens,
        dtype=None if m.dtype == pb.DTYPE_UNSPECIFIED else wire.dtype_from_pb(m.dtype),
        evidence=MapEvidence(
            e.arm, e.top1, e.top10, e.kl, e.attn_cos, e.recommended_refresh, e.drift_attn_cos, e.drift_rel_err
        ),
    )
