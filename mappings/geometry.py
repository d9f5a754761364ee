"""Model geometry and fingerprints: what must match before two caches can be combined."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from .errors import Incompatible
from .rope import RopeSpec

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def digest(obj) -> str:
    """sha256 over canonical JSON: the project's one way to fingerprint structured data."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class Geometry:
    """The KV-cache layout of one model, plus what determines its key positions."""

    architecture: str
    layers: int
    kv_heads: int
    head_dim: int
    rope: RopeSpec
    attention: str = "full"  # "full" or "sliding_window:<n>"; "+qk_norm" when keys are normalised
    vocab_size: int = 0

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def as_dict(self) -> dict:
        return {
            "architecture": self.architecture,
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "rope": self.rope.as_dict(),
            "attention": self.attention,
            "vocab_size": self.vocab_size,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Geometry:
        return cls(
            d["architecture"],
            int(d["layers"]),
            int(d["kv_heads"]),
            int(d["head_dim"]),
            RopeSpec.from_dict(d["rope"]),
            d.get("attention", "full"),
            int(d.get("vocab_size", 0)),
        )

    @property
    def fingerprint(self) -> str:
        return digest(self.as_dict())


def geometry_of(config) -> Geometry:
    """Read the geometry from an HF config; refuse architectures and RoPE kinds we cannot map."""
    arch = config.model_type
    if arch not in SUPPORTED_ARCHITECTURES:
        raise Incompatible(
            f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}. "
            "Other decoder-only models with standard RoPE can be added in kvferry.mappings.geometry."
        )
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.pop("rope_type", "default")
    theta = float(params.pop("rope_theta", getattr(config, "rope_theta", 10000.0)))
    if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise Incompatible("partial rotary embeddings are not supported (partial_rotary_factor != 1)")
    rope = RopeSpec(
        rope_type,
        theta,
        int(head_dim),
        tuple(sorted(params.items())),
        int(getattr(config, "max_position_embeddings", 0) or 0),
    )
    rope.check_supported()
    attention = "full"
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and arch == "mistral":
        attention = f"sliding_window:{window}"
    if arch == "qwen3":
        attention += "+qk_norm"
    return Geometry(
        arch,
        config.num_hidden_layers,
        config.num_key_value_heads or heads,
        int(head_dim),
        rope,
        attention,
        int(config.vocab_size),
    )


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of vocab, merges, special/added tokens, normalizer and pre-tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise Incompatible("only fast (tokenizers-backed) tokenizers can be fingerprinted; load with use_fast=True")
    spec = json.loads(backend.to_str())
    model = spec.get("model", {})
    return digest(
        {
            "type": model.get("type"),
            "vocab": model.get("vocab"),
            "merges": model.get("merges"),
            "added_tokens": [(t["id"], t["content"], t.get("special")) for t in spec.get("added_tokens", [])],
            "normalizer": spec.get("normalizer"),
            "pre_tokenizer": spec.get("pre_tokenizer"),
            "special_tokens": sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items()),
        }
    )


@dataclass(frozen=True)
class ModelIdentity:
    """A model as a map endpoint: a display name, its geometry and its tokenizer fingerprint."""

    name: str
    geometry: Geometry
    tokenizer: str
    weights: str = ""  # sha256 of the weights file(s), when known

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "geometry": self.geometry.as_dict(),
            "geometry_fingerprint": self.geometry.fingerprint,
            "tokenizer_fingerprint": self.tokenizer,
            "weights_sha256": self.weights,
        }

    @classmethod
    def from_dict(cls, d: dict) -> ModelIdentity:
        ident = cls(
            d["name"], Geometry.from_dict(d["geometry"]), d["tokenizer_fingerprint"], d.get("weights_sha256", "")
        )
        if d.get("geometry_fingerprint") not in (None, ident.geometry.fingerprint):
            raise Incompatible(
                f"geometry fingerprint of {ident.name!r} does not match its geometry: the manifest was edited"
            )
        return ident


def check_pair(source: ModelIdentity, target: ModelIdentity) -> None:
    """Refuse pairs whose caches cannot be mapped, saying why and what to do."""
    if source.tokenizer != target.tokenizer:
        raise Incompatible(
            f"tokenizers differ ({source.name}: {source.tokenizer[:12]}…, {target.name}: {target.tokenizer[:12]}…): "
            "token positions would not line up. Use two models that share one tokenizer (same vocab, merges, specials)."
        )
    if (
        source.geometry.vocab_size
        and target.geometry.vocab_size
        and source.geometry.vocab_size != target.geometry.vocab_size
    ):
        raise Incompatible(f"vocab sizes differ ({source.geometry.vocab_size} vs {target.geometry.vocab_size})")
    for ident in (source, target):
        ident.geometry.rope.check_supported()
