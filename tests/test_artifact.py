import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from kvferry.mappings.artifact import LayerMap, MapSet, artifact_dir, check_name, load, save, write_evidence
from kvferry.mappings.errors import ArtifactError, Incompatible
from kvferry.mappings.geometry import ModelIdentity, geometry_of

GOLDEN = Path(__file__).parent / "golden" / "artifact_v1"


def golden_mapset() -> MapSet:
    """A fully deterministic map: 2-layer llama (kv 2x16) -> 3-layer llama (kv 3x16)."""
    src = ModelIdentity("tiny-src", geometry_of(tiny_config("llama")), "a" * 64)
    tgt = ModelIdentity(
        "tiny-tgt", geometry_of(tiny_config("llama", layers=3, hidden=96, heads=6, kv_heads=3)), "a" * 64
    )
    maps = {}
    for t in range(3):
        for i, kind in enumerate("kv"):
            srcs = (0,) if t == 0 else (0, 1)
            w = torch.arange(len(srcs) * 32 * 48, dtype=torch.float32).reshape(len(srcs) * 32, 48) / 1000 + t + i
            maps[(t, kind)] = LayerMap(t, kind, srcs, w, torch.full((48,), 0.5 * t), 1e-3, 0.9)
    return MapSet(
        src,
        tgt,
        maps,
        "1.2.3",
        {"k": 2},
        {"corpus_sha256": "b" * 64, "tokens": 1000},
        {"arms": {"mapped_refresh": {"top1": 0.9, "top10": 0.95, "kl": 0.01, "attn_cos": 0.99}}},
        created_at="2026-01-01T00:00:00Z",
        kvferry_version="0.1.0",
    )


def test_golden_bytes(tmp_path):
    """The artifact format outlives the process: today's save() writes exactly the committed bytes (written once by
    hand; no test rewrites them), and today's load() reads them back."""
    dest = save(golden_mapset(), tmp_path)
    assert dest == tmp_path / "tiny-src__tiny-tgt" / "1.2.3"
    for name in ("manifest.json", "maps.safetensors"):
        assert (dest / name).read_bytes() == (GOLDEN / name).read_bytes(), (
            f"{name} changed: a format change needs a new FORMAT_VERSION"
        )
    committed = tmp_path / "committed" / "tiny-src__tiny-tgt" / "1.2.3"
    committed.mkdir(parents=True)
    for name in ("manifest.json", "maps.safetensors"):
        (committed / name).write_bytes((GOLDEN / name).read_bytes())
    back, ms = load(committed), golden_mapset()
    assert back.version == "1.2.3" and back.evidence == ms.evidence and back.source == ms.source
    for key, m in ms.maps.items():
        assert torch.equal(back.maps[key].weight, m.weight) and back.maps[key].source_layers == m.source_layers


def test_roundtrip(tmp_path):
    ms = golden_mapset()
    back = load(save(ms, tmp_path))
    assert back.name == ms.name and back.version == "1.2.3" and back.evidence == ms.evidence
    assert back.source == ms.source and back.target == ms.target
    for key, m in ms.maps.items():
        torch.testing.assert_close(back.maps[key].weight, m.weight)
        assert back.maps[key].source_layers == m.source_layers


def test_artifacts_are_immutable(tmp_path):
    save(golden_mapset(), tmp_path)
    with pytest.raises(ArtifactError, match="bump the version"):
        save(golden_mapset(), tmp_path)


def test_tampered_tensors_are_refused(tmp_path):
    dest = save(golden_mapset(), tmp_path)
    blob = bytearray((dest / "maps.safetensors").read_bytes())
    blob[-5] ^= 0xFF
    (dest / "maps.safetensors").write_bytes(bytes(blob))
    with pytest.raises(ArtifactError, match="sha256 does not match"):
        load(dest)


def test_truncated_tensors_are_refused(tmp_path):
    dest = save(golden_mapset(), tmp_path)
    blob = (dest / "maps.safetensors").read_bytes()
    (dest / "maps.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ArtifactError, match="modified or truncated"):
        load(dest)


def test_edited_manifest_is_refused(tmp_path):
    dest = save(golden_mapset(), tmp_path)
    man = json.loads((dest / "manifest.json").read_text())
    man["evidence"]["arms"]["mapped_refresh"]["top10"] = 0.99
    (dest / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ArtifactError, match="manifest_sha256 does not match"):
        load(dest)
    (dest / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        load(dest)


def test_evidence_update_keeps_artifact_valid(tmp_path):
    dest = save(golden_mapset(), tmp_path)
    write_evidence(dest, {"arms": {"mapped": {"top10": 0.5}}})
    assert load(dest).evidence == {"arms": {"mapped": {"top10": 0.5}}}


def test_model_mismatch_is_refused(tmp_path):
    ms = golden_mapset()
    dest = save(ms, tmp_path)
    other = ModelIdentity("x", geometry_of(tiny_config("qwen2")), "a" * 64)
    with pytest.raises(Incompatible, match="geometry fingerprint"):
        load(dest, expect_source=other)
    wrong_tok = ModelIdentity("tiny-src", ms.source.geometry, "c" * 64)
    with pytest.raises(Incompatible, match="tokenizer fingerprint"):
        load(dest, expect_source=wrong_tok)


@pytest.mark.parametrize("bad", ["../evil", "a/b", "..", "", "x" * 200, "/abs"])
def test_names_cannot_escape_the_registry(bad):
    with pytest.raises(ArtifactError):
        check_name(bad)


@pytest.mark.parametrize("bad", ["1.0", "v1.0.0", "../1.0.0", "1.0.0/.."])
def test_versions_must_be_semver(tmp_path, bad):
    with pytest.raises(ArtifactError, match="semantic version"):
        artifact_dir(tmp_path, "a__b", bad)


def test_wrong_shapes_are_refused():
    ms = golden_mapset()
    ms.maps[(1, "k")].weight = torch.zeros(10, 48)
    with pytest.raises(ArtifactError, match="expected"):
        ms.validate()


def test_bfloat16_maps_keep_their_dtype_and_mixed_or_other_dtypes_are_refused(tmp_path):
    ms = golden_mapset().to(dtype=torch.bfloat16)
    back = load(save(ms, tmp_path))
    assert back.dtype == torch.bfloat16
    assert all(m.weight.dtype == torch.bfloat16 and m.bias.dtype == torch.bfloat16 for m in back.maps.values())
    half = golden_mapset().to(dtype=torch.float16)
    with pytest.raises(ArtifactError, match="float32 or bfloat16"):
        half.validate()
    mixed = golden_mapset()
    mixed.maps[(1, "v")].weight = mixed.maps[(1, "v")].weight.bfloat16()
    with pytest.raises(ArtifactError, match="shares one dtype"):
        mixed.validate()
