"""A model's KV cache as kvferry handles it: per layer (K, V), keys after RoPE, and the adapters between that and HF
transformers' caches. The runtime's own shape (apply, drift) and the engine importers' (kvferry.client.importers
re-exports the HF one), so it lives here, below both."""

from __future__ import annotations

import torch

from .errors import InvalidInput

LayerKV = tuple[torch.Tensor, torch.Tensor]
"""One layer's cache: (keys, values), each [batch, kv_heads, tokens, head_dim], keys post-RoPE."""


def kv_slice(kv: list[LayerKV], start: int, stop: int) -> list[LayerKV]:
    """Every layer's (K, V) for tokens [start, stop) (views, no copy)."""
    return [(k[:, :, start:stop], v[:, :, start:stop]) for k, v in kv]


def kv_join(head: list[LayerKV], tail: list[LayerKV]) -> list[LayerKV]:
    """Every layer's (K, V) of ``head`` followed by ``tail`` along the tokens."""
    return [(torch.cat([hk, tk], 2), torch.cat([hv, tv], 2)) for (hk, hv), (tk, tv) in zip(head, tail)]


def cache_layers(cache) -> list[LayerKV]:
    """An HF cache (anything with ``.layers`` of keys/values), a list of (K, V), or None, as a list of (K, V)."""
    if cache is None:
        return []
    if hasattr(cache, "layers") and not isinstance(cache, list):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(cache)


def to_dynamic_cache(layers: list[LayerKV], config, device=None, dtype=None):
    """An HF transformers (5.x) DynamicCache holding ``layers``, ready for ``model(..., past_key_values=)``."""
    from transformers import DynamicCache

    if len(layers) != config.num_hidden_layers:
        raise InvalidInput(f"{len(layers)} layers for a model with {config.num_hidden_layers}")
    cache = DynamicCache(config=config)
    for i, (k, v) in enumerate(layers):
        if device is not None or dtype is not None:
            k, v = k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)
        cache.update(k, v, i)
    return cache
