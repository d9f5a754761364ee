"""The sidecar end to end: a real grpc.aio server on port 0, real models from the shipped family."""

import grpc
import pytest
import torch
from conftest import make_kv, sample, wait_until

from kvferry.client.client import ClientOptions, Retry, TranslateClient, encode_requests, make_spec
from kvferry.client.importers import PagedKVPool, to_dynamic_cache
from kvferry.common.listing import MappingInfo
from kvferry.common.messages import ALL_PAGES
from kvferry.mappings.artifact import save
from kvferry.mappings.lab.capture import capture_kv
from kvferry.mappings.lab.fit import identity_mapset


@pytest.fixture(scope="module")
def maps_dir(tmp_path_factory, family):
    root = tmp_path_factory.mktemp("maps")
    s = family["S"]
    ms = identity_mapset(s.identity, version="1.0.0")
    save(ms, root)
    return root


@pytest.fixture
def sidecar(sidecar_factory, maps_dir):
    return sidecar_factory(maps_dir=str(maps_dir), force_maps=True)


@pytest.fixture
def client(sidecar):
    with TranslateClient(ClientOptions(target=sidecar.address, chunk_tokens=50, retry=Retry(retries=0))) as c:
        yield c


def _spec_kw(s):
    return dict(source_geometry=s.identity.geometry.fingerprint, tokenizer=s.identity.tokenizer)


def _held_stream(release, wait: float = 20):
    """A small valid S__S-self request stream whose header goes at once and whose chunks wait for ``release``:
    a stream that holds a slot for as long as a test needs."""
    kv = make_kv(layers=4, tokens=8, heads=2, head_dim=32)
    reqs = list(encode_requests(make_spec(kv, "S__S-self"), kv, chunk_tokens=8))

    def held():
        yield reqs[0]
        release.wait(wait)
        yield from reqs[1:]

    return kv, reqs, held


def test_list_mappings(client):
    (m,) = client.list_mappings()
    assert isinstance(m, MappingInfo)  # the package's own dataclass, not a protobuf message
    assert m.name == "S__S-self" and m.version == "1.0.0" and m.servable
    assert m.source.layers == 4 and m.target.kv_heads == 2 and m.dtype == torch.float32
    assert m.evidence.recommended_refresh >= 0 and m.context_tokens == 0


@pytest.mark.parametrize("layout, pages", [("contiguous", 0), ("paged", 0), ("paged", 5), ("paged", ALL_PAGES)])
def test_exact_map_end_to_end_matches_full_prefill(client, family, layout, pages):
    s = family["S"]
    ids = torch.randint(2, 4096, (1, 181))
    src = capture_kv(s.model, ids[:, :-1])
    res = client.translate(
        src,
        "S__S-self",
        "1.0.0",
        layout=layout,
        block_size=16,
        token_ids=ids[0, :-1].tolist(),
        pages_per_block=pages,
        **_spec_kw(s),
    )
    assert res.info.map_version == "1.0.0" and res.stats.tokens == 180
    if layout == "paged":
        pool = PagedKVPool(layers=4, num_blocks=32, block_size=16, kv_heads=2, head_dim=32)
        table = pool.allocate(180)
        pool.write(res.blocks, table)
        sizes = [b.key.shape[0] for b in res.blocks]  # pages a block, every block [pages, 16, 2, 32] in the result
        assert sum(sizes) == 4 * len(table) and res.stats.blocks == len(res.blocks)
        # a 64 MiB message holds 8,191 pages of 16 fp32 tokens here (512 bytes a token); chunks cut the pages too
        assert res.info.pages_per_block == min(pages, 8191) and max(sizes) <= max(pages, 1)
        assert (
            (max(sizes) > 1) == (pages > 1) and len(res.blocks) < 4 * len(table) if pages > 1 else len(res.blocks) == 48
        )
        layers = pool.gather(table, 180)
    else:
        layers = res.layers()
    with torch.no_grad():
        got = s.model(input_ids=ids[:, -1:], past_key_values=to_dynamic_cache(layers, s.model.config)).logits[0, -1]
        want = s.model(input_ids=ids).logits[0, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_dtype_conversion_and_start_position(client, family):
    s = family["S"]
    kv = make_kv(layers=4, tokens=30, heads=2, head_dim=32, dtype=torch.bfloat16)
    res = client.translate(kv, "S__S-self", start_position=500, target_dtype=torch.float16, **_spec_kw(s))
    out = res.layers()
    assert out[0][0].dtype == torch.float16 and res.info.start_position == 500
    torch.testing.assert_close(out[2][1].float(), kv[2][1].float(), rtol=1e-2, atol=1e-2)


def test_a_bfloat16_map_returns_bfloat16_unless_asked_otherwise(sidecar_factory, tmp_path, family):
    s = family["S"]
    save(identity_mapset(s.identity, version="2.0.0").to(dtype=torch.bfloat16), tmp_path)
    sc = sidecar_factory(maps_dir=str(tmp_path), force_maps=True)
    kv = make_kv(layers=4, tokens=12, heads=2, head_dim=32)
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        res = c.translate(kv, "S__S-self", **_spec_kw(s))
        assert res.info.dtype == torch.bfloat16 and res.layers()[0][1].dtype == torch.bfloat16
        torch.testing.assert_close(res.layers()[3][1], kv[3][1].bfloat16())
        wide = c.translate(kv, "S__S-self", target_dtype=torch.float32, **_spec_kw(s))
        assert wide.info.dtype == torch.float32
        torch.testing.assert_close(wide.layers()[3][1], kv[3][1].bfloat16().float())  # the precision is the map's


def _code(client, *args, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        client.translate(*args, **kw)
    return e.value.code(), e.value.details()


def test_unknown_map_and_version_are_not_found(client, family):
    kv = make_kv(layers=4, tokens=8, heads=2, head_dim=32)
    code, msg = _code(client, kv, "nope__nope")
    assert code == grpc.StatusCode.NOT_FOUND and "S__S-self" in msg
    code, msg = _code(client, kv, "S__S-self", "9.9.9")
    assert code == grpc.StatusCode.NOT_FOUND and "1.0.0" in msg


def test_fingerprint_mismatch_is_failed_precondition(client, family):
    kv = make_kv(layers=4, tokens=8, heads=2, head_dim=32)
    t = family["T"]
    code, msg = _code(client, kv, "S__S-self", source_geometry=t.identity.geometry.fingerprint)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "geometry fingerprint" in msg
    code, msg = _code(client, kv, "S__S-self", tokenizer="0" * 64)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "tokenizer" in msg


@pytest.mark.parametrize(
    "bad,needle",
    [
        (dict(layers=3), "truncated stream"),
        (dict(heads=3), "shape"),
        (dict(head_dim=16), "shape"),
    ],
)
def test_bad_geometry_is_invalid_argument(client, bad, needle):
    kw = dict(layers=4, tokens=8, heads=2, head_dim=32) | bad
    code, msg = _code(client, make_kv(**kw), "S__S-self")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in msg


def _raw(sidecar, requests):
    from kvferry.v1 import translate_pb2_grpc as pb_grpc

    with grpc.insecure_channel(sidecar.address) as ch:
        stub = pb_grpc.TranslateServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Translate(iter(requests), timeout=20))
    return e.value.code(), e.value.details()


def test_chunks_in_any_protobuf_form_translate_alike(sidecar):
    """Chunks the sidecar cannot read in place (here each followed by an unknown field, which protobuf skips) go
    through protobuf and give the same translation as the canonical ones it reads in place."""
    from kvferry.client.client import TRANSLATE_METHOD
    from kvferry.common import wire
    from kvferry.common.messages import Block

    kv = make_kv(layers=4, tokens=40, heads=2, head_dim=32)
    reqs = list(encode_requests(make_spec(kv, "S__S-self", "1.0.0"), kv, chunk_tokens=16, encoded=True))
    odd = [reqs[0]] + [r + b"\x78\x05" for r in reqs[1:]]

    def translated(stream):
        with grpc.insecure_channel(sidecar.address) as ch:
            call = ch.stream_stream(
                TRANSLATE_METHOD, request_serializer=wire.serialize, response_deserializer=wire.decode_response
            )
            blocks = [m for m in call(iter(stream), timeout=20) if isinstance(m, Block)]
        return {(b.layer, b.start): (b.key.clone(), b.value.clone()) for b in blocks}

    assert all(isinstance(wire.decode_request(r).data, memoryview) for r in reqs[1:])  # read in place
    assert all(isinstance(wire.decode_request(r).data, bytes) for r in odd[1:])  # read by protobuf (a copy)
    plain, other = translated(reqs), translated(odd)
    assert plain.keys() == other.keys() and len(plain) == 4 * 3
    for key, (k, v) in plain.items():
        assert torch.equal(k, other[key][0]) and torch.equal(v, other[key][1])
        layer, start = key
        torch.testing.assert_close(k, kv[layer][0][0, :, start : start + k.shape[1]])  # the identity map: the source's


def test_paged_blocks_on_the_wire_one_page_or_several(sidecar):
    """What a client built from the proto sees: without pages_per_block (a client older than the field) one page a
    block, [block_size, H, D], block_index the page; with it, [pages, block_size, H, D] of consecutive pages,
    block_index the first page's, the response header saying the cap, the last page zero-padded either way."""
    from kvferry.v1 import translate_pb2_grpc as pb_grpc

    kv = make_kv(layers=4, tokens=40, heads=2, head_dim=32)  # 5 pages of 8; the identity map returns the source
    for asked, cap, sizes in (
        (0, 0, [1] * 5),
        (3, 3, [3, 2]),
        (ALL_PAGES, 16383, [5]),
    ):  # 64 MiB: 16,383 pages of 8 tokens of 512 B
        spec = make_spec(kv, "S__S-self", "1.0.0", layout="paged", block_size=8, pages_per_block=asked)
        with grpc.insecure_channel(sidecar.address) as ch:
            answer = list(
                pb_grpc.TranslateServiceStub(ch).Translate(encode_requests(spec, kv, chunk_tokens=40), timeout=20)
            )
        assert answer[0].header.pages_per_block == cap and answer[0].header.block_size == 8
        blocks = [m.block for m in answer if m.WhichOneof("msg") == "block" and m.block.layer == 1]
        assert [b.block_index for b in blocks] == [sum(sizes[:i]) for i in range(len(sizes))]
        for b, pages in zip(blocks, sizes):
            shape = [8, 2, 32] if not asked else [pages, 8, 2, 32]
            assert list(b.key.shape) == shape and list(b.value.shape) == shape
            assert (b.token_start, b.token_end) == (8 * b.block_index, min(8 * (b.block_index + pages), 40))
            got = torch.frombuffer(bytearray(b.value.data), dtype=torch.float32).view(pages, 8, 2, 32)
            want = kv[1][1][0, :, b.token_start : b.token_end].transpose(0, 1)  # [tokens, H, D]
            torch.testing.assert_close(got.reshape(-1, 2, 32)[: b.token_end - b.token_start], want)
            assert not got.reshape(-1, 2, 32)[b.token_end - b.token_start :].any()  # zero-padded past token_end


def test_stream_errors(sidecar):
    from kvferry.common import wire
    from kvferry.common.messages import Chunk

    kv = make_kv(layers=4, tokens=8, heads=2, head_dim=32)
    reqs = list(encode_requests(make_spec(kv, "S__S-self"), kv, chunk_tokens=4, order="layers"))
    # chunks out of order: the second token chunk before the first
    code, msg = _raw(sidecar, [reqs[0], reqs[2], reqs[1]])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "out of order" in msg
    # no header
    code, msg = _raw(sidecar, reqs[1:])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "header" in msg
    # wrong dtype against the header
    bad = wire.chunk_to_pb(Chunk(0, "k", 0, 4, kv[0][0][0, :, :4].half()))
    code, msg = _raw(sidecar, [reqs[0], bad])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "dtype" in msg
    # bytes that do not match the declared shape
    bad = wire.chunk_to_pb(Chunk(0, "k", 0, 4, kv[0][0][0, :, :4]))
    bad.chunk.tensor.data = bad.chunk.tensor.data[:-4]
    code, msg = _raw(sidecar, [reqs[0], bad])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in msg
    # a prefix key without the token ids to derive the keys from
    spec = make_spec(kv, "S__S-self")
    h = wire.spec_to_pb(spec)
    h.header.prefix_key = "abc"
    code, msg = _raw(sidecar, [h])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in msg


def test_limits_are_resource_exhausted(sidecar_factory, maps_dir, family):
    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True, max_tokens=16)
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        code, msg = _code(c, make_kv(layers=4, tokens=17, heads=2, head_dim=32), "S__S-self")
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 16" in msg


def test_gated_map_is_refused(sidecar_factory, maps_dir):
    sc = sidecar_factory(maps_dir=str(maps_dir))  # not forced: the identity map has no evidence
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        (m,) = c.list_mappings()
        assert not m.servable and "no evaluation evidence" in m.gate_reason
        code, msg = _code(c, make_kv(layers=4, tokens=8, heads=2, head_dim=32), "S__S-self")
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "passes the serving gates" in msg


@pytest.mark.parametrize("tokens, map_threads", [(64, 1), (512, 2)])
def test_pipelining_first_block_before_last_chunk(sidecar_factory, maps_dir, tokens, map_threads):
    """Target layer 0 reads only source layer 0, so it must come back while later layers are unsent: on the compute
    thread's own pool, and with the tokens mapped in two lanes (a chunk that completes a target layer waits for
    the lanes)."""
    import threading

    from kvferry.v1 import translate_pb2_grpc as pb_grpc

    sidecar = sidecar_factory(maps_dir=str(maps_dir), force_maps=True, map_threads=map_threads)
    assert (sidecar.sidecar.servicer.compute.lanes is not None) == (map_threads > 1)
    kv = make_kv(layers=4, tokens=tokens, heads=2, head_dim=32)
    reqs = list(encode_requests(make_spec(kv, "S__S-self"), kv, chunk_tokens=tokens))  # header + 8 chunks
    first_block = threading.Event()
    sent_after_first_block = []

    def requests():
        yield from reqs[:3]  # header, layer 0 K, layer 0 V
        assert first_block.wait(20), "no target block before the rest of the source was sent"
        for r in reqs[3:]:
            sent_after_first_block.append(r)
            yield r

    with grpc.insecure_channel(sidecar.address) as ch:
        kinds = []
        for msg in pb_grpc.TranslateServiceStub(ch).Translate(requests(), timeout=30):
            kinds.append(msg.WhichOneof("msg"))
            if kinds[-1] == "block":
                first_block.set()
    # a layer's lane pieces leave in one block when they finish together, in one block each otherwise
    assert kinds[0] == "header" and kinds[-1] == "trailer" and 4 <= kinds.count("block") <= 4 * map_threads
    assert len(sent_after_first_block) == 6


def test_cancel_mid_stream_frees_the_session(sidecar, caplog):
    """...and logs no traceback (an ExecuteBatchError traceback used to follow every cancel after the first block)."""
    import logging
    import time

    from kvferry.v1 import translate_pb2_grpc as pb_grpc

    kv = make_kv(layers=4, tokens=64, heads=2, head_dim=32)
    reqs = list(encode_requests(make_spec(kv, "S__S-self"), kv, chunk_tokens=16))
    servicer = sidecar.sidecar.servicer

    def requests():
        yield from reqs[:5]
        time.sleep(30)  # never finishes on its own

    with grpc.insecure_channel(sidecar.address) as ch:
        call = pb_grpc.TranslateServiceStub(ch).Translate(requests(), timeout=60)
        assert next(call).WhichOneof("msg") == "header"
        wait_until(lambda: sample(sidecar, "kvferry_active_streams") == 1, 10, "the stream in flight")
        assert len(servicer.sessions) == 1  # the leak check: the live request state, held weakly
        call.cancel()

    def released() -> bool:
        sidecar.call(_collect())
        return sample(sidecar, "kvferry_active_streams") == 0 and len(servicer.sessions) == 0

    wait_until(released, 10, "the cancelled stream's state released")
    counts = {
        s.labels["code"]: s.value
        for m in sidecar.sidecar.metrics.registry.collect()
        if m.name == "kvferry_requests"
        for s in m.samples
        if s.labels.get("method") == "Translate" and s.name.endswith("_total")
    }
    assert "INTERNAL" not in counts, counts
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def _collect():
    import gc

    gc.collect()


def test_deadline_is_honoured(sidecar):
    import time

    from kvferry.v1 import translate_pb2_grpc as pb_grpc

    kv = make_kv(layers=4, tokens=8, heads=2, head_dim=32)
    reqs = list(encode_requests(make_spec(kv, "S__S-self"), kv, chunk_tokens=8))

    def slow():
        yield reqs[0]
        time.sleep(2)
        yield from reqs[1:]

    with grpc.insecure_channel(sidecar.address) as ch, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.TranslateServiceStub(ch).Translate(slow(), timeout=0.5))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_health_reflection_and_metrics(sidecar_factory, maps_dir, family):
    import urllib.request

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True, metrics_port=0)
    with grpc.insecure_channel(sc.address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="kvferry.v1.TranslateService")
        )
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2

    for version in ("v1alpha", "v1"):  # v1 is what grpcurl and current tools ask first; only v1alpha answered
        with grpc.insecure_channel(sc.address) as ch:
            call = ch.stream_stream(
                f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            (resp,) = list(call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
            names = {s.name for s in resp.list_services_response.service}
            assert {
                "kvferry.v1.TranslateService",
                "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection",
            } <= names
            (resp,) = list(
                call(
                    iter(
                        [reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvferry.v1.TranslateService")]
                    ),
                    timeout=10,
                )
            )
            assert resp.file_descriptor_response.file_descriptor_proto, version
    s = family["S"]
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        c.translate(make_kv(layers=4, tokens=12, heads=2, head_dim=32), "S__S-self", **_spec_kw(s))
        with pytest.raises(grpc.RpcError):
            c.translate(make_kv(layers=4, tokens=12, heads=2, head_dim=32), "missing")
    text = urllib.request.urlopen(f"http://127.0.0.1:{sc.sidecar.metrics_port}/metrics", timeout=5).read().decode()
    assert 'kvferry_requests_total{code="OK",method="Translate"} 1.0' in text
    assert 'kvferry_requests_total{code="NOT_FOUND",method="Translate"} 1.0' in text
    assert 'kvferry_tokens_total{map="S__S-self@1.0.0"} 12.0' in text
    assert "kvferry_request_seconds_bucket" in text and "kvferry_maps_servable 1.0" in text


def test_health_not_serving_without_maps_and_while_draining(sidecar_factory, tmp_path, maps_dir):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    empty = sidecar_factory(maps_dir=str(tmp_path))

    def check(ch, svc):
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=svc)).status

    with grpc.insecure_channel(empty.address) as ch:
        assert check(ch, "") == health_pb2.HealthCheckResponse.SERVING  # alive
        assert check(ch, "kvferry.v1.TranslateService") == health_pb2.HealthCheckResponse.NOT_SERVING  # not ready
    full = sidecar_factory(maps_dir=str(maps_dir), force_maps=True, drain_seconds=5, drain_notice_seconds=2)
    import threading

    from kvferry.v1 import translate_pb2_grpc as pb_grpc

    hold = threading.Event()
    _, reqs, held = _held_stream(hold, 10)

    with grpc.insecure_channel(full.address) as ch:
        assert check(ch, "kvferry.v1.TranslateService") == health_pb2.HealthCheckResponse.SERVING
        out = {}
        t = threading.Thread(
            target=lambda: out.setdefault("r", list(pb_grpc.TranslateServiceStub(ch).Translate(held(), timeout=20)))
        )
        t.start()
        wait_until(lambda: sample(full, "kvferry_active_streams") == 1, 10, "the held stream in flight")
        drain = threading.Thread(target=lambda: full.call(full.sidecar.drain(5)))
        drain.start()
        wait_until(
            lambda: check(ch, "kvferry.v1.TranslateService") == health_pb2.HealthCheckResponse.NOT_SERVING,
            10,
            "the drain's health change",
        )
        assert check(ch, "") == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:  # new streams are turned away while draining
            list(pb_grpc.TranslateServiceStub(ch).Translate(iter(reqs), timeout=5))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
        hold.set()
        t.join(10)
        drain.join(10)
    assert out["r"][-1].WhichOneof("msg") == "trailer"


def test_new_versions_are_picked_up_without_restart(sidecar_factory, tmp_path, family):
    s = family["S"]
    save(identity_mapset(s.identity, version="1.0.0"), tmp_path)
    sc = sidecar_factory(maps_dir=str(tmp_path), force_maps=True)
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        kv = make_kv(layers=4, tokens=8, heads=2, head_dim=32)
        assert c.translate(kv, "S__S-self").info.map_version == "1.0.0"
        save(identity_mapset(s.identity, version="1.1.0"), tmp_path)
        events = sc.call(sc.sidecar.reload())
        assert any("loaded S__S-self 1.1.0" in e for e in events)
        assert c.translate(kv, "S__S-self").info.map_version == "1.1.0"  # latest resolves to the new one
        assert c.translate(kv, "S__S-self", "1.0.0").info.map_version == "1.0.0"  # exact still works
        # a corrupt newer version is refused and the good ones keep serving
        bad = tmp_path / "S__S-self" / "2.0.0"
        bad.mkdir()
        (bad / "manifest.json").write_text("{}")
        (bad / "maps.safetensors").write_bytes(b"junk")
        events = sc.call(sc.sidecar.reload())
        assert any("refused" in e and "2.0.0" in e for e in events)
        assert c.translate(kv, "S__S-self").info.map_version == "1.1.0"


def test_stream_cap_and_byte_limit_are_resource_exhausted(sidecar_factory, maps_dir):
    import threading

    from kvferry.v1 import translate_pb2_grpc as pb_grpc

    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True, max_streams=1, max_request_bytes=40000)
    release = threading.Event()
    kv, _reqs, held = _held_stream(release)

    done = {}

    def first():
        with grpc.insecure_channel(sc.address) as ch:
            done["kinds"] = [
                m.WhichOneof("msg") for m in pb_grpc.TranslateServiceStub(ch).Translate(held(), timeout=30)
            ]

    t = threading.Thread(target=first)
    t.start()
    wait_until(lambda: sample(sc, "kvferry_active_streams") == 1, 10, "the first stream in flight")
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        code, msg = _code(c, kv, "S__S-self")
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry after" in msg
        release.set()
        t.join(20)
        assert done["kinds"][-1] == "trailer"  # the held stream was not disturbed
        big = make_kv(layers=4, tokens=40, heads=2, head_dim=32)  # 4*2*64*40*4 = 81920 bytes > 40000
        code, msg = _code(c, big, "S__S-self")
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "bytes" in msg


def test_stream_cap_sends_retry_info_and_the_client_honours_it(sidecar_factory, maps_dir):
    """The client used to retry an overloaded sidecar only when the message text said "retry after": the hint now
    travels as google.rpc.RetryInfo (and kvferry-retry-after-ms), and the client waits at least that long."""
    import threading
    import time

    from kvferry.client.attempts import retry_hint
    from kvferry.v1 import translate_pb2_grpc as pb_grpc

    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True, max_streams=1)
    release = threading.Event()
    kv, reqs, held = _held_stream(release)

    with grpc.insecure_channel(sc.address) as ch:
        first = pb_grpc.TranslateServiceStub(ch).Translate(held(), timeout=30)
        wait_until(lambda: sample(sc, "kvferry_active_streams") == 1, 10, "the first stream in flight")
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.TranslateServiceStub(ch).Translate(iter(reqs), timeout=10))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert retry_hint(e.value) == pytest.approx(0.1)
        assert ("kvferry-retry-after-ms", "100") in tuple(e.value.trailing_metadata())
        threading.Timer(0.5, release.set).start()
        with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=8, backoff=0.001))) as c:
            t0 = time.perf_counter()
            result = c.translate(kv, "S__S-self")
            waited = time.perf_counter() - t0
        assert result.attempts > 1 and waited >= 0.1 * (result.attempts - 1)
        assert [m.WhichOneof("msg") for m in first][-1] == "trailer"


def test_size_limits_carry_no_retry_hint(sidecar_factory, maps_dir):
    from kvferry.client.attempts import retry_hint

    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True, max_request_bytes=40000)
    big = make_kv(layers=4, tokens=40, heads=2, head_dim=32)
    with (
        TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=3))) as c,
        pytest.raises(grpc.RpcError) as e,
    ):
        c.translate(big, "S__S-self")
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and retry_hint(e.value) is None


def test_maps_run_in_token_lanes_answer_as_the_whole_map_does(sidecar_factory, family):
    """map_threads > 1 (the default on a multi-core CPU): a translation's tokens are mapped in lanes, each on a thread
    of its own running torch on one core, fed by the compute thread (one core too). Through a real cross-model map
    (4 -> 6 layers, 2 -> 3 kv heads) the answer is the whole-cache apply's, with three lanes or none."""
    from conftest import ROOT

    from kvferry.mappings.apply import apply
    from kvferry.mappings.artifact import load
    from kvferry.mappings.errors import InvalidInput
    from kvferry.sidecar.config import SidecarConfig

    ms = load(ROOT / "maps" / "S__T" / "1.0.0")
    g = ms.source.geometry
    kv = make_kv(layers=g.layers, tokens=600, heads=g.kv_heads, head_dim=g.head_dim, seed=11)
    want = apply(ms, kv, 0)
    s = family["S"].identity
    kw = dict(source_geometry=s.geometry.fingerprint, tokenizer=s.tokenizer)
    for threads in (3, 1):
        sc = sidecar_factory(maps_dir=str(ROOT / "maps"), map_threads=threads, force_maps=True)
        compute = sc.sidecar.servicer.compute
        assert (compute.lanes.parts if compute.lanes else 1) == threads
        if threads > 1:
            assert compute.submit(torch.get_num_threads).result() == 1  # the compute thread runs torch on one core
        with TranslateClient(
            ClientOptions(target=sc.address, retry=Retry(retries=0))
        ) as c:  # whole layers: 600-token steps
            for (k, v), (wk, wv) in zip(c.translate(kv, "S__T", "1.0.0", **kw).layers(), want):
                (
                    torch.testing.assert_close(k, wk, rtol=1e-4, atol=1e-4),
                    torch.testing.assert_close(v, wv, rtol=1e-4, atol=1e-4),
                )
    assert SidecarConfig(map_threads=0, threads=3).resolved_map_threads() == 3
    assert SidecarConfig(map_threads=4, device="cuda").resolved_map_threads() == 1  # a GPU step is one kernel launch
    with pytest.raises(InvalidInput, match="map_threads must be >= 0"):
        SidecarConfig(map_threads=-1)


@pytest.mark.parametrize("block_tokens", [None, 250])
def test_a_layers_lane_pieces_leave_in_one_message(block_tokens):
    """Lanes hand a target layer over in one piece per lane. Pieces finished together leave as one block (BlockParts,
    joined only as its message is written: each message costs both ends a fixed amount), cut only where a block would
    outgrow the message limit, and each message holds the bytes a Block of the joined tokens makes. Through a real
    cross-model map (4 -> 6 layers, 2 -> 3 kv heads) in three lanes, held until every chunk has been queued."""
    import threading

    from conftest import ROOT

    from kvferry.common import wire
    from kvferry.common.messages import BlockParts, Chunk, TranslateSpec
    from kvferry.mappings.apply import apply
    from kvferry.mappings.artifact import load
    from kvferry.sidecar.lanes import Lanes
    from kvferry.sidecar.limits import Limits
    from kvferry.sidecar.pipeline import TranslateSession

    ms = load(ROOT / "maps" / "S__T" / "1.0.0")
    g, tg = ms.source.geometry, ms.target.geometry
    kv = make_kv(layers=g.layers, tokens=600, heads=g.kv_heads, head_dim=g.head_dim, seed=11)
    want = apply(ms, kv, 0)
    per_token = 2 * tg.kv_width * 4
    limits = Limits(max_message_bytes=Limits.MESSAGE_OVERHEAD + block_tokens * per_token) if block_tokens else Limits()
    lanes, hold = Lanes(3), threading.Event()
    try:
        for w in lanes.workers:  # every lane waits, so that all of a layer's pieces are finished by drain
            w.submit(hold.wait)
        session = TranslateSession(TranslateSpec("S__T", num_tokens=600), ms, limits, lanes=lanes)
        for layer, (k, v) in enumerate(kv):
            for kind, t in (("k", k), ("v", v)):
                assert session.add(Chunk(layer, kind, 0, 600, t[0])) == []
        hold.set()
        blocks = session.drain()
    finally:
        hold.set()
        lanes.shutdown()
    cuts = [(0, 600)] if block_tokens is None else [(0, 250), (250, 500), (500, 600)]  # lanes: 0-200, 200-400, 400-600
    assert [(b.layer, b.start, b.end, b.index) for b in blocks] == [
        (t, a, b, i) for t in range(tg.layers) for i, (a, b) in enumerate(cuts)
    ]
    spans_pieces = [True] if block_tokens is None else [True, True, False]  # 500-600 lies in the last lane's piece
    assert [isinstance(b, BlockParts) for b in blocks[: len(cuts)]] == spans_pieces
    assert session.finish().bytes_out == 600 * per_token * tg.layers
    for b in blocks:
        got = wire.decode_response(wire.encode_block_response(b))
        wk, wv = want[b.layer]
        torch.testing.assert_close(got.key, wk[0, :, b.start : b.end], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.value, wv[0, :, b.start : b.end], rtol=1e-4, atol=1e-4)


def test_maps_are_warmed_on_the_compute_thread_before_readiness(sidecar_factory, maps_dir, monkeypatch):
    """The first request used to pay ~1.5 s of one-off set-up (and could miss a short --max-stream-seconds):
    each servable map now runs once on the compute thread before health reports SERVING."""
    import threading

    from kvferry.sidecar import server

    seen = []
    real = server.warm
    monkeypatch.setattr(
        server,
        "warm",
        lambda ms, lanes: (seen.append((ms.name, ms.version, threading.current_thread().name)), real(ms, lanes)),
    )
    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True)
    assert [(n, v) for n, v, _ in seen] == [("S__S-self", "1.0.0")]
    assert seen[0][2].startswith("kvferry-compute")
    assert sc.sidecar.warmed == {("S__S-self", "1.0.0")}
    sc.call(sc.sidecar.reload())  # nothing new: nothing warmed again
    assert len(seen) == 1


def test_registry_survives_malformed_artifacts_missing_files_links_and_fifos(tmp_path, family):
    """Found by attacking the sidecar: a malformed manifest with a recomputed checksum aborted start-up and every
    rescan; deleting one file of a loaded version took it out of service; the registry followed symlinks out of
    the map directory, and a FIFO posing as a map file blocked the rescan forever."""
    import json
    import os
    import threading

    from kvferry.mappings.geometry import digest
    from kvferry.sidecar.registry import MapRegistry

    ident = family["S"].identity
    root = tmp_path / "maps"
    good = save(identity_mapset(ident, version="1.0.0"), root)
    bad = save(identity_mapset(ident, version="1.1.0"), root)
    man = json.loads((bad / "manifest.json").read_text())
    man.pop("manifest_sha256")
    man["evidence"] = ["arms"]  # well-formed JSON, checksum recomputed, but not evidence
    man["manifest_sha256"] = digest({k: v for k, v in man.items()})
    (bad / "manifest.json").write_text(json.dumps(man))
    reg = MapRegistry(root, force=True)
    events = reg.scan()
    assert [e.maps.version for e in reg.entries()] == ["1.0.0"]
    assert any(ev.startswith("refused") and "1.1.0" in ev and "malformed" in ev for ev in events), events
    save(identity_mapset(ident, version="1.2.0"), root)  # a good new version loads while the bad one is present
    reg.scan()
    assert [e.maps.version for e in reg.entries()] == ["1.0.0", "1.2.0"]
    (good / "maps.safetensors").unlink()  # one file of a loaded version deleted: it keeps serving from memory
    events = reg.scan()
    assert reg.resolve("S__S-self", "1.0.0") is not None and any("keeps serving" in ev for ev in events)
    outside = save(identity_mapset(ident, version="2.0.0"), tmp_path / "elsewhere")
    (root / "S__S-self" / "2.0.0").symlink_to(outside, target_is_directory=True)
    fifo_dir = root / "S__S-self" / "3.0.0"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "maps.safetensors")
    (fifo_dir / "manifest.json").write_text("{}")
    done = threading.Event()
    threading.Thread(target=lambda: (reg.scan(), done.set()), daemon=True).start()
    assert done.wait(20), "the rescan blocked on a FIFO"
    assert [e.maps.version for e in reg.entries()] == ["1.0.0", "1.2.0"]
    import shutil

    shutil.rmtree(good)  # the version directory itself removed: now it is gone
    reg.scan()
    assert [e.maps.version for e in reg.entries()] == ["1.2.0"]


def test_cancel_while_the_sidecar_is_sending_is_clean(sidecar, caplog):
    """A caller that cancels after the first block, while blocks are still being written to it: no INTERNAL,
    no traceback (a write into a cancelled call is the caller leaving, not a server fault)."""
    import logging

    from kvferry.v1 import translate_pb2_grpc as pb_grpc

    kv = make_kv(layers=4, tokens=4096, heads=2, head_dim=32)
    reqs = list(encode_requests(make_spec(kv, "S__S-self"), kv, chunk_tokens=256))
    for _ in range(3):
        with grpc.insecure_channel(sidecar.address, [("grpc.http2.bdp_probe", 0)]) as ch:
            call = pb_grpc.TranslateServiceStub(ch).Translate(iter(reqs), timeout=60)
            next(call), next(call)  # the header, then the first block
            call.cancel()
    wait_until(lambda: sample(sidecar, "kvferry_active_streams") == 0, 10, "no stream in flight")

    def codes():
        return {
            s.labels["code"]: s.value
            for m in sidecar.sidecar.metrics.registry.collect()
            if m.name == "kvferry_requests"
            for s in m.samples
            if s.labels.get("method") == "Translate" and s.name.endswith("_total")
        }

    wait_until(lambda: sum(codes().values()) >= 3, 10, "every call counted")
    counts = codes()
    assert sample(sidecar, "kvferry_active_streams") == 0 and "INTERNAL" not in counts, counts
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_responses_are_cut_to_the_message_limit(sidecar_factory, family):
    """A request chunk within --max-message-bytes could map to a target block over it (a wider target): the sidecar
    failed after the compute with RESOURCE_EXHAUSTED and a traceback. Blocks are now cut to fit; a page that cannot
    fit is refused up front; a limit gRPC cannot hold is refused at start-up (it crashed with OverflowError)."""
    from conftest import ROOT

    from kvferry.mappings.apply import apply
    from kvferry.mappings.artifact import load
    from kvferry.mappings.errors import InvalidInput
    from kvferry.sidecar.config import SidecarConfig

    ms = load(ROOT / "maps" / "S__T64" / "1.0.0")  # S (64 wide per K or V) -> T64 (128 wide): blocks twice the chunks
    g = ms.source.geometry
    kv = make_kv(layers=g.layers, tokens=2048, heads=g.kv_heads, head_dim=g.head_dim, seed=9)
    limit = 1 << 20
    sc = sidecar_factory(maps_dir=str(ROOT / "maps"), max_message_bytes=limit)
    s = family["S"].identity
    kw = dict(source_geometry=s.geometry.fingerprint, tokenizer=s.tokenizer)
    with TranslateClient(
        ClientOptions(target=sc.address, chunk_tokens=2048, retry=Retry(retries=0))
    ) as c:  # 512 KiB request chunks
        res = c.translate(kv, "S__T64", "1.0.0", **kw)
        assert max(b.key.numel() * b.key.element_size() * 2 for b in res.blocks) <= limit
        for (k, v), (wk, wv) in zip(res.layers(), apply(ms, kv, 0)):
            torch.testing.assert_close(k, wk), torch.testing.assert_close(v, wv)
        # paged, as many pages a block as asked for: capped to the message (1,023 tokens of 1 KiB: 3 pages of 256)
        paged = c.translate(kv, "S__T64", "1.0.0", layout="paged", block_size=256, **kw)
        assert paged.info.pages_per_block == 3 and {b.key.shape[0] for b in paged.blocks} == {3, 2}  # 8 pages a layer
        assert max(b.key.numel() * b.key.element_size() * 2 for b in paged.blocks) <= limit
        i = paged.info
        pool = PagedKVPool(i.layers, 8, 256, i.kv_heads, i.head_dim)
        pool.write(paged.blocks, list(range(8)))
        for (k, v), (wk, wv) in zip(pool.gather(list(range(8)), 2048), apply(ms, kv, 0)):
            torch.testing.assert_close(k, wk), torch.testing.assert_close(v, wv)
        with pytest.raises(grpc.RpcError) as e:
            c.translate(kv, "S__T64", "1.0.0", layout="paged", block_size=2048, **kw)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_message_bytes" in e.value.details()
    with pytest.raises(InvalidInput, match="signed 32-bit"):
        SidecarConfig(maps_dir=str(ROOT / "maps"), max_message_bytes=1 << 32)


def test_a_chunk_header_is_checked_once_and_add_alone_still_checks_it(monkeypatch):
    """The servicer checks a chunk's header before viewing its bytes; add() of that chunk does not check it again,
    and add() of a chunk whose header nobody checked still refuses it."""
    from conftest import ROOT

    from kvferry.common.messages import Chunk, TranslateSpec
    from kvferry.mappings.artifact import load
    from kvferry.mappings.errors import InvalidInput
    from kvferry.sidecar.limits import Limits
    from kvferry.sidecar.pipeline import TranslateSession

    ms = load(ROOT / "maps" / "S__T" / "1.0.0")
    g = ms.source.geometry
    kv = make_kv(layers=g.layers, tokens=40, heads=g.kv_heads, head_dim=g.head_dim, seed=3)
    session = TranslateSession(TranslateSpec("S__T", num_tokens=40), ms, Limits())
    calls = []
    real = session.check_chunk_header
    monkeypatch.setattr(session, "check_chunk_header", lambda *a: calls.append(a) or real(*a))
    session.check_chunk_header(0, "k", 0, 20)
    session.add(Chunk(0, "k", 0, 20, kv[0][0][0, :, :20]))
    assert calls == [(0, "k", 0, 20)]
    with pytest.raises(InvalidInput, match="out of order"):
        session.add(Chunk(0, "k", 30, 40, kv[0][0][0, :, 30:40]))  # never checked: add checks it
    assert len(calls) == 2
    session.close()
