"""Security: bearer tokens and mTLS identities pick the tenant, stalled streams are cut off, names
cannot escape the registry, and nothing loads a code-executing format (real sidecar, real Redis)."""

import dataclasses
import re
import threading

import grpc
import pytest
from conftest import ROOT, make_certs, make_kv, sample, spec_kw, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvferry.client.client import ClientOptions, Retry, Tls, TranslateClient, encode_requests, make_spec
from kvferry.common.errors import PermissionDenied, Unauthenticated
from kvferry.mappings.errors import InvalidInput
from kvferry.sidecar.auth import Authenticator
from kvferry.v1 import translate_pb2_grpc as pb_grpc

ALICE, BOB = "alice-token-0123456789abcdef", "bob-token-0123456789abcdef00"


@pytest.fixture(scope="module")
def maps_dir(self_maps):
    return self_maps


@pytest.fixture
def tokens_file(tmp_path):
    f = tmp_path / "tokens"
    f.write_text(f"# tenant token\nalice {ALICE}\nbob {BOB}\n")
    return f


def _kw(family):
    return spec_kw(family["S"])


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code()


def test_bearer_tokens_gate_every_kvferry_call_but_not_health(sidecar_factory, maps_dir, tokens_file, family):
    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True, auth_tokens_file=str(tokens_file))
    kv = make_kv(layers=4, tokens=8, heads=2, head_dim=32)
    with TranslateClient(ClientOptions(target=sc.address, timeout=10, retry=Retry(retries=0))) as c:
        assert _code(lambda: c.translate(kv, "S__S-self", **_kw(family))) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: c.list_mappings()) == grpc.StatusCode.UNAUTHENTICATED
        key_only = dict(token_ids=list(range(32)), prefix_key="ab" * 32, **_kw(family))  # goes as TranslateByKey
        assert _code(lambda: c.translate(None, "S__S-self", **key_only)) == grpc.StatusCode.UNAUTHENTICATED
        assert c.endpoints.has_by_key == [True]
    with TranslateClient(
        ClientOptions(target=sc.address, timeout=10, auth_token="x" * 30, retry=Retry(retries=0))
    ) as c:
        assert _code(lambda: c.translate(kv, "S__S-self", **_kw(family))) == grpc.StatusCode.UNAUTHENTICATED
    with TranslateClient(ClientOptions(target=sc.address, timeout=10, auth_token=ALICE, retry=Retry(retries=0))) as c:
        assert c.translate(kv, "S__S-self", **_kw(family)).stats.tokens == 8
        assert [m.name for m in c.list_mappings()] == ["S__S-self"]
        # a caller cannot pick another tenant's namespace
        assert (
            _code(lambda: c.translate(kv, "S__S-self", tenant="bob", **_kw(family)))
            == grpc.StatusCode.PERMISSION_DENIED
        )
        assert c.translate(kv, "S__S-self", tenant="alice", **_kw(family)).stats.tokens == 8
    with grpc.insecure_channel(sc.address) as ch:  # kubelet probes carry no token
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_the_token_picks_the_prefix_namespace(sidecar_factory, maps_dir, tokens_file, family, redis_url):
    import redis

    sc = sidecar_factory(
        maps_dir=str(maps_dir),
        force_maps=True,
        auth_tokens_file=str(tokens_file),
        redis_url=redis_url,
        prefix_secret="s" * 32,
        prefix_block_size=16,
        prefix_write_back=True,
    )
    kv, ids = make_kv(layers=4, tokens=32, heads=2, head_dim=32), list(range(100, 132))
    with TranslateClient(ClientOptions(target=sc.address, timeout=10, auth_token=ALICE, retry=Retry(retries=0))) as c:
        c.translate(kv, "S__S-self", token_ids=ids, **_kw(family))
    r = redis.Redis.from_url(redis_url)
    wait_until(lambda: r.keys("kvf:*"), 5, "the write-back")  # it runs off the critical path
    tenants = {k.decode().split(":")[1] for k in r.keys("kvf:*")}
    assert tenants == {"alice"}
    with TranslateClient(ClientOptions(target=sc.address, timeout=10, auth_token=BOB, retry=Retry(retries=0))) as c:
        assert (
            c.translate(kv, "S__S-self", token_ids=ids, **_kw(family)).stats.cached_blocks == 0
        )  # bob sees none of alice's
    with TranslateClient(ClientOptions(target=sc.address, timeout=10, auth_token=ALICE, retry=Retry(retries=0))) as c:
        assert c.translate(kv, "S__S-self", token_ids=ids, **_kw(family)).stats.cached_blocks == 2


def test_mtls_identity_is_the_tenant(sidecar_factory, maps_dir, tmp_path, family, redis_url):
    import redis

    d = make_certs(tmp_path)
    sc = sidecar_factory(
        maps_dir=str(maps_dir),
        force_maps=True,
        tls_cert=str(d / "server.pem"),
        tls_key=str(d / "server.key"),
        tls_client_ca=str(d / "ca.pem"),
        auth_mtls_tenant=True,
        redis_url=redis_url,
        prefix_secret="s" * 32,
        prefix_block_size=16,
        prefix_write_back=True,
    )
    opts = ClientOptions(
        target=sc.address,
        timeout=10,
        retry=Retry(retries=0),
        tls=Tls(root_certs=str(d / "ca.pem"), client_cert=str(d / "client.pem"), client_key=str(d / "client.key")),
    )
    kv, ids = make_kv(layers=4, tokens=16, heads=2, head_dim=32), list(range(16))
    with TranslateClient(opts) as c:
        c.translate(kv, "S__S-self", token_ids=ids, **_kw(family))
        assert (
            _code(lambda: c.translate(kv, "S__S-self", tenant="other", **_kw(family)))
            == grpc.StatusCode.PERMISSION_DENIED
        )
    r = redis.Redis.from_url(redis_url)
    wait_until(lambda: r.keys("kvf:*"), 5, "the write-back")
    assert {k.decode().split(":")[1] for k in r.keys("kvf:*")} == {"client"}  # the certificate's CN


def test_authenticator_compares_digests_and_reads_its_file(tmp_path):
    auth = Authenticator({ALICE: "alice", BOB: "bob"})
    assert auth.identify([("authorization", f"Bearer {BOB}")], {}).tenant == "bob"
    assert auth.identify([("authorization", f"bearer {ALICE}")], {}).tenant == "alice"
    for md in (
        [],
        [("authorization", ALICE)],
        [("authorization", "Bearer " + ALICE[:-1])],
        [("authorization", "Basic x")],
    ):
        with pytest.raises(Unauthenticated):
            auth.identify(md, {})
    assert ALICE not in repr(auth.__dict__)  # only digests are kept
    bad = tmp_path / "bad"
    for text, needle in (
        ("alice short\n", "at least 16"),
        ("", "no '<tenant> <token>'"),
        (f"alice {ALICE}\nbob {ALICE}\n", "already given"),
        (f"a/b {ALICE}\n", "tenant"),
    ):
        bad.write_text(text)
        with pytest.raises(InvalidInput, match=needle):
            Authenticator.from_file(str(bad))
    mtls = Authenticator(mtls_identity=True)
    assert mtls.identify([], {"x509_common_name": [b"svc-a"]}).tenant == "svc-a"
    with pytest.raises(Unauthenticated):
        mtls.identify([], {})
    with pytest.raises(PermissionDenied):
        mtls.identify([], {"x509_common_name": [b"../etc"]})


def test_a_stalled_stream_is_cut_off_by_the_server_deadline(sidecar_factory, maps_dir, family):
    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True, max_stream_seconds=1.0)
    kv = make_kv(layers=4, tokens=8, heads=2, head_dim=32)
    reqs = list(encode_requests(make_spec(kv, "S__S-self", **_kw(family)), kv, 8))

    release, stalled_over = threading.Event(), threading.Event()

    def stall():
        yield reqs[0]
        release.wait(30)  # sends no chunks until the test has its answer
        stalled_over.set()

    with grpc.insecure_channel(sc.address) as ch:
        code = _code(lambda: list(pb_grpc.TranslateServiceStub(ch).Translate(stall(), timeout=30)))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not stalled_over.is_set()  # the server cut the stream off while its caller was still stalled
    release.set()
    with TranslateClient(
        ClientOptions(target=sc.address, timeout=10, retry=Retry(retries=0))
    ) as c:  # the slot was freed
        assert c.translate(kv, "S__S-self", **_kw(family)).stats.tokens == 8
    assert sample(sc, "kvferry_active_streams") == 0


@pytest.mark.parametrize(
    "name,version",
    [
        ("../../etc/passwd", ""),
        ("S__S-self", "../../1.0.0"),
        ("S__S-self/../x", "1.0.0"),
        ("/abs", "1.0.0"),
        ("S__S-self", "1.0.0/../../x"),
    ],
)
def test_map_names_cannot_leave_the_registry(sidecar_factory, maps_dir, family, name, version):
    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True)
    kv = make_kv(layers=4, tokens=8, heads=2, head_dim=32)
    with TranslateClient(ClientOptions(target=sc.address, timeout=10, retry=Retry(retries=0))) as c:
        assert _code(lambda: c.translate(kv, name, version, **_kw(family))) == grpc.StatusCode.NOT_FOUND


def test_no_code_executing_formats_anywhere():
    """safetensors and protobuf only: no pickle, no torch.load, no eval of data."""
    banned = re.compile(
        r"\bimport pickle\b|\bpickle\.|\btorch\.load\(|\bmarshal\.|\bshelve\b|"
        r"(?<![.\w])eval\(|(?<![.\w])exec\(|yaml\.load\("
    )
    offenders = []
    for folder in ("kvferry", "mappings", "sidecar", "client", "scripts"):
        for f in (ROOT / folder).rglob("*.py"):
            if "_pb2" in f.name:
                continue
            for no, line in enumerate(f.read_text().splitlines(), 1):
                if banned.search(line):
                    offenders.append(f"{f.relative_to(ROOT)}:{no}: {line.strip()}")
    assert not offenders, offenders
    pickled = [p for p in (ROOT / "models").rglob("*") if p.is_file() and p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    assert not pickled, f"pickled weights shipped: {pickled}"


def test_header_sizes_are_checked_before_allocation(sidecar_factory, maps_dir, family):
    """A header declaring a huge request is refused at once, whatever bytes follow."""
    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True, max_tokens=1 << 20, max_request_bytes=1 << 20)
    kv = make_kv(layers=4, tokens=8, heads=2, head_dim=32)
    spec = make_spec(kv, "S__S-self", **_kw(family))
    huge = dataclasses.replace(spec, num_tokens=8000)  # 16 MB of source KV declared, within max_position_embeddings
    reqs = list(encode_requests(huge, [], 8))
    with grpc.insecure_channel(sc.address) as ch, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.TranslateServiceStub(ch).Translate(iter(reqs), timeout=10))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max-request-bytes" in e.value.details()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_source_kv_is_refused(sidecar_factory, maps_dir, family, bad):
    """NaN/Inf in the source cache would map to NaN/Inf in the target's: INVALID_ARGUMENT, before any compute."""
    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True)
    kv = make_kv(layers=4, tokens=8, heads=2, head_dim=32)
    kv[2][1][0, 1, 5, 7] = bad
    with TranslateClient(ClientOptions(target=sc.address, timeout=10, retry=Retry(retries=0))) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.translate(kv, "S__S-self", **_kw(family))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN or infinite" in e.value.details()
        assert (
            c.translate(make_kv(layers=4, tokens=8, heads=2, head_dim=32), "S__S-self", **_kw(family)).stats.tokens == 8
        )


def test_tenant_names_are_matched_whole():
    from kvferry.common.prefix import check_tenant

    assert check_tenant("alice") == "alice"
    for bad in ("alice\n", "\nalice", "al ice", "a" * 65, ""):
        with pytest.raises(InvalidInput):
            check_tenant(bad)


def test_long_identifiers_and_surplus_token_ids_are_refused_unechoed(sidecar_factory, maps_dir, family):
    """A 20 kB map name used to come back in a NOT_FOUND message (and past the caller's size limits); 100k
    token_ids for a 1-token request used to be hashed and looked up before any size check."""
    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True)
    kv = make_kv(layers=4, tokens=8, heads=2, head_dim=32)
    spec = make_spec(kv, "S__S-self", **_kw(family))
    cases = [
        (dataclasses.replace(spec, map_name="m" * 20_000), "map.name is 20000 characters"),
        (dataclasses.replace(spec, tenant="t" * 5_000), "tenant is 5000 characters"),
        (dataclasses.replace(spec, num_tokens=1, token_ids=tuple(range(100_000))), "100000 token_ids for num_tokens=1"),
    ]
    with grpc.insecure_channel(sc.address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        for bad, needle in cases:
            with pytest.raises(grpc.RpcError) as e:
                list(pb_grpc.TranslateServiceStub(ch).Translate(iter(list(encode_requests(bad, [], 8))), timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert needle in e.value.details() and len(e.value.details()) < 300


def test_a_caller_that_stops_reading_loses_its_slot_at_the_deadline(sidecar_factory, maps_dir, family):
    """Clients that never read their response used to hold their stream slots past --max-stream-seconds (the
    deadline only covered receiving); now time blocked sending counts too."""
    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True, max_streams=1, max_stream_seconds=3)
    kv = make_kv(layers=4, tokens=4096, heads=2, head_dim=32)  # 8 MiB of target KV back: far past a 64 KiB window
    reqs = list(encode_requests(make_spec(kv, "S__S-self", **_kw(family)), kv, 512))
    opts = [("grpc.http2.bdp_probe", 0), ("grpc.max_receive_message_length", 64 << 20)]  # no window growth
    with grpc.insecure_channel(sc.address, opts) as ch:
        stalled = pb_grpc.TranslateServiceStub(ch).Translate(iter(reqs), timeout=60)  # never read from
        wait_until(lambda: sample(sc, "kvferry_active_streams") == 1, what="the stalled stream holding the slot")
        wait_until(lambda: sample(sc, "kvferry_active_streams") == 0, timeout=15, what="the slot freed at the deadline")
        with TranslateClient(
            ClientOptions(target=sc.address, timeout=10, retry=Retry(retries=0))
        ) as c:  # the one slot is free again
            assert (
                c.translate(make_kv(layers=4, tokens=8, heads=2, head_dim=32), "S__S-self", **_kw(family)).stats.tokens
                == 8
            )
        with pytest.raises(grpc.RpcError) as e:
            list(stalled)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "did not read" in e.value.details()


def test_oversized_headers_are_refused_unparsed(sidecar_factory, maps_dir):
    """One 32 MB header of 8M token_ids with num_tokens=1 cost ~600 MB of server memory before it was refused:
    a header larger than any request within --max-tokens needs is now refused before it is parsed."""
    from kvferry.common import wire
    from kvferry.sidecar.limits import Limits, OversizedHeader, request_decoder
    from kvferry.v1 import translate_pb2 as pb
    from kvferry.v1 import translate_pb2_grpc as pb_grpc

    limits = Limits(max_tokens=1000)
    n = 100_000
    big = pb.TranslateRequest(
        header=pb.TranslateHeader(
            map=pb.MapRef(name="S__S-self", latest=True), num_tokens=n, token_ids=range(n), source_dtype=1
        )
    ).SerializeToString()

    def never(data):
        raise AssertionError("the oversized header was parsed")

    out = request_decoder(limits, never)(big)
    assert isinstance(out, OversizedHeader) and out.size == len(big) > limits.max_header_bytes
    # a crafted message that hides the header behind another field is parsed, then dropped
    chunk_first = pb.TranslateRequest(chunk=pb.SourceChunk(layer=1)).SerializeToString()
    assert isinstance(request_decoder(limits, wire.decode_request)(chunk_first + big), OversizedHeader)
    ok = pb.TranslateRequest(header=pb.TranslateHeader(num_tokens=1000, token_ids=[49151] * 1000)).SerializeToString()
    assert request_decoder(limits, wire.decode_request)(ok).header.num_tokens == 1000  # the widest legal one

    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True, max_tokens=1000)
    with grpc.insecure_channel(sc.address) as ch, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.TranslateServiceStub(ch).Translate(iter([pb.TranslateRequest.FromString(big)]), timeout=30))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-tokens" in e.value.details()
    # TranslateByKey's one message: the same cap, refused before parsing too
    from kvferry.client.client import BY_KEY_METHOD
    from kvferry.sidecar.limits import by_key_decoder

    assert isinstance(by_key_decoder(limits, never)(big), OversizedHeader)
    assert by_key_decoder(limits, pb.TranslateByKeyRequest.FromString)(ok).header.num_tokens == 1000
    with grpc.insecure_channel(sc.address) as ch, pytest.raises(grpc.RpcError) as e:
        list(ch.unary_stream(BY_KEY_METHOD)(big, timeout=30))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-tokens" in e.value.details()


@pytest.mark.parametrize("tenant", ["alice\n", "alice\0", "al ice", "a" * 65])
def test_a_bad_tenant_is_refused_on_every_request(sidecar_factory, maps_dir, family, tenant):
    """Whether or not the request carries token ids (and so would ever reach the prefix store), and whether or not
    calls are authenticated, a tenant that is not a valid name is refused the same way, in one place."""
    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True)
    kv = make_kv(layers=4, tokens=8, heads=2, head_dim=32)
    with TranslateClient(ClientOptions(target=sc.address, timeout=10, retry=Retry(retries=0))) as c:
        for ids in ((), tuple(range(8))):
            with pytest.raises(grpc.RpcError) as e:
                c.translate(kv, "S__S-self", tenant=tenant, token_ids=ids, **_kw(family))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "header.tenant" in e.value.details()
        assert c.translate(kv, "S__S-self", tenant="alice", **_kw(family)).stats.tokens == 8


def test_callers_cut_off_at_the_deadline_leave_no_traceback(sidecar_factory, maps_dir, family, caplog):
    """Three callers that stop reading, then cancel: each is cut off at max_stream_seconds (DEADLINE_EXCEEDED counted)
    and the sidecar logs no error: a status that cannot reach a caller who has gone is an expected end."""
    import logging
    import threading

    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True, max_stream_seconds=1.0)
    kv = make_kv(layers=4, tokens=4096, heads=2, head_dim=32)
    reqs = list(encode_requests(make_spec(kv, "S__S-self", **_kw(family)), kv, 512))
    opts = [("grpc.http2.bdp_probe", 0), ("grpc.max_receive_message_length", 64 << 20)]

    def counted():
        return sample(sc, "kvferry_requests_total", method="Translate", code="DEADLINE_EXCEEDED")

    caplog.set_level(logging.WARNING)
    cut_off = threading.Event()

    def stalled():
        with grpc.insecure_channel(sc.address, opts) as ch:
            call = pb_grpc.TranslateServiceStub(ch).Translate(iter(reqs), timeout=60)
            next(call)  # one message read, then none
            cut_off.wait(20)
            call.cancel()

    threads = [threading.Thread(target=stalled) for _ in range(3)]
    for t in threads:
        t.start()
    wait_until(lambda: counted() >= 3, 20, "three stalled calls counted")
    cut_off.set()
    for t in threads:
        t.join()
    assert counted() == 3
    wait_until(lambda: sample(sc, "kvferry_active_streams") == 0, 20, "no stream in flight")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
