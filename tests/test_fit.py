import subprocess
import sys

import pytest
import torch
from conftest import DATA, MODELS

from kvferry.mappings.apply import apply
from kvferry.mappings.artifact import load, save
from kvferry.mappings.cache import to_dynamic_cache
from kvferry.mappings.errors import InvalidInput
from kvferry.mappings.lab.capture import capture_kv, load_model
from kvferry.mappings.lab.fit import FitSettings, fit_pair

CALIB = [str(DATA / "calib.jsonl")]


@pytest.mark.parametrize("min_gain", [0.0, 1e-4])
def test_self_map_gives_the_models_own_logits(family, min_gain):
    s = family["S"]
    ms = fit_pair(s, s, CALIB, FitSettings(k=2, seq_len=256, max_tokens=16384, min_gain=min_gain), progress=False)
    for (t, _kind), m in ms.maps.items():
        assert t in m.source_layers and m.heldout_r2 > 0.9999
        # with a minimum gain, a layer the source shares is read alone: a second layer adds nothing
        assert len(m.source_layers) == (1 if min_gain else 2)
    ids = torch.randint(2, 4096, (2, 200))
    mapped = apply(ms, capture_kv(s.model, ids[:, :-1]))
    with torch.no_grad():
        got = s.model(input_ids=ids[:, -1:], past_key_values=to_dynamic_cache(mapped, s.model.config)).logits[:, -1]
        want = s.model(input_ids=ids).logits[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def _r2(mapped, true, spec) -> float:
    """R² of mapped against true cache tensors in the maps' position-free space (keys un-rotated with ``spec``)."""
    from kvferry.mappings.features import to_features

    pos = torch.arange(true.shape[2])
    a, b = to_features(mapped, spec, pos)[0].double(), to_features(true, spec, pos)[0].double()
    return float(1 - ((a - b) ** 2).sum() / ((b - b.mean(0)) ** 2).sum())


@pytest.mark.parametrize("pair", [("qwen3", "llama_wide"), ("mistral", "llama"), ("qwen2", "qwen2")])
def test_cross_architecture_fit(tiny_models, pair):
    """Maps between architectures are fitted, applied and shaped as the target's cache. Where the two models hold the
    same weights (one seed, one size: Mistral and Llama share the layout), the map must reproduce the target's cache
    layer by layer (an all-zero, constant or K/V-swapped map would not); between unrelated random models it must
    still explain part of the target's K and V on held-out windows."""
    src, tgt = load_model(tiny_models[pair[0]]), load_model(tiny_models[pair[1]])
    ms = fit_pair(src, tgt, CALIB, FitSettings(k=2, seq_len=128, max_tokens=8192), progress=False)
    g = tgt.identity.geometry
    assert len(ms.maps) == 2 * g.layers
    assert all(len(m.source_layers) == min(2, src.identity.geometry.layers) for m in ms.maps.values())
    ids = torch.randint(2, 4096, (1, 30))
    out, want = apply(ms, capture_kv(src.model, ids)), capture_kv(tgt.model, ids)
    assert out[0][0].shape == (1, g.kv_heads, 30, g.head_dim)
    if pair[0] != "qwen3":  # the same weights on both sides
        for (k, v), (wk, wv) in zip(out, want):
            assert _r2(k, wk, g.rope) > 0.999 and _r2(v, wv, None) > 0.999
            assert _r2(v, wk, g.rope) < 0.5  # K and V are different things: a swapped map would be caught
    else:
        assert all(m.heldout_r2 > 0.1 for m in ms.maps.values()), {k: m.heldout_r2 for k, m in ms.maps.items()}


def test_subsampling_and_too_little_text(family, tmp_path):
    s = family["S"]
    ms = fit_pair(s, s, CALIB, FitSettings(k=1, seq_len=128, max_tokens=8192, subsample=0.5), progress=False)
    assert ms.fit["subsample"] == 0.5 and ms.calibration["tokens"] == 8192
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("x = 1\n")
    with pytest.raises(InvalidInput, match="windows"):
        fit_pair(s, s, [str(tiny)], FitSettings(seq_len=128), progress=False)
    with pytest.raises(InvalidInput, match="min_gain"):
        FitSettings(min_gain=1.0)
    with pytest.raises(InvalidInput):
        FitSettings(subsample=0)


def test_torchrun_two_processes_match_one(tmp_path):
    """Gram sums add: a 2-process gloo fit writes the same maps as a single process."""
    common = [
        "fit",
        "--source",
        str(MODELS / "S"),
        "--target",
        str(MODELS / "T"),
        "--k",
        "2",
        "--seq-len",
        "128",
        "--max-tokens",
        "6400",
        "--quiet",
    ]
    one = subprocess.run(
        [sys.executable, "-m", "kvferry", "--threads", "1", *common, "--out", str(tmp_path / "one")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "kvferry",
            "--threads",
            "1",
            *common,
            "--out",
            str(tmp_path / "two"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = load(tmp_path / "one" / "S__T" / "1.0.0"), load(tmp_path / "two" / "S__T" / "1.0.0")
    assert b.calibration["processes"] == 2 and a.calibration["tokens"] == b.calibration["tokens"]
    for key, m in a.maps.items():
        assert b.maps[key].source_layers == m.source_layers
        torch.testing.assert_close(b.maps[key].weight, m.weight, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(b.maps[key].bias, m.bias, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("inputs,per_head", [("kv", False), ("same", True), ("kv", True)])
def test_joint_inputs_and_per_head_variants(family, tmp_path, inputs, per_head):
    s, t = family["S"], family["T"]
    ms = fit_pair(
        s, t, CALIB, FitSettings(k=2, seq_len=128, max_tokens=8192, inputs=inputs, per_head=per_head), progress=False
    )
    sg, tg = s.identity.geometry, t.identity.geometry
    m = ms.maps[(1, "k")]
    assert m.inputs == (("k", "v") if inputs == "kv" else ("k",))
    assert m.weight.shape == (2 * len(m.inputs) * sg.kv_width, tg.kv_width)
    if per_head:  # target head j (of 4) reads source head j // 2 (of 2) only
        w = m.weight.view(2 * len(m.inputs), sg.kv_heads, sg.head_dim, tg.kv_heads, tg.head_dim)
        for j in range(tg.kv_heads):
            assert w[:, 1 - j // 2, :, j].abs().max() == 0
    back = load(save(ms, tmp_path))
    out = apply(back, capture_kv(s.model, torch.randint(2, 4096, (1, 40))))
    assert len(out) == tg.layers and out[0][0].shape == (1, tg.kv_heads, 40, tg.head_dim)


def test_saved_sums_refit_without_capture_and_match(family, tmp_path, monkeypatch):
    """--stats: the second fit reads the sums instead of running the models, and solves the same maps;
    sums captured for other settings or another pair are not reused."""
    import kvferry.mappings.lab.fit as fit

    s, t = family["S"], family["T"]
    stats = tmp_path / "sums.safetensors"
    settings = FitSettings(k=2, seq_len=128, max_tokens=4096)
    first = fit_pair(s, t, CALIB, settings, progress=False, stats_path=stats)
    assert stats.is_file()

    def no_capture(*a, **k):
        raise AssertionError("captured again although matching sums were saved")

    monkeypatch.setattr(fit, "accumulate", no_capture)
    again = fit_pair(s, t, CALIB, FitSettings(k=2, seq_len=128, max_tokens=4096), progress=False, stats_path=stats)
    for key, m in first.maps.items():
        assert again.maps[key].source_layers == m.source_layers
        torch.testing.assert_close(again.maps[key].weight, m.weight, rtol=0, atol=0)
    assert again.calibration["tokens"] == first.calibration["tokens"] == 4096
    with pytest.raises(AssertionError, match="captured again"):  # other capture settings: stale sums are not used
        fit_pair(s, t, CALIB, FitSettings(k=2, seq_len=128, max_tokens=2048), progress=False, stats_path=stats)
    with pytest.raises(AssertionError, match="captured again"):  # another pair
        fit_pair(s, s, CALIB, settings, progress=False, stats_path=stats)


def test_shared_decompositions_give_todays_selection_on_the_shipped_pair(family):
    """The solver shares eigendecompositions across target maps: the shipped S__T 1.0.0 (fitted before the
    sharing existed) comes out with the same source layers and weights from the same calibration data."""
    shipped = load(MODELS.parent / "maps" / "S__T" / "1.0.0")
    ms = fit_pair(family["S"], family["T"], CALIB, FitSettings(), progress=False)
    for key, m in shipped.maps.items():
        assert ms.maps[key].source_layers == m.source_layers, key
        # Relative to the map's norm, not per element: the capture and solve run through the CPU's BLAS kernels,
        # and another CPU's kernels move single elements near zero by more than 1e-4 relatively (measured on an
        # AMD EPYC runner: 3.3e-5 of the norm at most). A change in what the solver computes moves far more.
        err = ((ms.maps[key].weight - m.weight).norm() / m.weight.norm()).item()
        assert err < 2e-4, (key, err)


WINDOWED = dict(k=2, seq_len=128, max_tokens=4096, window=3, window_layers=(2, 4), window_kinds="kv", window_sources=2)


def _windowed_rows(s, t, settings):
    """The windowed maps' inputs and targets, materialised from both models' caches: (train X, Y), (held-out X, Y)."""
    from kvferry.mappings.features import to_features, window_inputs
    from kvferry.mappings.lab.capture import read_corpus, token_windows

    sg, tg = s.identity.geometry, t.identity.geometry
    out = {True: ([], []), False: ([], [])}
    for i, ids in enumerate(token_windows(s.tokenizer, read_corpus(CALIB), settings.seq_len, settings.max_tokens)):
        skv, tkv = capture_kv(s.model, ids[None]), capture_kv(t.model, ids[None])
        pos = range(len(ids))

        def feat(kv, spec, layer, kind):
            return to_features(kv[layer][0 if kind == "k" else 1], spec if kind == "k" else None, pos)[0]

        xs, ys = out[i % settings.heldout_every == 0]
        xs.append(window_inputs(lambda l, c: feat(skv, sg.rope, l, c), (2, 3), ("k", "v"), 3))
        ys.append(torch.cat([feat(tkv, tg.rope, l, c) for l in (2, 3, 4) for c in ("k", "v")], -1))
    return [(torch.cat(xs).double(), torch.cat(ys).double()) for xs, ys in (out[False], out[True])]


def test_windowed_fit_solves_the_ridge_of_its_materialised_windows(family, tmp_path):
    """window=3 over target layers 2-4 (K and V): those six maps read three tokens of the source's last two layers,
    and each equals the centred ridge solve on the windows built by hand from both caches (zeros before each
    calibration window's first token); the other maps stay per-token and greedily chosen."""
    s, t = family["S"], family["T"]
    sg, tg = s.identity.geometry, t.identity.geometry
    settings = FitSettings(**WINDOWED)
    ms = fit_pair(s, t, CALIB, settings, progress=False)
    (xtr, ytr), (xho, yho) = _windowed_rows(s, t, settings)
    x, y = torch.cat([xtr, xho]), torch.cat([ytr, yho])
    mx, my = x.mean(0), y.mean(0)
    cxx = (x - mx).T @ (x - mx)
    for i, key in enumerate((l, c) for l in (2, 3, 4) for c in ("k", "v")):
        m = ms.maps[key]
        assert (m.window, m.source_layers, m.inputs) == (3, (2, 3), ("k", "v"))
        assert m.weight.shape == (3 * 2 * 2 * sg.kv_width, tg.kv_width)
        cols = slice(i * tg.kv_width, (i + 1) * tg.kv_width)
        ridge = m.lam * float(cxx.diagonal().mean())
        w = torch.linalg.solve(cxx + ridge * torch.eye(len(cxx), dtype=cxx.dtype), (x - mx).T @ (y[:, cols] - my[cols]))
        want, got = (xho - mx) @ w + my[cols], xho @ m.weight.double() + m.bias.double()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        resid = ((xho @ m.weight.double() + m.bias.double() - yho[:, cols]) ** 2).sum()
        assert m.heldout_r2 > 0.5 and 1 - resid / ((yho[:, cols] - yho[:, cols].mean(0)) ** 2).sum() > 0.5
    assert all(m.window == 1 for (l, _), m in ms.maps.items() if l not in (2, 3, 4))
    assert ms.fit["window"] == 3 and ms.fit["window_layers"] == [2, 4]
    back = load(save(ms, tmp_path))  # a windowed set is written as format 2 and applies
    out = apply(back, capture_kv(s.model, torch.randint(2, 4096, (1, 40))))
    assert len(out) == tg.layers and out[3][0].shape == (1, tg.kv_heads, 40, tg.head_dim)


def test_windowed_sums_are_saved_and_reused(family, tmp_path, monkeypatch):
    """--stats keeps the windowed sums beside the per-token ones: a refit reads both and solves the same maps;
    another window is another capture."""
    import kvferry.mappings.lab.fit as fit

    s, t = family["S"], family["T"]
    stats = tmp_path / "sums.safetensors"
    first = fit_pair(s, t, CALIB, FitSettings(**WINDOWED), progress=False, stats_path=stats)

    def no_capture(*a, **k):
        raise AssertionError("captured again although matching sums were saved")

    monkeypatch.setattr(fit, "accumulate", no_capture)
    again = fit_pair(s, t, CALIB, FitSettings(**WINDOWED), progress=False, stats_path=stats)
    for key, m in first.maps.items():
        assert again.maps[key].window == m.window
        torch.testing.assert_close(again.maps[key].weight, m.weight, rtol=0, atol=0)
    with pytest.raises(AssertionError, match="captured again"):
        fit_pair(s, t, CALIB, FitSettings(**(WINDOWED | {"window": 2})), progress=False, stats_path=stats)


def test_window_settings_that_cannot_work_are_refused_before_capture(family):
    s, t = family["S"], family["T"]
    with pytest.raises(InvalidInput, match="run past the target's 6 layers"):
        fit_pair(s, t, CALIB, FitSettings(**(WINDOWED | {"window_layers": (4, 6)})), progress=False)
    for bad, match in [
        ({"window": 0}, "window must be"),
        ({"window": 65}, "window must be"),
        ({"window_layers": (3, 2)}, "first <= last"),
        ({"window_kinds": "v"}, "window_kinds"),
        ({"window_sources": 0}, "window_sources"),
        ({"per_head": True}, "per_head maps cannot be windowed"),
        ({"window": 1}, "window is 1"),
    ]:
        with pytest.raises(InvalidInput, match=match):
            FitSettings(**(WINDOWED | bad))


def test_fit_command_writes_a_windowed_set(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvferry",
            "--threads",
            "1",
            "fit",
            "--source",
            str(MODELS / "S"),
            "--target",
            str(MODELS / "T"),
            "--k",
            "1",
            "--seq-len",
            "128",
            "--max-tokens",
            "2048",
            "--window",
            "2",
            "--window-layers",
            "4-5",
            "--out",
            str(tmp_path),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "layer 5 K: sources [0, 1, 2, 3] x 2 tokens" in run.stdout
    ms = load(tmp_path / "S__T" / "1.0.0")
    assert {key: m.window for key, m in ms.maps.items() if m.window > 1} == {(4, "k"): 2, (5, "k"): 2}
    bad = subprocess.run(
        [sys.executable, "-m", "kvferry", "fit", "--window", "2", "--window-layers", "four"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "FIRST-LAST" in bad.stderr


def test_kept_features_resume_a_capture_and_serve_other_windows(family, tmp_path, monkeypatch):
    """--features: each window's features are written as captured; a fit with other capture settings (a window)
    reads them instead of running the models, and solves what a fresh capture solves."""
    import kvferry.mappings.lab.fit as fit

    s, t = family["S"], family["T"]
    feats = tmp_path / "features"
    plain = FitSettings(k=2, seq_len=128, max_tokens=4096)
    first = fit_pair(s, t, CALIB, plain, progress=False, features=feats)
    files = sorted(feats.rglob("*.safetensors"))
    assert len(files) == 32 and not list(feats.rglob("*.tmp"))
    files[3].unlink()  # a capture stopped before this window: only it is captured again
    calls = []
    real_capture = fit.capture_kv
    monkeypatch.setattr(fit, "capture_kv", lambda model, ids: calls.append(ids.shape[0]) or real_capture(model, ids))
    windowed = FitSettings(**WINDOWED)
    got = fit_pair(s, t, CALIB, windowed, progress=False, features=feats)
    assert calls == [1, 1]  # one window, source and target
    monkeypatch.setattr(fit, "capture_kv", real_capture)
    want = fit_pair(s, t, CALIB, windowed, progress=False)
    for key, m in want.maps.items():
        torch.testing.assert_close(got.maps[key].weight, m.weight, rtol=0, atol=0)
    again = fit_pair(s, t, CALIB, plain, progress=False, features=feats)
    for key, m in first.maps.items():
        torch.testing.assert_close(again.maps[key].weight, m.weight, rtol=0, atol=0)


def test_capture_runs_the_decoder_alone(family):
    """The LM head makes nothing the cache holds: the captured cache is the full forward pass's."""
    t = family["T"]
    ids = torch.randint(2, 4096, (1, 64))
    with torch.no_grad():
        want = t.model(input_ids=ids, use_cache=True).past_key_values
    for (k, v), layer in zip(capture_kv(t.model, ids), want.layers):
        torch.testing.assert_close(k, layer.keys, rtol=0, atol=0)
        torch.testing.assert_close(v, layer.values, rtol=0, atol=0)
