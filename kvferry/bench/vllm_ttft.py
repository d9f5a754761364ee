"""``kvferry bench vllm``: the target vLLM's time to first token with the kvferry connector vs without.

One run, side by side: a real redis-server, the sidecar in its own process on the shipped maps, the
source engine S (producer) and the target engine T (consumer), each its own vLLM process. Per prompt
length n, T's TTFT is measured first with nothing published (its own prefill), then S reads the
prompt and publishes its KV, and T's TTFT is measured again (translated prefix + its own tail).
Beside them, per n: the end-to-end cascade (S's own time to first token on the prompt, which publishes it, plus T's
with kvferry), and the in-process bound of the connector path: the map's apply on n tokens in this process (a random
source cache of the pair's geometry: its cost does not depend on the values) plus T's time to first token on the
tail it still computes, alone (a lower bound: over the loaded prefix the tail's attention reads more). The engines'
and the sidecar's peak resident memory close the table.
Then the loads, three ways: in the target's step whole (the forward starts once the translation is in its pages), in
its step layer by layer (each attention layer waits for its own layer only), and off the step (``async_loads``). In
each engine, the longest published prompt alone (its time to first token), and a short prompt (never mapped)
submitted together with it: the short prompt's time to its first token, beside the same prompt alone.
Needs vLLM (``make test-vllm`` builds ``.venv-vllm``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from kvferry import paths
from kvferry.bench.refused import add_flag, banner, bench_map
from kvferry.pretrained import model_path


def run(a: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from kvferry.mappings.lab.capture import read_corpus

    from .harness import RedisServer, ServerProcess
    from .vllm_driver import EngineProcess

    secret = "bench-vllm-secret"
    tok = AutoTokenizer.from_pretrained(a.target)
    ids: list[int] = []
    for text in read_corpus([paths.data_file("heldout.jsonl")]):
        ids += tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= 2 * max(a.sizes) + a.reps:
            break
    if len(ids) < 2 * max(a.sizes) + a.reps:
        raise SystemExit(f"the held-out text has {len(ids)} tokens; --sizes up to {(len(ids) - a.reps) // 2} fit")
    tails = ids[max(a.sizes) + a.reps :]  # never published: the tails' own prefill
    ms, served = bench_map(a.maps_dir, a.map, a.version, a.serve_refused_maps)
    redis_server = RedisServer()
    url = redis_server.url
    rows = []
    try:
        with ServerProcess(
            a.maps_dir,
            redis_url=url,
            prefix_secret=secret,
            prefix_block_size=a.prefix_block,
            serve_refused_maps=served is not None,
        ) as sc:
            common = {"redis_url": url, "prefix_secret": secret, "prefix_block_size": a.prefix_block}
            consumer = {
                **common,
                "sidecar": sc.address,
                "map_name": a.map,
                "map_version": ms.version,
                "refresh": a.refresh,
            }
            with (
                EngineProcess(a.target, "kv_consumer", consumer, dtype=a.dtype) as target,
                EngineProcess(a.source, "kv_producer", common, dtype=a.dtype) as source,
            ):
                target.batch([ids[1000:1300]], 1)  # warm-up
                for n in a.sizes:
                    prompts = [ids[i : i + n] for i in range(a.reps)]  # distinct prompts: no reuse between reps
                    own = target.batch(prompts, 1)
                    published = source.batch(prompts, 1)  # S reads them (it would anyway) and publishes their KV
                    mapped = target.batch(prompts, 1)

                    def med(rs, k):
                        return statistics.median(r[k] for r in rs)

                    row = {
                        "n": n,
                        "vllm_full_prefill_ttft_ms": med(own, "ttft_s") * 1e3,
                        "vllm_kvferry_ttft_ms": med(mapped, "ttft_s") * 1e3,
                        "vllm_source_ttft_ms": med(published, "ttft_s") * 1e3,
                        "cached_tokens": med(mapped, "num_cached_tokens"),
                        "prefill_tokens_without": n,
                        "first_token_agree": sum(x["tokens"][0] == y["tokens"][0] for x, y in zip(own, mapped))
                        / len(own),
                    }
                    tail = max(1, n - int(row["cached_tokens"]))
                    row["tail_alone_ttft_ms"] = (
                        med(target.batch([tails[i : i + tail] for i in range(a.reps)], 1), "ttft_s") * 1e3
                    )
                    row["apply_in_process_ms"] = _apply_ms(ms, n, a.reps)
                    row["bound_ms"] = row["apply_in_process_ms"] + row["tail_alone_ttft_ms"]
                    row["kvferry_vs_bound"] = row["bound_ms"] / row["vllm_kvferry_ttft_ms"]
                    row["cascade_ttft_ms"] = row["vllm_source_ttft_ms"] + row["vllm_kvferry_ttft_ms"]
                    row["speedup"] = row["vllm_full_prefill_ttft_ms"] / row["vllm_kvferry_ttft_ms"]
                    row["refused_map_served"] = served
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                memory = {
                    "target_engine_peak_mb": target.peak_rss_mb(),
                    "source_engine_peak_mb": source.peak_rss_mb(),
                    "sidecar_peak_mb": sc.peak_rss_mb(),
                }
            loads = _blocking_vs_async(a, ids, consumer) if not a.skip_load_modes else {}
    finally:
        redis_server.stop()
    lines = [
        *([banner(served), ""] if served else []),
        f"map {a.map} {ms.version}; vLLM CPU, {a.dtype}, block size from the engine; prefix blocks of "
        f"{a.prefix_block}; r >= {a.refresh}; medians of {a.reps} prompts",
        "",
        "| n | vLLM T own prefill TTFT ms | vLLM T + kvferry TTFT ms | speedup | bound: apply + tail alone ms | "
        "bound / kvferry | cascade: S's TTFT + T + kvferry ms | prompt tokens loaded | first token agrees |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['n']} | {r['vllm_full_prefill_ttft_ms']:.1f} | {r['vllm_kvferry_ttft_ms']:.1f} | "
            f"{r['speedup']:.2f}x | {r['apply_in_process_ms']:.1f} + {r['tail_alone_ttft_ms']:.1f} | "
            f"{r['kvferry_vs_bound']:.2f} | {r['cascade_ttft_ms']:.1f} | "
            f"{r['cached_tokens']:.0f} of {r['n']} | {r['first_token_agree']:.2f} |"
        )
    lines += [
        "",
        f"Peak resident memory: target engine {memory['target_engine_peak_mb']:.0f} MB, source engine "
        f"{memory['source_engine_peak_mb']:.0f} MB, sidecar {memory['sidecar_peak_mb']:.0f} MB",
    ]
    if loads:
        lines += [
            "",
            f"The published {max(a.sizes)}-token prompt alone, and a short prompt ({SHORT} tokens, never mapped) "
            f"submitted with it; medians of {a.reps}: time to first token",
            "",
            "| target engine loads | long one alone ms | short prompt alone ms | short prompt beside the long one ms | "
            "long one beside it ms |",
            "|---|---|---|---|---|",
        ]
        for mode, r in loads.items():
            lines.append(
                f"| {mode} | {r['long_alone_ms']:.1f} | {r['short_alone_ms']:.1f} | "
                f"{r['short_beside_long_ms']:.1f} | {r['long_ms']:.1f} |"
            )
    print("\n".join(lines))
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "map": a.map,
                    "version": ms.version,
                    "dtype": a.dtype,
                    "refused_map_served": served,
                    "rows": rows,
                    "memory": memory,
                    "loads": loads,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


SHORT = 48  # below the connector's min_tokens: never mapped
MODES = {
    "in the step, whole": {"async_loads": False, "layer_by_layer": False},
    "in the step, layer by layer": {"async_loads": False, "layer_by_layer": True},
    "off the step (asynchronous)": {"async_loads": True},
}


def _apply_ms(ms, n: int, reps: int) -> float:
    """The map's in-process apply on a random n-token source cache of its pair's geometry: median of ``reps``."""
    from kvferry.mappings.apply import apply

    from .apply_cost import random_source_cache
    from .harness import round_robin_ms

    kv = random_source_cache(ms.source.geometry, n, dtype=ms.dtype)
    apply(ms, kv, 0)  # warm-up
    return statistics.median(round_robin_ms({"apply": lambda: apply(ms, kv, 0)}, reps)["apply"])


def _blocking_vs_async(a, ids: list[int], consumer: dict) -> dict:
    """The longest published prompt's TTFT alone, and the short prompt's alone and beside it, per way of loading."""
    from .vllm_driver import EngineProcess

    n = max(a.sizes)
    out = {}
    for mode, flags in MODES.items():
        with EngineProcess(a.target, "kv_consumer", {**consumer, **flags}, dtype=a.dtype) as target:
            target.batch([ids[1000:1300]], 1)  # warm-up
            long_alone, alone, beside, long = [], [], [], []
            for i in range(a.reps):
                short = ids[len(ids) - (i + 1) * SHORT : len(ids) - i * SHORT]
                long_alone.append(target.together([ids[i : i + n]])[0]["ttft_s"])
                alone.append(target.together([short])[0]["ttft_s"])
                both = target.together(
                    [ids[i : i + n], short]
                )  # the published prompt first: its load is scheduled first
                long.append(both[0]["ttft_s"])
                beside.append(both[1]["ttft_s"])
            med = statistics.median
            out[mode] = {
                "long_alone_ms": med(long_alone) * 1e3,
                "short_alone_ms": med(alone) * 1e3,
                "short_beside_long_ms": med(beside) * 1e3,
                "long_ms": med(long) * 1e3,
            }
            print(json.dumps({mode: out[mode]}), flush=True)
    return out


def add_parser(sub) -> None:
    b = sub.add_parser("vllm", help="vLLM TTFT with the kvferry connector vs without (needs vLLM)")
    b.add_argument("--source", type=model_path, default=paths.model_dir("S"))
    b.add_argument("--target", type=model_path, default=paths.model_dir("T"))
    b.add_argument("--maps-dir", type=Path, default=paths.maps_dir())
    b.add_argument("--map", default="S__T")
    b.add_argument("--version", default="")
    add_flag(b)
    b.add_argument("--sizes", type=int, nargs="+", default=[2048, 8000])
    b.add_argument("--reps", type=int, default=3)
    b.add_argument("--refresh", type=int, default=16)
    b.add_argument("--prefix-block", type=int, default=256)
    b.add_argument("--json", default=None)
    b.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the engines' precision")
    b.add_argument(
        "--skip-load-modes",
        action="store_true",
        help="skip the three ways of loading (whole, layer by layer, asynchronous) beside a short prompt",
    )
    b.set_defaults(func=run)
