"""The shared-basis map kind: every source layer -> one low-rank code -> every target layer (reduced-rank
regression)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import DATA, make_kv, tiny_config

from kvferry.mappings.apply import StreamingApplier, apply
from kvferry.mappings.artifact import Basis, LayerMap, MapSet, load, save
from kvferry.mappings.errors import ArtifactError, InvalidInput
from kvferry.mappings.geometry import ModelIdentity, geometry_of
from kvferry.mappings.lab.capture import capture_kv
from kvferry.mappings.lab.fit import FitSettings, fit_pair, solve_basis, solve_maps
from kvferry.mappings.lab.gram import GramStats
from kvferry.mappings.lab.reduced_rank import heldout_r2, reduced_rank

CALIB = [str(DATA / "calib.jsonl")]
GOLDEN = Path(__file__).parent / "golden" / "artifact_v3"


def _regression(n=600, dx=12, dy=10, rank=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dx, generator=g, dtype=torch.float64) * torch.linspace(0.5, 3, dx) + 2
    b = torch.randn(dx, rank, generator=g, dtype=torch.float64) @ torch.randn(
        rank, dy, generator=g, dtype=torch.float64
    )
    y = x @ b + 0.1 * torch.randn(n, dy, generator=g, dtype=torch.float64) + 1
    y[:, dy // 2 :] *= 10  # one block ten times the other's scale: the weighting must not let it decide alone
    train, held = GramStats(dx, dy), GramStats(dx, dy)
    train.add(x[: n * 2 // 3], y[: n * 2 // 3])
    held.add(x[n * 2 // 3 :], y[n * 2 // 3 :])
    return x, y, train, held, [torch.arange(0, dy // 2), torch.arange(dy // 2, dy)]


def test_reduced_rank_is_the_weighted_projection_of_the_ridge_fit():
    """At full rank the factors multiply back to the least-squares map; at rank 2 they are its fitted values' top two
    directions under per-block variance weights (an SVD of the materialised fitted values says so); codes are centred
    with unit variance; held-out R² from sums equals R² computed on the held-out rows."""
    x, y, train, held, blocks = _regression()
    n = train.n
    xt, yt = x[:n], y[:n]
    mx, my = xt.mean(0), yt.mean(0)
    w = torch.linalg.lstsq(xt - mx, yt - my).solution
    full = reduced_rank(train, blocks, [1e-9, 1e-9], 10)
    torch.testing.assert_close(full.encoder @ full.decoder, w, rtol=1e-5, atol=1e-5)
    weights = torch.cat([torch.full((len(c),), 1 / float(((yt[:, c] - my[c]) ** 2).sum())) for c in blocks])
    _, _, vt = torch.linalg.svd((xt - mx) @ w * weights.sqrt(), full_matrices=False)
    v = vt[:2].T
    low = reduced_rank(train, blocks, [1e-9, 1e-9], 2)
    torch.testing.assert_close(
        low.encoder @ low.decoder, (w * weights.sqrt()) @ v @ v.T / weights.sqrt(), rtol=1e-5, atol=1e-5
    )
    z = xt @ low.encoder + low.encoder_bias
    torch.testing.assert_close(z.mean(0), torch.zeros(2, dtype=torch.float64), atol=1e-9, rtol=0)
    torch.testing.assert_close(z.var(0, unbiased=False), torch.ones(2, dtype=torch.float64))
    pred = (x[n:] @ low.encoder + low.encoder_bias) @ low.decoder + low.decoder_bias
    for cols, got in zip(blocks, heldout_r2(low, train, held, blocks, [1, 2])[2]):
        yh = y[n:, cols]
        want = 1 - ((pred[:, cols] - yh) ** 2).sum() / ((yh - yh.mean(0)) ** 2).sum()
        assert got == pytest.approx(float(want), abs=1e-9)
    r2 = heldout_r2(full, train, held, blocks, [1, 2, 4, 10])
    assert r2[1][0] < r2[2][0] < r2[4][0] and r2[4][0] > 0.99  # the data have rank 4: four directions explain it


def test_reduced_rank_refuses_an_impossible_rank():
    _, _, train, _, blocks = _regression()
    for rank in (0, 11):
        with pytest.raises(InvalidInput, match=r"rank must be in 1..10"):
            reduced_rank(train, blocks, [1e-3, 1e-3], rank)


@pytest.fixture(scope="module")
def basis_set(family):
    """The tiny family's S -> T as a shared basis of rank 48, with its cost/R² curve."""
    s, t = family["S"], family["T"]
    return fit_pair(s, t, CALIB, FitSettings(seq_len=128, max_tokens=8192, basis_rank=48), progress=False)


def test_fit_writes_a_basis_set_and_its_curve(basis_set, family):
    ms = basis_set
    sg, tg = family["S"].identity.geometry, family["T"].identity.geometry
    assert ms.basis.rank == 48 and ms.basis.source_layers == tuple(range(sg.layers))
    assert ms.basis.encoder.shape == (2 * sg.layers * sg.kv_width, 48)
    assert all(m.weight.shape == (48, tg.kv_width) for m in ms.maps.values())
    curve = ms.fit["rank_curve"]
    ridge = curve[-1]
    assert ridge["rank"] is None and ridge["mflop_per_token"] == pytest.approx(
        2 * 2 * sg.layers * sg.kv_width * 2 * tg.layers * tg.kv_width / 1e6, abs=0.01
    )
    ranked = [row for row in curve[:-1]]
    assert [row["rank"] for row in ranked] == sorted(row["rank"] for row in ranked) and 48 in [
        row["rank"] for row in ranked
    ]
    means = [row["k_r2_mean"] for row in ranked]
    assert means == sorted(means)  # more directions never explain less on these sums
    assert ranked[-1]["k_r2_mean"] == pytest.approx(ridge["k_r2_mean"], abs=0.02)  # full rank: the ridge map itself
    assert 0.5 < ms.maps[(0, "k")].heldout_r2 <= 1


def test_basis_apply_equals_the_materialised_map_in_any_chunking(basis_set, family):
    """The streaming applier sums each chunk into its tokens' codes: whole layers, token ranges and interleaved
    one-token chunks all give what the dense product encoder @ decoder gives."""
    ms = basis_set
    s = family["S"]
    ids = torch.randint(2, 4096, (2, 37))
    kv = capture_kv(s.model, ids)
    got = apply(ms, kv)
    dense = _dense(ms)
    want = apply(dense, kv)
    for (k, v), (wk, wv) in zip(got, want):
        torch.testing.assert_close(k, wk, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v, wv, rtol=1e-4, atol=1e-4)
    import copy

    def worst(out):  # the largest relative error of any layer's K or V against the float32 basis set's
        return max(
            float((a.float() - b).norm() / b.norm())
            for (k, v), (wk, wv) in zip(out, got)
            for a, b in ((k, wk), (v, wv))
        )

    # stored and applied in bfloat16, the code rounded between the two products: no worse than the same map
    # materialised and applied in bfloat16 (this float32 fit's weights are large for bf16 either way: a bf16 fit
    # chooses its lambdas for that rounding)
    assert worst(apply(copy.deepcopy(ms).to(dtype=torch.bfloat16), kv)) < 1.5 * worst(
        apply(dense.to(dtype=torch.bfloat16), kv)
    )
    applier = StreamingApplier(ms, 0, tokens=37)
    out: dict[int, list] = {}
    for a, b in ((0, 1), (1, 9), (9, 37)):  # token ranges, every layer of each before the next range
        for layer, (k, v) in enumerate(kv):
            for kind, x in (("k", k), ("v", v)):
                for t, lo, hi, tk, tv in applier.push(layer, kind, x[:, :, a:b], a):
                    out.setdefault(t, []).append((lo, hi, tk, tv))
    assert applier.done
    for t, pieces in out.items():
        assert [(lo, hi) for lo, hi, _, _ in pieces] == [(0, 1), (1, 9), (9, 37)]
        torch.testing.assert_close(torch.cat([p[2] for p in pieces], 2), got[t][0], rtol=1e-5, atol=1e-5)


def test_a_basis_set_emits_nothing_before_its_last_source_layer(basis_set, family):
    """What the pipeline gives up: every target layer of a token range waits for every source layer of it."""
    ms = basis_set
    kv = capture_kv(family["S"].model, torch.randint(2, 4096, (1, 20)))
    applier = StreamingApplier(ms, 0, tokens=20)
    pushes = [(layer, kind, x) for layer, (k, v) in enumerate(kv) for kind, x in (("k", k), ("v", v))]
    for layer, kind, x in pushes[:-1]:
        assert list(applier.push(layer, kind, x)) == []
    assert len(list(applier.push(*pushes[-1]))) == ms.target.geometry.layers


def _dense(ms: MapSet) -> MapSet:
    """The same set with every map's weight materialised (encoder @ decoder) as a per-layer set reading every source
    layer."""
    enc, bias = ms.basis.encoder.float(), ms.basis.bias.float()
    maps = {
        key: LayerMap(
            m.target_layer,
            m.kind,
            m.source_layers,
            enc @ m.weight.float(),
            bias @ m.weight.float() + m.bias.float(),
            inputs=m.inputs,
        )
        for key, m in ms.maps.items()
    }
    return MapSet(ms.source, ms.target, maps, ms.version)


def test_fitted_basis_round_trips_and_is_refused_when_edited(basis_set, tmp_path):
    dest = save(basis_set, tmp_path)
    man = json.loads((dest / "manifest.json").read_text())
    assert man["format_version"] == 3 and man["basis"] == {
        "rank": 48,
        "source_layers": [0, 1, 2, 3],
        "inputs": ["k", "v"],
    }
    back = load(dest)
    torch.testing.assert_close(back.basis.encoder, basis_set.basis.encoder, rtol=0, atol=0)
    assert back.fit["rank_curve"] == basis_set.fit["rank_curve"]


def golden_basis_set() -> MapSet:
    """A deterministic shared-basis set: 2-layer llama (kv 2x16) -> 3-layer llama (kv 3x16), rank 5."""
    src = ModelIdentity("tiny-src", geometry_of(tiny_config("llama")), "a" * 64)
    tgt = ModelIdentity(
        "tiny-tgt", geometry_of(tiny_config("llama", layers=3, hidden=96, heads=6, kv_heads=3)), "a" * 64
    )
    enc = torch.arange(2 * 2 * 32 * 5, dtype=torch.float32).reshape(128, 5) / 1000
    basis = Basis((0, 1), enc, torch.linspace(-1, 1, 5))
    maps = {
        (t, kind): LayerMap(
            t,
            kind,
            (0, 1),
            torch.arange(5 * 48, dtype=torch.float32).reshape(5, 48) / 100 + t + i,
            torch.full((48,), 0.25 * t),
            1e-3,
            0.8,
            ("k", "v"),
        )
        for t in range(3)
        for i, kind in enumerate("kv")
    }
    return MapSet(
        src,
        tgt,
        maps,
        "3.0.0",
        {"basis_rank": 5},
        {"corpus_sha256": "b" * 64, "tokens": 1000},
        created_at="2026-01-01T00:00:00Z",
        kvferry_version="0.1.0",
        basis=basis,
    )


def test_golden_bytes_of_a_basis_set(tmp_path):
    """Format 3 outlives the process: today's save() writes exactly the committed bytes, and load() reads them."""
    dest = save(golden_basis_set(), tmp_path)
    for name in ("manifest.json", "maps.safetensors"):
        assert (dest / name).read_bytes() == (GOLDEN / name).read_bytes(), (
            f"{name} changed: a format change needs a new FORMAT_VERSION"
        )
    committed = tmp_path / "committed" / "tiny-src__tiny-tgt" / "3.0.0"
    committed.mkdir(parents=True)
    for name in ("manifest.json", "maps.safetensors"):
        (committed / name).write_bytes((GOLDEN / name).read_bytes())
    back = load(committed)
    assert back.basis.source_layers == (0, 1) and torch.equal(back.basis.encoder, golden_basis_set().basis.encoder)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda ms: setattr(ms.basis, "encoder", ms.basis.encoder[:, :4]), "bias"),
        (lambda ms: setattr(ms.basis, "source_layers", (0, 0)), "distinct"),
        (lambda ms: setattr(ms.basis, "encoder", ms.basis.encoder.double()), "dtype"),
        (lambda ms: setattr(ms.maps[(1, "v")], "weight", torch.zeros(4, 48)), "weight"),
        (lambda ms: setattr(ms.maps[(1, "k")], "source_layers", (0,)), "read the basis"),
        (lambda ms: ms.basis.encoder.__setitem__((0, 0), float("nan")), "NaN"),
    ],
)
def test_inconsistent_basis_sets_are_refused(tmp_path, edit, match):
    ms = golden_basis_set()
    edit(ms)
    with pytest.raises(ArtifactError, match=match):
        save(ms, tmp_path)


def test_an_edited_basis_manifest_is_refused(tmp_path):
    from kvferry.mappings.geometry import digest

    dest = save(golden_basis_set(), tmp_path)
    man = json.loads((dest / "manifest.json").read_text())
    man.pop("basis")
    man.pop("manifest_sha256")
    man["manifest_sha256"] = digest(man)
    (dest / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ArtifactError, match="must go together"):
        load(dest)


def test_basis_settings_that_cannot_work_are_refused(family):
    with pytest.raises(InvalidInput, match="basis_rank must be a positive integer"):
        FitSettings(basis_rank=0)
    with pytest.raises(InvalidInput, match="drop window"):
        FitSettings(basis_rank=8, window=2)
    with pytest.raises(InvalidInput, match="drop window"):
        FitSettings(basis_rank=8, per_head=True)


def test_basis_and_per_layer_solvers_agree_on_the_same_sums(family):
    """Same sums: the every-source ridge row of the curve equals the per-layer solver's fit with every source layer."""
    from kvferry.mappings.lab.capture import read_corpus, token_windows
    from kvferry.mappings.lab.fit import GramSet, accumulate

    s, t = family["S"], family["T"]
    settings = FitSettings(k=s.identity.geometry.layers, seq_len=128, max_tokens=4096, basis_rank=16)
    windows = token_windows(s.tokenizer, read_corpus(CALIB), 128, 4096)
    gs: GramSet = accumulate(s, t, windows, settings, progress=False)
    _, _, curve = solve_basis(gs, s.identity, t.identity, settings)
    dense = solve_maps(gs, s.identity, t.identity, settings)
    k_mean = sum(m.heldout_r2 for (_, kind), m in dense.items() if kind == "k") / t.identity.geometry.layers
    assert curve[-1]["k_r2_mean"] == pytest.approx(k_mean, abs=1e-3)


def _degraded(ms: MapSet) -> MapSet:
    """``ms`` with its encoder shrunk to 0.6: a shared-basis set the target's tail KL can repair."""
    b = ms.basis
    return MapSet(
        ms.source,
        ms.target,
        dict(ms.maps),
        "1.0.0",
        dict(ms.fit),
        dict(ms.calibration),
        basis=Basis(b.source_layers, b.encoder * 0.6, b.bias, b.inputs, b.mlp),
    )


def _distilled(start: MapSet, family) -> MapSet:
    """``start`` distilled from layer 0 on 9 windows of 256 tokens; asserts the held-out tail KL fell by a fifth."""
    import random

    from kvferry.mappings.lab.capture import read_corpus, token_windows
    from kvferry.mappings.lab.distill import DistillSettings, capture_tails, distill

    source, target = family["S"], family["T"]
    windows = token_windows(target.tokenizer, read_corpus(CALIB), 256, 256 * 12)
    s = DistillSettings(from_layer=0, tail=16, repeat_span=48, epochs=3, lr=5e-4, seed=0)
    rng = random.Random(0)
    train, held = (
        capture_tails(start, source, target, windows[:9], s, rng),
        capture_tails(start, source, target, windows[9:], s, rng),
    )
    maps, log = distill(start, source, target, train, held, s)
    assert log[log[-1]["kept_epoch"]]["held_kl"] < 0.8 * log[0]["held_kl"], log
    return maps.mapset("1.0.1", s.as_dict())


def test_distilling_a_basis_set_trains_its_encoder_and_matches_apply(basis_set, family):
    """The trainable cache of a shared-basis set is what apply gives; distillation from layer 0 moves the encoder and
    every decoder and lowers the held-out tail KL of a degraded copy; from a later layer the encoder stays as it was."""
    from kvferry.mappings.lab.distill import TrainableMaps

    g = basis_set.source.geometry
    kv = make_kv(layers=g.layers, tokens=30, heads=g.kv_heads, head_dim=g.head_dim, seed=1)
    want = apply(basis_set, kv, 0)
    for (gk, gv), (wk, wv) in zip(TrainableMaps(basis_set, 0).cache(kv, want, 30), want):
        torch.testing.assert_close(gk, wk, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gv, wv, rtol=1e-4, atol=1e-4)
    start = _degraded(basis_set)
    out = _distilled(start, family)
    assert not torch.equal(out.basis.encoder, start.basis.encoder)
    assert all(not torch.equal(out.maps[k].weight, m.weight) for k, m in start.maps.items())
    out.validate()
    later = TrainableMaps(start, 2)
    assert "encoder" not in later.shared and not later.encoder.requires_grad
    assert torch.equal(later.mapset("1.0.2", {}).basis.encoder, start.basis.encoder)


@pytest.mark.parametrize("map_threads", [1, 2])
def test_a_real_sidecar_serves_a_basis_set_as_apply_maps_it(basis_set, family, sidecar_factory, tmp_path, map_threads):
    """Through gRPC, in chunks of 16 tokens, mapped by one thread or by token lanes: the target blocks equal the
    in-process apply; the listing shows the version (the wire and the client are unchanged)."""
    from kvferry.client.client import ClientOptions, Retry, TranslateClient

    save(basis_set, tmp_path / "maps")
    s = family["S"].identity
    g = s.geometry
    kv = make_kv(layers=g.layers, tokens=70, heads=g.kv_heads, head_dim=g.head_dim, seed=4)
    want = apply(basis_set, kv)
    sc = sidecar_factory(maps_dir=str(tmp_path / "maps"), force_maps=True, map_threads=map_threads)
    with TranslateClient(ClientOptions(target=sc.address, chunk_tokens=16, retry=Retry(retries=0))) as c:
        assert [m.version for m in c.list_mappings("S__T")] == [basis_set.version]
        got = c.translate(kv, "S__T", basis_set.version, source_geometry=g.fingerprint, tokenizer=s.tokenizer)
        for (k, v), (wk, wv) in zip(got.layers(), want):
            torch.testing.assert_close(k, wk, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, wv, rtol=1e-4, atol=1e-4)


def golden_mlp_set() -> MapSet:
    """The golden basis set with a code MLP of 3 units (format 4)."""
    from kvferry.mappings.artifact import CodeMLP

    ms = golden_basis_set()
    ms.version = "4.0.0"
    ms.basis.mlp = CodeMLP(
        torch.linspace(-1, 1, 15).reshape(5, 3), torch.tensor([0.5, -0.5, 0.0]), torch.linspace(1, -1, 15).reshape(3, 5)
    )
    return ms


def test_golden_bytes_of_a_basis_set_with_a_code_mlp(tmp_path):
    dest = save(golden_mlp_set(), tmp_path)
    golden = GOLDEN.parent / "artifact_v4"
    for name in ("manifest.json", "maps.safetensors"):
        assert (dest / name).read_bytes() == (golden / name).read_bytes(), (
            f"{name} changed: a format change needs a new FORMAT_VERSION"
        )
    man = json.loads((dest / "manifest.json").read_text())
    assert man["format_version"] == 4 and man["basis"]["mlp_hidden"] == 3
    back = load(dest)
    assert torch.equal(back.basis.mlp.w_out, golden_mlp_set().basis.mlp.w_out)
    assert load(save(golden_basis_set(), tmp_path / "plain")).basis.mlp is None  # format 3 stays as it was


def test_a_code_mlp_refines_the_code_every_map_reads(basis_set, family):
    """apply decodes z + gelu(z W1 + b1) W2 (z the code); added by with_code_mlp it starts as the linear map."""
    import copy

    from kvferry.mappings.artifact import CodeMLP
    from kvferry.mappings.lab.distill import with_code_mlp

    kv = capture_kv(family["S"].model, torch.randint(2, 4096, (1, 21)))
    plain = apply(basis_set, kv)
    added = with_code_mlp(basis_set, 16)
    for (k, _v), (wk, _wv) in zip(apply(added, kv), plain):
        torch.testing.assert_close(k, wk, rtol=1e-5, atol=1e-5)
    ms = copy.deepcopy(added)
    g = torch.Generator().manual_seed(1)
    ms.basis.mlp = CodeMLP(ms.basis.mlp.w_in, torch.randn(16, generator=g), torch.randn(16, 48, generator=g) * 0.1)
    got = apply(ms, kv)
    from kvferry.mappings.lab.attention_match import map_inputs

    code = map_inputs(basis_set, kv)[0]
    z = code + torch.nn.functional.gelu(code @ ms.basis.mlp.w_in + ms.basis.mlp.b_in) @ ms.basis.mlp.w_out
    want = z @ ms.maps[(0, "v")].weight + ms.maps[(0, "v")].bias
    tg = ms.target.geometry
    torch.testing.assert_close(got[0][1][0].transpose(0, 1).reshape(21, tg.kv_width), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(InvalidInput, match="already has a code MLP"):
        with_code_mlp(added, 8)
    with pytest.raises(ArtifactError, match="code MLP shapes"):
        bad = copy.deepcopy(added)
        bad.basis.mlp = CodeMLP(bad.basis.mlp.w_in[:, :4], bad.basis.mlp.b_in, bad.basis.mlp.w_out)
        bad.validate()


def test_distillation_trains_a_code_mlp(basis_set, family):
    """From a degraded basis set with a zero-output code MLP, distillation moves the MLP and lowers the held-out KL."""
    from kvferry.mappings.lab.distill import with_code_mlp

    out = _distilled(with_code_mlp(_degraded(basis_set), 16), family)
    assert out.basis.mlp is not None and out.basis.mlp.w_out.abs().sum() > 0
    out.validate()


def test_what_a_set_costs_per_token(basis_set):
    """One answer to "what does a map cost per token": the basis' encoder, its code MLP and the decoders."""
    from kvferry.mappings.lab.distill import with_code_mlp

    rows, r, tw, maps = basis_set.basis.encoder.shape[0], 48, basis_set.target.geometry.kv_width, len(basis_set.maps)
    assert basis_set.flops_per_token == 2 * (rows * r + r * tw * maps)
    assert with_code_mlp(basis_set, 16).flops_per_token == basis_set.flops_per_token + 2 * 2 * r * 16
    assert _dense(basis_set).flops_per_token == 2 * rows * tw * maps


def test_distill_refuses_a_code_mlp_without_a_basis(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvferry",
            "distill",
            str(ROOT / "maps" / "S__T" / "1.0.0"),
            "--version",
            "1.0.1",
            "--out",
            str(tmp_path),
            "--code-mlp",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0 and "has no basis" in run.stderr and "Traceback" not in run.stderr


def test_bench_apply_counts_what_streaming_overlaps(basis_set, family):
    """Fed layer by layer, a self map emits target layer 0 once source layer 0's K and V are in; a shared basis
    emits nothing before the last source chunk."""
    from kvferry.bench.apply_cost import first_layer_after, synthetic_basis_set
    from kvferry.mappings.lab.fit import identity_mapset

    s = family["S"]
    kv = capture_kv(s.model, torch.randint(2, 4096, (1, 12)))
    layers = s.identity.geometry.layers
    assert first_layer_after(identity_mapset(s.identity), kv) == 2
    assert first_layer_after(basis_set, kv) == 2 * layers
    synthetic = synthetic_basis_set(basis_set, 8)
    assert synthetic.basis.rank == 8 and synthetic.flops_per_token < basis_set.flops_per_token
    synthetic.validate()
