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
from kvferry.mappings.lab.fit import identity_mapset
from kvferry.v1 import translate_pb2 as pb
from kvferry.v1 import translate_pb2_grpc as pb_grpc

ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.UNAVAILABLE,
}

small = st.integers(min_value=0, max_value=40)
names = st.sampled_from(["S__S-self", "", "nope", "../x", "S__S-self\x00"])
dtypes = st.sampled_from([0, 1, 2, 3, 7])

header = st.builds(
    lambda name, version, latest, n, start, ids, dt, layout, bs, tdt, key, tenant: pb.TranslateRequest(
        header=pb.TranslateHeader(
            map=pb.MapRef(name=name, version=version) if not latest else pb.MapRef(name=name, latest=True),
            num_tokens=n,
            start_position=start,
            token_ids=ids,
            source_dtype=dt,
            layout=layout,
            block_size=bs,
            target_dtype=tdt,
            prefix_key=key,
            tenant=tenant,
        )
    ),
    names,
    st.sampled_from(["1.0.0", "", "9.9.9", "x"]),
    st.booleans(),
    small,
    st.integers(0, 10000),
    st.lists(st.integers(0, 5000), max_size=40),
    dtypes,
    st.sampled_from([0, 1, 2, 5]),
    st.integers(0, 64),
    dtypes,
    st.sampled_from(["", "abc", "0" * 64]),
    st.sampled_from(["", "t", "bad/tenant"]),
)


@st.composite
def chunk(draw):
    heads, tokens, dim = draw(st.integers(0, 3)), draw(st.integers(0, 6)), draw(st.sampled_from([0, 16, 32]))
    dt = draw(dtypes)
    size = heads * tokens * dim * {1: 4, 2: 2, 3: 2}.get(dt, 1) + draw(st.sampled_from([0, 0, 0, -1, 3]))
    start = draw(st.integers(0, 10))
    return pb.TranslateRequest(
        chunk=pb.SourceChunk(
            layer=draw(st.integers(0, 5)),
            kind=draw(st.integers(0, 3)),
            token_start=start,
            token_end=max(0, start + draw(st.integers(-1, 6))),
            tensor=pb.Tensor(dtype=dt, shape=[heads, tokens, dim], data=b"\x01" * max(0, size)),
        )
    )


def _valid_stream(tokens: int, chunk_tokens: int, layout: int, seed: int) -> list:
    from conftest import make_kv

    from kvferry.client.client import encode_requests, make_spec

    kv = make_kv(layers=4, tokens=tokens, heads=2, head_dim=32, seed=seed)
    return list(
        encode_requests(
            make_spec(kv, "S__S-self", layout="paged" if layout == 2 else "contiguous", block_size=4), kv, chunk_tokens
        )
    )


@st.composite
def near_valid(draw):
    """A well-formed stream, then up to two mutations: the decoder's deeper paths, and some streams that succeed."""
    msgs = _valid_stream(
        draw(st.integers(1, 16)), draw(st.integers(1, 16)), draw(st.sampled_from([1, 2])), draw(st.integers(0, 3))
    )
    for _ in range(draw(st.integers(0, 2))):
        op, i = (
            draw(st.sampled_from(["drop", "dup", "swap", "bytes", "layer", "range", "dtype", "kind", "header"])),
            draw(st.integers(0, len(msgs) - 1)),
        )
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


# The shapes that found holes when the sidecar was attacked: strings far past any identifier limit,
# huge repeated fields under a tiny declared size, 1-token chunks, non-finite values.
long_text = st.one_of(st.text(max_size=40), st.integers(200, 70_000).map(lambda n: "x" * n))


@st.composite
def hostile(draw):
    msgs = _valid_stream(draw(st.integers(1, 16)), draw(st.integers(1, 4)), 1, 0)
    h = msgs[0].header
    what = draw(st.sampled_from(["name", "version", "tenant", "prefix_key", "token_ids", "shape", "nan"]))
    if what in ("name", "version"):
        setattr(h.map, what, draw(long_text))
    elif what in ("tenant", "prefix_key"):
        setattr(h, what, draw(long_text))
    elif what == "token_ids":  # up to 300k ids behind num_tokens <= 16: must be refused before any work
        del h.token_ids[:]
        h.token_ids.extend(range(draw(st.sampled_from([17, 1000, 300_000]))))
    elif what == "shape":
        c = msgs[draw(st.integers(1, len(msgs) - 1))].chunk
        c.tensor.shape.extend([1] * draw(st.sampled_from([1, 64, 100_000])))
    else:
        msgs[draw(st.integers(1, len(msgs) - 1))] = _poisoned(msgs, draw)
    return msgs


def _poisoned(msgs, draw):
    m = pb.TranslateRequest()
    m.CopyFrom(msgs[draw(st.integers(1, len(msgs) - 1))])
    data = bytearray(m.chunk.tensor.data)  # float32 source: one value becomes NaN, +Inf or -Inf
    at = 4 * draw(st.integers(0, len(data) // 4 - 1))
    data[at : at + 4] = draw(st.sampled_from([b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\x00\x00\x80\xff"]))
    m.chunk.tensor.data = bytes(data)
    return m


streams = st.one_of(
    st.lists(chunk(), max_size=3),
    st.tuples(header, st.lists(st.one_of(chunk(), header), max_size=8)).map(lambda t: [t[0], *t[1]]),
    near_valid(),
    hostile(),
)


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
        Path(report).write_text(
            json.dumps(
                {
                    "cases": sum(OUTCOMES.values()),
                    "outcomes": dict(OUTCOMES),
                    "internal_errors": OUTCOMES.get("INTERNAL", 0),
                },
                indent=1,
            )
            + "\n"
        )
    ch.close()
    sc.stop()


@settings(max_examples=CASES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(streams)
def test_any_stream_gets_an_answer_or_a_proper_status(fuzz_server, msgs):
    _sc, stub = fuzz_server
    try:
        out = list(stub.Translate(iter(msgs), timeout=10))
        OUTCOMES["OK"] += 1
        assert out and out[-1].WhichOneof("msg") == "trailer"
    except grpc.RpcError as e:
        OUTCOMES[e.code().name] += 1
        assert e.code() in ALLOWED, (e.code(), e.details())
        assert e.details()  # every rejection says what was wrong


@settings(max_examples=max(CASES // 10, 30), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 32), st.sampled_from([1, 2]), st.data())
def test_one_token_chunks_succeed_and_non_finite_values_are_refused(fuzz_server, tokens, layout, data):
    """1-token chunks are legal (and linear since the fix); a single NaN or Inf anywhere is INVALID_ARGUMENT, never
    mapped into an answer or a cache."""
    _sc, stub = fuzz_server
    msgs = _valid_stream(tokens, 1, layout, 0)
    out = list(stub.Translate(iter(msgs), timeout=30))
    assert out[-1].WhichOneof("msg") == "trailer"
    poisoned = list(msgs)
    at = data.draw(st.integers(1, len(msgs) - 1))
    poisoned[at] = _poisoned([msgs[at], msgs[at]], data.draw)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Translate(iter(poisoned), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "finite" in e.value.details(), e.value.details()


@pytest.fixture(scope="module")
def by_key_raw(fuzz_server):
    """TranslateByKey on the fuzz sidecar, taking raw request bytes."""
    from kvferry.client.client import BY_KEY_METHOD

    with grpc.insecure_channel(fuzz_server[0].address) as ch:
        yield ch.unary_stream(BY_KEY_METHOD)


@settings(max_examples=max(CASES // 3, 50), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.one_of(
        header.map(lambda r: pb.TranslateByKeyRequest(header=r.header).SerializeToString()), st.binary(max_size=64)
    )
)
def test_any_translate_by_key_request_gets_an_answer_or_a_proper_status(by_key_raw, raw):
    """TranslateByKey's one message, well-formed or not: an answer, or a proper status with a reason (never
    INTERNAL)."""
    try:
        out = list(by_key_raw(raw, timeout=10))
    except grpc.RpcError as e:
        OUTCOMES[e.code().name] += 1
        assert e.code() in ALLOWED, (e.code(), e.details())
        assert e.details()
        return
    OUTCOMES["OK"] += 1
    assert pb.TranslateResponse.FromString(out[-1]).WhichOneof("msg") == "trailer"
