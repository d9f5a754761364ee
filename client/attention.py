"""Exact grouped-query attention over an imported cache, without copying it per query head.

When new tokens attend to a cache (the mapped path's refresh, and decoding), transformers' ``sdpa`` attention
needs a mask, and with a mask it expands every cached K and V to one copy per query head before the kernel
(``repeat_kv``): for SmolLM2-135M at 8k tokens that is 1.1 GB of copies per forward pass, more than the attention
itself. Grouped-query attention does not need them: the query heads that share a KV head can be stacked into one
head's query rows, attend to that KV head once, and be unstacked. Every score and output is the same dot product
over the same keys (tested equal to ``sdpa``); only the copies are gone.

``use_folded_gqa(model)`` switches a model that uses ``sdpa`` to this implementation (``kvferry_sdpa``); every
case it does not fold (no mask, no grouping, per-head masks, dropout, a paged cache, attention weights asked
for) is handed to transformers' own ``sdpa`` unchanged.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

IMPLEMENTATION = "kvferry_sdpa"


def folded_gqa_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, Hq, q, D], key/value [B, Hkv, kv, D] (cache
    included), mask [B, 1, q, kv] or None; returns ([B, q, Hq, D], None)."""
    b, hq, q, d = query.shape
    hkv = key.shape[1]
    folds = (
        hq != hkv
        and hq % hkv == 0
        and attention_mask is not None
        and attention_mask.dim() == 4
        and attention_mask.shape[1] == 1
        and dropout == 0.0
        and kwargs.get("cache") is None
        and kwargs.get("position_bias") is None
        and not kwargs.get("output_attentions", False)
    )
    if not folds:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    g = hq // hkv
    # Query head h reads KV head h // g, so heads [j*g, (j+1)*g) become query rows of KV head j, head-major; the
    # mask's rows repeat once per stacked head.
    stacked = query.reshape(b, hkv, g * q, d)
    mask = attention_mask.expand(b, 1, q, attention_mask.shape[-1]).repeat(1, 1, g, 1)
    out = torch.nn.functional.scaled_dot_product_attention(stacked, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, q, d).transpose(1, 2).contiguous(), None


def use_folded_gqa(model) -> bool:
    """Switch an ``sdpa`` model to ``kvferry_sdpa`` (same outputs, no per-head copies of the cache). Returns
    whether it switched; a model on another implementation (eager, flash, flex) is left as it is."""
    if model.config._attn_implementation not in ("sdpa", IMPLEMENTATION):
        return False
    AttentionInterface.register(IMPLEMENTATION, folded_gqa_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)  # the same masks sdpa gets (None where it needs none)
    if model.config._attn_implementation != IMPLEMENTATION:
        model.set_attn_implementation(IMPLEMENTATION)
    return True
