"""Shared fixtures: the shipped family, tiny random models of each supported class, KV builders."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
DATA = ROOT / "data"

torch.set_num_threads(2)


def pytest_configure(config):
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def tiny_config(
    arch: str, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, **rope
):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(
        arch,
        vocab_size=4096,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=2 * hidden,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        eos_token_id=0,
        pad_token_id=1,
        bos_token_id=0,
    )
    if rope:
        cfg.rope_parameters = {"rope_theta": 10000.0, **rope}
    return cfg


def save_tiny(dest: Path, cfg, seed: int = 0) -> Path:
    """A randomly initialised model of a real transformers class, saved with the shipped tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(dest)
    for f in (MODELS / "tokenizer").iterdir():
        shutil.copy(f, dest / f.name)
    return dest


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for arch in ("llama", "mistral", "qwen2", "qwen3"):
        out[arch] = save_tiny(root / arch, tiny_config(arch))
    out["llama_wide"] = save_tiny(
        root / "llama_wide", tiny_config("llama", layers=3, hidden=96, heads=6, kv_heads=3), seed=1
    )
    return out


class _Family(dict):
    """The shipped models, loaded on first use."""

    def __missing__(self, name):
        from kvferry.mappings.lab.capture import load_model

        self[name] = load_model(MODELS / name)
        return self[name]


@pytest.fixture(scope="session")
def family():
    return _Family()


@pytest.fixture(scope="module")
def self_maps(tmp_path_factory, family):
    """A maps folder holding S__S-self 1.0.0, the tiny S mapped onto itself exactly (tests of the service, not the
    math); one per test module, which may add to it."""
    from kvferry.mappings.artifact import save
    from kvferry.mappings.lab.fit import identity_mapset

    root = tmp_path_factory.mktemp("self_maps")
    save(identity_mapset(family["S"].identity, version="1.0.0"), root)
    return root


def spec_kw(model) -> dict:
    """The request keywords that say which source model's cache this is (``model``: a loaded model)."""
    return dict(source_geometry=model.identity.geometry.fingerprint, tokenizer=model.identity.tokenizer)


def wait_until(condition, timeout: float = 10.0, what: str = "the condition") -> None:
    """Poll ``condition()`` until it holds; fail after ``timeout`` seconds (a wait on an event, not a fixed sleep)."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout:g} s")
        time.sleep(0.01)


def sample(sc, name: str, **labels) -> float:
    """A running sidecar's metric, read through its registry (prometheus_client's public API); 0 when never set."""
    return sc.sidecar.metrics.registry.get_sample_value(name, labels) or 0.0


# A passing long-range copy probe, for hand-written evidence of exact (identity) maps, which keep exactly what
# the target's full prefill has; maps fitted and evaluated for real carry their own.
PASSING_COPY = {
    "settings": {"gaps": [500], "prompts": 1, "passage": 120, "cue": 40, "score": 40, "refresh": 16, "seed": 0},
    "gaps": {
        "500": {"full": 0.95, "truncate": 0.4, "mapped": 0.95, "mapped_refresh": 0.95, "retention": 1.0, "prompts": 1}
    },
}


def make_kv(
    layers: int = 2,
    tokens: int = 16,
    heads: int = 2,
    head_dim: int = 16,
    batch: int = 1,
    seed: int = 0,
    dtype=torch.float32,
):
    """A random cache: ``layers`` x (K, V), each [batch, heads, tokens, head_dim]."""
    g = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randn(batch, heads, tokens, head_dim, generator=g).to(dtype) for _ in range(2))
        for _ in range(layers)
    ]


def RunningSidecar(**config):
    """A real kvferry sidecar (grpc.aio) on a loopback port 0, in a background event loop."""
    from kvferry.sidecar.background import BackgroundSidecar
    from kvferry.sidecar.config import SidecarConfig

    config.setdefault("port", 0)
    config.setdefault("reload_seconds", 0)
    config.setdefault("drain_seconds", 1)
    config.setdefault("drain_notice_seconds", 0.5)
    # the tests assert stored blocks are found on a loaded 2-core runner: give the probe the store's whole timeout
    # (the hung-store tests set their own)
    config.setdefault("prefix_probe_seconds", config.get("prefix_store_timeout_seconds", 1.0))
    return BackgroundSidecar(SidecarConfig(**config))


@pytest.fixture
def sidecar_factory():
    started = []

    def start(**config) -> RunningSidecar:
        sc = RunningSidecar(**config)
        started.append(sc)
        return sc

    yield start
    for sc in started:
        sc.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server (the benches' harness: one helper for both) with a client beside it."""
    import redis

    from kvferry.bench.harness import RedisServer

    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: `apt-get install redis-server` (make test and .ci/run do it)")
    server = RedisServer(str(tmp_path_factory.mktemp("redis")))
    server.client = redis.Redis(port=server.port)
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    """A flushed database on the session's redis-server."""
    if redis_server.proc.poll() is not None:
        redis_server.restart()
    redis_server.client.flushall()
    return redis_server.url


def make_certs(tmp_path: Path) -> Path:
    """A throwaway CA, and server and client certificates it signed (CN=server, CN=client), via openssl."""
    import subprocess

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=kvferry-test-ca",
        "-keyout",
        str(tmp_path / "ca.key"),
        "-out",
        str(tmp_path / "ca.pem"),
    )
    for name in ("server", "client"):
        run(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            str(tmp_path / f"{name}.key"),
            "-out",
            str(tmp_path / f"{name}.csr"),
        )
        ext = tmp_path / f"{name}.ext"
        ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        run(
            "x509",
            "-req",
            "-in",
            str(tmp_path / f"{name}.csr"),
            "-CA",
            str(tmp_path / "ca.pem"),
            "-CAkey",
            str(tmp_path / "ca.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            str(ext),
            "-out",
            str(tmp_path / f"{name}.pem"),
        )
    return tmp_path
