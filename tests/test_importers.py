"""Engine importers: contiguous blocks written into a paged cache (what the vLLM connector does with a translation)."""

import pytest
import torch

from kvferry.client.importers import vllm_cpu_views, write_pages
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
    for a, b in zip(cuts, cuts[1:]):
        write_pages(Block(0, a, b, 0, k[:, a:b], v[:, a:b]), k_pages, v_pages, table, from_token)
    for t in range(n):
        got_k, got_v = k_pages[table[t // page], :, t % page], v_pages[table[t // page], :, t % page]
        if t < from_token:  # the engine has these already: left as they were
            assert not got_k.any() and not got_v.any(), t
        else:
            assert torch.equal(got_k, k[:, t].bfloat16()) and torch.equal(got_v, v[:, t].bfloat16()), t
    unused = [p for p in range(12) if p not in table]
    assert not k_pages[unused].any() and not v_pages[unused].any()


def test_a_block_table_too_short_or_out_of_the_cache_is_refused():
    k_pages, v_pages = _vllm_like_views(4, 2, 4, 8)
    block = Block(0, 0, 10, 0, torch.ones(2, 10, 8), torch.ones(2, 10, 8))
    with pytest.raises(InvalidInput, match="need 3 pages of 4; the block table has 2"):
        write_pages(block, k_pages, v_pages, [0, 1])
    with pytest.raises(InvalidInput, match="outside the cache"):
        write_pages(block, k_pages, v_pages, [0, 1, 4])
    assert not k_pages.any() and not v_pages.any()  # nothing written by a refused block
