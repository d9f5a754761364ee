"""What the benches share: a sidecar in its own process, a real redis-server, timing, long held-out prompts."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

from kvferry import paths


def round_robin_ms(calls: dict, reps: int) -> dict[str, list[float]]:
    """Each call's times in ms over ``reps`` rounds, the calls taken in turn within a round, so that the machine's drift
    hits every one alike (what side-by-side comparisons here read)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def paired_ratio(times: dict[str, list[float]], over: tuple[str, ...], under: tuple[str, ...]) -> dict[str, float]:
    """The ratio sum(``over``) / sum(``under``) of the calls' times in each round of ``round_robin_ms``, summarised:
    its median and quartiles over the rounds. A round's calls ran back to back, so each round's ratio pairs times the
    machine's drift hit alike; the spread shows how far one run's ratio can be trusted (a ratio of medians has none)."""
    rounds = len(times[under[0]])
    per = sorted(sum(times[c][i] for c in over) / sum(times[c][i] for c in under) for i in range(rounds))
    q1, _, q3 = statistics.quantiles(per, n=4, method="inclusive") if rounds > 1 else (per[0],) * 3
    return {"median": statistics.median(per), "q1": q1, "q3": q3}


def spread(r: dict[str, float]) -> str:
    """A ``paired_ratio`` as printed in the benches' tables: median [q1, q3]."""
    return f"{r['median']:.2f} [{r['q1']:.2f}, {r['q3']:.2f}]"


def write_json(path, results) -> None:
    """``results`` as indented JSON at ``path`` (its folder made), when a path was given."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(results, indent=1))


def median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class ServerProcess:
    """The sidecar (and an echo service) in a separate process, as in production: no shared GIL."""

    def __init__(
        self,
        maps_dir,
        threads: int = 0,
        env: dict[str, str] | None = None,
        code: str = "",
        cwd: str | None = None,
        serve_refused_maps: bool = False,
        **extra,
    ):
        """``env``: variables added to the server process's environment; ``code``: Python run in place of
        ``-m kvferry.bench.server`` (it must end by calling that module's main(): side-by-side variants); ``cwd``: the
        folder it runs in (another than a checkout, for a kvferry found on PYTHONPATH before the checkout's);
        ``serve_refused_maps``: the sidecar serves maps its gates refuse (kvferry.bench.refused)."""
        cmd = [
            sys.executable,
            *(["-c", code] if code else ["-m", "kvferry.bench.server"]),
            "--maps-dir",
            str(maps_dir),
            "--threads",
            str(threads),
        ]
        for k, v in extra.items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
        if serve_refused_maps:  # kvferry.bench.refused: the bench asked for it, and says so in its results
            cmd.append("--serve-refused-maps")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}, cwd=cwd)
        line = self.proc.stdout.readline()
        m = re.search(r"listening on ([\d.]+:\d+)", line)
        if not m:
            self.proc.kill()
            raise RuntimeError(f"bench server did not start: {line!r}")
        self.address = m.group(1)
        from kvferry.client.client import (
            SINGLE_THREADED_STREAMS,  # the client's own transport setting: the floor stays its best
        )
        from kvferry.common.channel import MAX_MESSAGE_BYTES, message_size_options

        opts = [*message_size_options(MAX_MESSAGE_BYTES), SINGLE_THREADED_STREAMS]
        self.channel = grpc.insecure_channel(self.address, opts)
        from kvferry.bench.server import ECHO_METHOD, REPLAY_METHOD, SINK_METHOD

        self.echo = self.channel.stream_stream(ECHO_METHOD)
        self.replay_call = self.channel.unary_stream(REPLAY_METHOD)
        self.sink_call = self.channel.stream_unary(SINK_METHOD)

    def peak_rss_mb(self) -> float:
        """The server process's peak resident memory so far (VmHWM), in MB."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 1024

    def roundtrip(self, payloads: list[bytes]) -> int:
        return sum(len(r) for r in self.echo(iter(payloads), timeout=120))

    def sink(self, payloads: list[bytes]) -> int:
        """Send these messages to the server process, which only counts them: the transport alone, one way."""
        return struct.unpack("<Q", self.sink_call(iter(payloads), timeout=120))[0]

    def replay(self, sizes: list[int]) -> int:
        """Receive messages of these sizes from the server process: the transport alone, one way."""
        return sum(len(r) for r in self.replay_call(struct.pack(f"<{len(sizes)}I", *sizes), timeout=120))

    def close(self) -> None:
        self.channel.close()
        self.proc.terminate()
        self.proc.wait(30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def shm_folder():
    """A fresh folder for response regions on the machine's memory-backed /dev/shm (what a pod's memory emptyDir
    is), removed afterwards; a folder in the system's temporary directory where there is no /dev/shm."""
    return tempfile.TemporaryDirectory(prefix="kvferry-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


def long_ids(tokenizer, n: int) -> torch.Tensor:
    from kvferry.mappings.lab.capture import read_corpus

    ids: list[int] = []
    for text in read_corpus([paths.data_file("heldout.jsonl")]):
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= n:
            break
    return torch.tensor(ids[:n])[None]


def tiny_pair():
    """The shipped tiny family's latest S__T map and both models (LoadedModel): what the hit-path scripts read."""
    from kvferry.mappings.lab.capture import load_model
    from kvferry.sidecar.registry import MapRegistry

    registry = MapRegistry(paths.maps_dir(), force=True)
    registry.scan()
    return registry.resolve("S__T", ""), load_model(paths.model_dir("S")), load_model(paths.model_dir("T"))


def published_prefix(source, target, ms, store, secret: bytes, n: int, block_size: int, tenant: str = "bench"):
    """The full blocks of an ``n``-token held-out prompt (16 tokens left to recompute), with the source's KV of them
    published to ``store``: (their token ids, the prefix key, the keyword arguments of a key-only translate)."""
    from kvferry.common.prefix_cache import publish_source
    from kvferry.mappings.lab.capture import capture_kv

    ids = long_ids(target.tokenizer, n)
    prefix = ids[0, : (n - 16) // block_size * block_size].tolist()
    with torch.no_grad():
        kv = capture_kv(source.model, ids[:, : len(prefix)])
    key = publish_source(kv, prefix, ms.source, store=store, secret=secret, tenant=tenant, block_size=block_size)
    kw = dict(
        source_geometry=ms.source.geometry.fingerprint,
        tokenizer=ms.source.tokenizer,
        tenant=tenant,
        token_ids=prefix,
        prefix_key=key,
    )
    return prefix, key, kw


class RedisServer:
    """A real redis-server (Debian's package) on a free loopback port, in a temp dir; ``restart`` reuses the port."""

    def __init__(self, directory: str | None = None):
        self.binary = shutil.which("redis-server")
        if not self.binary:
            raise RuntimeError("redis-server not found: apt-get install redis-server (or pass --redis-url)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = directory or tempfile.mkdtemp()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.restart()

    def restart(self) -> None:
        """Start the server (again, on the same port) and wait until it answers PING."""
        import redis

        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port)
        for _ in range(200):
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _free_cluster_port() -> int:
    """A free loopback port whose cluster-bus port (+10000) is free too, and within range."""
    import random

    for _ in range(1000):
        port = random.randrange(20000, 55000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


class RedisClusterServers:
    """A real Redis Cluster of ``masters`` redis-server processes on free loopback ports (no replicas), created with
    ``redis-cli --cluster create``; ``kill(i)`` and ``restart(i)`` stop and start one master on its port, its node
    identity and slots kept in its node file."""

    def __init__(self, directory: str | None = None, masters: int = 3):
        self.binary, self.cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if not (self.binary and self.cli):
            raise RuntimeError("redis-server and redis-cli not found: apt-get install redis-server")
        self.dir = Path(directory or tempfile.mkdtemp())
        self.ports = [_free_cluster_port() for _ in range(masters)]
        self.procs: list[subprocess.Popen | None] = [None] * masters
        for i in range(masters):
            self.restart(i)
        out = subprocess.run(
            [
                self.cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in self.ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if out.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout[-500:]} {out.stderr[-500:]}")
        self.wait_ok()
        self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    @staticmethod
    def node(port: int):
        """A plain client of one node (no retries: a node that is down says so at once)."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        return redis.Redis(port=port, socket_timeout=2, retry=Retry(NoBackoff(), 0))

    def restart(self, i: int) -> None:
        """Start master ``i`` (again, on its port, from its node file) and wait until it answers PING."""
        import redis

        port, d = self.ports[i], self.dir / str(self.ports[i])
        d.mkdir(parents=True, exist_ok=True)
        self.procs[i] = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(d),
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "2000",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(200):
            if self.procs[i].poll() is not None:
                raise RuntimeError(f"redis-server on port {port} exited at start ({self.procs[i].returncode})")
            try:
                if self.node(port).ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {port} did not answer PING")

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every running master reports cluster_state:ok."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if all(
                    "cluster_state:ok" in self.node(p).execute_command("CLUSTER", "INFO").decode()
                    for p, proc in zip(self.ports, self.procs)
                    if proc is not None and proc.poll() is None
                ):
                    return
            except Exception:  # a node still starting
                pass
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def client(self):
        """redis-py's cluster client of this cluster."""
        from redis.cluster import ClusterNode, RedisCluster

        return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in self.ports])

    def stop(self) -> None:
        for i in range(len(self.ports)):
            self.kill(i)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
