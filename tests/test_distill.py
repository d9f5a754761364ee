"""Distillation through the frozen target (mappings/distill.py, kvferry distill), on the real cross-model map S -> T."""

import json
import random
import subprocess
import sys

import pytest
import torch

from kvferry.mappings.apply import apply
from kvferry.mappings.artifact import LayerMap, MapSet, load
from kvferry.mappings.capture import read_corpus, token_windows
from kvferry.mappings.distill import DistillSettings, TrainableMaps, capture_tails, distill, tail_kl, with_repeat
from kvferry.mappings.errors import InvalidInput

from conftest import DATA, MODELS, ROOT, make_kv


@pytest.fixture(scope="module")
def s_t():
    return load(ROOT / "maps" / "S__T" / "1.0.0")


def _mixed(ms: MapSet, from_layer: int) -> MapSet:
    """``ms`` with the maps of layers >= from_layer replaced by random windowed (2-token) maps of K and V inputs."""
    g = torch.Generator().manual_seed(3)
    maps = dict(ms.maps)
    for (t, kind), m in ms.maps.items():
        if t >= from_layer:
            rows = m.weight.shape[0]
            w = torch.randn(2 * rows, m.weight.shape[1], generator=g) / rows ** 0.5
            maps[(t, kind)] = LayerMap(t, kind, m.source_layers, w, torch.randn(m.weight.shape[1], generator=g), 0.0,
                                       m.heldout_r2, m.inputs, 2)
    return MapSet(ms.source, ms.target, maps, "9.0.0", dict(ms.fit), dict(ms.calibration))


def test_the_trainable_cache_is_what_apply_gives(s_t):
    """The trained maps read their inputs in LayerMap's column order: per-token and windowed maps, checked against
    apply() (a wrong order or offset would differ everywhere)."""
    ms = _mixed(s_t, 3)
    g = ms.source.geometry
    kv = make_kv(layers=g.layers, tokens=40, heads=g.kv_heads, head_dim=g.head_dim, seed=1)
    want = apply(ms, kv, 0)
    got = TrainableMaps(ms, 2).cache(kv, want, 40)
    assert len(got) == len(want)
    for (gk, gv), (wk, wv) in zip(got, want):
        torch.testing.assert_close(gk, wk, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gv, wv, rtol=1e-4, atol=1e-4)
    shorter = TrainableMaps(ms, 2).cache(kv, want, 25)  # a prefix: what the tail is computed on
    torch.testing.assert_close(shorter[4][0], want[4][0][:, :, :25], rtol=1e-4, atol=1e-4)


def _degraded(ms: MapSet, from_layer: int) -> MapSet:
    """``ms`` with the weights of layers >= from_layer shrunk to 0.6: a map the target's tail KL can repair."""
    maps = {k: LayerMap(m.target_layer, m.kind, m.source_layers, m.weight * 0.6, m.bias, m.lam, m.heldout_r2, m.inputs,
                        m.window) if k[0] >= from_layer else m for k, m in ms.maps.items()}
    return MapSet(ms.source, ms.target, maps, "1.0.0", dict(ms.fit), dict(ms.calibration))


def test_distillation_lowers_the_heldout_tail_kl_and_trains_only_its_layers(s_t, family):
    """On windows it never trained on, the target's tail after the distilled map is closer to its own prefill
    (the shipped S -> T map is already close, KL 0.014; a degraded copy of it, 0.086, leaves room to show it)."""
    source, target = family["S"], family["T"]
    start = _degraded(s_t, 3)
    windows = token_windows(target.tokenizer, read_corpus([DATA / "calib.jsonl"]), 256, 256 * 14)
    s = DistillSettings(from_layer=3, tail=16, repeat_span=48, epochs=2, lr=3e-4, seed=0)
    rng = random.Random(0)
    train, held = capture_tails(start, source, target, windows[:11], s, rng), capture_tails(start, source, target, windows[11:], s, rng)
    assert len(train) == 11 and len(held) == 3 and train[0].ids.shape == (16,) and train[0].fixed[0][0].shape[2] == 240
    maps, log = distill(start, source, target, train, held, s)
    assert [e["epoch"] for e in log[:-1]] == [0, 1, 2] and log[-1]["kept_epoch"] > 0
    kept = log[log[-1]["kept_epoch"]]["held_kl"]
    assert kept < 0.8 * log[0]["held_kl"], log
    out = maps.mapset("1.0.1", s.as_dict())
    for key, m in start.maps.items():
        same = torch.equal(out.maps[key].weight, m.weight)
        assert same == (key[0] < 3), key  # layers below from_layer untouched, every trained one moved
        assert (out.maps[key].heldout_r2 != out.maps[key].heldout_r2) == (key[0] >= 3)  # a trained map's fit R² is unknown
    assert out.fit["distilled"]["base_version"] == "1.0.0" and out.maps[(3, "k")].weight.dtype == s_t.dtype


def test_a_temperature_softens_both_distributions(s_t, family):
    """tail_kl at temperature T is T² × KL(softmax(full / T) ‖ softmax(mapped / T)), computed here by hand from the
    target's logits over the mapped cache; T = 1 is the plain KL the held-out epochs are chosen by."""
    from kvferry.mappings.capture import to_dynamic_cache

    source, target = family["S"], family["T"]
    windows = token_windows(target.tokenizer, read_corpus([DATA / "calib.jsonl"]), 256, 256)
    sample = capture_tails(s_t, source, target, windows[:1], DistillSettings(from_layer=3, tail=16, repeat_span=0),
                           random.Random(0))[0]
    maps = TrainableMaps(s_t, 3)
    with torch.no_grad():
        skv = [(k.float(), v.float()) for k, v in sample.source_kv]
        fixed = [(k.float(), v.float()) for k, v in sample.fixed]
        cache = to_dynamic_cache(maps.cache(skv, fixed, skv[0][0].shape[2] - 16), target.model.config)
        logits = target.model(input_ids=sample.ids[None], past_key_values=cache).logits[0].float()
        full = sample.logp.float()
        for t in (1.0, 2.0, 4.0):
            p, q = (full / t).log_softmax(-1), (logits / t).log_softmax(-1)
            want = float((p.exp() * (p - q)).sum(-1).mean()) * t * t
            assert float(tail_kl(target.model, maps, sample, t)) == pytest.approx(want, rel=1e-4), t
    with torch.no_grad():
        assert float(tail_kl(target.model, maps, sample, 2.0)) != pytest.approx(float(tail_kl(target.model, maps, sample)), rel=1e-3)
    with pytest.raises(InvalidInput, match="temperature"):
        DistillSettings(temperature=0.0)


def test_settings_and_windows_are_checked():
    with pytest.raises(InvalidInput, match="tail"):
        DistillSettings(tail=0)
    with pytest.raises(InvalidInput, match="lr"):
        DistillSettings(lr=0.0)
    with pytest.raises(InvalidInput, match="too short"):
        DistillSettings(tail=48, tails=2).check_window(90)
    ids = torch.arange(400)
    rep = with_repeat(ids, 100, random.Random(1))
    start = int(rep[300])
    assert torch.equal(rep[:300], ids[:300]) and torch.equal(rep[300:], ids[start : start + 100]) and start + 100 + 64 <= 300


def test_kvferry_distill_writes_an_artifact_without_evidence(tmp_path, s_t):
    run = subprocess.run([sys.executable, "-m", "kvferry", "distill", str(ROOT / "maps" / "S__T" / "1.0.0"),
                          "--source", str(MODELS / "S"), "--target", str(MODELS / "T"), "--out", str(tmp_path),
                          "--version", "1.0.1", "--seq-len", "256", "--max-tokens", str(256 * 6), "--from-layer", "4",
                          "--tail", "16", "--repeat-span", "48", "--epochs", "1", "--quiet"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "no evidence yet" in run.stdout
    out = load(tmp_path / "S__T" / "1.0.1")
    record = json.loads((tmp_path / "S__T" / "1.0.1" / "manifest.json").read_text())["fit"]["distilled"]
    assert record["from_layer"] == 4 and record["train_windows"] == 5 and record["held_windows"] == 1
    assert not out.evidence and torch.equal(out.maps[(0, "k")].weight, s_t.maps[(0, "k")].weight)


def test_a_stopped_distillation_resumes_where_it_stopped(s_t, family, tmp_path, monkeypatch):
    """Captured tails are kept per window and the training state is checkpointed: a run stopped mid-epoch and started
    again ends with exactly the maps of a run that was never stopped, and recaptures nothing."""
    import kvferry.mappings.distill as d

    source, target = family["S"], family["T"]
    start = _degraded(s_t, 3)
    windows = token_windows(target.tokenizer, read_corpus([DATA / "calib.jsonl"]), 256, 256 * 12)
    s = DistillSettings(from_layer=3, tail=16, repeat_span=48, epochs=2, lr=1e-3)
    tails = tmp_path / "tails"
    train = capture_tails(start, source, target, windows[:10], s, random.Random(0), tails)
    held = capture_tails(start, source, target, windows[10:], s, random.Random(1), tails)
    assert len(list(tails.rglob("*.safetensors"))) == 12
    calls = []
    monkeypatch.setattr(d, "capture_kv", lambda *a: calls.append(1))  # kept windows need no prefill
    again = capture_tails(start, source, target, windows[:10], s, random.Random(0), tails)
    assert not calls and all(torch.equal(a.ids, b.ids) and torch.equal(a.logp, b.logp) for a, b in zip(again, train))
    monkeypatch.undo()

    want, want_log = distill(start, source, target, train, held, s)
    ckpt = tmp_path / "run.ckpt"
    real_kl, steps = d.tail_kl, []

    def stops_after_seven(model, maps, sample, temperature=1.0):
        if torch.is_grad_enabled():
            steps.append(1)
            if len(steps) == 8:
                raise KeyboardInterrupt
        return real_kl(model, maps, sample, temperature)

    monkeypatch.setattr(d, "tail_kl", stops_after_seven)
    with pytest.raises(KeyboardInterrupt):
        distill(start, source, target, train, held, s, checkpoint=ckpt, checkpoint_every=0.0)
    monkeypatch.undo()
    got, got_log = distill(start, source, target, train, held, s, checkpoint=ckpt)
    assert got_log == want_log
    for key in want.keys:
        torch.testing.assert_close(got.weight[key], want.weight[key], rtol=0, atol=0)
    other = DistillSettings(from_layer=3, tail=16, repeat_span=48, epochs=2, lr=2e-3)  # another run ignores it
    assert d._load_checkpoint(ckpt, d._run_key(start, other, train, held)) is None
