"""``kvferry bench vllm``: the target vLLM's time to first token with the kvferry connector vs without.

One run, side by side: a real redis-server, the sidecar in its own process on the shipped maps, the
source engine S (producer) and the target engine T (consumer), each its own vLLM process. Per prompt
length n, T's TTFT is measured first with nothing published (its own prefill), then S reads the
prompt and publishes its KV, and T's TTFT is measured again (translated prefix + its own tail).
Needs vLLM (``make test-vllm`` builds ``.venv-vllm``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from kvferry import paths
from kvferry.pretrained import model_path


def run(a: argparse.Namespace) -> int:
    from kvferry.mappings.capture import read_corpus
    from transformers import AutoTokenizer

    from .harness import RedisServer, ServerProcess
    from .vllm_driver import EngineProcess

    secret = "bench-vllm-secret"
    tok = AutoTokenizer.from_pretrained(a.target)
    ids: list[int] = []
    for text in read_corpus([paths.data_file("heldout.jsonl")]):
        ids += tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= max(a.sizes) + a.reps:
            break
    redis_server = RedisServer()
    url = redis_server.url
    rows = []
    try:
        with ServerProcess(a.maps_dir, redis_url=url, prefix_secret=secret, prefix_block_size=a.prefix_block) as sc:
            common = {"redis_url": url, "prefix_secret": secret, "prefix_block_size": a.prefix_block}
            consumer = {**common, "sidecar": sc.address, "map_name": a.map, "map_version": a.version, "refresh": a.refresh}
            with EngineProcess(a.target, "kv_consumer", consumer) as target, EngineProcess(a.source, "kv_producer", common) as source:
                target.batch([ids[1000:1300]], 1)  # warm-up
                for n in a.sizes:
                    prompts = [ids[i : i + n] for i in range(a.reps)]  # distinct prompts: no reuse between reps
                    own = target.batch(prompts, 1)
                    source.batch(prompts, 1)  # S reads them (it would anyway) and publishes their KV
                    mapped = target.batch(prompts, 1)
                    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
                    row = {"n": n, "vllm_full_prefill_ttft_ms": med(own, "ttft_s") * 1e3,
                           "vllm_kvferry_ttft_ms": med(mapped, "ttft_s") * 1e3,
                           "cached_tokens": med(mapped, "num_cached_tokens"), "prefill_tokens_without": n,
                           "first_token_agree": sum(x["tokens"][0] == y["tokens"][0] for x, y in zip(own, mapped)) / len(own)}
                    row["speedup"] = row["vllm_full_prefill_ttft_ms"] / row["vllm_kvferry_ttft_ms"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        redis_server.stop()
    hf = {}
    hf_json = Path(a.hf_json)
    if hf_json.exists():
        hf = {r["n"]: r for r in json.loads(hf_json.read_text())["rows"]}
    lines = [f"map {a.map} {a.version or '(newest)'}; vLLM CPU, float32, block size from the engine; prefix blocks of "
             f"{a.prefix_block}; r >= {a.refresh}; medians of {a.reps} prompts",
             "", "| n | vLLM T own prefill TTFT ms | vLLM T + kvferry TTFT ms | speedup | prompt tokens loaded | "
                 "first token agrees | HF path (bench translate) full / translate ms |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        h = hf.get(r["n"])
        hf_cell = f"{h['full_prefill_ms']:.0f} / {h['translate_path_ttft_ms']:.0f}" if h else "—"
        lines.append(f"| {r['n']} | {r['vllm_full_prefill_ttft_ms']:.1f} | {r['vllm_kvferry_ttft_ms']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['cached_tokens']:.0f} of {r['n']} | {r['first_token_agree']:.2f} | {hf_cell} |")
    print("\n".join(lines))
    if a.json:
        Path(a.json).write_text(json.dumps({"map": a.map, "rows": rows}, indent=1) + "\n")
    return 0


def add_parser(sub) -> None:
    b = sub.add_parser("vllm", help="vLLM TTFT with the kvferry connector vs without (needs vLLM)")
    b.add_argument("--source", type=model_path, default=paths.model_dir("S"))
    b.add_argument("--target", type=model_path, default=paths.model_dir("T"))
    b.add_argument("--maps-dir", type=Path, default=paths.maps_dir())
    b.add_argument("--map", default="S__T")
    b.add_argument("--version", default="")
    b.add_argument("--sizes", type=int, nargs="+", default=[2048, 8000])
    b.add_argument("--reps", type=int, default=3)
    b.add_argument("--refresh", type=int, default=16)
    b.add_argument("--prefix-block", type=int, default=256)
    b.add_argument("--hf-json", default="runs/results/bench_translate.json", help="bench translate results to show beside")
    b.add_argument("--json", default=None)
    b.set_defaults(func=run)
