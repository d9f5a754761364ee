"""An unmodified vLLM (CPU build) with the kvferry connector: real engines, a real sidecar, a real Redis.

Runs where vLLM is installed (``make test-vllm`` builds that venv; the main suite skips it). The source
engine publishes its prompts' KV; the target engine reports the published prefix as matched tokens,
loads the translation into its paged cache and computes only the tail.
"""

import os
import re
import shutil

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this in its own venv")

from conftest import DATA, MODELS, PASSING_COPY, sample

from kvferry.bench.vllm_driver import EngineProcess
from kvferry.client.rollout import update_policy_file
from kvferry.mappings.artifact import save, write_evidence
from kvferry.mappings.lab.capture import read_corpus, token_windows
from kvferry.mappings.lab.fit import identity_mapset
from kvferry.sidecar.background import BackgroundSidecar
from kvferry.sidecar.config import SidecarConfig

SECRET, PREFIX_BLOCK, PROMPTS, LENGTH = "v" * 32, 128, 8, 400


def _sidecar_config(maps, redis_url: str, **overrides) -> SidecarConfig:
    """A sidecar on a free port over ``maps``, sharing the engines' Redis, secret and prefix blocks."""
    return SidecarConfig(
        **{
            "maps_dir": str(maps),
            "port": 0,
            "reload_seconds": 0,
            "redis_url": redis_url,
            "prefix_secret": SECRET,
            "prefix_block_size": PREFIX_BLOCK,
            **overrides,
        }
    )


def _published_kv_is_the_models_own(model, redis_url, ids):
    """What the producer read out of vLLM's paged cache is the HF model's own K and V: layout, head order, RoPE."""
    import redis
    import torch

    from kvferry.common.prefix import Namespace, block_hashes, decode_block, model_id
    from kvferry.mappings.lab.capture import capture_kv

    g = model.identity.geometry
    ns = Namespace("default", model_id(model.identity))
    hashes = block_hashes(SECRET.encode(), ns, ids, PREFIX_BLOCK)
    blobs = redis.Redis.from_url(redis_url).mget([ns.key(h) for h in hashes])
    blocks = [decode_block(b, h, g.layers, (g.kv_heads, PREFIX_BLOCK, g.head_dim)) for b, h in zip(blobs, hashes)]
    with torch.no_grad():
        ref = capture_kv(model.model, torch.tensor([ids]))
    for layer, (rk, rv) in enumerate(ref):
        k = torch.cat([b[layer][0] for b in blocks], 1)
        v = torch.cat([b[layer][1] for b in blocks], 1)
        torch.testing.assert_close(k, rk[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v, rv[0], rtol=1e-4, atol=1e-4)


def test_vllm_imports_translated_kv_and_skips_the_prefill(tmp_path, family, redis_url):
    s, t = family["S"], family["T"]
    maps = tmp_path / "maps"
    good = {
        "arms": {"mapped_refresh": {"top1": 1.0, "top10": 1.0, "kl": 0.0, "attn_cos": 1.0}},
        "recommended_refresh": 16,
        "copy": PASSING_COPY,
    }
    self_map = save(identity_mapset(s.identity, version="1.0.0"), maps)
    write_evidence(self_map, good)
    shutil.copytree(MODELS.parent / "maps" / "S__T", maps / "S__T")  # the shipped map, with its evidence
    prompts = [
        w.tolist() for w in token_windows(t.tokenizer, list(read_corpus([DATA / "heldout.jsonl"])), LENGTH)[:PROMPTS]
    ]
    common = {"redis_url": redis_url, "prefix_secret": SECRET, "prefix_block_size": PREFIX_BLOCK}
    sidecar = BackgroundSidecar(_sidecar_config(maps, redis_url))  # gates on

    def consumer(model, name):
        return {**common, "sidecar": sidecar.address, "map_name": name, "status_seconds": 0}

    log = tmp_path / "target.log"
    try:  # the target loads in its step, layer by layer: each attention layer waits for its own layer's pages
        with (
            EngineProcess(
                MODELS / "T",
                "kv_consumer",
                {**consumer(MODELS / "T", "S__T"), "async_loads": False, "layer_by_layer": True},
                log=log,
            ) as target,
            EngineProcess(MODELS / "S", "kv_producer", common, max_num_batched_tokens=256) as source,
        ):  # chunked prefill
            bs = target.info["block_size"]
            covered = (LENGTH - 16) // PREFIX_BLOCK * PREFIX_BLOCK  # whole prefix blocks before the refreshed tail
            baseline = target.batch(prompts)  # nothing published yet: T's own prefill
            assert all(r["num_cached_tokens"] == 0 for r in baseline)
            source_out = source.batch(prompts)  # S reads the prompts and publishes their KV
            mapped = target.batch(prompts)
        assert covered % bs == 0
        _published_kv_is_the_models_own(s, redis_url, prompts[0][:covered])
        assert all(r["num_cached_tokens"] >= covered for r in mapped), [r["num_cached_tokens"] for r in mapped]
        first = sum(a["tokens"][0] == b["tokens"][0] for a, b in zip(baseline, mapped)) / PROMPTS
        greedy = (
            sum(
                sum(x == y for x, y in zip(a["tokens"], b["tokens"])) / len(a["tokens"])
                for a, b in zip(baseline, mapped)
            )
            / PROMPTS
        )
        # kvferry eval's evidence for this map (mapped + refresh 16): top-1 0.90, 32-token greedy agreement 0.52
        assert first >= 0.6 and greedy >= 0.3, (first, greedy)
        said = log.read_text()  # every load went layer by layer (the driver runs each prompt twice: TTFT, then tokens)
        assert said.count("loaded layer by layer") == 2 * PROMPTS, said[-3000:]
        assert "does not call wait_for_layer_load" not in said and "kvferry: translation for" not in said, said[-3000:]

        policy = tmp_path / "policy.toml"
        update_policy_file(policy, "S__S-self", enabled=True)
        self_log = tmp_path / "self.log"
        with EngineProcess(
            MODELS / "S",
            "kv_consumer",
            {
                **consumer(MODELS / "S", "S__S-self"),
                "policy_file": str(policy),
                "policy_reload_seconds": 0,  # each request sees the file as it is now
                "direct_reads": True,
            },
            log=self_log,
        ) as engine:

            def served():
                return sample(sidecar, "kvferry_tokens_total", map="S__S-self@1.0.0")

            before = served()
            exact = engine.batch(prompts)  # the sidecar maps the stored source blocks and stores the mapped ones
            after = served()
            assert after > before
            direct = engine.batch(prompts)  # now every mapped block is stored: read from Redis, the sidecar not asked
            assert served() == after
            for run in (exact, direct):
                assert all(r["num_cached_tokens"] >= covered for r in run)
                for a, b in zip(source_out, run):  # an exact map: the same tokens and logprobs as S's own prefill
                    assert a["tokens"] == b["tokens"]
                    for tok, lp in a["top_logprobs"].items():
                        assert abs(b["top_logprobs"][tok] - lp) < 1e-3
            same = [r["tokens"] for r in source_out]
            update_policy_file(policy, "S__S-self", enabled=False)  # the rollout kill switch
            off = engine.batch(prompts)
            assert all(r["num_cached_tokens"] == 0 for r in off) and [r["tokens"] for r in off] == same
            # Live quality: a mapped request whose refreshed tail holds a whole published prefix block has it
            # translated but not loaded, and compared with what the engine computes (drift); a shadow-sampled request
            # is prefilled by the engine, and its prefix's translation compared with that (shadow). A gate no sample
            # passes switches the map off at the first sample (a policy change switches it on again); the log names
            # the signal and its mean, for this exact map the engines' float noise: the tokens line up.
            for signal, entry in (("drift", {"refresh": 144}), ("shadow", {"shadow_percent": 100.0})):
                update_policy_file(
                    policy,
                    "S__S-self",
                    enabled=True,
                    min_tokens=200,
                    max_drift_rel_err=-1.0,
                    window=1,
                    min_samples=1,
                    **entry,
                )
                engine.batch(prompts[:1])
                then = engine.batch(prompts[1:3])
                assert all(r["num_cached_tokens"] == 0 for r in then) and [r["tokens"] for r in then] == same[1:3]
                trips = re.findall(
                    rf"switched off by live quality monitoring: {signal}_rel_err mean ([0-9.]+)", self_log.read_text()
                )
                assert trips and float(trips[-1]) < 1e-3, (signal, trips, self_log.read_text()[-3000:])
            update_policy_file(policy, "S__S-self", enabled=True, refresh=16, shadow_percent=0.0, max_drift_rel_err=1e9)
            write_evidence(
                self_map, {**good, "arms": {"mapped_refresh": {**good["arms"]["mapped_refresh"], "top10": 0.1}}}
            )
            sidecar.call(sidecar.sidecar.reload())  # the map's evidence now fails the gate: it is gated off
            gated = engine.batch(prompts)
            assert all(r["num_cached_tokens"] == 0 for r in gated) and [r["tokens"] for r in gated] == same
            sidecar.stop()
            down = engine.batch(prompts)  # sidecar gone: 0 matched tokens, vLLM's own prefill, same answers
            assert all(r["num_cached_tokens"] == 0 for r in down) and [r["tokens"] for r in down] == same
        # A translation that fails after the scheduler matched the tokens (this sidecar derives other keys, so
        # it finds nothing for them): the worker reports the blocks as load errors and vLLM recomputes them, loading
        # asynchronously and loading layer by layer (the failure then arrives while the forward waits on a layer).
        other = BackgroundSidecar(_sidecar_config(maps, redis_url, prefix_secret="w" * 32, force_maps=True))
        try:
            for asynchronous in (True, False):
                with EngineProcess(
                    MODELS / "S",
                    "kv_consumer",
                    {
                        **common,
                        "sidecar": other.address,
                        "map_name": "S__S-self",
                        "async_loads": asynchronous,
                        "layer_by_layer": True,
                    },
                ) as engine:
                    failed = engine.batch(prompts)
                assert [r["tokens"] for r in failed] == same, asynchronous
        finally:
            other.stop()
    finally:
        sidecar.stop()


QWEN_SOURCE, QWEN_TARGET = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"


@pytest.mark.skipif(os.environ.get("KVFERRY_SKIP_REAL") == "1", reason="KVFERRY_SKIP_REAL=1")
def test_the_qwen_pair_through_vllm(tmp_path, redis_url):
    """Qwen2.5-Coder 0.5B's cache into vLLM's 1.5B: the 0.5B engine publishes a long prompt (a made-up function,
    2,000 tokens of other code, its first lines again), the 1.5B engine loads its translation and writes the
    function on. Its continuation is checked against the same map's under HF transformers on the same prompt (the
    same tokens, or a divergence at a near tie of the HF logits), and against the 1.5B's own prefill in vLLM."""
    import json

    import torch

    from kvferry import pretrained
    from kvferry.demo_qwen import function_prompt
    from kvferry.mappings.apply import apply
    from kvferry.mappings.artifact import load
    from kvferry.mappings.cache import to_dynamic_cache
    from kvferry.mappings.gates import Gates
    from kvferry.mappings.lab.capture import capture_kv, load_model
    from kvferry.mappings.lab.evaluate import greedy_continuation
    from kvferry.mappings.versions import version_key

    src_dir, tgt_dir = pretrained.fetch(QWEN_SOURCE), pretrained.fetch(QWEN_TARGET)
    maps = MODELS.parent / "data" / "candidates"  # the pair's best map, 0.8.0 (docs/real_pair.md)
    pair = maps / f"{QWEN_SOURCE}__{QWEN_TARGET}"
    ms = load(pair / sorted((p.name for p in pair.iterdir()), key=version_key)[-1])
    refused = Gates().failures(ms.evidence)
    if refused:  # the operator switch that serves a refused map, named in the test's output
        print(f"SERVING A MAP ITS GATE REFUSES (force_maps) to measure it: {ms.name} {ms.version}: {refused}")
    from transformers import AutoTokenizer

    prompt, passage = function_prompt(AutoTokenizer.from_pretrained(tgt_dir), 2000)
    common = {"redis_url": redis_url, "prefix_secret": SECRET, "prefix_block_size": PREFIX_BLOCK}
    with BackgroundSidecar(_sidecar_config(maps, redis_url, force_maps=bool(refused))) as sidecar:
        consumer = {**common, "sidecar": sidecar.address, "map_name": ms.name, "map_version": ms.version}
        with (
            EngineProcess(tgt_dir, "kv_consumer", consumer, max_model_len=4096) as target,
            EngineProcess(src_dir, "kv_producer", common, max_model_len=4096) as source,
        ):
            own = target.batch([prompt], len(passage))[0]  # nothing published: the 1.5B's own prefill
            source.batch([prompt], 1)
            mapped = target.batch([prompt], len(passage))[0]
    refresh = max(16, int(ms.evidence["recommended_refresh"]))
    loaded = (len(prompt) - refresh) // PREFIX_BLOCK * PREFIX_BLOCK
    assert own["num_cached_tokens"] == 0 and mapped["num_cached_tokens"] == loaded, (own, mapped)

    source_hf, target_hf = load_model(src_dir), load_model(tgt_dir)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        kv = apply(ms, capture_kv(source_hf.model, ids[:, :loaded]), 0)
        hf = greedy_continuation(target_hf.model, ids, kv, len(passage), target_hf.tokenizer.eos_token_id)
    got = mapped["tokens"]
    same = next((i for i, (a, b) in enumerate(zip(hf, got)) if a != b), len(hf))
    report = {
        "map": f"{ms.name} {ms.version}",
        "refused_map_served": refused or None,
        "vllm_mapped": got,
        "hf_mapped": hf,
        "vllm_own": own["tokens"],
        "passage": passage,
        "tokens_alike": same,
    }
    if same < len(hf):  # where they part, the HF logits must be a near tie between the two tokens
        with torch.no_grad():
            step = torch.tensor([prompt + hf[:same]])
            cache = to_dynamic_cache(kv, target_hf.model.config)
            logits = target_hf.model(input_ids=step[:, loaded:], past_key_values=cache).logits[0, -1]
        report["margin_at_divergence"] = float(logits[hf[same]] - logits[got[same]])
    print(json.dumps(report))
    assert same == len(hf) or report["margin_at_divergence"] < 0.5, report
    # the map's evidence: copy kept >= 85% at gaps of 1,000 and 3,000 tokens, so the function goes on as the 1.5B's
    # own prefill writes it
    assert sum(a == b for a, b in zip(got, own["tokens"])) >= 0.85 * len(passage), report
