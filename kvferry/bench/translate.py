"""``kvferry bench translate``: TTFT of the translate path against the target's own prefill.

Measured side by side in one run, per prompt length n, medians over ``--reps``:
  (a) target full prefill to the first token;
  (b) translate path to the first token: the source cache (which the source computed anyway) goes
      through the sidecar over loopback gRPC, is imported into the target's HF cache, the target
      recomputes the last r tokens and produces the first token;
  (c) the map applied in-process (no transport);
  (d) a raw gRPC echo of the same request bytes (the transport's limit) on the same kind of server;
  (f) the translate RPC with a response region (kvferry.v1 SharedRegion): the target blocks' bytes written into a
      file on /dev/shm that this process maps, the messages carrying only where (a client sharing a memory volume
      with its sidecar, as in the chart's podSidecar mode), against the same bound;
  (e) the sidecar's own compute time for one of the translations (its trailer's compute_seconds): the same map
      as (c), timed inside the sidecar while the bytes stream in and out; (e) > (c) means the map runs slower
      there than alone (not only from sharing the cores with the transfer);
  (g) the bound of the translate path: (c) plus the target's refresh of the last r tokens over the mapped cache,
      in-process (no transport, no import); a/g is the most (b) could gain;
  (h) the cascade, for a router that has not yet run the source: the source's own prefill of the prompt, then (b);
      a/h is what that router sees.
Every forward pass computes logits for the last position only (``logits_to_keep=1``), as a serving engine does.
The sidecar's peak resident memory (VmHWM of its process) is printed with the map loaded and every size served.
The sidecar and the echo service run in their own process (``kvferry.bench.server``), as in production.
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
    import torch

    from kvferry.client.attention import IMPLEMENTATION, use_folded_gqa
    from kvferry.client.client import (
        ClientOptions,
        SharedMemory,
        TranslateClient,
        chunk_tokens_for,
        encode_requests,
        make_spec,
    )
    from kvferry.client.importers import to_dynamic_cache
    from kvferry.mappings.apply import apply
    from kvferry.mappings.artifact import MapSet
    from kvferry.mappings.lab.capture import capture_kv, load_model
    from kvferry.quiet import quiet_transformers
    from kvferry.sidecar.compute import ComputeThread

    from .harness import ServerProcess, long_ids, median_seconds, paired_ratio, round_robin_ms, shm_folder, spread

    quiet_transformers()
    torch.set_num_threads(a.threads or torch.get_num_threads())
    source, target = load_model(a.source), load_model(a.target)
    if a.attention == IMPLEMENTATION:  # both arms: it changes only attention over a cache (the full prefill has none)
        use_folded_gqa(target.model)
    name = f"{source.identity.name}__{target.identity.name}"
    r = a.refresh
    rows = []
    ms: MapSet
    ms, served = bench_map(a.maps_dir, name, a.version, a.serve_refused_maps)
    laned = ComputeThread(a.map_threads or torch.get_num_threads())  # the sidecar's default: as many as torch's threads
    with (
        shm_folder() as shm,
        ServerProcess(
            a.maps_dir, a.threads or 0, map_threads=a.map_threads, shm_dir=shm, serve_refused_maps=served is not None
        ) as echo,
    ):
        with (
            TranslateClient(ClientOptions(target=echo.address, chunk_tokens=a.chunk_tokens, timeout=300)) as client,
            TranslateClient(
                ClientOptions(
                    target=echo.address, chunk_tokens=a.chunk_tokens, timeout=300, shared_memory=SharedMemory(dir=shm)
                )
            ) as shared,
        ):
            for n in a.sizes:
                ids = long_ids(target.tokenizer, n)
                with torch.no_grad():
                    src = capture_kv(source.model, ids[:, : n - r])
                kw = dict(source_geometry=source.identity.geometry.fingerprint, tokenizer=source.identity.tokenizer)

                @torch.no_grad()
                def full():
                    return int(target.model(input_ids=ids, logits_to_keep=1).logits[0, -1].argmax())

                @torch.no_grad()
                def source_prefill():
                    return capture_kv(source.model, ids[:, : n - r])

                mapped_here = [(k.contiguous(), v.contiguous()) for k, v in apply(ms, src, 0)]

                @torch.no_grad()
                def refresh():
                    cache = to_dynamic_cache(mapped_here, target.model.config, dtype=target.model.dtype)
                    return int(
                        target.model(input_ids=ids[:, n - r :], past_key_values=cache, logits_to_keep=1)
                        .logits[0, -1]
                        .argmax()
                    )

                state = {}

                wire = getattr(torch, a.wire_dtype)

                @torch.no_grad()
                def translate_path():
                    sent = src if wire == torch.float32 else [(k.to(wire), v.to(wire)) for k, v in src]
                    res = client.translate(sent, ms.name, ms.version, **kw)
                    cache = to_dynamic_cache(res.layers(), target.model.config, dtype=target.model.dtype)
                    state["res"] = res
                    return int(
                        target.model(input_ids=ids[:, n - r :], past_key_values=cache, logits_to_keep=1)
                        .logits[0, -1]
                        .argmax()
                    )

                @torch.no_grad()
                def in_process():
                    return apply(ms, src, 0)

                def in_lanes():  # as the sidecar maps: fed from a one-core thread, in map_threads token lanes
                    return laned.submit(torch.no_grad()(apply), ms, src, 0, 0, laned.lanes).result()

                wire_src = src if wire == torch.float32 else [(k.to(wire), v.to(wire)) for k, v in src]
                payloads = [
                    m.SerializeToString()
                    for m in encode_requests(
                        make_spec(wire_src, ms.name, ms.version, **kw),
                        wire_src,
                        chunk_tokens_for(client.options, wire_src),
                    )
                ]
                full(), translate_path(), in_process(), in_lanes(), echo.roundtrip(payloads)  # warm-up
                assert shared.translate(wire_src, ms.name, ms.version, **kw).info.response_region, "region not taken"
                t_full = median_seconds(full, a.reps)
                t_path = median_seconds(translate_path, a.reps)
                t_source = median_seconds(source_prefill, a.reps)
                t_refresh = median_seconds(refresh, a.reps)
                st = state["res"].stats
                req_bytes = sum(len(p) for p in payloads)
                # taken in turn within each round, so the machine's drift hits the RPC and its bound alike
                times = round_robin_ms(
                    {
                        "apply_pool": in_process,
                        "apply_lanes": in_lanes,
                        "echo": lambda: echo.roundtrip(payloads),
                        "rpc": lambda: client.translate(wire_src, ms.name, ms.version, **kw),
                        "rpc_region": lambda: shared.translate(wire_src, ms.name, ms.version, **kw),
                    },
                    a.reps,
                )
                # the bound's map: the faster of torch's own pool and the sidecar's lanes, in each round
                times["apply"] = [min(p, q) for p, q in zip(times["apply_pool"], times["apply_lanes"])]
                t_pool, t_lanes, t_echo, t_rpc, t_region, _t_apply = (
                    statistics.median(t) / 1e3 for t in times.values()
                )
                row = {
                    "n": n,
                    "refresh": r,
                    "full_prefill_ms": t_full * 1e3,
                    "translate_path_ttft_ms": t_path * 1e3,
                    "speedup": t_full / t_path,
                    "apply_in_process_ms": min(t_pool, t_lanes) * 1e3,
                    "apply_torch_pool_ms": t_pool * 1e3,
                    "apply_lanes_ms": t_lanes * 1e3,
                    "translate_rpc_ms": t_rpc * 1e3,
                    "echo_ms": t_echo * 1e3,
                    "sidecar_compute_ms": st.compute_seconds * 1e3,
                    "bytes_in": st.bytes_in,
                    "bytes_out": st.bytes_out,
                    "translate_MiB_s": (st.bytes_in + st.bytes_out) / t_rpc / 2**20,
                    "echo_MiB_s": 2 * req_bytes / t_echo / 2**20,
                }
                row["throughput_vs_echo"] = row["translate_MiB_s"] / row["echo_MiB_s"]
                row["rpc_serial_bound_ms"] = (
                    row["apply_in_process_ms"] + row["echo_ms"]
                )  # the map's arithmetic + moving the bytes
                row["rpc_vs_bound"] = row["rpc_serial_bound_ms"] / row["translate_rpc_ms"]
                row["rpc_vs_bound_paired"] = paired_ratio(times, ("apply", "echo"), ("rpc",))  # within each round
                row["translate_rpc_region_ms"] = t_region * 1e3  # (f)
                row["rpc_region_vs_bound"] = row["rpc_serial_bound_ms"] / row["translate_rpc_region_ms"]
                row["rpc_region_vs_bound_paired"] = paired_ratio(times, ("apply", "echo"), ("rpc_region",))
                row["refresh_ms"] = t_refresh * 1e3
                row["path_bound_ms"] = row["apply_in_process_ms"] + row["refresh_ms"]  # (g)
                row["speedup_bound"] = row["full_prefill_ms"] / row["path_bound_ms"]
                row["source_prefill_ms"] = t_source * 1e3
                row["cascade_ttft_ms"] = row["source_prefill_ms"] + row["translate_path_ttft_ms"]  # (h)
                row["cascade_speedup"] = row["full_prefill_ms"] / row["cascade_ttft_ms"]
                rows.append(row)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        peak_mb = echo.peak_rss_mb()
    table = [
        *([banner(served), ""] if served else []),
        f"map {name} {ms.version}; sidecar peak RSS {peak_mb:.0f} MB; torch threads {torch.get_num_threads()}; "
        f"map_threads {laned.lanes.parts if laned.lanes else 1}; medians of {a.reps} "
        f"(both applies, echo, RPC and (f) taken in turn each round); r={r}; wire {a.wire_dtype}; "
        f"target attention {target.model.config._attn_implementation}; (c) is the faster of torch's pool and the "
        "sidecar's lanes",
        "",
        "| n | (a) full prefill ms | (b) translate path TTFT ms | a/b | (g) bound: apply + refresh ms | a/g | "
        "(h) cascade: source prefill + (b) ms | a/h | (c) apply in-process ms: torch pool / lanes | translate RPC ms "
        "| (d) echo ms | "
        "RPC serial bound (c)+(d) ms | bound/RPC | per round: median [quartiles] | (f) RPC, response region ms | "
        "bound/(f) | "
        "per round: median [quartiles] | (e) sidecar compute ms | translate MiB/s | echo MiB/s | translate/echo |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in rows:
        table.append(
            f"| {w['n']} | {w['full_prefill_ms']:.1f} | {w['translate_path_ttft_ms']:.1f} | {w['speedup']:.2f}x | "
            f"{w['path_bound_ms']:.1f} | {w['speedup_bound']:.2f}x | {w['cascade_ttft_ms']:.1f} | "
            f"{w['cascade_speedup']:.2f}x | "
            f"{w['apply_torch_pool_ms']:.1f} / {w['apply_lanes_ms']:.1f} | {w['translate_rpc_ms']:.1f} | "
            f"{w['echo_ms']:.1f} | "
            f"{w['rpc_serial_bound_ms']:.1f} | {w['rpc_vs_bound']:.2f} | {spread(w['rpc_vs_bound_paired'])} | "
            f"{w['translate_rpc_region_ms']:.1f} | {w['rpc_region_vs_bound']:.2f} | "
            f"{spread(w['rpc_region_vs_bound_paired'])} | "
            f"{w['sidecar_compute_ms']:.1f} | "
            f"{w['translate_MiB_s']:.0f} | {w['echo_MiB_s']:.0f} | {w['throughput_vs_echo']:.2f} |"
        )
    print("\n".join(table))
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "map": name,
                    "version": ms.version,
                    "refused_map_served": served,
                    "attention": target.model.config._attn_implementation,
                    "sidecar_peak_rss_mb": peak_mb,
                    "reps": a.reps,
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


def add_parser(sub) -> None:
    b = sub.add_parser("translate", help="TTFT: translate path vs full prefill, apply, gRPC echo")
    b.add_argument("--source", type=model_path, default=paths.model_dir("S"))
    b.add_argument("--target", type=model_path, default=paths.model_dir("T"))
    b.add_argument("--maps-dir", type=Path, default=paths.maps_dir())
    b.add_argument("--version", default="")
    add_flag(b)
    b.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 8192])
    b.add_argument("--refresh", type=int, default=16)
    b.add_argument("--reps", type=int, default=5)
    b.add_argument(
        "--chunk-tokens",
        type=int,
        default=0,
        help="tokens per source chunk (0: the client's default, about 2 MiB of one layer's K or V)",
    )
    b.add_argument("--threads", type=int, default=None)
    b.add_argument(
        "--map-threads",
        type=int,
        default=0,
        help="the sidecar's map_threads (0: torch's threads; 1: the compute thread on torch's own pool)",
    )
    b.add_argument(
        "--wire-dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="dtype of the KV on the wire (the source cache is converted inside the timed path)",
    )
    b.add_argument(
        "--attention",
        choices=["sdpa", "kvferry_sdpa"],
        default="sdpa",
        help="the target's attention: transformers' sdpa (what the Cascade uses by default) or kvferry_sdpa "
        "(grouped-query attention over the imported cache without per-head copies; Cascade(fold_gqa=True))",
    )
    b.add_argument("--json", default=None)
    b.set_defaults(func=run)
