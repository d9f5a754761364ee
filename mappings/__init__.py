"""kvferry's map math: capture, Gram sums, closed-form ridge maps, artifacts, apply, evaluation, gates.

    from kvferry.mappings import fit_pair, FitSettings, load, Gates
    from kvferry.mappings.apply import apply

Names are imported on first use (``import kvferry.mappings`` alone loads no torch).
"""

from __future__ import annotations

from kvferry.lazy import lazy_exports

_EXPORTS = {
    "Geometry": "geometry",
    "ModelIdentity": "geometry",
    "geometry_of": "geometry",
    "check_pair": "geometry",
    "tokenizer_fingerprint": "geometry",
    "LoadedModel": "capture",
    "load_model": "capture",
    "capture_kv": "capture",
    "read_corpus": "capture",
    "FitSettings": "fit",
    "fit_pair": "fit",
    "identity_mapset": "fit",
    "LayerMap": "artifact",
    "MapSet": "artifact",
    "load": "artifact",
    "save": "artifact",
    "write_evidence": "artifact",
    "StreamingApplier": "apply",
    "EvalSettings": "evaluate",
    "CopySettings": "copy_probe",
    "CompletionSettings": "completion",
    "completion_task": "completion",
    "Gates": "gates",
    "load_for_serving": "gates",
    "DistillSettings": "distill",
    "capture_tails": "distill",
    "Memo": "memo",
}
# Functions named like their module (apply, evaluate, distill, copy_probe, scramble) are imported from it:
# `from kvferry.mappings.apply import apply`; a package attribute cannot be both the module and the function.
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
