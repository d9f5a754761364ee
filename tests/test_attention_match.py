"""Values matched to attention (mappings/lab/attention_match.py) on the tiny family."""

import pytest
import torch
from conftest import DATA, ROOT

from kvferry.mappings.artifact import load
from kvferry.mappings.errors import InvalidInput
from kvferry.mappings.lab.attention_match import MatchSettings, match_values
from kvferry.mappings.lab.capture import read_corpus, token_windows
from kvferry.mappings.lab.fit import identity_mapset


def _windows(tokenizer, n, count):
    return token_windows(tokenizer, read_corpus([DATA / "calib.jsonl"]), n, n * count)


def test_exact_keys_make_the_matched_values_the_targets_own(family):
    """A model mapped onto itself with its values scaled by 0.5: the keys are exact, so matching the attention outputs
    recovers the values themselves and the held-out attention error goes from 0.5 to ~0."""
    s = family["S"]
    ms = identity_mapset(s.identity)
    for t in range(s.identity.geometry.layers):
        ms.maps[(t, "v")].weight = ms.maps[(t, "v")].weight * 0.5
    out, record = match_values(ms, s, s, _windows(s.tokenizer, 256, 6), MatchSettings(lambdas=(1e-6,), repeat_span=48))
    assert all(b == pytest.approx(0.5, abs=1e-3) for b in record["heldout_attn_rel_err_before"])
    assert max(record["heldout_attn_rel_err_after"]) < 1e-2
    torch.testing.assert_close(out.maps[(0, "v")].weight, torch.eye(s.identity.geometry.kv_width), atol=2e-2, rtol=0)
    assert torch.equal(out.maps[(0, "k")].weight, ms.maps[(0, "k")].weight)  # keys are not touched
    assert out.fit["attention_matched"]["held_windows"] == 2


def test_matching_lowers_the_attention_error_of_a_real_cross_model_map(family):
    """S -> T's shipped map: on held-out windows, the target's attention outputs under its own queries are closer to
    its full prefill's with the matched values than with the closed form's; a layer where no strength helps keeps its
    closed-form values."""
    source, target = family["S"], family["T"]
    ms = load(ROOT / "maps" / "S__T" / "1.0.0")
    out, record = match_values(ms, source, target, _windows(target.tokenizer, 256, 31), MatchSettings(repeat_span=48))
    before, after = record["heldout_attn_rel_err_before"], record["heldout_attn_rel_err_after"]
    assert all(a <= b for a, b in zip(after, before)) and sum(after) < 0.97 * sum(before), record
    for t, lam in enumerate(record["chosen_lambda"]):
        assert torch.equal(out.maps[(t, "v")].weight, ms.maps[(t, "v")].weight) == (lam is None)
    out.validate()


def test_match_settings_are_checked(family):
    with pytest.raises(InvalidInput, match="lambdas"):
        MatchSettings(lambdas=(0.1, 0.0))
    s = family["S"]
    with pytest.raises(InvalidInput, match="at least 5 windows"):
        match_values(identity_mapset(s.identity), s, s, _windows(s.tokenizer, 128, 3))


def test_kvferry_match_values_writes_an_artifact(tmp_path):
    import json
    import subprocess
    import sys

    from conftest import MODELS

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvferry",
            "match-values",
            str(ROOT / "maps" / "S__T" / "1.0.0"),
            "--source",
            str(MODELS / "S"),
            "--target",
            str(MODELS / "T"),
            "--out",
            str(tmp_path),
            "--version",
            "1.0.2",
            "--seq-len",
            "128",
            "--max-tokens",
            str(128 * 10),
            "--repeat-span",
            "24",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "layer 0 V: held-out attention-output error" in run.stdout
    record = json.loads((tmp_path / "S__T" / "1.0.2" / "manifest.json").read_text())["fit"]["attention_matched"]
    assert record["windows"] == 8 and record["held_windows"] == 2 and len(record["chosen_lambda"]) == 6
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvferry",
            "match-values",
            str(ROOT / "maps" / "S__T" / "1.0.0"),
            "--out",
            str(tmp_path),
            "--version",
            "1.0.3",
            "--lambdas",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "lambdas must be positive" in bad.stderr and "Traceback" not in bad.stderr
