"""The Helm chart renders valid manifests whose args, config, ports, probes and mounts are ones
`kvferry serve` actually accepts: parsed by the binary's own parser and config class."""

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from kvferry.cli import build_parser
from kvferry.sidecar.config import SidecarConfig, from_sources
from kvferry.sidecar.server import SERVICE

CHART = ROOT / "helm" / "kvferry"
HELM = shutil.which("helm") or str(ROOT / ".tools" / "node_modules" / ".bin" / "helm")
pytestmark = pytest.mark.skipif(not Path(HELM).exists(), reason="helm not installed (make chart-check installs it)")
VALUES = sorted((CHART / "ci").glob("*-values.yaml"))


def render(values: Path | None = None, *sets: str) -> list[dict]:
    cmd = [HELM, "template", "t", str(CHART), "--kube-version", "1.30.0"]
    if values:
        cmd += ["-f", str(values)]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _one(docs, kind):
    (d,) = [d for d in docs if d["kind"] == kind]
    return d


@pytest.mark.parametrize("values", [None, *VALUES], ids=lambda v: v.name if v else "defaults")
def test_chart_agrees_with_the_binary(values, tmp_path):
    docs = render(values)
    cm = _one(docs, "ConfigMap")
    toml_text = cm["data"]["kvferry.toml"]
    (tmp_path / "kvferry.toml").write_text(toml_text)
    config = from_sources(build_parser().parse_args(["serve", "--config", str(tmp_path / "kvferry.toml")]), env={})
    assert isinstance(config, SidecarConfig)
    assert set(tomllib.loads(toml_text)["sidecar"]) <= set(SidecarConfig.__dataclass_fields__)

    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    (c,) = [c for c in pod["containers"] if c["name"] == "kvferry"]
    args = build_parser().parse_args(c["args"])  # exits on any flag `kvferry serve` does not accept
    for e in c.get("env", []):  # every env var the chart sets is one the config reads
        assert e["name"].startswith("KVFERRY_") and e["name"][8:].lower() in SidecarConfig.__dataclass_fields__, e[
            "name"
        ]
    assert args.cmd == "serve" and args.config == "/etc/kvferry/kvferry.toml"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": config.port, "metrics": config.metrics_port}
    assert c["readinessProbe"]["grpc"] == {"port": config.port, "service": SERVICE}
    assert c["livenessProbe"]["grpc"] == {"port": config.port} and c["startupProbe"]["grpc"]["port"] == config.port
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts[config.maps_dir]["readOnly"] and mounts["/etc/kvferry"]["readOnly"]
    for path in (
        config.tls_cert,
        config.tls_key,
        config.tls_client_ca,
        config.redis_password_file,
        config.prefix_secret_file,
    ):
        if path:
            assert any(path.startswith(m + "/") for m in mounts), f"{path} is not on a mounted volume"
    assert pod["terminationGracePeriodSeconds"] >= config.drain_seconds + c["lifecycle"]["preStop"]["sleep"]["seconds"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"]
    for init in pod.get("initContainers", []):
        if init.get("args"):
            build_parser().parse_args(init["args"])  # maps fetch
    test_pod = _one(docs, "Pod")
    build_parser().parse_args(test_pod["spec"]["containers"][0]["args"])  # kvferry health


def test_modes_and_options():
    docs = render(CHART / "ci" / "pod-sidecar-values.yaml")
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["kvferry", "model-server"]
    # response regions: one memory volume, mounted by both containers; on it the folder that the sidecar's shm_dir,
    # the model server's KVFERRY_SHM_DIR and its connector's shm_dir name, which an init container prepares for
    # several users (`kvferry shm-folder`: group-writable, sticky, set-group-ID)
    shm_dir = tomllib.loads(_one(docs, "ConfigMap")["data"]["kvferry.toml"])["sidecar"]["shm_dir"]
    (volume,) = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    (prepare,) = [c for c in pod["initContainers"] if c["name"] == "kvferry-shm"]
    assert (
        prepare["args"] == ["shm-folder", shm_dir]
        and prepare["securityContext"] == pod["containers"][0]["securityContext"]
    )
    for c in [*pod["containers"], prepare]:
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == volume["name"]]
        assert shm_dir.startswith(mount["mountPath"] + "/"), c["name"]
    (server,) = [c for c in pod["containers"] if c["name"] == "model-server"]
    assert {"name": "KVFERRY_SHM_DIR", "value": shm_dir} in server["env"] and f'"shm_dir":"{shm_dir}"' in server[
        "args"
    ][-1]
    off = _one(render(CHART / "ci" / "pod-sidecar-values.yaml", "sharedMemory.enabled=false"), "Deployment")
    assert not any(v.get("emptyDir", {}).get("medium") == "Memory" for v in off["spec"]["template"]["spec"]["volumes"])
    r = subprocess.run(
        [HELM, "template", "t", str(CHART), "--kube-version", "1.30.0", "--set", "sharedMemory.enabled=true"],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "sharedMemory.enabled needs mode: podSidecar" in r.stderr
    gpu = _one(render(CHART / "ci" / "gpu-values.yaml"), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    kinds = {d["kind"] for d in render(CHART / "ci" / "standalone-values.yaml")}
    assert {"PodDisruptionBudget", "HorizontalPodAutoscaler", "NetworkPolicy", "ServiceMonitor"} <= kinds


def test_bad_values_fail_at_install():
    r = subprocess.run(
        [HELM, "template", "t", str(CHART), "--kube-version", "1.30.0", "--set", "sidecar.port=0"],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "port" in r.stderr
    r = subprocess.run(
        [HELM, "template", "t", str(CHART), "--kube-version", "1.30.0", "--set", "maps.source=url"],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0


def test_metrics_network_rule_defaults_to_this_namespace():
    """It rendered `namespaceSelector: {}` (every namespace) while its comment said "same namespace"."""
    pol = _one(render(CHART / "ci" / "standalone-values.yaml"), "NetworkPolicy")
    metrics = [r for r in pol["spec"]["ingress"] if any(p["port"] == 9100 for p in r["ports"])]
    assert metrics and metrics[0]["from"] == [{"podSelector": {}}], metrics
    scoped = _one(
        render(
            CHART / "ci" / "standalone-values.yaml",
            "networkPolicy.metricsNamespaceSelector.matchLabels.name=monitoring",
        ),
        "NetworkPolicy",
    )
    rule = next(r for r in scoped["spec"]["ingress"] if any(p["port"] == 9100 for p in r["ports"]))
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]


HOSTILE = sorted((CHART / "hostile").glob("*.yaml"))


@pytest.mark.parametrize("values", HOSTILE, ids=lambda v: v.stem)
def test_hostile_values_are_refused_with_the_fix(values):
    """Each of these rendered silently before: a public LoadBalancer without auth or TLS, root or privileged
    containers, no limits, http map URLs, a password in the ConfigMap, injected TOML/YAML/cp arguments, and a
    maxMessageBytes the sidecar could not bind."""
    expect = next(
        line[len("# expect: ") :] for line in values.read_text().splitlines() if line.startswith("# expect: ")
    )
    r = subprocess.run(
        [HELM, "template", "t", str(CHART), "--kube-version", "1.30.0", "-f", str(values)],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0, f"{values.name} rendered"
    assert expect in r.stderr, r.stderr


def test_allow_insecure_renders_what_it_names():
    docs = render(CHART / "hostile" / "http-maps.yaml", "allowInsecure=true")
    init = _one(docs, "Deployment")["spec"]["template"]["spec"]["initContainers"][0]
    assert "http://artifacts.example.internal/maps.tar.gz" in init["args"]


def test_strings_reach_toml_and_args_as_single_values(tmp_path):
    """Values with quotes and spaces that the schema allows arrive as one string each, never as new keys or args."""
    docs = render(
        CHART / "ci" / "redis-values.yaml",
        "redis.url=rediss://user@redis-0.cache:6380/0?ssl_cert_reqs=required",
        "maps.image.path=/opt/kvferry/maps.v2",
    )
    toml_text = _one(docs, "ConfigMap")["data"]["kvferry.toml"]
    cfg = tomllib.loads(toml_text)["sidecar"]
    assert cfg["redis_url"] == "rediss://user@redis-0.cache:6380/0?ssl_cert_reqs=required"
    init = _one(docs, "Deployment")["spec"]["template"]["spec"]["initContainers"][0]
    assert init["command"] == ["cp", "-R", "--", "/opt/kvferry/maps.v2/.", "/maps/"]
