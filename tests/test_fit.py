import subprocess
import sys

import pytest
import torch

from kvferry.mappings.apply import apply
from kvferry.mappings.artifact import load, save
from kvferry.mappings.capture import capture_kv, load_model, to_dynamic_cache
from kvferry.mappings.errors import InvalidInput
from kvferry.mappings.fit import FitSettings, fit_pair

from conftest import DATA, MODELS

CALIB = [str(DATA / "calib.jsonl")]


@pytest.mark.parametrize("min_gain", [0.0, 1e-4])
def test_self_map_gives_the_models_own_logits(family, min_gain):
    s = family["S"]
    ms = fit_pair(s, s, CALIB, FitSettings(k=2, seq_len=256, max_tokens=16384, min_gain=min_gain), progress=False)
    for (t, kind), m in ms.maps.items():
        assert t in m.source_layers and m.heldout_r2 > 0.9999
        # with a minimum gain, a layer the source shares is read alone: a second layer adds nothing
        assert len(m.source_layers) == (1 if min_gain else 2)
    ids = torch.randint(2, 4096, (2, 200))
    mapped = apply(ms, capture_kv(s.model, ids[:, :-1]))
    with torch.no_grad():
        got = s.model(input_ids=ids[:, -1:], past_key_values=to_dynamic_cache(mapped, s.model.config)).logits[:, -1]
        want = s.model(input_ids=ids).logits[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("pair", [("qwen3", "llama_wide"), ("mistral", "llama"), ("qwen2", "qwen2")])
def test_cross_architecture_fit(tiny_models, pair):
    src, tgt = load_model(tiny_models[pair[0]]), load_model(tiny_models[pair[1]])
    ms = fit_pair(src, tgt, CALIB, FitSettings(k=2, seq_len=128, max_tokens=8192), progress=False)
    assert len(ms.maps) == 2 * tgt.identity.geometry.layers
    assert all(len(m.source_layers) == min(2, src.identity.geometry.layers) for m in ms.maps.values())
    out = apply(ms, capture_kv(src.model, torch.randint(2, 4096, (1, 30))))
    assert out[0][0].shape == (1, tgt.identity.geometry.kv_heads, 30, tgt.identity.geometry.head_dim)


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
    common = ["fit", "--source", str(MODELS / "S"), "--target", str(MODELS / "T"), "--k", "2", "--seq-len", "128",
              "--max-tokens", "6400", "--quiet"]
    one = subprocess.run([sys.executable, "-m", "kvferry", "--threads", "1", *common, "--out", str(tmp_path / "one")],
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "kvferry", "--threads", "1", *common, "--out", str(tmp_path / "two")], capture_output=True, text=True, timeout=300)
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
    ms = fit_pair(s, t, CALIB, FitSettings(k=2, seq_len=128, max_tokens=8192, inputs=inputs, per_head=per_head), progress=False)
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
    import kvferry.mappings.fit as fit

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
        torch.testing.assert_close(ms.maps[key].weight, m.weight, rtol=1e-4, atol=1e-5)
