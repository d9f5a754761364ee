"""Blocks handed over as they arrive (TranslateClient.stream) and written into paged caches layer by layer
(client.layer_load: what the vLLM connector's wait_for_layer_load waits on), against a real sidecar and a real
cross-model map (S -> T64: a wider target, so shapes cannot be confused)."""

import asyncio
import dataclasses
import itertools
import shutil
import threading

import pytest
import torch
from conftest import ROOT, make_kv, sample, spec_kw, wait_until

from kvferry.client import AsyncTranslateClient, ClientOptions, Retry, TranslateClient
from kvferry.client.importers import contiguous_layers, vllm_cpu_views
from kvferry.client.layer_load import LayerLoad, write_stream
from kvferry.common.errors import InvalidInput, Unavailable
from kvferry.mappings.artifact import load

MAP = "S__T64"
PAGE = 16


@pytest.fixture(scope="module")
def maps_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("maps")
    shutil.copytree(ROOT / "maps" / MAP / "1.0.0", root / MAP / "1.0.0")
    return root


@pytest.fixture(scope="module")
def geometry(maps_dir):
    ms = load(maps_dir / MAP / "1.0.0")
    return ms.source.geometry, ms.target.geometry


def _source_kv(geometry, tokens, seed=0):
    sg, _ = geometry
    return make_kv(layers=sg.layers, tokens=tokens, heads=sg.kv_heads, head_dim=sg.head_dim, seed=seed)


def _paged(tg, tokens):
    """A vLLM CPU cache per target layer, and a scrambled block table for ``tokens`` tokens."""
    pages = -(-tokens // PAGE)
    caches = [torch.zeros(pages + 2, tg.kv_heads, PAGE, 2 * tg.head_dim) for _ in range(tg.layers)]
    table = torch.randperm(pages + 2, generator=torch.Generator().manual_seed(1))[:pages]
    return caches, table


def test_a_stream_hands_over_each_block_before_the_call_has_ended(sidecar_factory, maps_dir, geometry, family):
    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True)
    kv = _source_kv(geometry, 300)
    with TranslateClient(ClientOptions(sc.address, chunk_tokens=64)) as c:
        whole = c.translate(kv, MAP, **spec_kw(family["S"]))
        stream = c.stream(kv, MAP, **spec_kw(family["S"]))
        got = []
        with stream:
            for block in stream:
                assert stream.info is not None and stream.stats is None  # the header is in, the trailer is not
                got.append(block)
        assert stream.stats is not None and stream.attempts == 1 and stream.info == whole.info
    for layer in range(whole.info.layers):  # uploaded in token ranges: each layer's ranges arrive in order
        starts = [b.start for b in got if b.layer == layer]
        assert starts == sorted(starts) and len(starts) > 1
    for (k, v), (wk, wv) in zip(contiguous_layers(got, whole.info.layers, 300), whole.layers()):
        assert torch.equal(k, wk) and torch.equal(v, wv)


def test_each_layer_is_released_as_soon_as_its_pages_are_written(sidecar_factory, maps_dir, geometry, family):
    """A waiter on layer 0 is released before any block of layer 1 is written: the stream below is held at layer 1's
    first block until the waiter has returned (an event, with a bound that fails the test). The pages then hold
    exactly the contiguous import's bytes from ``start`` on."""
    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True)
    _, tg = geometry
    n, start = 300, 32
    caches, table = _paged(tg, n)
    views = [vllm_cpu_views(c) for c in caches]
    progress = LayerLoad(tg.layers, n - start)
    released = threading.Event()
    order = []

    def waiter():
        for layer in range(tg.layers):
            assert progress.wait(layer, timeout=30)
            order.append(layer)
            if layer == 0:
                released.set()

    with TranslateClient(sc.address) as c:  # the source in one range: the answer comes layer after layer
        whole = c.translate(_source_kv(geometry, n), MAP, **spec_kw(family["S"]))
        stream = c.stream(_source_kv(geometry, n), MAP, **spec_kw(family["S"]))
        held = []

        def blocks():
            for b in stream:
                if b.layer == 1 and not held:
                    held.append(released.wait(timeout=30))
                yield b

        t = threading.Thread(target=waiter)
        t.start()
        with stream:
            write_stream(blocks(), lambda layer: views[layer], table, start, progress)
        t.join(30)
    assert held == [True] and order == list(range(tg.layers)) and progress.error is None
    ready = progress.ready_at
    assert all(a <= b for a, b in itertools.pairwise(ready))
    for layer, (wk, wv) in enumerate(whole.layers()):
        k_pages, v_pages = views[layer]
        for t_ in range(n):
            k, v = k_pages[table[t_ // PAGE], :, t_ % PAGE], v_pages[table[t_ // PAGE], :, t_ % PAGE]
            if t_ < start:
                assert not k.any() and not v.any()
            else:
                assert torch.equal(k, wk[0, :, t_]) and torch.equal(v, wv[0, :, t_])


def test_a_load_that_ends_short_or_breaks_releases_every_waiter(sidecar_factory, maps_dir, geometry, family):
    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True)
    _, tg = geometry
    n = 100
    with TranslateClient(sc.address) as c:
        blocks = list(c.stream(_source_kv(geometry, n), MAP, **spec_kw(family["S"])))
    last = tg.layers - 1

    caches, table = _paged(tg, n)
    views = [vllm_cpu_views(x) for x in caches]
    short = LayerLoad(tg.layers, n)
    with pytest.raises(InvalidInput, match=rf"ended without all of target layers \[{last}\]"):
        write_stream([b for b in blocks if b.layer != last], lambda layer: views[layer], table, 0, short)
    assert short.wait(0, timeout=5) and not short.wait(last, timeout=5) and short.done.is_set()

    broken = LayerLoad(tg.layers, n)

    def breaks():
        yield from (b for b in blocks if b.layer == 0)
        raise Unavailable("the sidecar went away")

    with pytest.raises(Unavailable):
        write_stream(breaks(), lambda layer: views[layer], table, 0, broken)
    assert broken.wait(0, timeout=5) and not any(broken.wait(layer, timeout=5) for layer in range(1, tg.layers))
    assert isinstance(broken.error, Unavailable)

    stray = LayerLoad(tg.layers, n)  # a block for a layer the engine does not have
    with pytest.raises(InvalidInput, match=f"target layer {tg.layers}; the engine has {tg.layers} layers"):
        write_stream([dataclasses.replace(blocks[0], layer=tg.layers)], lambda layer: views[0], table, 0, stray)
    assert not stray.wait(0, timeout=5)


def test_a_stream_closed_early_cancels_its_call(sidecar_factory, maps_dir, geometry, family):
    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True)

    def cancelled():
        return sample(sc, "kvferry_requests_total", method="Translate", code="CANCELLED")

    with TranslateClient(ClientOptions(sc.address, chunk_tokens=64)) as c:
        stream = c.stream(_source_kv(geometry, 4096), MAP, **spec_kw(family["S"]))
        with stream:
            next(stream)
        assert stream.stats is None
        wait_until(lambda: cancelled() == 1 and sample(sc, "kvferry_active_streams") == 0, what="the sidecar's cancel")
        again = c.translate(_source_kv(geometry, 64), MAP, **spec_kw(family["S"]))  # the channel serves on
    assert again.info.num_tokens == 64


def test_a_stream_is_retried_until_its_first_block_and_never_after(sidecar_factory, maps_dir, geometry, family):
    """Before the first block a failure moves to the next endpoint, as translate() does; a sidecar that goes away
    mid-answer leaves its caller with blocks it cannot take back, so that failure is raised, not retried."""
    a = sidecar_factory(maps_dir=str(maps_dir), force_maps=True)
    b = sidecar_factory(maps_dir=str(maps_dir), force_maps=True)

    def served(sc):
        return sample(sc, "kvferry_requests_total", method="Translate", code="OK")

    kv = _source_kv(geometry, 8192)
    with TranslateClient(
        ClientOptions(a.address, endpoints=(b.address,), chunk_tokens=64, retry=Retry(retries=3))
    ) as c:
        stream = c.stream(kv, MAP, **spec_kw(family["S"]))
        next(stream)
        a.stop()
        with pytest.raises(Unavailable):
            for _ in stream:
                pass
        assert served(b) == 0 and stream.stats is None
        again = c.stream(kv, MAP, **spec_kw(family["S"]))  # a is gone: the next attempt goes to b
        assert sum(blk.end - blk.start for blk in again) == 8192 * again.info.layers and again.attempts == 2
    assert served(b) == 1


def test_the_asyncio_client_streams_alike(sidecar_factory, maps_dir, geometry, family):
    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True)
    kv = _source_kv(geometry, 300)

    def cancelled():
        return sample(sc, "kvferry_requests_total", method="Translate", code="CANCELLED")

    async def go():
        async with AsyncTranslateClient(ClientOptions(sc.address, chunk_tokens=64)) as c:
            whole = await c.translate(kv, MAP, **spec_kw(family["S"]))
            stream = c.stream(kv, MAP, **spec_kw(family["S"]))
            got = []
            async with stream:
                async for block in stream:
                    assert stream.info is not None and stream.stats is None
                    got.append(block)
            assert stream.stats is not None and stream.attempts == 1
            early = c.stream(_source_kv(geometry, 4096), MAP, **spec_kw(family["S"]))
            async with early:
                await early.__anext__()
            return whole, got

    whole, got = asyncio.run(go())
    for (k, v), (wk, wv) in zip(contiguous_layers(got, whole.info.layers, 300), whole.layers()):
        assert torch.equal(k, wk) and torch.equal(v, wv)
    wait_until(lambda: cancelled() == 1 and sample(sc, "kvferry_active_streams") == 0, what="the sidecar's cancel")
