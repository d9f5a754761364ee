"""kvferry's map math. The runtime, what serving imports, is this package's own modules: artifact, apply, cache
(per-layer KV and the HF adapters), rope, features, geometry, precision, versions, gates (and their bars), drift,
intervals, errors. The offline lab is the ``lab`` subpackage: capture, Gram sums, closed-form fits, distillation,
values matched to attention, the evaluation and its probes, references, the frontier.

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
    "LoadedModel": "lab.capture",
    "load_model": "lab.capture",
    "capture_kv": "lab.capture",
    "read_corpus": "lab.capture",
    "FitSettings": "lab.fit",
    "fit_pair": "lab.fit",
    "identity_mapset": "lab.fit",
    "LayerMap": "artifact",
    "MapSet": "artifact",
    "load": "artifact",
    "save": "artifact",
    "write_evidence": "artifact",
    "StreamingApplier": "apply",
    "EvalSettings": "lab.evaluate",
    "CopySettings": "lab.copy_probe",
    "CompletionSettings": "lab.completion",
    "completion_task": "lab.completion",
    "Gates": "gates",
    "load_for_serving": "gates",
    "DistillSettings": "lab.distill",
    "capture_tails": "lab.distill",
    "Memo": "lab.memo",
}
# Functions named like their module (apply, evaluate, distill, copy_probe, scramble) are imported from it:
# `from kvferry.mappings.apply import apply`; a package attribute cannot be both the module and the function.
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
