"""What ListMappings says of each map: the package's own dataclasses (callers never handle protobuf messages), and
both directions between them and the messages (the sidecar writes them, the clients read them)."""

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


def geometry_to_pb(g) -> pb.Geometry:
    """A map side's geometry (kvferry.mappings.geometry.Geometry) as the message."""
    return pb.Geometry(
        architecture=g.architecture,
        layers=g.layers,
        kv_heads=g.kv_heads,
        head_dim=g.head_dim,
        fingerprint=g.fingerprint,
        rope_type=g.rope.rope_type,
        rope_theta=g.rope.theta,
    )


def mapping_to_pb(entry, arm: str) -> pb.MappingInfo:
    """A registry entry (its MapSet, whether it serves and why not) as ListMappings says it, with the evidence of
    the arm the gates read."""
    ms = entry.maps
    ev = (ms.evidence or {}).get("arms", {}).get(arm, {})
    return pb.MappingInfo(
        name=ms.name,
        version=ms.version,
        source=geometry_to_pb(ms.source.geometry),
        target=geometry_to_pb(ms.target.geometry),
        tokenizer_fingerprint=ms.source.tokenizer,
        content_sha256=ms.content_sha256,
        servable=entry.servable,
        gate_reason=entry.reason,
        context_tokens=ms.context,
        dtype=wire.dtype_to_pb(ms.dtype),
        evidence=pb.MapEvidence(
            arm=arm,
            top1=ev.get("top1", 0.0),
            top10=ev.get("top10", 0.0),
            kl=ev.get("kl", 0.0),
            attn_cos=ev.get("attn_cos", 0.0),
            drift_attn_cos=ev.get("drift_attn_cos", 0.0),
            drift_rel_err=ev.get("drift_rel_err", 0.0),
            recommended_refresh=int((ms.evidence or {}).get("recommended_refresh", 0)),
        ),
    )
