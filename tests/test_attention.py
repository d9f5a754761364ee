"""kvferry_sdpa: grouped-query attention over a cache without per-head copies gives transformers' sdpa outputs."""

import pytest
import torch
from conftest import MODELS, save_tiny, tiny_config

from kvferry.client import attention
from kvferry.client.importers import to_dynamic_cache
from kvferry.mappings.cache import cache_layers
from kvferry.mappings.lab.capture import load_model


def _prefix_then_tail(model, ids, mask, split: int) -> torch.Tensor:
    """The target's prefill of ids[:, :split] as an imported cache, then ids[:, split:] on top (the refresh)."""
    with torch.no_grad():
        prefix = model(input_ids=ids[:, :split], attention_mask=mask[:, :split], use_cache=True).past_key_values
        cache = to_dynamic_cache(cache_layers(prefix), model.config)
        return model(input_ids=ids[:, split:], attention_mask=mask, past_key_values=cache).logits


def test_folded_attention_equals_sdpa_on_a_cache():
    t = load_model(MODELS / "T")  # 6 query heads over 3 KV heads
    model = t.model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 4000, (2, 48), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row: the mask differs per batch row
    assert model.config._attn_implementation == "sdpa"
    want = _prefix_then_tail(model, ids, mask, 32)
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.shape[1], k.shape[1]))
        return sdpa(q, k, v, **kw)

    assert attention.use_folded_gqa(model)
    try:
        torch.nn.functional.scaled_dot_product_attention = spy
        got = _prefix_then_tail(model, ids, mask, 32)
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    assert model.config._attn_implementation == attention.IMPLEMENTATION
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (3, 3) in seen and (6, 6) not in seen  # the tail attended with 3 stacked heads, K/V never copied to 6
    # decoding one token at a time over the cache gives the same tokens as well
    with torch.no_grad():
        out = model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=6, do_sample=False)
        model.set_attn_implementation("sdpa")
        ref = model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref)


def test_models_it_does_not_fold_are_left_alone(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_tiny(tmp_path / "m", tiny_config("llama", heads=4, kv_heads=4))
    eager = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    assert not attention.use_folded_gqa(eager) and eager.config._attn_implementation == "eager"
    mha = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")  # no grouping: handed to sdpa
    ids = torch.randint(2, 4000, (1, 24))
    with torch.no_grad():
        want = mha(input_ids=ids).logits
        assert attention.use_folded_gqa(mha)
        torch.testing.assert_close(mha(input_ids=ids).logits, want)


@pytest.mark.parametrize("kw", [{"dropout": 0.1}, {"output_attentions": True}])
def test_cases_it_cannot_fold_go_to_sdpa(kw, monkeypatch):
    called = []
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **k: called.append(k) or ("sdpa", None))
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    assert attention.folded_gqa_attention(None, q, k, k, mask, **kw)[0] == "sdpa" and called
