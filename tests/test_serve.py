"""`kvferry serve` as a real process: config from flags/env/file, graceful drain on SIGTERM."""

import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from conftest import make_kv, wait_until

from kvferry.client.client import encode_requests, make_spec
from kvferry.mappings.artifact import save
from kvferry.mappings.errors import InvalidInput
from kvferry.mappings.lab.fit import identity_mapset
from kvferry.sidecar.config import SidecarConfig, from_sources
from kvferry.v1 import translate_pb2_grpc as pb_grpc


def test_config_precedence_and_validation(tmp_path):
    f = tmp_path / "kvferry.toml"
    f.write_text('[sidecar]\nport = 7000\nmax_streams = 5\nmaps_dir = "/m"\n')
    import argparse

    a = argparse.Namespace(config=str(f), port=None, max_streams=9, maps_dir=None)
    c = from_sources(a, env={"KVFERRY_PORT": "7001", "KVFERRY_FORCE_MAPS": "true"})
    assert (c.port, c.max_streams, c.maps_dir, c.force_maps) == (7001, 9, "/m", True)
    with pytest.raises(InvalidInput, match="unknown config keys"):
        f.write_text("prot = 1\n")
        from_sources(argparse.Namespace(config=str(f)), env={})
    with pytest.raises(InvalidInput):
        SidecarConfig(max_streams=0)
    with pytest.raises(InvalidInput, match="tls_cert and tls_key"):
        SidecarConfig(tls_cert="a.pem")
    with pytest.raises(InvalidInput, match="cannot read"):
        from_sources(argparse.Namespace(config=None), env={"KVFERRY_PORT": "eighty"})


def test_settings_read_alike_in_the_sidecar_and_the_connector():
    """One reader (kvferry.common.settings) for both: a boolean is true/false or an unambiguous word, and a typo is
    refused instead of read as false (the sidecar read any unknown text as false)."""
    import argparse

    from kvferry.client.connector_config import ConnectorConfig
    from kvferry.common.settings import read_setting

    words = {"true": True, "ON": True, "yes": True, "1": True, "false": False, "Off": False, "no": False, "0": False}
    for text, want in words.items():
        assert from_sources(argparse.Namespace(config=None), env={"KVFERRY_FORCE_MAPS": text}).force_maps is want
        extra = {"redis_url": "redis://r", "prefix_secret": "x", "direct_reads": text}
        assert ConnectorConfig.from_extra(extra).direct_reads is want
    with pytest.raises(InvalidInput, match=r"force_maps: expected true or false .*got 'flase'"):
        from_sources(argparse.Namespace(config=None), env={"KVFERRY_FORCE_MAPS": "flase"})
    with pytest.raises(InvalidInput, match="expected a number"):
        read_setting("port", "int", True)
    assert read_setting("timeout", "float", "2.5") == 2.5 and read_setting("tenant", "str", 7) == "7"


def test_the_connector_takes_its_rollout_defaults_and_checks_from_the_rollout():
    """min_tokens and refresh have one home (MapRollout): the connector's defaults are its, and so is the check that
    min_tokens exceeds refresh; the policy file's reload interval is a checked number."""
    from kvferry.client.connector_config import ConnectorConfig
    from kvferry.client.rollout import MapRollout

    base = {"redis_url": "redis://r", "prefix_secret": "x"}
    cfg = ConnectorConfig.from_extra(base)
    assert (cfg.min_tokens, cfg.refresh) == (MapRollout().min_tokens, MapRollout().refresh)
    with pytest.raises(InvalidInput, match="kvferry connector: min_tokens must exceed refresh"):
        ConnectorConfig.from_extra({**base, "min_tokens": 16, "refresh": 16})
    with pytest.raises(InvalidInput, match=r"policy_reload_seconds must be in \[0, 3600\]"):
        ConnectorConfig.from_extra({**base, "policy_reload_seconds": -1})
    assert ConnectorConfig.from_extra({**base, "policy_reload_seconds": 0}).policy_reload_seconds == 0


def _serve(maps_dir, *flags: str) -> tuple[subprocess.Popen, int, int | None]:
    """`kvferry serve` in its own process: (the process, its gRPC port, its metrics port if it has one)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvferry", "serve", "--maps-dir", str(maps_dir), "--port", "0", "--force-maps", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 60
    while time.time() < deadline:
        m = re.search(r"listening on [\d.]+:(\d+)(?:, metrics on :(\d+))?", proc.stdout.readline())
        if m:
            return proc, int(m.group(1)), int(m.group(2)) if m.group(2) else None
    proc.kill()
    raise AssertionError("the sidecar did not report its port")


def test_sigterm_drains_in_flight_streams(tmp_path, family):
    save(identity_mapset(family["S"].identity, version="1.0.0"), tmp_path)
    proc, port, _ = _serve(tmp_path, "--drain-seconds", "20")
    try:
        kv = make_kv(layers=4, tokens=32, heads=2, head_dim=32)
        reqs = list(encode_requests(make_spec(kv, "S__S-self"), kv, chunk_tokens=32))
        got_header, release = threading.Event(), threading.Event()

        def slow():
            yield from reqs[:4]
            release.wait(30)  # the stream stays in flight until the drain has been seen refusing new ones
            yield from reqs[4:]

        result = {}

        def run():
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                msgs = []
                for m in pb_grpc.TranslateServiceStub(ch).Translate(slow(), timeout=30):
                    msgs.append(m.WhichOneof("msg"))
                    got_header.set()  # the sidecar has opened this stream
                result["msgs"] = msgs

        t = threading.Thread(target=run)
        t.start()
        assert got_header.wait(20)
        proc.send_signal(signal.SIGTERM)
        codes = []

        def refused() -> bool:  # new streams are refused while draining
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                try:
                    list(pb_grpc.TranslateServiceStub(ch).Translate(iter(reqs), timeout=5))
                    return False
                except grpc.RpcError as err:
                    codes.append(err.code())
                    return True

        wait_until(refused, 20, "a new stream refused after SIGTERM")
        release.set()
        assert codes[-1] == grpc.StatusCode.UNAVAILABLE
        t.join(30)
        assert result["msgs"][0] == "header" and result["msgs"][-1] == "trailer" and result["msgs"].count("block") == 4
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_cancels_are_counted_as_cancels(tmp_path, family):
    """A caller that cancels mid-upload reaches the handler as a plain end of stream, a moment before gRPC's cancel
    notice: it was counted INVALID_ARGUMENT ("truncated stream"), every time, across processes. Cancels mid-upload
    and mid-download are now all CANCELLED in the metrics (a real process: in-process, the client and server share
    one gRPC core, and some cancels never reach the server's side of it at all)."""
    import urllib.request

    save(identity_mapset(family["S"].identity, version="1.0.0"), tmp_path)
    proc, port, metrics_port = _serve(tmp_path, "--metrics-port", "0")
    try:
        small = make_kv(layers=4, tokens=64, heads=2, head_dim=32)
        small_reqs = list(encode_requests(make_spec(small, "S__S-self"), small, chunk_tokens=16))
        big = make_kv(layers=4, tokens=4096, heads=2, head_dim=32)
        big_reqs = list(encode_requests(make_spec(big, "S__S-self"), big, chunk_tokens=256))

        def stalls():
            yield from small_reqs[:5]
            time.sleep(3)  # the caller cancels while the sidecar waits for the rest

        def counts() -> dict[str, float]:
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
            return {
                c: float(v)
                for c, v in re.findall(r'kvferry_requests_total\{code="(\w+)",method="Translate"\} ([\d.]+)', text)
            }

        for i, (requests, reads) in enumerate([(stalls, 1)] * 4 + [(lambda: iter(big_reqs), 2)] * 4):
            with grpc.insecure_channel(f"127.0.0.1:{port}", [("grpc.http2.bdp_probe", 0)]) as ch:
                call = pb_grpc.TranslateServiceStub(ch).Translate(requests(), timeout=30)
                for _ in range(reads):
                    next(call)  # the header (and the first block)
                time.sleep(0.1 if reads == 1 else 0)  # the sidecar has read all that was sent, and waits for more
                call.cancel()
                wait_until(lambda: sum(counts().values()) >= i + 1, 20, f"stream {i + 1} counted")
        assert counts() == {"CANCELLED": 8.0}
    finally:
        proc.kill()
        proc.wait(30)


def test_memory_comes_back_after_oversized_headers(tmp_path, family):
    """Four concurrent 25 MB headers, nine rounds, each refused unparsed: the sidecar process's resident memory
    comes back to where it started (it grew by about 200 MB and stayed there before the allocator was tuned and
    freed memory released after each refusal; kvferry.sidecar.memory)."""
    from kvferry.v1 import translate_pb2 as pb

    save(identity_mapset(family["S"].identity, version="1.0.0"), tmp_path)
    proc, port, _ = _serve(tmp_path, "--force-maps")

    def rss_mb() -> float:
        return int(re.search(r"VmRSS:\s+(\d+)", open(f"/proc/{proc.pid}/status").read()).group(1)) / 1024

    n = 7_000_000
    big = pb.TranslateRequest(
        header=pb.TranslateHeader(
            map=pb.MapRef(name="S__S-self", latest=True), num_tokens=n, token_ids=range(n), source_dtype=1
        )
    ).SerializeToString()
    codes = []

    def send():
        with grpc.insecure_channel(f"127.0.0.1:{port}", [("grpc.max_send_message_length", 64 << 20)]) as ch:
            try:
                list(ch.stream_stream("/kvferry.v1.TranslateService/Translate")(iter([big]), timeout=60))
            except grpc.RpcError as e:
                codes.append(e.code())

    try:
        start = rss_mb()
        for _ in range(9):
            threads = [threading.Thread(target=send) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        after = rss_mb()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 36
    assert after < start + 50, (start, after)
