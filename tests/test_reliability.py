"""Faults under load (real sidecars on loopback, a real redis-server): nothing that should succeed fails,
and nothing is lost."""

import threading

import grpc
import pytest
import torch
from conftest import make_kv, sample, spec_kw, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvferry.client.client import ClientOptions, Retry, TranslateClient

WORKERS, PER_WORKER = 4, 12


@pytest.fixture(scope="module")
def maps_dir(self_maps):
    return self_maps


def _kw(family):
    return spec_kw(family["S"])


def _load(options: ClientOptions, family, during, token_ids: bool = False):
    """WORKERS threads x PER_WORKER translates; ``during()`` runs once the load is under way.
    Returns (results checked against their input, errors)."""
    ok, errors = [], []
    started = threading.Barrier(WORKERS + 1)

    def worker(w: int):
        kv = make_kv(layers=4, tokens=64, heads=2, head_dim=32, seed=w)
        with TranslateClient(options) as c:
            started.wait()
            for i in range(PER_WORKER):
                ids = list(range(w * 1000 + i * 64, w * 1000 + i * 64 + 64)) if token_ids else ()
                try:
                    res = c.translate(kv, "S__S-self", token_ids=ids, **_kw(family))
                    torch.testing.assert_close(
                        res.layers()[2][0], kv[2][0], rtol=1e-5, atol=1e-5
                    )  # nothing lost or mixed up
                    ok.append(res)
                except (grpc.RpcError, AssertionError) as e:
                    errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(WORKERS)]
    for t in threads:
        t.start()
    started.wait()
    wait_until(lambda: len(ok) + len(errors) >= WORKERS, 60, "a request per worker")  # the load is under way
    during()
    for t in threads:
        t.join(120)
    return ok, errors


def test_redis_killed_mid_load_fails_no_streamed_request(sidecar_factory, maps_dir, family, redis_url, redis_server):
    sc = sidecar_factory(
        maps_dir=str(maps_dir), force_maps=True, redis_url=redis_url, prefix_secret="s" * 32, prefix_block_size=16
    )
    ok, errors = _load(
        ClientOptions(target=sc.address, timeout=30, retry=Retry(retries=0)), family, redis_server.stop, token_ids=True
    )
    assert not errors, errors[:3]
    assert len(ok) == WORKERS * PER_WORKER
    assert sample(sc, "kvferry_prefix_store_errors_total") >= 1  # the outage was noticed, and served through


def test_sigterm_under_load_drains_and_clients_fail_over(sidecar_factory, maps_dir, family):
    a = sidecar_factory(maps_dir=str(maps_dir), force_maps=True, drain_seconds=10, drain_notice_seconds=1.0)
    b = sidecar_factory(maps_dir=str(maps_dir), force_maps=True)
    health = {}

    def drain_a():
        done = threading.Thread(target=lambda: a.call(a.sidecar.drain()))
        done.start()
        with grpc.insecure_channel(a.address) as ch:

            def check():
                return (
                    health_pb2_grpc.HealthStub(ch)
                    .Check(health_pb2.HealthCheckRequest(service="kvferry.v1.TranslateService"), timeout=5)
                    .status
                )

            wait_until(lambda: check() != health_pb2.HealthCheckResponse.SERVING, 10, "the drain's health change")
            health["a"] = check()
        done.join(30)

    opts = ClientOptions(target=a.address, endpoints=(b.address,), timeout=30, retry=Retry(retries=4, backoff=0.02))
    ok, errors = _load(opts, family, drain_a)
    assert not errors, errors[:3]
    assert len(ok) == WORKERS * PER_WORKER
    assert health["a"] == health_pb2.HealthCheckResponse.NOT_SERVING

    def served(sc):
        return sample(sc, "kvferry_requests_total", method="Translate", code="OK")

    assert served(a) > 0 and served(b) > 0  # both took load: a until it drained, b after
    assert served(a) + served(b) == WORKERS * PER_WORKER  # every in-flight stream on a finished
    refused = sample(a, "kvferry_requests_total", method="Translate", code="UNAVAILABLE")
    assert refused >= 1 or served(b) == WORKERS * PER_WORKER  # new streams on the draining sidecar were turned away


def test_failover_skips_an_endpoint_that_is_down(sidecar_factory, maps_dir, family):
    b = sidecar_factory(maps_dir=str(maps_dir), force_maps=True)
    opts = ClientOptions(target="127.0.0.1:1", endpoints=(b.address,), timeout=10, retry=Retry(retries=2, backoff=0.01))
    with TranslateClient(opts) as c:
        res = c.translate(make_kv(layers=4, tokens=8, heads=2, head_dim=32), "S__S-self", **_kw(family))
    assert res.attempts == 2 and res.stats.tokens == 8
