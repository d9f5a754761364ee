"""The shipped family and maps: what the README and model card claim about them holds."""

import json

import pytest
import torch
from conftest import DATA, MODELS, ROOT

from kvferry.mappings.gates import Gates, load_for_serving
from kvferry.mappings.lab.capture import read_corpus, token_windows


def test_family_geometry(family):
    s, t, t64 = (family[n].identity.geometry for n in ("S", "T", "T64"))
    assert t.layers > s.layers and t.kv_width > s.kv_width and t.head_dim == s.head_dim
    cfg = family["T"].model.config
    assert cfg.num_attention_heads > cfg.num_key_value_heads  # GQA
    assert t64.head_dim != t.head_dim and t64.kv_heads != t.kv_heads
    assert len({family[n].identity.tokenizer for n in ("S", "T", "T64")}) == 1
    for n in ("S", "T", "T64"):
        assert family[n].model.config.max_position_embeddings >= 8192


def test_family_fits_the_size_budget():
    pretrained = MODELS / "pretrained"  # git-ignored: real models converted by `kvferry models fetch`
    total = sum(f.stat().st_size for f in MODELS.rglob("*") if f.is_file() and pretrained not in f.parents)
    assert total <= 40 * 2**20


@torch.no_grad()
def test_target_beats_source_on_heldout_perplexity(family):
    windows = token_windows(family["S"].tokenizer, read_corpus([DATA / "heldout.jsonl"]), 512)[:6]
    ids = torch.stack(windows)
    nll = {}
    for n in ("S", "T"):
        nll[n] = float(family[n].model(input_ids=ids, labels=ids).loss)
    assert nll["T"] < nll["S"] - 0.05, nll


@pytest.mark.parametrize("pair", ["S__T", "S__T64"])
def test_shipped_maps_verify_and_pass_their_gates(family, pair):
    (path,) = sorted((ROOT / "maps" / pair).iterdir())[-1:]
    ms = load_for_serving(
        path, Gates(), expect_source=family["S"].identity, expect_target=family[pair.split("__")[1]].identity
    )
    assert ms.evidence and "mapped_refresh" in ms.evidence["arms"]
    assert ms.calibration["corpus_sha256"] and ms.calibration["tokens"] > 0


def test_corpus_manifest_records_source_license_and_digests():
    man = json.loads((DATA / "corpus.json").read_text())
    assert "PSF" in man["license"] and set(man["splits"]) == {"train", "calib", "heldout"}
    assert all(len(s["sha256"]) == 64 for s in man["splits"].values())


def test_inspect_prints_the_manifest_r2_and_the_gate_verdict():
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "kvferry", "maps", "inspect", str(ROOT / "maps" / "S__T" / "1.1.0")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    manifest = json.loads((ROOT / "maps" / "S__T" / "1.1.0" / "manifest.json").read_text())
    k = [m["heldout_r2"] for m in sorted(manifest["maps"], key=lambda m: m["target_layer"]) if m["kind"] == "k"]
    assert "held-out R² of K by target layer: " + ", ".join(f"{x:.2f}" for x in k) in r.stdout
    assert "serving gates (defaults): pass" in r.stdout
    refresh = manifest["evidence"]["arms"]["mapped_refresh"]  # the evidence's own tables, as the demo prints them
    assert (
        f"| mapped_refresh   | {refresh['top1']:12.3f} | {refresh['top10']:12.3f} | {refresh['kl']:12.3f} |" in r.stdout
    )
    brief = subprocess.run(
        [sys.executable, "-m", "kvferry", "maps", "inspect", "--brief", str(ROOT / "maps" / "S__T" / "1.1.0")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "mapped_refresh" not in brief.stdout and "serving gates (defaults): pass" in brief.stdout
    gated = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvferry",
            "maps",
            "inspect",
            str(ROOT / "maps" / "smollm2-135m-l10__smollm2-135m" / "0.1.0"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        gated.returncode == 0
        and "serving gates (defaults): fail: " in gated.stdout
        and "long-range copy" in gated.stdout
    )


def test_the_family_command_builds_the_family_it_names():
    """`kvferry family` (its flags built without torch) offers exactly the builder's members, and its steps parse."""
    from kvferry.cli import build_parser
    from kvferry.commands.family import FAMILY_MODELS
    from kvferry.mappings.lab.family import FAMILY

    assert set(FAMILY_MODELS) == set(FAMILY)
    a = build_parser().parse_args(["--threads", "1", "family", "train", "--model", "T64", "--warmup-copy", "0"])
    assert (a.step, a.model, a.warmup_copy) == ("train", "T64", 0)
