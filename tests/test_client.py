"""Client behaviour against a real sidecar: async API, retries, TLS, fallback, the cascade."""

import asyncio
import itertools
import re
import time

import grpc
import pytest
import torch
from conftest import RunningSidecar, make_certs, make_kv

from kvferry.client.cascade import Cascade
from kvferry.client.client import AsyncTranslateClient, ClientOptions, Retry, SharedMemory, Tls, TranslateClient
from kvferry.client.rollout import MapRollout
from kvferry.common.errors import InvalidInput
from kvferry.mappings.lab.capture import capture_kv


@pytest.fixture(scope="module")
def maps_dir(self_maps):
    return self_maps


def test_async_client(sidecar_factory, maps_dir):
    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True)
    kv = make_kv(layers=4, tokens=40, heads=2, head_dim=32)

    async def go():
        async with AsyncTranslateClient(ClientOptions(target=sc.address, chunk_tokens=16)) as c:
            (m,) = await c.list_mappings()
            results = await asyncio.gather(*[c.translate(kv, m.name, layout="paged", block_size=8) for _ in range(3)])
        return results

    for res in asyncio.run(go()):
        # chunks of 16 tokens complete two pages of 8 at a time: blocks of 2, 2 and 1 pages a layer
        assert res.stats.blocks == 4 * 3 and [b.key.shape[0] for b in res.blocks if b.layer == 0] == [2, 2, 1]
        assert res.blocks[0].key.shape == (2, 8, 2, 32) and [b.index for b in res.blocks if b.layer == 0] == [0, 2, 4]
        torch.testing.assert_close(res.blocks[0].value[1, :, 1], kv[0][1][0, 1, 8:16])


def test_source_chunks_default_to_about_two_mebibytes(sidecar_factory, maps_dir):
    """chunk_tokens 0 (the default) sends as many tokens per chunk as fill CHUNK_BYTES of one layer's K or V, within
    the channel's message limit; an explicit chunk_tokens is kept. The automatic chunks translate like any other."""
    from kvferry.client.client import CHUNK_BYTES, chunk_tokens_for, encode_requests, make_spec

    assert ClientOptions().tokens_per_chunk(3 * 64 * 4) == CHUNK_BYTES // 768 == 2730  # SmolLM2-135M, fp32
    assert ClientOptions(chunk_tokens=100).tokens_per_chunk(768) == 100
    assert ClientOptions(max_message_bytes=64 << 10).tokens_per_chunk(768) < (64 << 10) // 768
    with pytest.raises(InvalidInput, match="chunk_tokens"):
        ClientOptions(chunk_tokens=-1)
    kv = make_kv(layers=4, tokens=5000, heads=2, head_dim=32)  # 256 bytes a token: 8192 tokens fill 2 MiB
    auto = chunk_tokens_for(ClientOptions(), kv)
    assert auto == 8192 and len(list(encode_requests(make_spec(kv, "S__S-self"), kv, auto))) == 1 + 4 * 2
    assert len(list(encode_requests(make_spec(kv, "S__S-self"), kv, 512))) == 1 + 4 * 2 * 10  # the old default
    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True)
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        for (k, v), (tk, tv) in zip(kv, c.translate(kv, "S__S-self").layers()):
            torch.testing.assert_close(tk, k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(tv, v, rtol=1e-5, atol=1e-5)


def test_unavailable_is_retried_until_the_server_appears(maps_dir):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    opts = ClientOptions(target=f"127.0.0.1:{port}", timeout=5, retry=Retry(retries=8, backoff=0.1))
    kv = make_kv(layers=4, tokens=8, heads=2, head_dim=32)
    import threading

    holder = {}
    timer = threading.Timer(
        0.4, lambda: holder.setdefault("sc", RunningSidecar(maps_dir=str(maps_dir), force_maps=True, port=port))
    )
    timer.start()
    try:
        with TranslateClient(opts) as c:
            res = c.translate(kv, "S__S-self")
        assert res.attempts > 1 and res.info.map_version == "1.0.0"
    finally:
        timer.join()
        if "sc" in holder:
            holder["sc"].stop()


def test_unavailable_gives_up_after_retries():
    opts = ClientOptions(target="127.0.0.1:1", timeout=2, retry=Retry(retries=2, backoff=0.01))
    with TranslateClient(opts) as c, pytest.raises(grpc.RpcError) as e:
        c.translate(make_kv(layers=4, tokens=8, heads=2, head_dim=32), "S__S-self")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls(sidecar_factory, maps_dir, tmp_path):
    d = make_certs(tmp_path)
    sc = sidecar_factory(
        maps_dir=str(maps_dir),
        force_maps=True,
        tls_cert=str(d / "server.pem"),
        tls_key=str(d / "server.key"),
        tls_client_ca=str(d / "ca.pem"),
    )
    kv = make_kv(layers=4, tokens=8, heads=2, head_dim=32)
    good = ClientOptions(
        target=sc.address,
        timeout=10,
        retry=Retry(retries=0),
        tls=Tls(root_certs=str(d / "ca.pem"), client_cert=str(d / "client.pem"), client_key=str(d / "client.key")),
    )
    with TranslateClient(good) as c:
        assert c.translate(kv, "S__S-self").stats.tokens == 8
    no_cert = ClientOptions(
        target=sc.address, timeout=10, retry=Retry(retries=0), tls=Tls(root_certs=str(d / "ca.pem"))
    )
    with TranslateClient(no_cert) as c, pytest.raises(grpc.RpcError) as e:
        c.translate(kv, "S__S-self")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    plaintext = ClientOptions(target=sc.address, timeout=5, retry=Retry(retries=0))
    with TranslateClient(plaintext) as c, pytest.raises(grpc.RpcError):
        c.translate(kv, "S__S-self")


def _counter(reason: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("kvferry_client_fallbacks_total", {"reason": reason}) or 0.0


def test_cascade_mapped_path_matches_full_prefill_and_falls_back(sidecar_factory, maps_dir, family):
    s = family["S"]
    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True)
    ids = torch.randint(2, 4096, (1, 120))
    src = capture_kv(s.model, ids)
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        cascade = Cascade(s.model, c, "S__S-self", MapRollout(refresh=8, min_tokens=32), s.identity)
        mapped = cascade.generate(ids, src, max_new_tokens=12)
        gold = cascade.full_prefill(ids, 12)
        assert mapped.path == "mapped" and mapped.tokens == gold.tokens
        before = _counter("short_prompt")
        short = cascade.generate(ids[:, :20], capture_kv(s.model, ids[:, :20]), max_new_tokens=4)
        assert (
            short.path == "fallback"
            and short.reason.startswith("short_prompt")
            and _counter("short_prompt") == before + 1
        )
        missing = Cascade(s.model, c, "S__S-self", MapRollout(version="7.7.7", refresh=8, min_tokens=32), s.identity)
        res = missing.generate(ids, src, max_new_tokens=12)
        assert res.path == "fallback" and res.reason.startswith("map_not_found") and res.tokens == gold.tokens
    sc.stop()
    with TranslateClient(ClientOptions(target=sc.address, timeout=2, retry=Retry(retries=1, backoff=0.01))) as c:
        down = Cascade(s.model, c, "S__S-self", MapRollout(refresh=8, min_tokens=32), s.identity)
        res = down.generate(ids, src, max_new_tokens=12)
    assert res.path == "fallback" and res.reason.startswith("sidecar_unavailable") and res.tokens == gold.tokens


def test_gated_map_falls_back(sidecar_factory, maps_dir, family):
    s = family["S"]
    sc = sidecar_factory(maps_dir=str(maps_dir))  # gates on: the identity map has no evidence
    ids = torch.randint(2, 4096, (1, 80))
    with TranslateClient(ClientOptions(target=sc.address, retry=Retry(retries=0))) as c:
        res = Cascade(s.model, c, "S__S-self", MapRollout(refresh=8, min_tokens=32), s.identity).generate(
            ids, capture_kv(s.model, ids), max_new_tokens=4
        )
    assert res.path == "fallback" and res.reason.startswith("map_gated_or_incompatible")


def test_vllm_connector_settings_are_validated_once(tmp_path):
    from kvferry.client.connector_config import ConnectorConfig
    from kvferry.mappings.errors import InvalidInput

    cfg = ConnectorConfig.from_extra(
        {
            "redis_url": "redis://r:6379/0",
            "prefix_secret": "x" * 32,
            "prefix_block_size": "256",
            "refresh": 16,
            "sidecar": "s:1",
            "map_name": "S__T",
            "timeout": "5",
        }
    )
    assert cfg.prefix_block_size == 256 and cfg.timeout == 5.0 and cfg.secret() == b"x" * 32 and not cfg.direct_reads
    assert cfg.token() == "" and not cfg.layer_by_layer and cfg.async_loads
    (tmp_path / "secret").write_text("s" * 32 + "\n")
    (tmp_path / "token").write_text("t0k3n\n")
    files = ConnectorConfig.from_extra(
        {
            "redis_url": "redis://r",
            "prefix_secret_file": str(tmp_path / "secret"),
            "auth_token_file": str(tmp_path / "token"),
        }
    )
    assert files.secret() == b"s" * 32 and files.token() == "t0k3n"  # kept out of the settings vLLM logs
    with pytest.raises(InvalidInput, match="auth_token or auth_token_file, not both"):
        ConnectorConfig.from_extra(
            {
                "redis_url": "redis://r",
                "prefix_secret": "x",
                "auth_token": "a",
                "auth_token_file": str(tmp_path / "token"),
            }
        )
    base = {"redis_url": "redis://r", "prefix_secret": "x"}
    assert [
        ConnectorConfig.from_extra({**base, "direct_reads": v}).direct_reads
        for v in (True, "true", "1", False, "False", "0")
    ] == [True, True, True, False, False, False]
    with pytest.raises(
        InvalidInput, match=r"kvferry connector: direct_reads: expected true or false .*got 'yes please'"
    ):
        ConnectorConfig.from_extra({**base, "direct_reads": "yes please"})
    with pytest.raises(InvalidInput, match="refresh: cannot read 'sixteen' as int"):  # was a bare ValueError
        ConnectorConfig.from_extra({**base, "refresh": "sixteen"})
    for extra, needle in (
        ({"prefix_secret": "x"}, "redis_url"),
        ({"redis_url": "redis://r"}, "prefix_secret"),
        ({"redis_url": "redis://r", "prefix_secret": "x", "bogus": 1}, "unknown"),
        ({"redis_url": "redis://r", "prefix_secret": "x", "refresh": 64, "min_tokens": 32}, "min_tokens"),
    ):
        with pytest.raises(InvalidInput, match=needle):
            ConnectorConfig.from_extra(extra)


def _hostile_server(seconds: int, nanos: int = 0):
    """A real gRPC server that answers every Translate with RESOURCE_EXHAUSTED and a RetryInfo of ``seconds``."""
    from concurrent import futures

    from google.protobuf import any_pb2, duration_pb2
    from google.rpc import code_pb2, error_details_pb2, status_pb2
    from grpc_status import rpc_status

    calls = []

    def translate(requests, context):
        calls.append(time.monotonic())
        for _ in requests:  # read to the end first: an asyncio client that is still writing when a call ends early
            pass  # reports INTERNAL instead of the server's status (grpc/grpc#36066)
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=seconds, nanos=nanos)))
        context.abort_with_status(
            rpc_status.to_status(
                status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message="busy, come back later", details=[detail])
            )
        )

    server = grpc.server(futures.ThreadPoolExecutor(4))
    handler = grpc.stream_stream_rpc_method_handler(translate)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("kvferry.v1.TranslateService", {"Translate": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, calls


@pytest.mark.parametrize("seconds", [10**9, 315_576_000_000, -5, 3])
def test_a_servers_retry_hint_never_outlasts_the_callers_deadline(seconds):
    """A hostile (or man-in-the-middle) server asks the client to wait years, an amount past what a duration holds,
    a negative time, or 3 s: the call ends with that server's own gRPC error within the caller's 1.5 s timeout."""
    server, port, calls = _hostile_server(seconds)
    try:
        opts = ClientOptions(target=f"127.0.0.1:{port}", timeout=1.5, retry=Retry(retries=5, backoff=0.01))
        kv = make_kv(layers=4, tokens=8, heads=2, head_dim=32)
        t0 = time.monotonic()
        with TranslateClient(opts) as c, pytest.raises(grpc.RpcError) as e:
            c.translate(kv, "S__S-self")
        assert time.monotonic() - t0 < 1.5
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and len(calls) == 1

        async def run():
            async with AsyncTranslateClient(opts) as ac:
                await ac.translate(kv, "S__S-self")

        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            asyncio.run(run())
        assert time.monotonic() - t0 < 1.5 and e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and len(calls) == 2
    finally:
        server.stop(None)


def test_a_sane_retry_hint_is_honoured_within_the_deadline():
    server, port, calls = _hostile_server(0, 200_000_000)  # 0.2 s
    try:
        opts = ClientOptions(target=f"127.0.0.1:{port}", timeout=5, retry=Retry(retries=2, backoff=0.01))
        with TranslateClient(opts) as c, pytest.raises(grpc.RpcError):
            c.translate(make_kv(layers=4, tokens=8, heads=2, head_dim=32), "S__S-self")
        assert len(calls) == 3 and all(b - a >= 0.2 for a, b in itertools.pairwise(calls))
    finally:
        server.stop(None)


def test_failed_calls_raise_the_services_typed_errors(sidecar_factory, maps_dir, family):
    """One table (kvferry.common.status) both ways: the sidecar's domain error becomes a status, and the client
    raises that domain class again, which is also a grpc.RpcError with the status's code and details."""
    from kvferry.common.errors import NotFound, Unavailable
    from kvferry.common.status import _CLIENT_CLASSES, STATUS, ServiceError
    from kvferry.mappings.errors import InvalidInput, KvferryError

    for code, cls in _CLIENT_CLASSES.items():
        assert (cls in STATUS and STATUS[cls] == code) or code in (
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
    sc = sidecar_factory(maps_dir=str(maps_dir), force_maps=True)
    kv = make_kv(layers=4, tokens=8, heads=2, head_dim=32)
    s = family["S"].identity
    kw = dict(source_geometry=s.geometry.fingerprint, tokenizer=s.tokenizer)
    with TranslateClient(ClientOptions(target=sc.address, timeout=10, retry=Retry(retries=0))) as c:
        with pytest.raises(NotFound) as e:
            c.translate(kv, "no__such-map", **kw)
        assert (
            isinstance(e.value, grpc.RpcError)
            and isinstance(e.value, ServiceError)
            and isinstance(e.value, KvferryError)
        )
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "no__such-map" in e.value.details()
        with pytest.raises(InvalidInput):
            c.translate(kv, "S__S-self", tenant="bad tenant", **kw)
        with pytest.raises(TypeError):
            c.translate(kv, "S__S-self", not_a_header_field=1)  # named arguments only: a typo is an error
    with TranslateClient(ClientOptions(target="127.0.0.1:1", timeout=2, retry=Retry(retries=0))) as c:
        with pytest.raises(Unavailable):
            c.translate(kv, "S__S-self", **kw)
        with pytest.raises(Unavailable):
            c.list_mappings()


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: Retry(retries=-1), "retries must be in [0, 100]"),
        (lambda: Retry(backoff=float("nan")), "backoff"),
        (lambda: Tls(root_certs="ca.pem", client_cert="c.pem"), "client_cert and client_key together"),
        (lambda: Tls(server_name="sidecar"), "need root_certs"),
        (lambda: SharedMemory(dir="/shm", file_mode=0o666), "0o600 or 0o660"),
        (lambda: SharedMemory(region_bytes=0), "region_bytes"),
        (lambda: SharedMemory(idle_files=-1), "idle_files"),
        (lambda: ClientOptions(timeout=0), "timeout"),
        (lambda: ClientOptions(max_message_bytes=10), "max_message_bytes"),
    ],
)
def test_client_options_refuse_bad_values_where_they_are_made(make, words):
    """Each option group checks its own fields when it is built, with the package's InvalidInput naming the field."""
    with pytest.raises(InvalidInput, match=re.escape(words)):
        make()


def test_request_keywords_are_one_dataclass():
    """translate, stream and make_spec take Request's fields as keywords; an unknown one is refused by name."""
    from kvferry.client.client import Request, make_spec

    kv = make_kv(layers=2, tokens=4, heads=2, head_dim=8)
    spec = make_spec(kv, "S__S-self", tenant="acme", block_size=8, layout="paged", pages_per_block=2)
    assert (spec.tenant, spec.block_size, spec.pages_per_block, spec.num_tokens) == ("acme", 8, 2, 4)
    assert Request().layout == "contiguous"
    with pytest.raises(TypeError, match="tenat"):
        make_spec(kv, "S__S-self", tenat="acme")
