"""Unguessable passages, the completion task, the memo of the target's own arms, and gates over every domain."""

import json

import pytest
from conftest import DATA, ROOT

from kvferry.mappings.errors import InvalidInput
from kvferry.mappings.gates import Gates
from kvferry.mappings.lab.capture import read_corpus, token_stream
from kvferry.mappings.lab.completion import CompletionSettings, completion_task, format_completion_table, make_tasks
from kvferry.mappings.lab.copy_probe import CopySettings, copy_probe, examples_for, make_examples
from kvferry.mappings.lab.fit import identity_mapset
from kvferry.mappings.lab.memo import Memo, Pin
from kvferry.mappings.lab.scramble import scramble

CODE = list(read_corpus([DATA / "heldout.jsonl"]))
PROSE = list(read_corpus([DATA / "prose_heldout.jsonl"]))


def test_scramble_keeps_the_shape_and_renames_consistently():
    src = (
        "class FooBar(Base):\n"
        "    def get_value(self, key_name):\n"
        "        return self.get_value(key_name) + len(key_name)\n"
    )
    out = scramble(src, seed=1)
    assert out.splitlines()[0].startswith("class ") and "def " in out and "return self." in out and "len(" in out
    for name in ("FooBar", "Base", "get_value", "key_name"):
        assert name not in out
    lines = out.splitlines()
    renamed = lines[1].split("def ")[1].split("(")[0]
    assert "_" in renamed and lines[2].count(renamed) == 1  # snake_case kept, same name both times
    assert out.split()[1][0].isupper()  # CamelCase stays capitalised
    assert scramble(src, seed=1) == out and scramble(src, seed=2) != out
    prose = scramble("The interpreter evaluates the expression and binds the result.", seed=0)
    assert prose.startswith("The ") and " and " in prose and "interpreter" not in prose


def test_unguessable_passages_come_from_the_scrambled_text(family):
    tok = family["T"].tokenizer
    s = CopySettings(gaps=(200,), prompts=3, passage=60, cue=20, score=20, refresh=8)
    plain, scrambled = token_stream(tok, CODE), token_stream(tok, [scramble(t, s.seed) for t in CODE])
    exs = examples_for(tok, CODE, s)
    assert exs == make_examples(plain, s, scrambled)

    def as_text(ids):
        return "".join(map(str, ids))

    for e in exs:
        assert as_text(e.prompt[:60]) in as_text(scrambled) and as_text(e.prompt[60:260]) in as_text(plain)
        assert e.prompt[260:] == e.prompt[:20] and e.answer == e.prompt[20:40]
    assert examples_for(tok, CODE, CopySettings(gaps=(200,), prompts=3, unguessable=False)) != exs


def test_old_evidence_settings_read_as_plain_passages():
    assert (
        CopySettings.from_dict(
            {"gaps": [500], "prompts": 6, "passage": 120, "cue": 40, "score": 40, "refresh": 16, "seed": 0}
        ).unguessable
        is False
    )
    assert CopySettings.from_dict(CopySettings().as_dict()) == CopySettings()


def test_completion_tasks_are_function_bodies_after_long_context(family):
    tok = family["T"].tokenizer
    s = CompletionSettings(tasks=6, min_context=400, max_context=900)
    tasks = make_tasks(tok, CODE, s)
    assert len(tasks) == 6
    for t in tasks:
        assert 400 <= len(t.prompt) <= 900 and t.answer and t.answer == t.answer.strip()
        assert tok.decode(t.prompt).rstrip(" \t").endswith("\n")  # the prompt stops at the body line's indentation
    with pytest.raises(Exception, match="functions with"):
        make_tasks(tok, CODE[:1], CompletionSettings(tasks=500))


def test_completion_with_an_exact_map_scores_like_full_prefill(family, tmp_path):
    s = family["S"]
    ms = identity_mapset(s.identity)
    ms.target = s.identity
    cs = CompletionSettings(tasks=3, min_context=300, max_context=500, refresh=8, max_new_tokens=12)
    memo = Memo(tmp_path / "memo.jsonl", Pin.of(s, "float32"))
    ev = completion_task(ms, s, s, CODE, cs, memo=memo)
    assert ev["arms"]["mapped_refresh"] == ev["arms"]["full"]
    assert "full prefill" in format_completion_table(ev)
    assert len(memo.values) == 6  # full and truncate of 3 tasks


def test_the_memo_answers_the_targets_own_arms(family, tmp_path):
    s = family["S"]
    ms = identity_mapset(s.identity)
    ms.target = s.identity
    cs = CopySettings(gaps=(100,), prompts=2, refresh=8)
    path = tmp_path / "memo.jsonl"
    pin = Pin.of(s, "float32")
    first = copy_probe(ms, s, s, CODE, cs, memo=Memo(path, pin))
    assert len(Memo(path, pin).values) == 4  # full and truncate, two prompts
    # A memo is trusted for the target's own arms: a planted value shows it is read, and the mapped arms are not
    planted = Memo(path, pin)
    for k in list(planted.values):
        planted.put(k, 0.123)
    again = copy_probe(ms, s, s, CODE, cs, memo=Memo(path, pin, frozen=True))
    row, before = again["gaps"]["100"], first["gaps"]["100"]
    assert row["full"] == row["truncate"] == pytest.approx(0.123)
    assert row["mapped_refresh"] == before["mapped_refresh"]
    # another target (other weights) shares nothing with it
    other = family["T"]
    assert Memo.key("copy-full", other.identity.weights) != Memo.key("copy-full", s.identity.weights)
    with open(path, "a") as f:
        f.write('{"k": "torn')  # a stopped run's last line
    assert len(Memo(path, pin).values) == 4


def test_references_refuse_another_target_precision_or_prompt_set(family, tmp_path):
    """Committed references are pinned to the target's weights, geometry and precision, and a frozen file answers
    only the prompts it was built on: anything else is refused with what to do, never mixed with fresh results."""
    s, t = family["S"], family["T"]
    ms = identity_mapset(s.identity)
    ms.target = s.identity
    path = tmp_path / "refs.jsonl"
    cs = CopySettings(gaps=(100,), prompts=2, refresh=8)
    copy_probe(ms, s, s, CODE, cs, memo=Memo(path, Pin.of(s, "float32")))
    with pytest.raises(InvalidInput, match=r"were made for .* --update-references"):
        Memo(path, Pin.of(t, "float32"))  # another target's weights
    with pytest.raises(InvalidInput, match="were made for"):
        Memo(path, Pin.of(s, "bfloat16"))
    frozen = Memo(path, Pin.of(s, "float32"), frozen=True)
    with pytest.raises(InvalidInput, match="no result for the copy-full arm"):
        copy_probe(ms, s, s, CODE, CopySettings(gaps=(100,), prompts=2, refresh=8, seed=5), memo=frozen)
    with pytest.raises(InvalidInput, match="frozen"):
        frozen.put("k", 1.0)
    with pytest.raises(InvalidInput, match="no references at"):
        Memo(tmp_path / "none.jsonl", Pin.of(s, "float32"), frozen=True)


def test_the_references_file_format_is_stable(tmp_path):
    """Golden bytes: committed references outlive the code that wrote them (pin line, then key/value lines, the
    key a digest of the result's parts)."""
    pin = Pin("ab" * 32, "fp-1", "bfloat16")
    memo = Memo(tmp_path / "r.jsonl", pin)
    memo.put(Memo.key("copy-full", "ab" * 32, "fp-1", [1, 2, 3], [4]), 0.5)
    golden = (ROOT / "tests" / "golden" / "references.jsonl").read_bytes()
    assert (tmp_path / "r.jsonl").read_bytes() == golden
    assert Memo(tmp_path / "r.jsonl", pin, frozen=True).values == {json.loads(golden.splitlines()[1])["k"]: 0.5}


def _domain_evidence(code_top10=0.9, prose_top10=0.9, prose_copy=0.9, completion=None) -> dict:
    def copy(got):
        return {"gaps": {"500": {"full": 0.95, "truncate": 0.4, "mapped_refresh": got}}}

    ev = {
        "arms": {"mapped_refresh": {"top1": 0.9, "top10": code_top10, "kl": 0.1, "attn_cos": 0.99}},
        "copy": copy(0.9),
        "prose": {"arms": {"mapped_refresh": {"top1": 0.8, "top10": prose_top10, "kl": 0.2}}, "copy": copy(prose_copy)},
    }
    if completion:
        ev["completion"] = {"arms": dict(zip(("full", "truncate", "mapped_refresh"), completion))}
    return ev


def test_the_gate_reads_the_worst_domain():
    g = Gates()
    assert g.failures(_domain_evidence()) == []
    assert g.failures(_domain_evidence(prose_top10=0.7)) == [
        "prose: mapped_refresh top10=0.700 fails the gate (>= 0.8)"
    ]
    lost = g.failures(_domain_evidence(prose_copy=0.5))
    assert len(lost) == 1 and lost[0].startswith("prose: long-range copy at gap 500")
    ev = _domain_evidence()
    del ev["prose"]["copy"]
    assert g.failures(ev) == []  # a prose probe is read where measured; the code probe stays required
    del ev["copy"]
    assert "no long-range (copy probe) evidence" in g.failures(ev)[0]


def test_the_downstream_gate():
    g = Gates()
    assert g.failures(_domain_evidence(completion=(0.5, 0.2, 0.5))) == []
    bad = g.failures(_domain_evidence(completion=(0.5, 0.2, 0.45)))
    assert bad == [
        "completion: mapped_refresh writes 0.450 of the lines exactly, full prefill 0.500 (gate: within 0.02; "
        "truncation 0.200)"
    ]
    assert Gates(max_completion_drop=0.1).failures(_domain_evidence(completion=(0.5, 0.2, 0.45))) == []
    with pytest.raises(InvalidInput, match="max_completion_drop must lie in"):
        Gates(max_completion_drop=-1)


def test_shipped_evidence_reads_every_domain():
    """The SmolLM2 l18 map keeps copying but its prose top-10 is under the bar: the worst domain refuses it."""
    ev = json.loads((DATA.parent / "maps" / "smollm2-135m-l18__smollm2-135m" / "0.3.0" / "manifest.json").read_text())[
        "evidence"
    ]
    problems = Gates().failures(ev)
    assert problems and all(p.startswith("prose: mapped_refresh top10") for p in problems)
