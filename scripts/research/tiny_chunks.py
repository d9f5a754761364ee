"""One-token chunks sent layer by layer through a real sidecar (S__T 1.0.0): time per prompt length.

    PYTHONPATH=tests .venv/bin/python scripts/research/tiny_chunks.py
"""
import time, grpc, sys
sys.path.insert(0, "tests")  # conftest: make_kv, RunningSidecar
from conftest import make_kv, RunningSidecar
from kvferry.client.client import encode_requests, make_spec
from kvferry.v1 import translate_pb2_grpc as pb_grpc
sc = RunningSidecar(maps_dir="maps", max_stream_seconds=600)
for n in (512, 1024, 2048):
    kv = make_kv(layers=4, tokens=n, heads=2, head_dim=32)
    reqs = list(encode_requests(make_spec(kv, "S__T", "1.0.0"), kv, 1, order="layers"))
    t0 = time.perf_counter()
    with grpc.insecure_channel(sc.address, [("grpc.max_receive_message_length", 64 << 20)]) as ch:
        out = list(pb_grpc.TranslateServiceStub(ch).Translate(iter(reqs), timeout=600))
    print(n, f"{time.perf_counter() - t0:.1f}s", len(reqs), "messages", len(out), "responses", flush=True)
sc.stop()
