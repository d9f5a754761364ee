"""Property-based fuzz of the request decoder and validation against a real sidecar: any stream of
messages gets an answer or a proper status code; nothing crashes or hangs, and the server stays up."""

import collections
import json
import os
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry.mappings.artifact import save
from kvferry.mappings.fit import identity_mapset
from kvferry.v1 import translate_pb2 as pb
from kvferry.v1 import translate_pb2_grpc as pb_grpc

ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE}

small = st.integers(min_value=0, max_value=40)
names = st.sampled_from(["S__S-self", "", "nope", "../x", "S__S-self\x00"])
dtypes = st.sampled_from([0, 1, 2, 3, 7])

header = st.builds(
    lambda name, version, latest, n, start, ids, dt, layout, bs, tdt, key, tenant: pb.TranslateRequest(header=pb.TranslateHeader(
        map=pb.MapRef(name=name, version=version) if not latest else pb.MapRef(name=name, latest=True),
        num_tokens=n, start_position=start, token_ids=ids, source_dtype=dt, layout=layout, block_size=bs,
        target_dtype=tdt, prefix_key=key, tenant=tenant)),
    names, st.sampled_from(["1.0.0", "", "9.9.9", "x"]), st.booleans(), small, st.integers(0, 10000),
    st.lists(st.integers(0, 5000), max_size=40), dtypes, st.sampled_from([0, 1, 2, 5]), st.integers(0, 64), dtypes,
    st.sampled_from(["", "abc", "0" * 64]), st.sampled_from(["", "t", "bad/tenant"]))


@st.composite
def chunk(draw):
    heads, tokens, dim = draw(st.integers(0, 3)), draw(st.integers(0, 6)), draw(st.sampled_from([0, 16, 32]))
    dt = draw(dtypes)
    size = heads * tokens * dim * {1: 4, 2: 2, 3: 2}.get(dt, 1) + draw(st.sampled_from([0, 0, 0, -1, 3]))
    start = draw(st.integers(0, 10))
    return pb.TranslateRequest(chunk=pb.SourceChunk(
        layer=draw(st.integers(0, 5)), kind=draw(st.integers(0, 3)), token_start=start,
        token_end=max(0, start + draw(st.integers(-1, 6))), tensor=pb.Tensor(dtype=dt, shape=[heads, tokens, dim], data=b"\x01" * max(0, size))))


def _valid_stream(tokens: int, chunk_tokens: int, layout: int, seed: int) -> list:
    from kvferry.client.client import encode_requests, make_spec

    from conftest import make_kv

    kv = make_kv(layers=4, tokens=tokens, heads=2, head_dim=32, seed=seed)
    return list(encode_requests(make_spec(kv, "S__S-self", layout="paged" if layout == 2 else "contiguous", block_size=4),
                                kv, chunk_tokens))


@st.composite
def near_valid(draw):
    """A well-formed stream, then up to two mutations: the decoder's deeper paths, and some streams that succeed."""
    msgs = _valid_stream(draw(st.integers(1, 16)), draw(st.integers(1, 16)), draw(st.sampled_from([1, 2])), draw(st.integers(0, 3)))
    for _ in range(draw(st.integers(0, 2))):
        op, i = draw(st.sampled_from(["drop", "dup", "swap", "bytes", "layer", "range", "dtype", "kind", "header"])), \
            draw(st.integers(0, len(msgs) - 1))
        m = pb.TranslateRequest()
        m.CopyFrom(msgs[i])
        c = m.chunk
        if op == "drop":
            msgs.pop(i)
        elif op == "dup":
            msgs.insert(i, m)
        elif op == "swap":
            j = draw(st.integers(0, len(msgs) - 1))
            msgs[i], msgs[j] = msgs[j], msgs[i]
        elif m.WhichOneof("msg") == "chunk":
            if op == "bytes":
                c.tensor.data = c.tensor.data[: draw(st.integers(0, max(0, len(c.tensor.data) - 1)))]
            elif op == "layer":
                c.layer = draw(st.integers(0, 9))
            elif op == "range":
                c.token_end = max(0, c.token_start + draw(st.integers(-1, 20)))
            elif op == "dtype":
                c.tensor.dtype = draw(st.sampled_from([0, 2, 3, 9]))
            elif op == "kind":
                c.kind = draw(st.sampled_from([0, 1, 2, 5]))
            if op == "header":
                msgs.insert(i, msgs[0])  # a second header mid-stream
            else:
                msgs[i] = m
    return msgs


streams = st.one_of(st.lists(chunk(), max_size=3),
                    st.tuples(header, st.lists(st.one_of(chunk(), header), max_size=8)).map(lambda t: [t[0], *t[1]]),
                    near_valid())


CASES = int(os.environ.get("KVFERRY_FUZZ_CASES", "300"))  # `make fuzz` runs 10,000
OUTCOMES: collections.Counter = collections.Counter()


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, family):
    from conftest import RunningSidecar

    root = tmp_path_factory.mktemp("fuzzmaps")
    save(identity_mapset(family["S"].identity, version="1.0.0"), root)
    sc = RunningSidecar(maps_dir=str(root), force_maps=True, max_tokens=32)
    ch = grpc.insecure_channel(sc.address)
    yield sc, pb_grpc.TranslateServiceStub(ch)
    report = os.environ.get("KVFERRY_FUZZ_REPORT")
    if report:
        Path(report).parent.mkdir(parents=True, exist_ok=True)
        Path(report).write_text(json.dumps({"cases": sum(OUTCOMES.values()), "outcomes": dict(OUTCOMES),
                                            "internal_errors": OUTCOMES.get("INTERNAL", 0)}, indent=1) + "\n")
    ch.close()
    sc.stop()


@settings(max_examples=CASES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(streams)
def test_any_stream_gets_an_answer_or_a_proper_status(fuzz_server, msgs):
    sc, stub = fuzz_server
    try:
        out = list(stub.Translate(iter(msgs), timeout=10))
        OUTCOMES["OK"] += 1
        assert out and out[-1].WhichOneof("msg") == "trailer"
    except grpc.RpcError as e:
        OUTCOMES[e.code().name] += 1
        assert e.code() in ALLOWED, (e.code(), e.details())
        assert e.details()  # every rejection says what was wrong
