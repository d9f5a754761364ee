"""The long-range copy probe and the gate that reads it."""

import pytest
from conftest import DATA

from kvferry.mappings.artifact import load
from kvferry.mappings.errors import InvalidInput
from kvferry.mappings.gates import Gates
from kvferry.mappings.lab.capture import read_corpus
from kvferry.mappings.lab.copy_probe import CopySettings, copy_probe, format_copy_table, make_examples
from kvferry.mappings.lab.evaluate import EvalSettings, evaluate
from kvferry.mappings.lab.fit import identity_mapset

HELDOUT = [str(DATA / "heldout.jsonl")]


def _evidence(full: float, refresh: float, truncate: float = 0.4, arms=None) -> dict:
    arms = arms or {"mapped_refresh": {"top1": 0.95, "top10": 0.97, "kl": 0.01, "attn_cos": 0.99}}
    return {
        "arms": arms,
        "copy": {"gaps": {"1000": {"full": full, "truncate": truncate, "mapped": refresh, "mapped_refresh": refresh}}},
    }


def test_examples_repeat_the_passage_after_a_disjoint_gap():
    stream = list(range(10_000))  # distinct ids: any overlap or misplacement shows
    s = CopySettings(gaps=(50, 700), prompts=4, passage=30, cue=10, score=12, refresh=4, seed=3)
    exs = make_examples(stream, s)
    assert [e.gap for e in exs] == [50] * 4 + [700] * 4
    for e in exs:
        passage = e.prompt[:30]
        assert passage == list(range(passage[0], passage[0] + 30))
        gap = e.prompt[30 : 30 + e.gap]
        assert not set(gap) & set(passage)
        assert e.prompt[30 + e.gap :] == passage[:10] and len(e.prompt) == 30 + e.gap + 10
        assert e.answer == passage[10:22]
    assert make_examples(stream, s) == exs  # seeded
    with pytest.raises(InvalidInput, match="needs at least"):
        make_examples(stream[:600], s)


def test_settings_are_validated():
    with pytest.raises(InvalidInput):
        CopySettings(gaps=())
    with pytest.raises(InvalidInput):
        CopySettings(cue=120, passage=120)
    with pytest.raises(InvalidInput, match="passage stays in the mapped cache"):
        CopySettings(gaps=(500, 1000), refresh=541, cue=40)  # would recompute the passage's last token
    assert CopySettings(gaps=(500, 1000), refresh=540, cue=40).refresh == 540  # the cue and the whole gap


def test_a_refresh_past_the_cue_recomputes_gap_tokens_and_still_scores_the_map(family):
    s = family["S"]
    ms = identity_mapset(s.identity)
    ms.target = s.identity
    cs = CopySettings(gaps=(100,), prompts=2, refresh=140)  # the cue (40) and the whole gap
    ev = copy_probe(ms, s, s, list(read_corpus(HELDOUT)), cs)
    row = ev["gaps"]["100"]
    assert row["mapped_refresh"] == row["full"] and ev["settings"]["refresh"] == 140


def test_an_exact_map_keeps_exactly_what_full_prefill_has(family):
    s = family["S"]
    ms = identity_mapset(s.identity)
    ms.target = s.identity
    cs = CopySettings(gaps=(100, 400), prompts=2, refresh=8)
    ev = copy_probe(ms, s, s, list(read_corpus(HELDOUT)), cs)
    for row in ev["gaps"].values():
        assert row["mapped"] == row["full"] and row["mapped_refresh"] == row["full"]
        assert row["prompts"] == 2
    assert "| 100 |" in format_copy_table(ev)


def test_the_tiny_family_cannot_copy_at_distance(family):
    """The test family has no long-range skill: its target scores low with full prefill, so the gate calls it n/a."""
    ms = load(DATA.parent / "maps" / "S__T" / "1.1.0")
    ev = copy_probe(ms, family["S"], family["T"], list(read_corpus(HELDOUT)), CopySettings(gaps=(500,), prompts=3))
    row = ev["gaps"]["500"]
    assert row["full"] < Gates().min_copy_full
    assert Gates().copy_failures({"copy": ev}) == []


def test_gate_refuses_a_map_that_loses_the_distant_passage():
    g = Gates()
    assert g.failures(_evidence(full=0.96, refresh=0.93)) == []
    lost = g.failures(_evidence(full=0.96, refresh=0.45, truncate=0.43))
    assert len(lost) == 1 and "long-range copy at gap 1000" in lost[0] and "truncation scores 0.430" in lost[0]
    assert g.failures(_evidence(full=0.2, refresh=0.0)) == []  # the target itself does not copy: nothing to lose
    no_copy = {"arms": _evidence(0.9, 0.9)["arms"]}
    assert "no long-range (copy probe) evidence" in g.failures(no_copy)[0]
    assert Gates(min_copy_retention=0).failures(no_copy) == []  # explicitly off
    with pytest.raises(InvalidInput):
        Gates(min_copy_retention=1.5)


def test_evaluate_records_copy_and_prose_evidence(family):
    s = family["S"]
    ms = identity_mapset(s.identity)
    ms.target = s.identity
    settings = EvalSettings(
        prompts=2,
        greedy_prompts=0,
        recall_prompts=0,
        min_len=64,
        max_len=128,
        prose_prompts=3,
        copy=CopySettings(gaps=(200,), prompts=1),
    )
    ev = evaluate(ms, s, s, HELDOUT, settings, progress=False, prose=[str(DATA / "prose_heldout.jsonl")])
    assert ev["copy"]["gaps"]["200"]["mapped_refresh"] == ev["copy"]["gaps"]["200"]["full"]
    assert ev["prose"]["arms"]["mapped_refresh"]["top1"] == 1.0
    assert ev["prose"]["arms"]["no_context"]["kl"] > 0


def test_the_mapped_arms_read_the_maps_cache_not_the_targets(family):
    """A map that destroys the prefix (every weight zero: each token's K and V is the mean) scores what the target
    scores on that destroyed cache, prompt by prompt, and not what full prefill scores: the mapped arms cannot be
    reading the target's own cache."""
    import torch

    from kvferry.mappings.apply import apply
    from kvferry.mappings.artifact import LayerMap, MapSet
    from kvferry.mappings.cache import kv_slice
    from kvferry.mappings.lab.capture import capture_kv
    from kvferry.mappings.lab.copy_probe import continuation_accuracy, examples_for

    s = family["S"]
    ident = identity_mapset(s.identity)
    zero = MapSet(
        s.identity,
        s.identity,
        {
            k: LayerMap(
                m.target_layer,
                m.kind,
                m.source_layers,
                torch.zeros_like(m.weight),
                m.bias,
                m.lam,
                m.heldout_r2,
                m.inputs,
            )
            for k, m in ident.maps.items()
        },
        "0.0.2",
        {"kind": "test"},
        {},
    )
    cs = CopySettings(gaps=(100,), prompts=3, refresh=8)
    texts = list(read_corpus(HELDOUT))
    ev = copy_probe(zero, s, s, texts, cs)
    per = ev["gaps"]["100"]["per_prompt"]
    for ex, row in zip(examples_for(s.tokenizer, texts, cs), per):
        n = len(ex.prompt)
        mapped = apply(zero, capture_kv(s.model, torch.tensor([ex.prompt[:-1]])), 0)
        assert row["mapped_refresh"] == pytest.approx(
            continuation_accuracy(s.model, kv_slice(mapped, 0, n - 8), ex.prompt[n - 8 :], ex.answer), abs=1e-6
        )
    assert any(row["mapped"] != row["full"] for row in per)
