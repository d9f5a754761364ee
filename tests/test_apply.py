import pytest
import torch
from conftest import ROOT, make_kv, wait_until

from kvferry.mappings.apply import StreamingApplier, apply
from kvferry.mappings.artifact import LayerMap, MapSet
from kvferry.mappings.errors import InvalidInput
from kvferry.mappings.lab.capture import load_model
from kvferry.mappings.lab.fit import identity_mapset


@pytest.fixture(scope="module")
def llama(tiny_models):
    return load_model(tiny_models["llama"])


def test_identity_map_reproduces_its_input(llama):
    kv = make_kv(layers=2, tokens=24, heads=2, head_dim=16, batch=3)
    out = apply(identity_mapset(llama.identity), kv, positions=100)
    for (k, v), (ok, ov) in zip(kv, out):
        torch.testing.assert_close(ok, k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ov, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtype_is_preserved(llama, dtype):
    kv = make_kv(layers=2, tokens=8, heads=2, head_dim=16, dtype=dtype)
    out = apply(identity_mapset(llama.identity), kv)
    assert all(k.dtype == dtype and v.dtype == dtype for k, v in out)
    torch.testing.assert_close(out[1][0].float(), kv[1][0].float(), rtol=2e-2, atol=2e-2)


def _two_layer_shift_map(ident):
    """Target layer 0 reads source layer 0 only; target layer 1 reads source layers 0 and 1."""
    w = ident.geometry.kv_width
    maps = {}
    for kind in "kv":
        maps[(0, kind)] = LayerMap(0, kind, (0,), torch.eye(w), torch.zeros(w))
        maps[(1, kind)] = LayerMap(1, kind, (0, 1), torch.cat([torch.zeros(w, w), torch.eye(w)]), torch.zeros(w))
    return MapSet(ident, ident, maps)


def test_streaming_emits_a_target_layer_as_soon_as_its_sources_arrive(llama):
    ms = _two_layer_shift_map(llama.identity)
    kv = make_kv(layers=2, tokens=10, heads=2, head_dim=16)
    app = StreamingApplier(ms, positions=0, tokens=10)
    assert list(app.push(0, "k", kv[0][0])) == []
    ready = list(app.push(0, "v", kv[0][1]))
    assert [t for t, *_ in ready] == [0]  # layer 0 out before any of source layer 1 is sent
    assert list(app.push(1, "k", kv[1][0])) == []
    ready = list(app.push(1, "v", kv[1][1]))
    assert [t for t, *_ in ready] == [1] and app.done
    torch.testing.assert_close(ready[0][4], kv[1][1])


def test_a_source_no_map_reads_is_checked_and_not_kept(llama):
    """Both target layers read source layer 0 only: source layer 1 is still checked and counted, but its features are
    never kept, and the answer is source layer 0's, range by range."""
    ident = llama.identity
    w = ident.geometry.kv_width
    ms = MapSet(
        ident,
        ident,
        {(t, kind): LayerMap(t, kind, (0,), torch.eye(w), torch.zeros(w)) for t in (0, 1) for kind in "kv"},
    )
    kv = make_kv(layers=2, tokens=12, heads=2, head_dim=16)
    app = StreamingApplier(ms, positions=0, tokens=12)
    got = []
    for s, e in ((0, 5), (5, 12)):
        for layer in (1, 0):
            for i, kind in enumerate("kv"):
                got += [(t, a, b) for t, a, b, *_ in app.push(layer, kind, kv[layer][i][:, :, s:e], s)]
    assert got == [(0, 0, 5), (1, 0, 5), (0, 5, 12), (1, 5, 12)] and app.done
    assert {layer for layer, _ in app._feats} == {0}
    with pytest.raises(InvalidInput, match="expected start 12"):
        list(app.push(1, "k", kv[1][0][:, :, :1], 0))
    torch.testing.assert_close(apply(ms, kv)[1][1], kv[0][1])


def test_streaming_emits_token_ranges_as_they_complete(llama):
    """Every target layer of a map reading all source layers still streams: range by range."""
    ident = llama.identity
    w = ident.geometry.kv_width
    maps = {
        (t, kind): LayerMap(
            t, kind, (0, 1), torch.cat([torch.eye(w) * (t == 0), torch.eye(w) * (t == 1)]), torch.zeros(w)
        )
        for t in range(2)
        for kind in "kv"
    }
    ms = MapSet(ident, ident, maps)
    kv = make_kv(layers=2, tokens=12, heads=2, head_dim=16)
    app = StreamingApplier(ms, positions=100, tokens=12)
    got = []
    for s in (0, 4, 8):
        for layer in range(2):
            for i, kind in enumerate("kv"):
                got += [(t, a, b) for t, a, b, _, _ in app.push(layer, kind, kv[layer][i][:, :, s : s + 4], s)]
        assert {(t, a, b) for t, a, b in got if a == s} == {(0, s, s + 4), (1, s, s + 4)}  # out before the next range
    assert app.done
    with pytest.raises(InvalidInput, match="in order"):
        list(app.push(0, "k", kv[0][0][:, :, :4], 0))


def test_bad_input_is_rejected_with_a_reason(llama):
    ms = identity_mapset(llama.identity)
    app = StreamingApplier(ms)
    with pytest.raises(InvalidInput, match="expected"):
        list(app.push(0, "k", torch.zeros(1, 3, 4, 16)))
    with pytest.raises(InvalidInput, match="out of range"):
        list(app.push(5, "k", torch.zeros(1, 2, 4, 16)))
    list(app.push(0, "k", torch.zeros(1, 2, 4, 16)))
    with pytest.raises(InvalidInput, match="sent twice"):
        list(app.push(0, "k", torch.zeros(1, 2, 4, 16)))  # tokens 0..3 again
    with pytest.raises(InvalidInput, match="layers"):
        apply(ms, make_kv(layers=3, heads=2, head_dim=16))


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_identity_map_through_a_real_cache_gives_the_models_logits(tiny_models, arch):
    """Un-rotate, map, re-rotate and import into the model's own cache class: logits are unchanged (qwen3: q/k-norm)."""
    from kvferry.client.importers import to_dynamic_cache
    from kvferry.mappings.lab.capture import capture_kv

    m = load_model(tiny_models[arch])
    ids = torch.randint(2, 4096, (1, 50))
    mapped = apply(identity_mapset(m.identity), capture_kv(m.model, ids[:, :-1]))
    with torch.no_grad():
        got = m.model(input_ids=ids[:, -1:], past_key_values=to_dynamic_cache(mapped, m.model.config)).logits[0, -1]
        want = m.model(input_ids=ids).logits[0, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_bfloat16_maps_round_their_output_to_bfloat16(llama):
    """A bf16 map computes in bf16 and its output carries bf16 precision, whatever dtype it is returned in."""
    ident = _two_layer_shift_map(llama.identity)
    kv = make_kv(layers=2, tokens=20, heads=2, head_dim=16)
    ref = apply(ident, kv, positions=7)
    out = apply(ident.to(dtype=torch.bfloat16), kv, positions=7)
    for (rk, rv), (k, v) in zip(ref, out):
        assert k.dtype == torch.float32  # the input's dtype
        torch.testing.assert_close(k, k.bfloat16().float(), rtol=0, atol=0)
        torch.testing.assert_close(k, rk, rtol=5e-2, atol=5e-2)
        torch.testing.assert_close(v, rv, rtol=5e-2, atol=5e-2)


def test_one_token_chunks_layer_by_layer_stay_linear_and_exact(family):
    """1-token chunks sent layer by layer used to be quadratic (512 / 1024 / 2048 tokens: 7 / 22 / 104 s through
    the sidecar): every push rescanned every stored piece. Pieces are now merged like a binary counter, so a
    list holds O(log n) of them, and the output is the same as mapping the whole cache at once."""
    import math

    from kvferry.mappings.artifact import load

    ms = load(ROOT / "maps" / "S__T" / "1.0.0")
    g = ms.source.geometry
    n = 300
    src = make_kv(layers=g.layers, tokens=n, heads=g.kv_heads, head_dim=g.head_dim, seed=4)
    applier = StreamingApplier(ms, 0)
    got: dict[tuple[int, str], list[torch.Tensor]] = {}
    longest = 0
    for layer in range(g.layers):
        for i, kind in enumerate("kv"):
            for t in range(n):
                for tl, _a, _b, k, v in applier.push(layer, kind, src[layer][i][:, :, t : t + 1], t):
                    got.setdefault((tl, "k"), []).append(k)
                    got.setdefault((tl, "v"), []).append(v)
                longest = max(
                    [longest] + [len(p) for p in applier._feats.values()] + [len(p) for p in applier._out.values()]
                )
    assert longest <= math.log2(n) + 2, longest
    want = apply(ms, src, 0)
    for tl, (wk, wv) in enumerate(want):
        torch.testing.assert_close(torch.cat(got[(tl, "k")], 2), wk, rtol=1e-3, atol=1e-4)  # 1-token vs whole matmuls
        torch.testing.assert_close(torch.cat(got[(tl, "v")], 2), wv, rtol=1e-3, atol=1e-4)


LANE_CHUNKS = {  # chunks sent as (start, end) token ranges, each for every layer; the segments they plan (lane last)
    "small ranges: contiguous lanes": (((0, 5), (5, 41), (41, 90)), [(0, 30, 0), (30, 60, 1), (60, 90, 2)]),
    "ranges shared by the lanes": (
        ((0, 40), (40, 80), (80, 90)),
        [(0, 13, 0), (13, 26, 1), (26, 40, 2), (40, 53, 0), (53, 66, 1), (66, 80, 2), (80, 90, 0)],
    ),
}


@pytest.mark.parametrize("chunks", list(LANE_CHUNKS))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("map_dtype", [torch.float32, torch.bfloat16])
def test_token_lanes_on_threads_give_the_whole_maps_cache_in_token_order(map_dtype, out_dtype, chunks):
    """The sidecar maps a translation's tokens in lanes, one thread each (sidecar/lanes.py). Through a real
    cross-model map (4 -> 6 layers, 2 -> 3 kv heads), a batch of two, a late start and chunks that straddle the lanes,
    each target layer leaves in token order and the cache is the one the whole map gives, in the dtype asked for and
    rounded as the map's dtype says. Ranges too short to share make contiguous lanes; longer ones are each cut among
    the lanes, so every lane works as each range arrives."""
    from kvferry.mappings.artifact import load
    from kvferry.sidecar.lanes import Lanes

    ms = load(ROOT / "maps" / "S__T" / "1.0.0").to(dtype=map_dtype)
    g = ms.source.geometry
    n = 90
    src = make_kv(layers=g.layers, tokens=n, heads=g.kv_heads, head_dim=g.head_dim, batch=2, seed=6, dtype=out_dtype)
    want = apply(ms, src, 37)
    lanes = Lanes(3, min_slice=8, share_min=8)
    app = lanes.applier(ms, 37, None, n, 0)
    sent, planned = LANE_CHUNKS[chunks]
    got: dict[int, list] = {}
    for s, e in sent:
        for layer, (k, v) in enumerate(src):
            for kind, t in (("k", k), ("v", v)):
                for tl, a, b, tk, tv in app.push(layer, kind, t[:, :, s:e], s):
                    got.setdefault(tl, []).append((a, b, tk, tv))
    for tl, a, b, tk, tv in app.drain():
        got.setdefault(tl, []).append((a, b, tk, tv))
    assert app.done and app.lane_seconds > 0 and [seg[:3] for seg in app.segments] == planned
    for tl, (wk, wv) in enumerate(want):
        assert [a for a, *_ in got[tl]] == [0, *[b for _, b, *_ in got[tl]][:-1]]  # token order, nothing missing
        k, v = torch.cat([k for *_, k, _ in got[tl]], 2), torch.cat([v for *_, v in got[tl]], 2)
        assert k.dtype == v.dtype == out_dtype and k.shape == wk.shape
        if map_dtype == torch.bfloat16:
            torch.testing.assert_close(k, k.bfloat16().to(out_dtype), rtol=0, atol=0)  # carries the map's precision
        tol = 0 if out_dtype == torch.float32 and map_dtype == torch.float32 else 2**-7  # else: one bf16 rounding
        torch.testing.assert_close(k, wk, rtol=max(tol, 1e-4), atol=max(tol, 1e-4) * float(wk.abs().max()))
        torch.testing.assert_close(v, wv, rtol=max(tol, 1e-4), atol=max(tol, 1e-4) * float(wv.abs().max()))
    assert torch.equal(apply(ms, src, 37, lanes=lanes)[5][0], torch.cat([k for *_, k, _ in got[5]], 2))


def test_lane_plans_share_each_range_the_client_sends():
    """kvferry's client sends 2 MiB token ranges (2,730 tokens of a SmolLM2 layer's float32 K) for every layer before
    the next range: each range is cut between the lanes, a short last range goes to the lane with the least work, and
    one range for all, or ranges under two lanes' minimum, give contiguous lanes."""
    from kvferry.sidecar.lanes import plan

    assert plan(8192, 2730, 2) == [
        (0, 1365, 0),
        (1365, 2730, 1),
        (2730, 4095, 0),
        (4095, 5460, 1),
        (5460, 6825, 0),
        (6825, 8190, 1),
        (8190, 8192, 0),
    ]
    assert plan(2048, 2730, 2) == plan(2048, 2048, 2) == [(0, 1024, 0), (1024, 2048, 1)]
    assert plan(8192, 1024, 2) == [(0, 4096, 0), (4096, 8192, 1)]  # pieces of 512 would cost more than they give
    assert plan(1000, 400, 3, share_min=128) == [
        (0, 133, 0),
        (133, 266, 1),
        (266, 400, 2),
        (400, 533, 0),
        (533, 666, 1),
        (666, 800, 2),
        (800, 1000, 0),
    ]
    assert plan(1000, 200, 2, share_min=128) == [(0, 500, 0), (500, 1000, 1)]  # too short to share


def test_lanes_run_at_once_on_one_core_each_and_the_feeder_never_waits_for_them(monkeypatch):
    """Each lane is a thread running torch on one core; ``push`` hands the lanes their parts and returns without
    waiting; a lane that finishes output calls ``on_output``; ``poll`` yields what is finished, ``drain`` waits for
    the rest and raises a lane's error; ``close`` drops work still queued. Through a real cross-model map."""
    import threading

    from kvferry.mappings.artifact import load
    from kvferry.sidecar import lanes as lanes_module

    ms = load(ROOT / "maps" / "S__T" / "1.0.0")
    g = ms.source.geometry
    src = make_kv(layers=g.layers, tokens=16, heads=g.kv_heads, head_dim=g.head_dim, seed=2)
    lanes = lanes_module.Lanes(2, min_slice=4)
    gate, seen = threading.Event(), []
    real = lanes_module.StreamingApplier.push

    def held(self, layer, kind, tensor, start=0):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        assert gate.wait(10)
        yield from real(self, layer, kind, tensor, start)

    monkeypatch.setattr(lanes_module.StreamingApplier, "push", held)
    app = lanes.applier(ms, 0, None, 16, 0)
    woken = threading.Event()
    app.on_output = woken.set
    for layer, (k, v) in enumerate(src):
        for kind, t in (("k", k), ("v", v)):
            assert list(app.push(layer, kind, t, 0)) == []  # the lanes are held, and push did not wait for them
    assert list(app.poll()) == [] and not woken.is_set()
    gate.set()
    assert woken.wait(10)  # a lane finished output: the caller is told, and can poll for it
    out = list(app.poll()) + list(app.drain())
    for layer in range(6):  # each target layer in token order (layers may interleave)
        assert [(a, b) for t, a, b, *_ in out if t == layer] == [(0, 8), (8, 16)]
    assert len(out) == 12
    assert {t for t, _ in seen} == {"kvferry-lane0_0", "kvferry-lane1_0"} and {c for _, c in seen} == {1}
    broken = lanes.applier(ms, 0, None, 16, 0)
    monkeypatch.setattr(lanes_module.StreamingApplier, "push", lambda *a: iter([1 / 0]))
    with pytest.raises(ZeroDivisionError):  # at the push that finds it, or at the drain
        list(broken.push(0, "k", src[0][0], 0))
        list(broken.drain())
    gate.clear()
    monkeypatch.setattr(lanes_module.StreamingApplier, "push", held)
    closed = lanes.applier(ms, 0, None, 16, 0)
    list(closed.push(0, "k", src[0][0], 0))  # held on the lanes
    list(closed.push(0, "v", src[0][1], 0))  # queued behind
    held_at = 2 * g.layers * 2 + 2
    wait_until(lambda: len(seen) == held_at, 10, "both lanes holding their first step")
    closed.close()
    gate.set()
    assert list(closed.drain()) == [] and len(seen) == held_at  # the queued steps never ran
    with pytest.raises(ValueError, match="at least one part"):
        lanes_module.Lanes(0)
    short = lanes.applier(ms, 0, None, 7, 0)  # under two lanes of min_slice: mapped by the caller, output at its push
    assert type(short) is StreamingApplier and not short.maps_off_thread
    lanes.shutdown()


def test_lanes_run_on_one_core_and_threads_started_after_them_do_not():
    """torch.set_num_threads is also the count every thread started later begins with: a lane's one core must not
    become every later thread's (the sidecar's I/O threads, a client or model in the same process). The lanes and the
    sidecar's compute thread keep one core each; a thread started after them has the count it had before."""
    from concurrent.futures import ThreadPoolExecutor

    from kvferry.sidecar.compute import ComputeThread
    from kvferry.sidecar.lanes import Lanes

    def later() -> int:
        with ThreadPoolExecutor(1) as fresh:
            return fresh.submit(torch.get_num_threads).result()

    before = later()
    lanes, compute = Lanes(2), ComputeThread(3)
    try:
        assert [w.submit(torch.get_num_threads).result() for w in lanes.workers] == [1, 1]
        assert compute.submit(torch.get_num_threads).result() == 1
        assert [w.submit(torch.get_num_threads).result() for w in compute.lanes.workers] == [1, 1, 1]
        assert later() == before
    finally:
        lanes.shutdown(), compute.shutdown()


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float32])
def test_a_bfloat16_map_gives_the_same_cache_whichever_dtype_multiplies_it(family, monkeypatch, compute):
    """CPUs without AVX-512 multiply bf16 matrices 40-70x slower than fp32 ones, so there a bf16 map is multiplied in
    fp32 (precision.matmul_dtype). Its inputs and weights are bf16 numbers either way and the output is rounded to
    bf16 either way, so the cache is the one the map's evidence measured: equal to bf16 multiplication within one
    bf16 rounding, through a real cross-model map."""
    from kvferry.mappings import apply as apply_module
    from kvferry.mappings.artifact import load

    ms = load(ROOT / "maps" / "S__T" / "1.0.0").to(dtype=torch.bfloat16)
    g = ms.source.geometry
    src = make_kv(layers=g.layers, tokens=40, heads=g.kv_heads, head_dim=g.head_dim, seed=5)
    monkeypatch.setattr(apply_module, "matmul_dtype", lambda map_dtype, device: map_dtype)
    want = apply(ms, src, 3)
    monkeypatch.setattr(apply_module, "matmul_dtype", lambda map_dtype, device: compute)
    got = apply(ms, src, 3)
    assert ms.fused_groups(compute)[0][2].dtype == compute  # the weights it multiplied with
    for (wk, wv), (k, v) in zip(want, got):
        for w, x in ((wk, k), (wv, v)):
            assert x.dtype == torch.float32  # the input's dtype, carrying bf16 precision
            torch.testing.assert_close(x, x.bfloat16().float(), rtol=0, atol=0)
            torch.testing.assert_close(x, w, rtol=2**-7, atol=2**-7 * float(w.abs().max()))


def test_bfloat16_maps_are_multiplied_in_float32_where_the_cpu_lacks_fast_bfloat16():
    """The one decision: float32 maps always run in float32; bf16 maps run in bf16 on a CPU with bfloat16
    instructions (AVX512_BF16 or AMX on x86) and in float32 on one without them (AVX-512 alone runs oneDNN's bf16 GEMM
    3x slower than float32; AVX2 alone, a scalar loop)."""
    from kvferry.mappings import precision
    from kvferry.mappings.precision import fast_bf16, matmul_dtype

    assert matmul_dtype(torch.float32, "cpu") == torch.float32
    assert matmul_dtype(torch.bfloat16, "cpu") == (torch.bfloat16 if fast_bf16("cpu") else torch.float32)
    flags = precision._cpu_flags()
    if "avx512bw" in flags or "avx2" in flags:  # x86 whose flags we can read
        assert fast_bf16("cpu") == bool(flags & {"avx512_bf16", "amx_bf16"})
