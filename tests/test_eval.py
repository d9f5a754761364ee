import json
import subprocess
import sys

import pytest
from conftest import DATA, MODELS, ROOT

from kvferry.mappings.artifact import load, save
from kvferry.mappings.errors import GateFailed, InvalidInput
from kvferry.mappings.gates import Gates
from kvferry.mappings.lab.copy_probe import CopySettings
from kvferry.mappings.lab.evaluate import EvalSettings, evaluate, format_table
from kvferry.mappings.lab.fit import identity_mapset

HELDOUT = [str(DATA / "heldout.jsonl")]


def test_exact_map_scores_like_gold(family):
    s = family["S"]
    ms = identity_mapset(s.identity)
    ms.target = s.identity
    ev = evaluate(
        ms,
        s,
        s,
        HELDOUT,
        EvalSettings(
            prompts=6,
            greedy_prompts=2,
            recall_prompts=4,
            min_len=64,
            max_len=256,
            copy=CopySettings(gaps=(300,), prompts=2),
        ),
        progress=False,
    )
    for arm in ("mapped", "mapped_refresh", "mapped_sinks"):
        row = ev["arms"][arm]
        assert row["top1"] == 1.0 and row["top10"] == 1.0 and abs(row["kl"]) < 1e-4 and row["attn_cos"] > 0.9999
        assert row["greedy_agree"] == 1.0  # (recall is not compared: the tiny family scores 0 on it, so 0 == 0 tests
        # nothing; long-range use is checked by the copy probe on the real pair, tests/test_real_pair.py)
    assert all(l["rel_err"] < 1e-5 for l in ev["layers"])
    assert ev["arms"]["no_context"]["kl"] > ev["arms"]["mapped"]["kl"]
    table = format_table(ev)
    assert "mapped_refresh" in table and "truncate_64" in table
    assert Gates().failures(ev) == []


def test_gates():
    g = Gates(min_top10=0.9, max_kl=0.1)
    copy = {"gaps": {"500": {"full": 0.95, "truncate": 0.4, "mapped_refresh": 0.9}}}
    ok = {"arms": {"mapped_refresh": {"top1": 0.9, "top10": 0.95, "kl": 0.05, "attn_cos": 0.99}}, "copy": copy}
    assert g.failures(ok) == []
    bad = {"arms": {"mapped_refresh": {"top1": 0.9, "top10": 0.85, "kl": 0.2, "attn_cos": 0.99}}, "copy": copy}
    assert len(g.failures(bad)) == 2
    assert "no evaluation evidence" in g.failures(None)[0]
    with pytest.raises(InvalidInput):
        Gates(min_top10=2)


def test_gate_check_refuses_unless_forced(family):
    ms = identity_mapset(family["S"].identity)
    with pytest.raises(GateFailed, match="gated off: the map has no evaluation evidence"):
        Gates().check(ms)
    Gates().check(ms, force=True)


def test_cli_fit_then_eval_writes_evidence(tmp_path):
    def run(*a):
        return subprocess.run(
            [sys.executable, "-m", "kvferry", "--threads", "2", *a], capture_output=True, text=True, timeout=600
        )

    fit = run(
        "fit",
        "--source",
        str(MODELS / "S"),
        "--target",
        str(MODELS / "T"),
        "--out",
        str(tmp_path),
        "--seq-len",
        "256",
        "--max-tokens",
        "20000",
        "--k",
        "2",
        "--quiet",
    )
    assert fit.returncode == 0, fit.stderr
    art = tmp_path / "S__T" / "1.0.0"
    ev = run(
        "eval",
        str(art),
        "--source",
        str(MODELS / "S"),
        "--target",
        str(MODELS / "T"),
        "--prompts",
        "5",
        "--copy-gaps",
        "200,400",
        "--copy-prompts",
        "1",
        "--recall-prompts",
        "3",
        "--greedy-prompts",
        "1",
        "--json",
        str(tmp_path / "ev.json"),
        "--write",
        "--quiet",
        "--precision",
        "bfloat16",
    )
    assert ev.returncode == 0, ev.stderr
    assert json.loads((tmp_path / "ev.json").read_text())["precision"] == "bfloat16"
    assert "mapped_refresh" in ev.stdout
    assert load(art).evidence == json.loads((tmp_path / "ev.json").read_text())
    # a map used with the wrong model is refused with a clear error, not a crash
    wrong = run(
        "eval", str(art), "--source", str(MODELS / "T"), "--target", str(MODELS / "T"), "--prompts", "2", "--quiet"
    )
    assert wrong.returncode == 2 and "geometry fingerprint" in wrong.stderr


def test_load_for_serving_checks_evidence(family, tmp_path):
    from kvferry.mappings.artifact import write_evidence
    from kvferry.mappings.gates import load_for_serving

    ms = identity_mapset(family["S"].identity)
    dest = save(ms, tmp_path)
    with pytest.raises(GateFailed, match="no evaluation evidence"):
        load_for_serving(dest)
    assert load_for_serving(dest, force=True).name == ms.name
    write_evidence(dest, {"arms": {"mapped_refresh": {"top1": 0.5, "top10": 0.7, "kl": 0.3, "attn_cos": 0.9}}})
    with pytest.raises(GateFailed, match=r"top10=0.700 fails the gate"):
        load_for_serving(dest)
    assert (
        load_for_serving(dest, Gates(min_top10=0.6, min_copy_retention=0)).evidence["arms"]["mapped_refresh"]["top10"]
        == 0.7
    )
    with pytest.raises(GateFailed, match="no long-range"):  # the long-range gate is on by default
        load_for_serving(dest, Gates(min_top10=0.6))


def test_several_positions_per_prompt_past_the_refresh_window(family):
    """With positions = 4 every arm scores the prompt's next token and the text's next 3, teacher-forced on its own
    cache: an exact map still matches full prefill at all of them, truncation does not, and a prompt's scores are
    the mean over its positions (one value per prompt, for the intervals)."""
    import torch

    from kvferry.mappings.lab.evaluate import NextTokenScores

    s = family["S"]
    ms = identity_mapset(s.identity)
    ms.target = s.identity
    ev = evaluate(
        ms,
        s,
        s,
        HELDOUT,
        EvalSettings(prompts=4, positions=4, greedy_prompts=0, recall_prompts=0, min_len=64, max_len=128, copy=None),
        progress=False,
    )
    for arm in ("mapped", "mapped_refresh", "mapped_sinks"):
        row = ev["arms"][arm]
        assert row["top1"] == 1.0 and row["top10"] == 1.0 and abs(row["kl"]) < 1e-4
        assert len(row["per_prompt"]["top10"]) == 4
    assert ev["arms"]["truncate"]["kl"] > 1e-3
    gold = torch.arange(100, 0, -1).float()
    half = gold.clone()
    half[[8, 9]] = -1.0  # 8 of the top 10 shared
    scores = NextTokenScores()
    scores.add(torch.stack([gold, gold]), torch.stack([gold, half]))
    assert scores.result(False)["per_prompt"]["top10"] == [0.9] and scores.result(False)["top1"] == 1.0
    with pytest.raises(InvalidInput, match="positions"):
        EvalSettings(positions=0)


def test_top10_overlap_is_counted_exactly_at_the_gate():
    """60 prompts that each share 8 of their top 10 tokens average 0.8 exactly, and pass a top-10 gate of 0.8 (summed
    as floats, 60 tenths read 0.79999…93 and failed it with a message saying "0.800 fails (>= 0.8)")."""
    import torch

    from kvferry.mappings.lab.evaluate import NextTokenScores

    gold = torch.arange(100, 0, -1).float()  # top 10: tokens 0..9
    arm = gold.clone()
    arm[[8, 9]] = -1.0  # tokens 8 and 9 leave the top 10, 10 and 11 come in: 8 shared
    scores = NextTokenScores()
    for _ in range(60):
        scores.add(gold, arm)
    row = scores.result(with_cos=True)  # no attention given: cosine 0, which the default gate (>= 0) takes
    assert row["top10"] == 0.8 and row["top1"] == 1.0
    copy = {"gaps": {"500": {"full": 0.95, "truncate": 0.4, "mapped_refresh": 0.95}}}
    assert Gates().failures({"arms": {"mapped_refresh": row}, "copy": copy}) == []


def test_eval_builds_references_once_then_runs_only_the_arms_under_test(tmp_path):
    """--update-references writes the target's own arms; a later evaluation with --references reads them (planted
    values show it) and computes only the mapped arms; a changed prompt set or precision is refused by name; the
    evidence records its precision."""
    refs = tmp_path / "refs.jsonl"
    art = ROOT / "maps" / "S__T" / "1.0.0"

    def run(*a):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "kvferry",
                "--threads",
                "2",
                "eval",
                str(art),
                "--source",
                str(MODELS / "S"),
                "--target",
                str(MODELS / "T"),
                "--only-copy",
                "--copy-gaps",
                "200",
                "--copy-prompts",
                "2",
                "--references",
                str(refs),
                "--json",
                str(tmp_path / "ev.json"),
                "--quiet",
                *a,
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )

    first = run("--update-references")
    assert first.returncode == 0, first.stderr
    lines = refs.read_text().splitlines()
    assert json.loads(lines[0])["pin"]["precision"] == "float32" and len(lines) == 1 + 4  # full and truncate, 2 prompts
    with open(refs, "w") as f:  # plant: the frozen file is what the target's arms read
        f.write(lines[0] + "\n" + "".join(json.dumps({"k": json.loads(x)["k"], "v": 0.25}) + "\n" for x in lines[1:]))
    again = run()
    assert again.returncode == 0, again.stderr
    ev = json.loads((tmp_path / "ev.json").read_text())
    row = ev["copy"]["gaps"]["200"]
    assert row["full"] == row["truncate"] == 0.25 and ev["precision"] == "float32"
    moved = run("--copy-prompts", "3")
    assert moved.returncode != 0 and "no result for the copy-full arm" in moved.stderr
    other = run("--precision", "bfloat16")
    assert other.returncode != 0 and "were made for" in other.stderr and "precision" in other.stderr
    mixed = run("--precision", "bfloat16", "--references", str(tmp_path / "bf16.jsonl"), "--update-references")
    assert mixed.returncode != 0 and "would mix the two" in mixed.stderr  # the artifact's evidence is float32
