"""Run one vLLM engine (optionally with the kvferry connector) and serve batches over stdin/stdout.

    python -m kvferry.bench.vllm_driver --model models/T --role kv_consumer --extra '{"sidecar": …}'

Prints ``{"ready": true, "block_size": …}`` once the engine is up, then for each JSON line on stdin
(``{"prompts": [[ids…], …], "max_tokens": 8}``) one JSON line with, per prompt, the generated token
ids, the first token's top logprobs, the prompt tokens served from cache (``num_cached_tokens``:
vLLM's own count, external loads included) and the time to first token. A job with ``"together": true``
submits its prompts at once and gives each one's time from submission to its first token (the engine's
step loop, timestamped per request). Each engine lives in its own
process because vLLM keeps the KV connector in a process-wide singleton.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time


class EngineProcess:
    """Start a driver process and talk to it: ``batch(prompts)`` -> per-prompt results."""

    def __init__(
        self,
        model: str,
        role: str = "none",
        extra: dict | None = None,
        env: dict | None = None,
        max_model_len: int = 8192,
        max_num_batched_tokens: int | None = None,
        log=None,
        dtype: str = "float32",
    ):
        """``log``: a file path the engine's stderr goes to (default: this process's stderr); ``dtype``: the
        engine's weights and KV cache ("float32", "bfloat16")."""
        import subprocess

        cmd = [
            sys.executable,
            "-m",
            "kvferry.bench.vllm_driver",
            "--model",
            str(model),
            "--role",
            role,
            "--extra",
            json.dumps(extra or {}),
            "--max-model-len",
            str(max_model_len),
            "--dtype",
            dtype,
        ]
        if max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        with open(log, "w") if log else contextlib.nullcontext() as err:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env={**os.environ, **(env or {})},
            )
        self.info = self._read()

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the vLLM driver exited (code {self.proc.wait()}); see its stderr")
            if line.startswith("{"):
                return json.loads(line)

    def batch(self, prompts: list[list[int]], max_tokens: int = 8) -> list[dict]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()["results"]

    def together(self, prompts: list[list[int]]) -> list[dict]:
        """Submit the prompts at once: each one's time from submission to its first token."""
        self.proc.stdin.write(json.dumps({"prompts": prompts, "together": True}) + "\n")
        self.proc.stdin.flush()
        return self._read()["results"]

    def peak_rss_mb(self) -> float:
        """The engine's peak resident memory so far: VmHWM summed over the driver and the processes it started
        (vLLM's engine core runs in its own), in MB."""
        import re
        from pathlib import Path

        total, todo = 0.0, [self.proc.pid]
        while todo:
            pid = todo.pop()
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:  # it exited meanwhile
                continue
            m = re.search(r"VmHWM:\s+(\d+)", status)
            total += int(m.group(1)) / 1024 if m else 0.0
        return total

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except Exception:
                self.proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--role", choices=["none", "kv_producer", "kv_consumer", "kv_both"], default="none")
    ap.add_argument("--extra", default="{}", help="kv_connector_extra_config as JSON")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="below the prompt length: chunked prefill")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    _log_to_stderr()
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.config import KVTransferConfig

    kw = {}
    if a.role != "none":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvferryConnector",
            kv_role=a.role,
            kv_connector_module_path="kvferry.client.vllm_connector",
            kv_connector_extra_config=json.loads(a.extra),
        )
    if a.block_size:
        kw["block_size"] = a.block_size
    llm = LLM(
        model=a.model,
        dtype=a.dtype,
        max_model_len=a.max_model_len,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_num_batched_tokens=a.max_num_batched_tokens or a.max_model_len,
        seed=0,
        **kw,
    )
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    print(json.dumps({"ready": True, "block_size": block_size}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("together"):
            print(json.dumps({"results": _together(llm, job["prompts"], SamplingParams, TokensPrompt)}), flush=True)
            continue
        params = SamplingParams(temperature=0.0, max_tokens=job.get("max_tokens", 8), logprobs=5)
        out = []
        for ids in job["prompts"]:  # one at a time: a clean TTFT per prompt
            first = SamplingParams(temperature=0.0, max_tokens=1)
            t0 = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=ids)], first, use_tqdm=False)
            ttft = time.perf_counter() - t0
            res = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
            comp = res.outputs[0]
            top = comp.logprobs[0] if comp.logprobs else {}
            out.append(
                {
                    "tokens": list(comp.token_ids),
                    "num_cached_tokens": res.num_cached_tokens,
                    "ttft_s": ttft,
                    "top_logprobs": {str(t): lp.logprob for t, lp in top.items()},
                }
            )
        print(json.dumps({"results": out}), flush=True)


def _log_to_stderr() -> None:
    """vLLM's and the connector's INFO lines on stderr, in every process vLLM starts (stdout carries the JSON
    lines): vLLM reads a logging dictConfig from the file VLLM_LOGGING_CONFIG_PATH names, in each of its processes."""
    import tempfile

    handler = {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "plain"}
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s %(name)s: %(message)s"}},
        "handlers": {"stderr": handler},
        "loggers": {
            name: {"handlers": ["stderr"], "level": "INFO", "propagate": False} for name in ("vllm", "kvferry")
        },
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="kvferry-vllm-logging-", delete=False) as f:
        json.dump(config, f)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = f.name


def _together(llm, prompts: list[list[int]], SamplingParams, TokensPrompt) -> list[dict]:
    """Submit every prompt at once; each one's time to its first token, from submission (max_tokens 1)."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=1)
    t0 = time.perf_counter()
    ids = [f"together-{t0}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=p), params)
    first: dict[str, float] = {}
    cached: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in first and out.outputs and out.outputs[0].token_ids:
                first[out.request_id] = time.perf_counter() - t0
                cached[out.request_id] = out.num_cached_tokens or 0
    return [{"ttft_s": first[r], "num_cached_tokens": cached[r]} for r in ids]


if __name__ == "__main__":
    main()
