"""The speed/quality frontier (mappings/lab/frontier.py, kvferry frontier): operating points, their shares of the
target's prefill, their measures against full prefill, and the plot."""

import argparse
import json
import subprocess
import sys

import pytest
import torch
from conftest import DATA, MODELS, ROOT

from kvferry.commands.args import int_list as _int_list
from kvferry.mappings.errors import InvalidInput
from kvferry.mappings.lab.capture import capture_first_layers, capture_kv, read_corpus
from kvferry.mappings.lab.copy_probe import CopySettings
from kvferry.mappings.lab.fit import identity_mapset
from kvferry.mappings.lab.frontier import (
    NEXT_LINE,
    FrontierSettings,
    copy_points,
    format_frontier,
    next_line_points,
    operating_points,
    plot,
    share,
    summarize,
    top10_points,
)
from kvferry.mappings.lab.next_line import NextLineSettings

CODE = list(read_corpus([DATA / "heldout.jsonl"]))


def test_shares_and_points():
    assert share("truncate", 16, 0, 400, 28) == pytest.approx(0.04)
    assert share("refresh", 1024, 0, 400, 28) == 1.0  # r past the prompt: the whole prefill
    assert share("hybrid", 16, 7, 400, 28) == pytest.approx(0.25 + 0.75 * 0.04)
    s = FrontierSettings(refreshes=(8, 32), hybrid_layers=(2, 6))
    points = operating_points(["1.0.0"], s, layers=6)
    assert [p for p in points if p[0] == "hybrid"] == [("hybrid", "1.0.0", 8, 2)]  # L = 6 is the full prefill
    assert len(points) == 2 + 2 + 1
    for bad in (
        dict(refreshes=(32, 8)),
        dict(refreshes=(0,)),
        dict(hybrid_layers=(0,)),
        dict(next_token_prompts=-1),
        dict(refreshes=(200,)),
    ):
        with pytest.raises(InvalidInput):
            FrontierSettings(**bad)
    assert _int_list("16, 64,256") == (16, 64, 256) and _int_list("") == ()
    for bad in ("0", "x", "-4"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive whole number"):
            _int_list(bad)


def test_the_first_layers_alone_are_a_prefills_first_layers(family):
    model = family["T"].model
    ids = torch.randint(0, 1000, (1, 40))
    full, part = capture_kv(model, ids), capture_first_layers(model, ids, 2)
    assert len(part) == 2 and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(full, part))
    with pytest.raises(InvalidInput, match="layers must be in"):
        capture_first_layers(model, ids, 99)


def test_an_exact_map_keeps_everything_at_every_point_and_truncation_pays_for_less(family, tmp_path):
    """The identity map of a model onto itself is exact: each of its refresh and hybrid points keeps full prefill's
    copying, top-10 and next lines (within float noise), while every point's share is what it spends."""
    s = family["S"]
    ms = identity_mapset(s.identity)
    ms.target = s.identity
    fs = FrontierSettings(
        refreshes=(8, 64),
        hybrid_layers=(2,),
        copy=CopySettings(gaps=(150,), prompts=2),
        next_token_prompts=2,
        min_len=40,
        max_len=80,
        next_line=NextLineSettings(tasks=2, min_context=300, max_context=600, max_new_tokens=16),
    )
    raw = {
        "code": {
            "copy": copy_points({"1.0.0": ms}, s, s, CODE, fs),
            "top10": top10_points({"1.0.0": ms}, s, s, CODE, fs),
        },
        "next_line": next_line_points({"1.0.0": ms}, s, s, CODE, fs),
    }
    lines = raw["next_line"]
    assert len(lines["full"]) == 2 and lines["points"]["1.0.0 refresh r=8"] == pytest.approx(lines["full"], abs=0.2)
    assert all(0 < x <= 8 / 300 for x in lines["share"]["truncate r=8"])
    row = raw["code"]["copy"]["150"]
    for name in ("1.0.0 refresh r=8", "1.0.0 refresh r=64", "1.0.0 hybrid L=2"):
        assert row["points"][name] == pytest.approx(row["full"], abs=0.03)
        assert raw["code"]["top10"]["points"][name] == pytest.approx([1.0, 1.0], abs=0.11)
    assert len(row["share"]["truncate r=8"]) == 2 and all(0 < x < 0.1 for x in row["share"]["truncate r=8"])
    front = summarize(raw, fs, ["1.0.0"], s.identity.geometry.layers)
    cell = front["measures"]["copy kept, code, gap 150"]["1.0.0 refresh r=8"]
    assert cell["interval"][0] <= cell["value"] <= cell["interval"][1] and cell["value"] == pytest.approx(1.0, abs=0.05)
    assert "| 1.0.0 hybrid L=2 |" in format_frontier(front)
    nl = front["measures"][NEXT_LINE]["1.0.0 refresh r=8"]
    assert nl["interval"][0] <= nl["value"] <= nl["interval"][1] and nl["value"] == pytest.approx(0.0, abs=0.2)
    plot(front, tmp_path / "f.png", "tiny")
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kvferry_frontier_writes_json_and_a_plot(tmp_path):
    out = tmp_path / "front"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvferry",
            "--threads",
            "2",
            "frontier",
            str(ROOT / "maps" / "S__T" / "1.0.0"),
            "--source",
            str(MODELS / "S"),
            "--target",
            str(MODELS / "T"),
            "--copy-gaps",
            "120",
            "--copy-prompts",
            "2",
            "--refreshes",
            "8,32",
            "--hybrid",
            "2",
            "--next-token-prompts",
            "0",
            "--next-line-tasks",
            "0",
            "--out",
            str(out),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    front = json.loads(out.with_suffix(".json").read_text())
    assert [p["name"] for p in front["points"]] == [
        "truncate r=8",
        "truncate r=32",
        "1.0.0 refresh r=8",
        "1.0.0 refresh r=32",
        "1.0.0 hybrid L=2",
    ]
    assert front["precision"] == "float32" and out.with_suffix(".png").is_file()
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvferry",
            "frontier",
            str(ROOT / "maps" / "S__T" / "1.0.0"),
            "--refreshes",
            "8,0",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "positive whole number" in bad.stderr
