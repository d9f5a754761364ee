"""Rotary position embeddings: strip the source's rotation, re-apply the target's.

Keys are cached after RoPE. Maps are fitted and applied in position-free space, so a key is
un-rotated with the source's RoPE and rotated again with the target's at the same absolute
positions. Frequencies come from transformers' own RoPE initialisers, so every supported
``rope_type`` matches the model code exactly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .errors import Incompatible

# Position-independent RoPE types: cos/sin depend only on the absolute position.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeSpec:
    """Everything that determines a model's rotary embedding for one head."""

    rope_type: str
    theta: float
    head_dim: int
    params: tuple[tuple[str, object], ...] = ()  # remaining rope_parameters, sorted
    max_position_embeddings: int = 0

    def as_dict(self) -> dict:
        return {
            "rope_type": self.rope_type,
            "theta": self.theta,
            "head_dim": self.head_dim,
            "params": dict(self.params),
            "max_position_embeddings": self.max_position_embeddings,
        }

    @classmethod
    def from_dict(cls, d: dict) -> RopeSpec:
        return cls(
            d["rope_type"],
            float(d["theta"]),
            int(d["head_dim"]),
            tuple(sorted(d.get("params", {}).items())),
            int(d.get("max_position_embeddings", 0)),
        )

    def check_supported(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise Incompatible(
                f"RoPE type {self.rope_type!r} is not supported: its rotation depends on the sequence length, "
                "so cached keys cannot be un-rotated position by position. Supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}."
            )


def _config_for(spec: RopeSpec):
    from transformers import PretrainedConfig

    params = {"rope_type": spec.rope_type, "rope_theta": spec.theta, **dict(spec.params)}
    cfg = PretrainedConfig()
    cfg.rope_parameters = params
    cfg.head_dim = spec.head_dim
    cfg.hidden_size = spec.head_dim
    cfg.num_attention_heads = 1
    cfg.max_position_embeddings = spec.max_position_embeddings or 8192
    return cfg


def inv_freq(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim/2], attention scaling) for a spec, cached (a few hundred bytes per spec)."""
    spec.check_supported()
    return _inv_freq(spec)


@functools.lru_cache(maxsize=64)  # bounded: one entry per RoPE geometry served
def _inv_freq(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _config_for(spec)
    if spec.rope_type == "default":
        freqs = 1.0 / (spec.theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float) / spec.head_dim))
        scale = 1.0
    else:
        freqs, scale = ROPE_INIT_FUNCTIONS[spec.rope_type](cfg, "cpu")
    if freqs.numel() * 2 != spec.head_dim:
        raise Incompatible("partial rotary embeddings are not supported: rotary dim != head_dim")
    return freqs.float(), float(scale)


def cos_sin(spec: RopeSpec, positions: torch.Tensor | range, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [..., T, head_dim] (float32), as the model's rotary embedding computes them.

    ``positions`` as a ``range`` (step 1, the streaming case) is served from a per-spec table of
    every position seen so far, grown by doubling, so a request's layers share one computation."""
    if isinstance(positions, range):
        if positions.step != 1:
            positions = torch.tensor(positions)
        else:
            cos, sin = _table(spec, positions.stop, device)
            return cos[positions.start : positions.stop], sin[positions.start : positions.stop]
    return _cos_sin(spec, positions, device)


_TABLES: dict[tuple[RopeSpec, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _table(spec: RopeSpec, upto: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (spec, str(device))
    have = _TABLES.get(key)  # one atomic read; a grown table replaces the entry whole
    if have is None or have[0].shape[0] < upto:
        size = max(upto, 2 * (have[0].shape[0] if have else 1024))
        have = _cos_sin(spec, torch.arange(size), device)
        _TABLES[key] = have
    return have


def _cos_sin(spec: RopeSpec, positions: torch.Tensor, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    freqs, scale = inv_freq(spec)
    ang = positions.to(device=device, dtype=torch.float32)[..., None] * freqs.to(device)
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def _rotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """k * cos + sign * rotate_half(k) * sin, without materialising rotate_half (cos/sin halves are equal)."""
    kf = k.float()
    half = kf.shape[-1] // 2
    c, s_ = cos[..., :half], sin[..., :half]
    a, b = kf[..., :half], kf[..., half:]
    if kf.requires_grad:  # autograd cannot see through out=; use the plain form
        return torch.cat([a * c - sign * b * s_, b * c + sign * a * s_], dim=-1)
    out = torch.empty_like(kf)
    torch.mul(a, c, out=out[..., :half])
    out[..., :half].addcmul_(b, s_, value=-sign)
    torch.mul(b, c, out=out[..., half:])
    out[..., half:].addcmul_(a, s_, value=sign)
    return out


def rotate(k: torch.Tensor, spec: RopeSpec, positions: torch.Tensor | range) -> torch.Tensor:
    """Apply RoPE to position-free keys ``k`` [..., heads, T, head_dim] (computed in float32)."""
    cos, sin = cos_sin(spec, positions, k.device)
    return _rotate(k, cos.unsqueeze(-3), sin.unsqueeze(-3), 1.0)


def unrotate(k: torch.Tensor, spec: RopeSpec, positions: torch.Tensor | range) -> torch.Tensor:
    """Invert :func:`rotate` exactly (RoPE is orthogonal up to the attention scaling)."""
    cos, sin = cos_sin(spec, positions, k.device)
    _, scale = inv_freq(spec)
    out = _rotate(k, cos.unsqueeze(-3), sin.unsqueeze(-3), -1.0)
    return out if scale == 1.0 else out / (scale * scale)
