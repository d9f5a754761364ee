"""Issue 16: the sidecar's share of a key-only hit, stripped layer by layer. One sidecar process (its MGET answered from
memory: hit_ab.py's no_get variant) serves TranslateByKey and, beside it, stripped copies of the same call; all are
called in turn (round robin), medians:

  client   TranslateClient.translate (spec, header, the call, every message decoded in place)
  bare     the same TranslateByKey call, its request serialised beforehand, the answer's bytes only counted
  work     an async-generator handler doing the hit's work (request parsed, flow.open: hashes, blob checks, session;
           blocks encoded) and yielding the messages: no servicer (no stream slot, deadlines, _Sender task per write)
  inline   work, with the store read and the session run on the event loop (no thread hand-offs)
  parsed   the request parsed (the sidecar's decoder and spec), then the hit's messages replayed from memory
  canned   the request's bytes taken unparsed, the hit's messages replayed from memory
  floor+2  the gRPC floor of the hit's message sizes (Replay, a 4-byte-per-message request)

bare - work is the servicer's machinery, work - inline the thread hand-offs, inline - parsed the hit's work in the
handler, parsed - canned the request's parse, canned - floor+2 the request's size.

    .venv/bin/python scripts/research/hit_strip.py --sizes 272 2048 8192 --reps 31 --json runs/results/hit_strip.json
"""

from __future__ import annotations

import statistics

from hit_ab import VARIANTS  # scripts/research/hit_ab.py (beside this script)
from hit_setup import BS, SECRET, bench_pair, hit_args  # scripts/research/hit_setup.py (beside this script)
from kvferry import paths
from kvferry.bench.harness import RedisServer, ServerProcess, published_prefix, round_robin_ms, write_json
from kvferry.client.client import BY_KEY_METHOD, ClientOptions, TranslateClient, make_spec
from kvferry.common import wire
from kvferry.common.stores import RedisStore
from kvferry.v1 import translate_pb2 as pb

STRIP = '''
import concurrent.futures as cf, dataclasses, grpc
import kvferry.sidecar.flow as fl
from kvferry.bench import server as bs
from kvferry.common import wire
from kvferry.sidecar.auth import tenant_for
from kvferry.sidecar.limits import by_key_decoder
from kvferry.v1 import translate_pb2 as pb
Real = bs.Sidecar
class Strip(Real):
    def __init__(self, cfg, extra_handlers=()):
        super().__init__(cfg, extra_handlers)
        flow, canned = self.servicer.flow, {}
        async def hit(request):
            spec = dataclasses.replace(wire.spec_from_pb(request.header), tenant=tenant_for(request.header.tenant))
            opened = await flow.open(spec)
            g = opened.ms.target.geometry
            yield wire.info_to_pb(opened.session.info(), g.rope.rope_type, g.rope.theta).SerializeToString()
            for b in opened.initial:
                yield wire.encode_block_response(b)
            yield wire.stats_to_pb(flow.finish(opened)).SerializeToString()
        async def work(request, context):
            async for m in hit(request):
                yield m
        class Inline:
            def submit(self, fn, *a):
                done = cf.Future()
                done.set_result(fn(*a))
                return done
        async def inline(request, context):
            spec = dataclasses.replace(wire.spec_from_pb(request.header), tenant=tenant_for(request.header.tenant))
            ms = flow.registry.resolve(spec.map_name, spec.map_version)
            session, initial, cached = flow.prefix.from_store(spec, ms, flow.limits, Inline())
            opened = fl.Opened(session, ms, None, cached, initial)
            g = ms.target.geometry
            yield wire.info_to_pb(session.info(), g.rope.rope_type, g.rope.theta).SerializeToString()
            for b in initial:
                yield wire.encode_block_response(b)
            yield wire.stats_to_pb(flow.finish(opened)).SerializeToString()
        async def load(request: bytes, context):
            parsed_request = pb.TranslateByKeyRequest.FromString(request)
            canned[request] = canned[parsed_request.header.prefix_key] = [m async for m in hit(parsed_request)]
            return b""
        async def parsed(request, context):
            wire.spec_from_pb(request.header), tenant_for(request.header.tenant)
            for m in canned[request.header.prefix_key]:  # found by its key: no serialising it again
                yield m
        async def replay(request: bytes, context):
            for m in canned[request]:
                yield m
        decode = by_key_decoder(self.servicer.limits, pb.TranslateByKeyRequest.FromString)
        self.extra_handlers = (*self.extra_handlers, grpc.method_handlers_generic_handler("kvferry.bench.Strip", {
            "Load": grpc.unary_unary_rpc_method_handler(load),
            "Work": grpc.unary_stream_rpc_method_handler(work, request_deserializer=decode),
            "Inline": grpc.unary_stream_rpc_method_handler(inline, request_deserializer=decode),
            "Parsed": grpc.unary_stream_rpc_method_handler(parsed, request_deserializer=decode),
            "Canned": grpc.unary_stream_rpc_method_handler(replay)}),)
bs.Sidecar = Strip
''' + VARIANTS["no_get"]


def main() -> None:
    a = hit_args(reps=31)
    ms, source, target = bench_pair()
    redis_server, results = RedisServer(), {}
    try:
        with ServerProcess(paths.maps_dir(), code=STRIP, redis_url=redis_server.url, prefix_secret=SECRET.decode(),
                           prefix_block_size=BS) as sc, TranslateClient(ClientOptions(target=sc.address, timeout=300)) as client:
            stub = {m: sc.channel.unary_stream(f"/kvferry.bench.Strip/{m}") for m in ("Work", "Inline", "Parsed", "Canned")}
            bare, load = sc.channel.unary_stream(BY_KEY_METHOD), sc.channel.unary_unary("/kvferry.bench.Strip/Load")
            for n in a.sizes:
                _, _, kw = published_prefix(source, target, ms, RedisStore(redis_server.url), SECRET, n, BS)
                client.translate(None, ms.name, ms.version, **kw)  # the miss: maps and stores
                request = wire.spec_to_pb(make_spec(None, ms.name, ms.version, **kw), pb.TranslateByKeyRequest).SerializeToString()
                load(request, timeout=60)
                sizes = [len(m) for m in stub["Canned"](request, timeout=60)]
                count = lambda call: sum(len(m) for m in call(request, timeout=60))  # noqa: E731
                calls = {"client": lambda: client.translate(None, ms.name, ms.version, **kw), "bare": lambda: count(bare),
                         **{m.lower(): (lambda s=s: count(s)) for m, s in stub.items()}, "floor+2": lambda: sc.replay(sizes)}
                times = round_robin_ms(calls, a.reps)
                med = {v: statistics.median(t) for v, t in times.items()}
                steps = {"client's own": med["client"] - med["bare"], "servicer": med["bare"] - med["work"],
                         "thread hand-offs": med["work"] - med["inline"], "hit work": med["inline"] - med["parsed"],
                         "request parse": med["parsed"] - med["canned"], "request size": med["canned"] - med["floor+2"]}
                results[n] = {"median_ms": med, "steps_ms": steps, "request_bytes": len(request), "messages": len(sizes)}
                print(f"n={n}: " + " | ".join(f"{v} {m:.2f}" for v, m in med.items()) + " ms; " +
                      " | ".join(f"{k} {v:.2f}" for k, v in steps.items()), flush=True)
    finally:
        redis_server.stop()
    write_json(a.json, results)


if __name__ == "__main__":
    main()
