"""The proto is the whole contract: a Node.js client built from translate.proto alone (tests/contract/translate.js,
@grpc/grpc-js + @grpc/proto-loader, installed by `make test`) translates through a real sidecar with a real
cross-model map (S -> T) and must get the Python client's answer byte for byte."""

import base64
import json
import shutil
import subprocess

import pytest
import torch
from conftest import ROOT

from kvferry.client.client import ClientOptions, Retry, TranslateClient
from kvferry.client.importers import PagedKVPool
from kvferry.mappings.lab.capture import capture_kv

NODE_MODULES = ROOT / ".tools" / "node-contract" / "node_modules"
PROTO = ROOT / "proto" / "kvferry" / "v1" / "translate.proto"


@pytest.fixture(scope="module")
def s_to_t(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract-maps")
    shutil.copytree(ROOT / "maps" / "S__T", root / "S__T")
    return root


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.contiguous().numpy().tobytes()).decode()


@pytest.mark.parametrize("paged", [None, 0, 3], ids=["contiguous", "paged-one-a-block", "paged-three-a-block"])
def test_a_node_client_from_the_proto_gets_the_python_answer(sidecar_factory, s_to_t, family, tmp_path, paged):
    """Paged: the Node client checks every block's shape and index against the response header's pages_per_block and
    unpages the answer; the Python client's own paged answer, read back from a paged pool, must match it too."""
    node = shutil.which("node")
    assert node, "node is not installed (make test needs node and npm for the contract test)"
    assert (NODE_MODULES / "@grpc" / "grpc-js").is_dir(), (
        "run `make test` (it installs @grpc/grpc-js into .tools/node-contract)"
    )
    s = family["S"]
    ids = torch.arange(5, 5 + 37)[None]
    kv = capture_kv(s.model, ids)
    sc = sidecar_factory(maps_dir=str(s_to_t))
    fingerprints = dict(source_geometry=s.identity.geometry.fingerprint, tokenizer=s.identity.tokenizer)
    with TranslateClient(ClientOptions(target=sc.address, chunk_tokens=16, retry=Retry(retries=0))) as c:
        py = c.translate(kv, "S__T", "1.0.0", **fingerprints)
        if paged is not None:  # the Python client's paged answer, through a pool, is the contiguous one
            pg = c.translate(kv, "S__T", "1.0.0", layout="paged", block_size=8, pages_per_block=paged, **fingerprints)
            pool = PagedKVPool(pg.info.layers, 5, 8, pg.info.kv_heads, pg.info.head_dim)
            pool.write(pg.blocks, list(range(5)))
            for (k, v), (pk, pv) in zip(py.layers(), pool.gather(list(range(5)), 37)):
                assert torch.equal(k, pk) and torch.equal(v, pv)
    g = s.identity.geometry
    header = {
        "map": {"name": "S__T", "version": "1.0.0"},
        "source_geometry_fingerprint": fingerprints["source_geometry"],
        "tokenizer_fingerprint": fingerprints["tokenizer"],
        "num_tokens": 37,
        "source_dtype": "DTYPE_FLOAT32",
        "layout": "LAYOUT_CONTIGUOUS",
    }
    if paged is not None:
        header.update(layout="LAYOUT_PAGED", block_size=8, pages_per_block=paged)
    request = {
        "header": header,
        "chunk_tokens": 16,  # the same ranges as the Python client: the same arithmetic
        "tokens": 37,
        "kv_heads": g.kv_heads,
        "head_dim": g.head_dim,
        "layers": [{"k": _b64(k[0]), "v": _b64(v[0])} for k, v in kv],
    }
    (tmp_path / "in.json").write_text(json.dumps(request))
    r = subprocess.run(
        [
            node,
            str(ROOT / "tests" / "contract" / "translate.js"),
            sc.address,
            str(PROTO),
            str(tmp_path / "in.json"),
            str(tmp_path / "out.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={"NODE_PATH": str(NODE_MODULES), "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert "code" not in out, out
    assert out["header"]["map_version"] == "1.0.0" and out["header"]["target"]["layers"] == len(py.layers())
    assert int(out["trailer"]["tokens"]) == 37 and out["trailer"]["blocks"] > len(py.layers())  # several blocks a layer
    assert out["header"]["pages_per_block"] == (paged or 0)
    for (k, v), got in zip(py.layers(), out["layers"]):
        assert base64.b64decode(got["k"]) == k[0].contiguous().numpy().tobytes()
        assert base64.b64decode(got["v"]) == v[0].contiguous().numpy().tobytes()
    assert py.layers()[0][0].shape[1] != kv[0][0].shape[1] or len(py.layers()) != len(kv)  # a real S -> T shape change
