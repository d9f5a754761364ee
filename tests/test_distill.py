"""Distillation through the frozen target (mappings/lab/distill.py, kvferry distill), on the real cross-model map
S -> T."""

import json
import random
import subprocess
import sys

import pytest
import torch
from conftest import DATA, MODELS, ROOT, make_kv

from kvferry.mappings.apply import apply
from kvferry.mappings.artifact import LayerMap, MapSet, load
from kvferry.mappings.errors import InvalidInput
from kvferry.mappings.lab.capture import read_corpus, token_windows
from kvferry.mappings.lab.distill import DistillSettings, TrainableMaps, capture_tails, distill, tail_kl, with_repeat


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
            w = torch.randn(2 * rows, m.weight.shape[1], generator=g) / rows**0.5
            maps[(t, kind)] = LayerMap(
                t, kind, m.source_layers, w, torch.randn(m.weight.shape[1], generator=g), 0.0, m.heldout_r2, m.inputs, 2
            )
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
    maps = {
        k: LayerMap(
            m.target_layer, m.kind, m.source_layers, m.weight * 0.6, m.bias, m.lam, m.heldout_r2, m.inputs, m.window
        )
        if k[0] >= from_layer
        else m
        for k, m in ms.maps.items()
    }
    return MapSet(ms.source, ms.target, maps, "1.0.0", dict(ms.fit), dict(ms.calibration))


def test_distillation_lowers_the_heldout_tail_kl_and_trains_only_its_layers(s_t, family):
    """On windows it never trained on, the target's tail after the distilled map is closer to its own prefill
    (the shipped S -> T map is already close, KL 0.014; a degraded copy of it, 0.086, leaves room to show it)."""
    source, target = family["S"], family["T"]
    start = _degraded(s_t, 3)
    windows = token_windows(target.tokenizer, read_corpus([DATA / "calib.jsonl"]), 256, 256 * 14)
    s = DistillSettings(from_layer=3, tail=16, repeat_span=48, epochs=2, lr=3e-4, seed=0)
    rng = random.Random(0)
    train, held = (
        capture_tails(start, source, target, windows[:11], s, rng),
        capture_tails(start, source, target, windows[11:], s, rng),
    )
    assert (
        len(train) == 11
        and len(held) == 3
        and train[0].ids.shape == (16,)
        and train[0].inputs()[1][0][0].shape[2] == 240
    )
    maps, log = distill(start, source, target, train, held, s)
    assert [e["epoch"] for e in log[:-1]] == [0, 1, 2] and log[-1]["kept_epoch"] > 0
    kept = log[log[-1]["kept_epoch"]]["held_kl"]
    assert kept < 0.8 * log[0]["held_kl"], log
    out = maps.mapset("1.0.1", s.as_dict())
    for key, m in start.maps.items():
        same = torch.equal(out.maps[key].weight, m.weight)
        assert same == (key[0] < 3), key  # layers below from_layer untouched, every trained one moved
        assert (out.maps[key].heldout_r2 != out.maps[key].heldout_r2) == (
            key[0] >= 3
        )  # a trained map's fit R² is unknown
    assert out.fit["distilled"]["base_version"] == "1.0.0" and out.maps[(3, "k")].weight.dtype == s_t.dtype


def test_the_last_epoch_can_be_kept_instead_of_the_best(s_t, family, tmp_path):
    """keep="last" returns the weights the training reached, and says so in the log; a finished run's checkpoint
    gives them again without training (a rerun with another keep)."""
    source, target = family["S"], family["T"]
    windows = token_windows(target.tokenizer, read_corpus([DATA / "calib.jsonl"]), 256, 256 * 3)
    s = DistillSettings(from_layer=3, tail=16, repeat_span=0, epochs=1, lr=3e-4, seed=0)
    train, held = (capture_tails(s_t, source, target, w, s, random.Random(0)) for w in (windows[:2], windows[2:]))
    ckpt = tmp_path / "run.ckpt"
    last, log = distill(s_t, source, target, train, held, s, checkpoint=ckpt, keep="last")
    assert log[-1] == {"kept_epoch": 1}
    _, relog = distill(s_t, source, target, train, held, s, checkpoint=ckpt, keep="best")  # resumed: no steps
    assert relog[:-1] == log[:-1] and relog[-1]["kept_epoch"] == (1 if log[1]["held_kl"] < log[0]["held_kl"] else 0)
    moved = [k for k in last.keys if not torch.equal(last.mapset("9.9.9", {}).maps[k].weight, s_t.maps[k].weight)]
    assert moved
    with pytest.raises(InvalidInput, match="keep must be"):
        distill(s_t, source, target, train, held, s, keep="first")


def test_a_temperature_softens_both_distributions(s_t, family):
    """tail_kl at temperature T is T² * KL(softmax(full / T) ‖ softmax(mapped / T)) on the reference's outcomes (its
    top tokens and "any other"), computed here by hand from both models' logits; T = 1 is the plain KL the held-out
    epochs are chosen by."""
    from kvferry.mappings.cache import to_dynamic_cache

    source, target = family["S"], family["T"]
    windows = token_windows(target.tokenizer, read_corpus([DATA / "calib.jsonl"]), 256, 256)
    sample = capture_tails(
        s_t, source, target, windows[:1], DistillSettings(from_layer=3, tail=16, repeat_span=0), random.Random(0)
    )[0]
    maps = TrainableMaps(s_t, 3)
    with torch.no_grad():
        skv, fixed = sample.inputs()
        cache = to_dynamic_cache(maps.cache(skv, fixed, skv[0][0].shape[2] - 16), target.model.config)
        logits = target.model(input_ids=sample.ids[None], past_key_values=cache).logits[0].float()
        full = target.model(input_ids=windows[0][None]).logits[0, -16:].float().log_softmax(-1)
        top = sample.ref.index

        def coarse(lp):  # the k + 1 outcomes: each top token, then every other token together
            other = lp.clone().scatter_(-1, top, float("-inf")).logsumexp(-1, keepdim=True)
            return torch.cat([lp.gather(-1, top), other], -1)

        for t in (1.0, 2.0, 4.0):
            p = (coarse(full) / t).log_softmax(-1)
            q = coarse((logits / t).log_softmax(-1))
            want = float((p.exp() * (p - q)).sum(-1).mean()) * t * t
            assert float(tail_kl(target.model, maps, sample, t)) == pytest.approx(want, rel=1e-4), t
    with torch.no_grad():
        assert float(tail_kl(target.model, maps, sample, 2.0)) != pytest.approx(
            float(tail_kl(target.model, maps, sample)), rel=1e-3
        )
    with pytest.raises(InvalidInput, match="temperature"):
        DistillSettings(temperature=0.0)


def test_settings_and_windows_are_checked():
    with pytest.raises(InvalidInput, match="tail"):
        DistillSettings(tail=0)
    with pytest.raises(InvalidInput, match="lr"):
        DistillSettings(lr=0.0)
    with pytest.raises(InvalidInput, match="too short"):
        DistillSettings(tail=48, tails=2).check_window(90)
    with pytest.raises(InvalidInput, match="too short"):  # no room left to place the repeated stretch
        DistillSettings(tail=16, repeat_span=32).check_window(128)
    DistillSettings(tail=16, repeat_span=32).check_window(129)
    ids = torch.arange(400)
    rep = with_repeat(ids, 100, random.Random(1))
    start = int(rep[300])
    assert (
        torch.equal(rep[:300], ids[:300])
        and torch.equal(rep[300:], ids[start : start + 100])
        and start + 100 + 64 <= 300
    )


def test_kvferry_distill_writes_an_artifact_without_evidence(tmp_path, s_t):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvferry",
            "distill",
            str(ROOT / "maps" / "S__T" / "1.0.0"),
            "--source",
            str(MODELS / "S"),
            "--target",
            str(MODELS / "T"),
            "--out",
            str(tmp_path),
            "--version",
            "1.0.1",
            "--seq-len",
            "256",
            "--max-tokens",
            str(256 * 6),
            "--from-layer",
            "4",
            "--tail",
            "16",
            "--repeat-span",
            "48",
            "--epochs",
            "1",
            "--train-precision",
            "bfloat16",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "no evidence yet" in run.stdout
    out = load(tmp_path / "S__T" / "1.0.1")
    record = json.loads((tmp_path / "S__T" / "1.0.1" / "manifest.json").read_text())["fit"]["distilled"]
    assert record["from_layer"] == 4 and record["train_windows"] == 5 and record["held_windows"] == 1
    assert record["train_precision"] == "bfloat16" and record["capture_precision"] == "float32"
    assert all(torch.isfinite(m.weight).all() for m in out.maps.values())
    assert not out.evidence and torch.equal(out.maps[(0, "k")].weight, s_t.maps[(0, "k")].weight)


def test_a_stopped_distillation_resumes_where_it_stopped(s_t, family, tmp_path, monkeypatch):
    """Captured tails are kept per window and the training state is checkpointed: a run stopped mid-epoch and started
    again ends with exactly the maps of a run that was never stopped, and recaptures nothing."""
    import kvferry.mappings.lab.distill as d

    source, target = family["S"], family["T"]
    start = _degraded(s_t, 3)
    windows = token_windows(target.tokenizer, read_corpus([DATA / "calib.jsonl"]), 256, 256 * 12)
    s = DistillSettings(from_layer=3, tail=16, repeat_span=48, epochs=2, lr=1e-3)
    tails = tmp_path / "tails"
    train = capture_tails(start, source, target, windows[:10], s, random.Random(0), tails)
    held = capture_tails(start, source, target, windows[10:], s, random.Random(1), tails)
    assert len(list(tails.rglob("*.safetensors"))) == 24  # per window: the source's cache and the target's references
    calls = []
    monkeypatch.setattr(d, "capture_kv", lambda *a: calls.append(1))  # kept windows need no prefill
    monkeypatch.setattr(target, "model", None)  # nor the target's forward
    again = capture_tails(start, source, target, windows[:10], s, random.Random(0), tails)
    assert not calls and all(
        torch.equal(a.ids, b.ids) and torch.equal(a.ref.logp, b.ref.logp) for a, b in zip(again, train)
    )
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


def test_a_compact_reference_keeps_the_top_tokens_and_the_rest_mass():
    """TailRef: with every token kept its KL is the exact KL; with k of them it is the KL of the coarsened
    distributions, never above the exact one and close to it when the top tokens hold most of the mass; its size
    does not grow with the vocabulary."""
    from kvferry.mappings.lab.distill import TailRef

    g = torch.Generator().manual_seed(0)
    full = torch.randn(8, 300, generator=g) * 3
    mine = full + torch.randn(8, 300, generator=g)
    p, q = full.log_softmax(-1), mine.log_softmax(-1)
    exact = float((p.exp() * (p - q)).sum(-1).mean())
    assert float(TailRef.of(full, 300).kl(mine)) == pytest.approx(exact, rel=1e-5)
    ref = TailRef.of(full, 32)
    assert ref.index.shape == ref.logp.shape == (8, 32) and ref.rest.shape == (8,)
    torch.testing.assert_close(torch.cat([ref.logp.exp(), ref.rest.exp()[:, None]], -1).sum(-1), torch.ones(8))
    coarse = float(ref.kl(mine))
    assert 0 < coarse <= exact + 1e-6 and coarse > 0.5 * exact
    assert float(TailRef.of(full, 32).kl(full)) == pytest.approx(0.0, abs=1e-6)


def test_capture_only_keeps_the_references_for_a_later_run(tmp_path):
    """--capture-only runs both prefills per window and stops: the references (small, committable) and the source's
    caches are kept, no artifact is written; a later run with the same windows reads them instead of the models."""
    args = [
        sys.executable,
        "-m",
        "kvferry",
        "distill",
        str(ROOT / "maps" / "S__T" / "1.0.0"),
        "--source",
        str(MODELS / "S"),
        "--target",
        str(MODELS / "T"),
        "--out",
        str(tmp_path / "maps"),
        "--seq-len",
        "256",
        "--max-tokens",
        str(256 * 6),
        "--tail",
        "16",
        "--repeat-span",
        "48",
        "--refs",
        str(tmp_path / "refs"),
        "--tails-cache",
        str(tmp_path / "kv"),
        "--quiet",
    ]
    run = subprocess.run([*args, "--capture-only"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "no training with --capture-only" in run.stdout and not (tmp_path / "maps").exists()
    refs = list((tmp_path / "refs").rglob("*.safetensors"))
    assert len(refs) == 6 and len(list((tmp_path / "kv").rglob("*.safetensors"))) == 6
    assert all(
        p.stat().st_size < 20_000 for p in refs
    )  # a 16-token tail's top-64: far below a vocabulary row per token
    stamp = {p: p.stat().st_mtime_ns for p in refs}
    run = subprocess.run([*args, "--version", "1.0.1", "--epochs", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert {p: p.stat().st_mtime_ns for p in refs} == stamp  # read, not recomputed
    missing = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "--version is required" in missing.stderr


def test_bfloat16_capture_and_training_stay_close_to_float32(s_t, family, tmp_path):
    """The bf16-autocast capture records its precision in each file and gives references close to the
    float32 ones (same top tokens); a bf16-autocast tail KL (what --train-precision bfloat16 trains on) is close to
    the float32 one; anything else is refused by name."""
    from safetensors import safe_open

    from kvferry.mappings.precision import autocast

    source, target = family["S"], family["T"]
    windows = token_windows(target.tokenizer, read_corpus([DATA / "calib.jsonl"]), 256, 512)
    got = {}
    for precision in ("float32", "bfloat16"):
        s = DistillSettings(from_layer=3, tail=16, repeat_span=0, capture_precision=precision)
        got[precision] = capture_tails(
            s_t,
            source,
            target,
            windows,
            s,
            random.Random(0),
            tmp_path / "kv" / precision,
            tmp_path / "refs" / precision,
        )
        files = list((tmp_path / "refs" / precision).rglob("*.safetensors"))
        assert len(files) == 2
        for f in files:
            with safe_open(str(f), "pt") as h:
                assert h.metadata() == {"precision": precision}
    for a, b in zip(got["float32"], got["bfloat16"]):
        assert torch.equal(a.ref.index[:, :1], b.ref.index[:, :1])
        torch.testing.assert_close(b.ref.logp[:, :5], a.ref.logp[:, :5], atol=0.1, rtol=0.05)
    maps = TrainableMaps(s_t, 3)
    sample = got["float32"][0]
    with torch.no_grad():
        exact = float(tail_kl(target.model, maps, sample))
        with autocast(target.model, "bfloat16"):
            fast = float(tail_kl(target.model, maps, sample))
    assert fast == pytest.approx(exact, rel=0.25, abs=2e-3)
    with pytest.raises(InvalidInput, match="train_precision"):
        DistillSettings(train_precision="float16")
    with pytest.raises(InvalidInput, match="capture_precision"):
        DistillSettings(capture_precision="fp8")
