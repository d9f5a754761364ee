"""The LCC-style next-line task (mappings/lab/next_line.py): scoring on hand-made cases, task construction, the pinned
file list, and the arms on the tiny family."""

import hashlib
import json

import pytest
from conftest import DATA, ROOT

from kvferry.mappings.artifact import load
from kvferry.mappings.errors import InvalidInput
from kvferry.mappings.lab.capture import read_corpus
from kvferry.mappings.lab.next_line import (
    NextLineSettings,
    edit_similarity,
    library_files,
    make_tasks,
    next_line_task,
    score,
)


@pytest.mark.parametrize(
    "got, want, sim",
    [
        ("x = foo(a, b)", "x = foo(a, b)", 1.0),
        ("  x = foo(a, b)  ", "x = foo(a, b)", 1.0),  # surrounding whitespace ignored
        ("abcd", "abce", 0.75),  # 2 * 3 matching characters / 8
        ("", "", 1.0),
        (None, "return x", 0.0),  # an unfinished line
        ("zzzz", "return", 0.0),
    ],
)
def test_edit_similarity_on_hand_made_lines(got, want, sim):
    assert edit_similarity(got, want) == pytest.approx(sim)


def test_scores_keep_every_task_and_average_them():
    s = NextLineSettings(tasks=3)
    ev = score({"full": ["a = 1", "b = 2", None], "truncate": ["a = 1", "c", "q"]}, ["a = 1", "b = 2", "c = 3"], s)
    assert ev["per_task"]["full"] == {"edit_sim": [1.0, 1.0, 0.0], "exact": [1, 1, 0]}
    assert ev["arms"]["full"]["exact"] == pytest.approx(2 / 3) and ev["arms"]["full"]["edit_sim"] == pytest.approx(
        2 / 3
    )
    assert ev["arms"]["truncate"]["exact"] == pytest.approx(1 / 3)
    assert ev["per_task"]["truncate"]["edit_sim"][1] == pytest.approx(0.0)
    assert ev["per_task"]["truncate"]["edit_sim"][2] == pytest.approx(edit_similarity("q", "c = 3"))


class _CharTokenizer:
    """One token per character: token counts are character counts (for hand-made files)."""

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        out = {"input_ids": [ord(c) for c in text]}
        if return_offsets_mapping:
            out["offset_mapping"] = [(i, i + 1) for i in range(len(text))]
        return out


def test_tasks_cut_a_scrambled_file_at_a_code_line_past_the_context():
    """Only code lines (no comments, decorators, lone brackets) with min_context tokens before them are cut at; the
    prompt ends with the line's indentation; the answer is the scrambled file's own line; the choice is seeded."""
    body = "".join(f"def helper_{i}(value):\n    # note {i}\n    return value + {i}\n\n" for i in range(60))
    texts = ["x = 1\n", body, body]
    s = NextLineSettings(tasks=2, min_context=1500, max_context=1800, min_chars=12, refresh=4)
    tasks = make_tasks(_CharTokenizer(), texts, s)
    assert len(tasks) == 2  # the first file is too short and is skipped
    for t in tasks:
        prompt = "".join(map(chr, t.prompt))
        assert len(t.prompt) <= 1800 and t.answer.startswith("return ") and prompt.endswith("\n    ")
        assert "helper" not in prompt  # scrambled: the names are made-up words
    assert make_tasks(_CharTokenizer(), texts, s) == tasks
    assert make_tasks(_CharTokenizer(), texts, NextLineSettings(**{**s.as_dict(), "seed": 1})) != tasks
    with pytest.raises(InvalidInput, match="hold 2 lines"):
        make_tasks(_CharTokenizer(), texts, NextLineSettings(**{**s.as_dict(), "tasks": 3}))
    with pytest.raises(InvalidInput, match="next-line needs"):
        NextLineSettings(min_context=100, max_context=50)


def test_the_file_list_is_pinned_by_content(tmp_path):
    """Files are read from the installed package the manifest names; one whose bytes differ is refused."""
    blob = (ROOT / "mappings" / "gates.py").read_bytes()
    man = {
        "package": "kvferry.mappings",
        "version": "test",
        "files": [{"path": "gates.py", "sha256": hashlib.sha256(blob).hexdigest()}],
    }
    good = tmp_path / "good.json"
    good.write_text(json.dumps(man))
    assert library_files(good) == [blob.decode()]
    man["files"][0]["sha256"] = "0" * 64
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(man))
    with pytest.raises(InvalidInput, match="differs from the file the task was built on"):
        library_files(bad)
    shipped = json.loads((DATA / "next_line_files.json").read_text())
    assert shipped["package"] == "torch" and len(shipped["files"]) == 140


def test_the_arms_on_the_tiny_family(family):
    """The target's own prefill writes the file's lines far better than from its last tokens; the mapped arm is scored
    on the same tasks, each task's scores kept for the gate's intervals."""
    source, target = family["S"], family["T"]
    ms = load(ROOT / "maps" / "S__T" / "1.1.0")
    texts = list(read_corpus([DATA / "heldout.jsonl"]))
    s = NextLineSettings(tasks=4, min_context=300, max_context=600, refresh=8, max_new_tokens=24)
    ev = next_line_task(ms, source, target, texts, s)
    assert set(ev["arms"]) == {"full", "truncate", "mapped_refresh"}
    assert all(len(ev["per_task"][arm]["exact"]) == 4 for arm in ev["arms"])
    assert 0 <= ev["arms"]["mapped_refresh"]["edit_sim"] <= 1


def test_the_gates_downstream_bar_reads_the_next_line_task():
    """Where the evidence has the next-line task, the downstream bar is its edit similarity within 0.02 of full
    prefill, with a paired interval over tasks; the older completion task is then not read."""
    from kvferry.mappings.gates import Gates

    s = NextLineSettings(tasks=40)
    answers = [f"line_{i} = value" for i in range(40)]
    close = score(
        {"full": answers, "truncate": ["x"] * 40, "mapped_refresh": [*answers[:39], "line_39 = valu"]}, answers, s
    )
    base = {
        "arms": {"mapped_refresh": {"top10": 0.9, "top1": 0.9, "kl": 0.1, "attn_cos": 0.9}},
        "completion": {"arms": {"full": 0.5, "truncate": 0.0, "mapped_refresh": 0.0}},
    }
    assert Gates(min_copy_retention=0).failures(base | {"next_line": close}) == []
    far = score({"full": answers, "truncate": ["x"] * 40, "mapped_refresh": answers[:30] + ["x"] * 10}, answers, s)
    (problem,) = Gates(min_copy_retention=0).failures(base | {"next_line": far})
    assert problem.startswith("next line: mapped_refresh edit similarity") and "95% interval" in problem
    assert len(Gates(min_copy_retention=0).failures(base)) == 1  # without it, the completion task is read
