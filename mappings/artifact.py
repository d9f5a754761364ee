"""The versioned map artifact: ``<root>/<source>__<target>/<version>/{maps.safetensors,manifest.json}``.

``maps.safetensors`` holds per target layer and K/V a weight, a bias and the source-layer
indices (and, for a shared-basis set, the basis' encoder, bias and source layers); its header metadata names the
format, map and fingerprints. ``manifest.json`` holds
the identities of both models, the fit settings, the calibration corpus digest, the measured
evidence, and two checksums: ``content_sha256`` of the tensor file and ``manifest_sha256`` of
the manifest's other fields. Loading checks all of it and refuses what does not add up.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .errors import ArtifactError, Incompatible
from .geometry import ModelIdentity, check_pair, digest
from .versions import check_version

FORMAT = "kvferry.maps"
FORMAT_VERSION = 4  # 4: a shared basis with a code MLP; 3: a shared basis; 2: a windowed map; else version 1
READ_VERSIONS = (1, 2, 3, 4)
KINDS = ("k", "v")
MAP_DTYPES = (torch.float32, torch.bfloat16)  # what maps are stored and applied in
MAX_WINDOW = 64  # tokens a windowed map may read per output token
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise ArtifactError(
            f"invalid map or model name {name!r}: use letters, digits, '.', '_' or '-' (no path separators)"
        )
    return name


@dataclass
class LayerMap:
    """One target layer's K or V map: y[t] = concat(x[t - o, s, c] for o < window for s in source_layers
    for c in inputs) @ weight + bias.

    x[t, s, "k"] is source layer s's un-rotated keys at token t and x[t, s, "v"] its values, heads side by side.
    ``window`` 1 is a per-token map; a windowed map also reads the window - 1 tokens before each token (offset o = 0
    first), zeros before the sequence's first token.
    """

    target_layer: int
    kind: str
    source_layers: tuple[int, ...]
    weight: torch.Tensor  # [len(source_layers) * len(inputs) * source_width, target_width]
    bias: torch.Tensor  # [target_width]
    lam: float = 0.0
    heldout_r2: float = float("nan")
    inputs: tuple[str, ...] = ()  # source features read; () means (kind,)
    window: int = 1  # tokens read per output token: t, t-1, ..., t-window+1

    def __post_init__(self) -> None:
        self.inputs = tuple(self.inputs) or (self.kind,)


@dataclass
class CodeMLP:
    """A per-token non-linearity on a shared basis' code, residual: z <- z + gelu(z @ w_in + b_in) @ w_out. Trained
    through the target (``kvferry distill --code-mlp H`` adds one whose output starts at zero, so training starts from
    the linear map)."""

    w_in: torch.Tensor  # [rank, hidden]
    b_in: torch.Tensor  # [hidden]
    w_out: torch.Tensor  # [hidden, rank]

    @property
    def hidden(self) -> int:
        return int(self.w_in.shape[1])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.w_in, self.b_in, self.w_out

    def __call__(self, z: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``z`` refined (the products in ``dtype``, default z's; the residual sum in z's dtype)."""
        dtype = dtype or z.dtype
        h = torch.nn.functional.gelu(z.to(dtype) @ self.w_in.to(dtype) + self.b_in.to(dtype))
        return z + (h @ self.w_out.to(dtype)).to(z.dtype)


@dataclass
class Basis:
    """A low-rank code shared by every map of a set: z[t] = concat(x[t, s, c] for s in source_layers for c in inputs)
    @ encoder + bias, r numbers per token. Each map of a shared-basis set reads z (its weight is [r, target_width]), so
    the source's features are multiplied once for all the target's maps: the set costs (source width + target
    width) x r multiply-adds per token, whatever the number of source layers it reads."""

    source_layers: tuple[int, ...]
    encoder: torch.Tensor  # [len(source_layers) * len(inputs) * source_width, rank]
    bias: torch.Tensor  # [rank]
    inputs: tuple[str, ...] = KINDS
    mlp: CodeMLP | None = None
    """A non-linear refinement of the code before the maps read it (None: the linear code)."""

    @property
    def rank(self) -> int:
        return int(self.encoder.shape[1])

    def rows(self, layer: int, kind: str, width: int) -> slice:
        """The encoder's rows that source ``layer``'s ``kind`` features multiply."""
        i = self.source_layers.index(layer) * len(self.inputs) + self.inputs.index(kind)
        return slice(i * width, (i + 1) * width)


@dataclass
class MapSet:
    """All maps from one source model to one target model, with their provenance and evidence."""

    source: ModelIdentity
    target: ModelIdentity
    maps: dict[tuple[int, str], LayerMap]
    version: str = "1.0.0"
    fit: dict = field(default_factory=dict)  # k, lambdas, seq_len, subsample...
    calibration: dict = field(default_factory=dict)  # corpus digest, tokens, sequences
    evidence: dict | None = None
    created_at: str = ""
    kvferry_version: str = ""
    content_sha256: str = ""
    basis: Basis | None = None
    """A shared low-rank code every map reads (None: each map reads its source layers' features directly)."""
    _fused: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # see fused_groups()

    @property
    def name(self) -> str:
        return f"{self.source.name}__{self.target.name}"

    @property
    def context(self) -> int:
        """Source tokens before a token that its maps read (0 for per-token maps)."""
        return max((m.window for m in self.maps.values()), default=1) - 1

    def layer(self, target_layer: int, kind: str) -> LayerMap:
        return self.maps[(target_layer, kind)]

    @property
    def flops_per_token(self) -> float:
        """Multiply-adds x 2 of one token through the set's matrices (the basis' encoder, its code MLP, the maps)."""
        maps = sum(m.weight.numel() for m in self.maps.values())
        if self.basis is None:
            return 2.0 * maps
        mlp = 2 * self.basis.mlp.hidden * self.basis.rank if self.basis.mlp is not None else 0
        return 2.0 * (self.basis.encoder.numel() + mlp + maps)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the maps are stored and applied in (float32, or bfloat16 for half the FLOP cost)."""
        return next(iter(self.maps.values())).weight.dtype if self.maps else torch.float32

    @property
    def device(self) -> torch.device:
        """Where the maps' weights are (``to()`` moves them)."""
        return next(iter(self.maps.values())).weight.device if self.maps else torch.device("cpu")

    def to(self, device=None, dtype: torch.dtype | None = None) -> MapSet:
        """Move the maps (and, with ``dtype``, convert them: the evidence was measured in the stored dtype)."""

        def moved(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype or t.dtype)

        for m in self.maps.values():
            m.weight, m.bias = moved(m.weight), moved(m.bias)
        if self.basis is not None:
            self.basis.encoder, self.basis.bias = moved(self.basis.encoder), moved(self.basis.bias)
            if self.basis.mlp is not None:
                self.basis.mlp = CodeMLP(*(moved(t) for t in self.basis.mlp.tensors()))
        self._fused = {}
        return self

    def fused_groups(
        self, dtype: torch.dtype | None = None
    ) -> list[tuple[tuple, list[tuple[int, str]], torch.Tensor, torch.Tensor]]:
        """Maps grouped by the source features they read ((source_layers, inputs, window)), weights and biases
        concatenated per group (in ``dtype``, default the stored one): built once per MapSet and dtype (and again after
        ``to()``), so apply runs one matmul per group. Lives and dies with the MapSet. A shared-basis set is one group
        whose weight multiplies the basis' code (:meth:`code`), not the source features."""
        dtype = dtype or self.dtype
        if dtype not in self._fused:
            groups: dict[tuple, list[tuple[int, str]]] = {}
            for key, m in sorted(self.maps.items()):
                groups.setdefault((m.source_layers, m.inputs, m.window), []).append(key)
            self._fused[dtype] = [
                (
                    group,
                    keys,
                    torch.cat([self.maps[k].weight for k in keys], dim=1).to(dtype),
                    torch.cat([self.maps[k].bias for k in keys]).to(dtype),
                )
                for group, keys in groups.items()
            ]
        return self._fused[dtype]

    def validate(self) -> None:
        check_name(self.source.name), check_name(self.target.name), check_version(self.version)
        check_pair(self.source, self.target)
        sg, tg = self.source.geometry, self.target.geometry
        dtype = self.dtype
        if dtype not in MAP_DTYPES:
            raise ArtifactError(
                f"map weights are {dtype}; kvferry applies maps in float32 or bfloat16. "
                "Refit with --dtype float32 (or bfloat16)"
            )
        if self.basis is not None:
            _check_basis(self.basis, sg.layers, sg.kv_width, dtype)
        for t in range(tg.layers):
            for kind in KINDS:
                m = self.maps.get((t, kind))
                if m is None:
                    raise ArtifactError(f"map for target layer {t} {kind.upper()} is missing; refit the map")
                if not m.source_layers or any(not 0 <= s < sg.layers for s in m.source_layers):
                    raise ArtifactError(f"layer {t}{kind}: source layers {m.source_layers} outside 0..{sg.layers - 1}")
                if not m.inputs or any(c not in KINDS for c in m.inputs) or len(set(m.inputs)) != len(m.inputs):
                    raise ArtifactError(f"layer {t}{kind}: inputs {m.inputs} must be distinct items of {KINDS}")
                if not isinstance(m.window, int) or not 1 <= m.window <= MAX_WINDOW:
                    raise ArtifactError(f"layer {t}{kind}: window {m.window!r} outside 1..{MAX_WINDOW}")
                if self.basis is not None and (m.source_layers, m.inputs, m.window) != (
                    self.basis.source_layers,
                    self.basis.inputs,
                    1,
                ):
                    raise ArtifactError(
                        f"layer {t}{kind}: a shared-basis set's maps read the basis (sources "
                        f"{list(self.basis.source_layers)}, inputs {self.basis.inputs}, window 1); this one "
                        f"reads {list(m.source_layers)}, {m.inputs}, window {m.window}. Refit the map"
                    )
                want = (
                    (
                        self.basis.rank
                        if self.basis is not None
                        else m.window * len(m.source_layers) * len(m.inputs) * sg.kv_width
                    ),
                    tg.kv_width,
                )
                if tuple(m.weight.shape) != want or tuple(m.bias.shape) != (tg.kv_width,):
                    raise ArtifactError(
                        f"layer {t}{kind}: weight {tuple(m.weight.shape)} / bias {tuple(m.bias.shape)}, "
                        f"expected {want} / ({tg.kv_width},) for these geometries"
                    )
                if m.weight.dtype != dtype or m.bias.dtype != dtype:
                    raise ArtifactError(
                        f"layer {t}{kind}: weight/bias dtype {m.weight.dtype}/{m.bias.dtype} differs from the "
                        f"other maps' {dtype}; every map of a set shares one dtype. Refit the map"
                    )
                if not (torch.isfinite(m.weight).all() and torch.isfinite(m.bias).all()):
                    raise ArtifactError(f"layer {t}{kind}: weights contain NaN or Inf")


def _check_basis(basis: Basis, source_layers: int, width: int, dtype: torch.dtype) -> None:
    if (
        not basis.source_layers
        or len(set(basis.source_layers)) != len(basis.source_layers)
        or any(not 0 <= s < source_layers for s in basis.source_layers)
    ):
        raise ArtifactError(
            f"basis: source layers {list(basis.source_layers)} must be distinct layers in 0..{source_layers - 1}"
        )
    if not basis.inputs or any(c not in KINDS for c in basis.inputs) or len(set(basis.inputs)) != len(basis.inputs):
        raise ArtifactError(f"basis: inputs {basis.inputs} must be distinct items of {KINDS}")
    rows = len(basis.source_layers) * len(basis.inputs) * width
    if basis.encoder.dim() != 2 or basis.encoder.shape[0] != rows or not 1 <= basis.encoder.shape[1] <= rows:
        raise ArtifactError(
            f"basis: encoder {tuple(basis.encoder.shape)}, expected [{rows}, rank] with 1 <= rank <= {rows}"
        )
    if tuple(basis.bias.shape) != (basis.rank,):
        raise ArtifactError(f"basis: bias {tuple(basis.bias.shape)}, expected ({basis.rank},)")
    if basis.encoder.dtype != dtype or basis.bias.dtype != dtype:
        raise ArtifactError(
            f"basis: dtype {basis.encoder.dtype}/{basis.bias.dtype} differs from the maps' {dtype}; "
            "every tensor of a set shares one dtype. Refit the map"
        )
    if not (torch.isfinite(basis.encoder).all() and torch.isfinite(basis.bias).all()):
        raise ArtifactError("basis: weights contain NaN or Inf")
    if basis.mlp is not None:
        w_in, b_in, w_out = basis.mlp.tensors()
        h = basis.mlp.hidden
        if (
            tuple(w_in.shape) != (basis.rank, h)
            or tuple(b_in.shape) != (h,)
            or tuple(w_out.shape) != (h, basis.rank)
            or h < 1
        ):
            raise ArtifactError(
                f"basis: code MLP shapes {tuple(w_in.shape)}, {tuple(b_in.shape)}, {tuple(w_out.shape)}; "
                f"expected [rank, hidden], [hidden], [hidden, rank] with rank {basis.rank}"
            )
        if any(t.dtype != dtype for t in basis.mlp.tensors()):
            raise ArtifactError(
                f"basis: the code MLP's dtype differs from the maps' {dtype}; every tensor of a set shares one dtype"
            )
        if not all(torch.isfinite(t).all() for t in basis.mlp.tensors()):
            raise ArtifactError("basis: the code MLP's weights contain NaN or Inf")


def _tensors(ms: MapSet) -> dict[str, torch.Tensor]:
    out = {}
    if ms.basis is not None:
        out["basis.encoder"] = ms.basis.encoder.detach().cpu().contiguous()
        out["basis.bias"] = ms.basis.bias.detach().cpu().contiguous()
        out["basis.sources"] = torch.tensor(ms.basis.source_layers, dtype=torch.int64)
        if ms.basis.mlp is not None:
            for name, t in zip(("w_in", "b_in", "w_out"), ms.basis.mlp.tensors()):
                out[f"basis.mlp.{name}"] = t.detach().cpu().contiguous()
    for (t, kind), m in sorted(ms.maps.items()):
        out[f"layer.{t}.{kind}.weight"] = m.weight.detach().cpu().contiguous()
        out[f"layer.{t}.{kind}.bias"] = m.bias.detach().cpu().contiguous()
        out[f"layer.{t}.{kind}.sources"] = torch.tensor(m.source_layers, dtype=torch.int64)
    return out


def _format_version(ms: MapSet) -> int:
    """1 for per-token sets (byte-identical to what earlier kvferry wrote), 2 once a map is windowed, 3 for a
    shared-basis set: a kvferry that cannot apply windows (a basis) refuses the artifact instead of reading its weights
    as per-token maps."""
    if ms.basis is not None:
        return 4 if ms.basis.mlp is not None else 3
    return 2 if ms.context else 1


def _manifest(ms: MapSet) -> dict:
    body = {
        "format": FORMAT,
        "format_version": _format_version(ms),
        "name": ms.name,
        "version": ms.version,
        "content_sha256": ms.content_sha256,
        "source": ms.source.as_dict(),
        "target": ms.target.as_dict(),
        "maps": [
            {
                "target_layer": t,
                "kind": k,
                "source_layers": list(m.source_layers),
                "inputs": list(m.inputs),
                "lambda": m.lam,
                "heldout_r2": None if m.heldout_r2 != m.heldout_r2 else round(m.heldout_r2, 6),
                **({"window": m.window} if m.window != 1 else {}),
            }
            for (t, k), m in sorted(ms.maps.items())
        ],
        "fit": ms.fit,
        "calibration": ms.calibration,
        "evidence": ms.evidence,
        "created_at": ms.created_at,
        "kvferry_version": ms.kvferry_version,
    }
    if ms.basis is not None:
        body["basis"] = {
            "rank": ms.basis.rank,
            "source_layers": list(ms.basis.source_layers),
            "inputs": list(ms.basis.inputs),
            **({"mlp_hidden": ms.basis.mlp.hidden} if ms.basis.mlp is not None else {}),
        }
    body["manifest_sha256"] = digest(body)
    return body


def artifact_dir(root: str | Path, ms_or_name, version: str | None = None) -> Path:
    name = ms_or_name.name if isinstance(ms_or_name, MapSet) else ms_or_name
    version = version or ms_or_name.version
    return Path(root) / check_name(name) / check_version(version)


def save(ms: MapSet, root: str | Path, overwrite: bool = False) -> Path:
    """Write the artifact atomically (a temp dir renamed into place); returns its directory."""
    from kvferry import __version__

    ms.validate()
    ms.created_at = ms.created_at or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    ms.kvferry_version = ms.kvferry_version or __version__
    dest = artifact_dir(root, ms)
    if dest.exists() and not overwrite:
        raise ArtifactError(f"{dest} exists; bump the version (artifacts are immutable) or pass overwrite=True")
    meta = {
        "format": FORMAT,
        "format_version": str(_format_version(ms)),
        "name": ms.name,
        "version": ms.version,
        "source_geometry": ms.source.geometry.fingerprint,
        "target_geometry": ms.target.geometry.fingerprint,
        "tokenizer": ms.source.tokenizer,
    }
    blob = _canonical(st_save(_tensors(ms), metadata=meta))
    ms.content_sha256 = hashlib.sha256(blob).hexdigest()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{ms.version}.", dir=dest.parent))
    (tmp / "maps.safetensors").write_bytes(blob)
    (tmp / "manifest.json").write_text(json.dumps(_manifest(ms), indent=1, sort_keys=True) + "\n")
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return dest


def write_evidence(path: str | Path, evidence: dict) -> None:
    """Record evaluation evidence in an artifact's manifest (atomic replace; tensors untouched)."""
    path = Path(path)
    ms = load(path)
    ms.evidence = evidence
    tmp = path / ".manifest.json.tmp"
    tmp.write_text(json.dumps(_manifest(ms), indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path / "manifest.json")


def read_manifest(path: str | Path) -> dict:
    f = Path(path) / "manifest.json"
    try:
        man = json.loads(f.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{f} is missing: a map directory needs manifest.json beside maps.safetensors") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{f} is not valid JSON ({e}); restore it from the map's source") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise ArtifactError(f"{f} is not a kvferry map manifest (format != {FORMAT!r})")
    if man.get("format_version") not in READ_VERSIONS:
        raise ArtifactError(
            f"{f}: format_version {man.get('format_version')!r} is not supported by this kvferry "
            f"(reads {', '.join(map(str, READ_VERSIONS))}); upgrade kvferry or re-export the map"
        )
    claimed = man.pop("manifest_sha256", None)
    if claimed != digest(man):
        raise ArtifactError(f"{f}: manifest_sha256 does not match its contents; the manifest was edited or corrupted")
    return man


def load(
    path: str | Path, expect_source: ModelIdentity | None = None, expect_target: ModelIdentity | None = None
) -> MapSet:
    """Load and verify an artifact directory; optionally check it fits the given models."""
    path = Path(path)
    man = read_manifest(path)
    try:
        blob = (path / "maps.safetensors").read_bytes()
    except FileNotFoundError:
        raise ArtifactError(f"{path / 'maps.safetensors'} is missing") from None
    if hashlib.sha256(blob).hexdigest() != man.get("content_sha256"):
        raise ArtifactError(
            f"{path / 'maps.safetensors'}: sha256 does not match manifest content_sha256; "
            "the tensors were modified or truncated. Re-copy the artifact."
        )
    try:
        tensors = st_load(blob)
        meta = _metadata(blob)
    except (SafetensorError, ValueError) as e:
        raise ArtifactError(f"{path / 'maps.safetensors'} is not readable safetensors: {e}") from None
    try:
        source, target = ModelIdentity.from_dict(man["source"]), ModelIdentity.from_dict(man["target"])
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"{path}: manifest model identity is malformed ({e})") from None
    for key, want in (
        ("format", FORMAT),
        ("name", man["name"]),
        ("version", man["version"]),
        ("source_geometry", source.geometry.fingerprint),
        ("target_geometry", target.geometry.fingerprint),
    ):
        if meta.get(key) != want:
            raise ArtifactError(
                f"{path}: safetensors header {key}={meta.get(key)!r} disagrees with the manifest ({want!r})"
            )
    maps = {}
    for entry in man["maps"]:
        t, kind = int(entry["target_layer"]), entry["kind"]
        try:
            w, b = tensors[f"layer.{t}.{kind}.weight"], tensors[f"layer.{t}.{kind}.bias"]
            srcs = tuple(int(s) for s in tensors[f"layer.{t}.{kind}.sources"].tolist())
        except KeyError as e:
            raise ArtifactError(f"{path}: tensor {e} is missing from maps.safetensors") from None
        if list(srcs) != entry["source_layers"]:
            raise ArtifactError(f"{path}: layer {t}{kind} source layers disagree between tensors and manifest")
        r2 = entry.get("heldout_r2")
        maps[(t, kind)] = LayerMap(
            t,
            kind,
            srcs,
            w,
            b,
            float(entry.get("lambda", 0.0)),
            float("nan") if r2 is None else r2,
            tuple(entry.get("inputs") or (kind,)),
            _window(path, entry, man["format_version"]),
        )
    ms = MapSet(
        source,
        target,
        maps,
        man["version"],
        man.get("fit", {}),
        man.get("calibration", {}),
        man.get("evidence"),
        man.get("created_at", ""),
        man.get("kvferry_version", ""),
        man["content_sha256"],
        _basis(path, man, tensors),
    )
    if ms.name != man["name"]:
        raise ArtifactError(f"{path}: manifest name {man['name']!r} does not match its models ({ms.name!r})")
    ms.validate()
    for want, got, role in ((expect_source, source, "source"), (expect_target, target, "target")):
        if want is not None:
            check_identity(want, got, role)
    return ms


def _basis(path: Path, man: dict, tensors: dict[str, torch.Tensor]) -> Basis | None:
    """The shared basis a format-3 or -4 manifest declares (tensors and manifest must agree); None for other formats."""
    entry = man.get("basis")
    with_mlp = man["format_version"] == 4
    if (
        (entry is not None) != (man["format_version"] in (3, 4))
        or (entry is None) != ("basis.encoder" not in tensors)
        or with_mlp != ("basis.mlp.w_in" in tensors)
        or with_mlp != ("mlp_hidden" in (entry or {}))
    ):
        raise ArtifactError(
            f"{path}: format_version {man['format_version']}, a basis in the manifest and one in the "
            "tensors must go together; the artifact was edited: re-export it"
        )
    if entry is None:
        return None
    try:
        mlp = CodeMLP(*(tensors[f"basis.mlp.{n}"] for n in ("w_in", "b_in", "w_out"))) if with_mlp else None
        basis = Basis(
            tuple(int(s) for s in tensors["basis.sources"].tolist()),
            tensors["basis.encoder"],
            tensors["basis.bias"],
            tuple(entry["inputs"]),
            mlp,
        )
    except (KeyError, TypeError) as e:
        raise ArtifactError(f"{path}: basis entry or tensor {e} is missing") from None
    if (
        list(basis.source_layers) != entry.get("source_layers")
        or basis.rank != entry.get("rank")
        or (mlp is not None and mlp.hidden != entry.get("mlp_hidden"))
    ):
        raise ArtifactError(f"{path}: the basis' source layers or rank disagree between tensors and manifest")
    return basis


def _window(path: Path, entry: dict, format_version: int) -> int:
    window = entry.get("window", 1)
    if window != 1 and format_version < 2:
        raise ArtifactError(
            f"{path}: layer {entry['target_layer']}{entry['kind']} is windowed but the manifest says "
            "format_version 1; the artifact was edited: re-export it"
        )
    if type(window) is not int:
        raise ArtifactError(f"{path}: layer {entry['target_layer']}{entry['kind']} window {window!r} is not an integer")
    return window


def check_identity(model: ModelIdentity, in_map: ModelIdentity, role: str) -> None:
    if model.geometry.fingerprint != in_map.geometry.fingerprint:
        raise Incompatible(
            f"{role} geometry fingerprint {model.geometry.fingerprint[:12]}… does not match the map's "
            f"{in_map.geometry.fingerprint[:12]}… ({in_map.name}); use the map fitted for this model"
        )
    if model.tokenizer != in_map.tokenizer:
        raise Incompatible(
            f"{role} tokenizer fingerprint does not match the map's ({in_map.name}); "
            "the model tokenizes differently from the one the map was fitted on"
        )


def _canonical(blob: bytes) -> bytes:
    """Re-emit the safetensors header with sorted keys, so equal maps give byte-identical files."""
    n = int.from_bytes(blob[:8], "little")
    header = json.dumps(json.loads(blob[8 : 8 + n]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # keep the data section 8-byte aligned, as safetensors does
    return len(header).to_bytes(8, "little") + header + blob[8 + n :]


def _metadata(blob: bytes) -> dict:
    n = int.from_bytes(blob[:8], "little")
    if n <= 0 or n > len(blob) - 8:
        raise ValueError("bad header length")
    return json.loads(blob[8 : 8 + n]).get("__metadata__", {}) or {}
