"""Engine importers: contiguous blocks written into a paged cache (what the vLLM connector does with a translation)."""

import itertools

import pytest
import torch

from kvferry.client.importers import read_pages, vllm_cpu_views, write_pages
from kvferry.common.messages import Block
from kvferry.mappings.errors import InvalidInput


def _vllm_like_views(pages: int, heads: int, page: int, dim: int):
    """K and V views [pages, heads, page, dim] of a zeroed bf16 layer of vLLM's CPU cache."""
    return vllm_cpu_views(torch.zeros(pages, heads, page, 2 * dim, dtype=torch.bfloat16))


def test_blocks_cut_anywhere_land_in_their_pages_and_slots():
    heads, dim, page, n, from_token = 3, 8, 4, 37, 9
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(heads, n, dim, generator=g), torch.randn(heads, n, dim, generator=g)
    table = [7, 2, 9, 0, 4, 11, 5, 1, 3, 10]  # physical pages in logical order (ten pages of four hold 37 tokens)
    k_pages, v_pages = _vllm_like_views(12, heads, page, dim)
    cuts = [0, 5, 6, 20, 37]  # blocks that start and end mid-page, as a sidecar cuts them to its message limit
    for a, b in itertools.pairwise(cuts):
        write_pages(Block(0, a, b, 0, k[:, a:b], v[:, a:b]), k_pages, v_pages, table, from_token)
    for t in range(n):
        got_k, got_v = k_pages[table[t // page], :, t % page], v_pages[table[t // page], :, t % page]
        if t < from_token:  # the engine has these already: left as they were
            assert not got_k.any() and not got_v.any(), t
        else:
            assert torch.equal(got_k, k[:, t].bfloat16()) and torch.equal(got_v, v[:, t].bfloat16()), t
    unused = [p for p in range(12) if p not in table]
    assert not k_pages[unused].any() and not v_pages[unused].any()
    got_k, got_v = read_pages(k_pages, v_pages, table, 13, 30)  # what the connector's comparisons read back
    assert torch.equal(got_k, k[:, 13:30].bfloat16()) and torch.equal(got_v, v[:, 13:30].bfloat16())
    with pytest.raises(InvalidInput, match="not all in a block table"):
        read_pages(k_pages, v_pages, table[:3], 0, 13)


def test_a_block_table_too_short_or_out_of_the_cache_is_refused():
    k_pages, v_pages = _vllm_like_views(4, 2, 4, 8)
    block = Block(0, 0, 10, 0, torch.ones(2, 10, 8), torch.ones(2, 10, 8))
    with pytest.raises(InvalidInput, match="need 3 pages of 4; the block table has 2"):
        write_pages(block, k_pages, v_pages, [0, 1])
    with pytest.raises(InvalidInput, match="outside the cache"):
        write_pages(block, k_pages, v_pages, [0, 1, 4])
    assert not k_pages.any() and not v_pages.any()  # nothing written by a refused block


def test_the_flash_attention_layout_holds_what_the_contiguous_import_holds(family):
    """A real cross-model translation (S -> T64: a wider target, so shapes cannot be confused) written into the paged
    layout of vLLM's GPU backends ([2, blocks, block_size, kv_heads, head_size], CPU tensors here) and into vLLM's
    CPU layout: read back token by token, both hold exactly the contiguous import's bytes."""
    from conftest import ROOT, make_kv

    from kvferry.client.importers import contiguous_layers, flash_attention_views
    from kvferry.mappings.apply import apply
    from kvferry.mappings.artifact import load

    ms = load(ROOT / "maps" / "S__T64" / "1.0.0")
    sg, tg = ms.source.geometry, ms.target.geometry
    n, page, table = 45, 16, [5, 0, 3]
    mapped = apply(ms, make_kv(layers=sg.layers, tokens=n, heads=sg.kv_heads, head_dim=sg.head_dim, seed=4), 0)
    blocks = [
        Block(l, a, b, 0, k[0, :, a:b], v[0, :, a:b]) for l, (k, v) in enumerate(mapped) for a, b in ((0, 20), (20, n))
    ]
    want = contiguous_layers(blocks, tg.layers, n)
    for layout in ("flash", "vllm_cpu"):
        for l in range(tg.layers):
            if layout == "flash":
                cache = torch.zeros(2, 6, page, tg.kv_heads, tg.head_dim)
                k_pages, v_pages = flash_attention_views(cache)
            else:
                cache = torch.zeros(6, tg.kv_heads, page, 2 * tg.head_dim)
                k_pages, v_pages = vllm_cpu_views(cache)
            for b in (b for b in blocks if b.layer == l):
                write_pages(b, k_pages, v_pages, table)
            for t in range(n):
                p, s = table[t // page], t % page
                got_k = cache[0, p, s] if layout == "flash" else k_pages[p, :, s]
                got_v = cache[1, p, s] if layout == "flash" else v_pages[p, :, s]
                assert torch.equal(got_k, want[l][0][0, :, t]) and torch.equal(got_v, want[l][1][0, :, t]), (
                    layout,
                    l,
                    t,
                )
    with pytest.raises(InvalidInput, match="num_kv_heads"):
        flash_attention_views(torch.zeros(6, page, 2, 8))
