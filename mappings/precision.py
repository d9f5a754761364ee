"""Which dtype a map's matmul runs in: the stored dtype where the device has native kernels for it, else float32.

A bfloat16 map is applied as if its inputs and weights were rounded to bfloat16 and its output rounded to bfloat16
(that is what its evidence measured). Products of two bfloat16 numbers are exact in float32 and the kernels
accumulate in float32 either way, so running such a map in float32 gives the same result up to summation order. It
matters on every x86 CPU without bfloat16 instructions (AVX512_BF16 or AMX): on one with AVX-512 alone, oneDNN's
bfloat16 GEMM of 2,032 x 1,024 by 1,024 x 512 took 69 ms against 22 ms in float32 (2 threads); without AVX-512, torch
falls back to a scalar loop 40-70x slower than float32.
"""

from __future__ import annotations

import functools

import torch


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (x86 "flags", Arm "Features"); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def _cpu_has_fast_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 natively: x86 with AVX512_BF16 or AMX, Arm with its BF16 extension. Where
    the flags cannot be read, what torch's own CPU matmul dispatch asks before taking oneDNN's bfloat16 GEMM."""
    flags = _cpu_flags()
    if flags:
        return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def _fast_bf16(device: torch.device) -> bool:
    if device.type == "cpu":
        return _cpu_has_fast_bf16()
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return True  # other accelerators: trust the stored dtype


def fast_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices natively, at least as fast as float32 ones (asked once per
    device: apply asks on every matmul)."""
    return _fast_bf16(torch.device(device))


def matmul_dtype(map_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype a map stored in ``map_dtype`` is multiplied in on ``device``; the result is then rounded to
    ``map_dtype``, so the output is the one the evidence measured."""
    if map_dtype == torch.bfloat16 and not fast_bf16(device):
        return torch.float32
    return map_dtype


PRECISIONS = ("float32", "bfloat16")
"""What a lab run's forwards (capture, distillation, evaluation) may run in."""


def check_precision(name: str, value: str) -> str:
    """``value`` when it is one of :data:`PRECISIONS`; else a named refusal."""
    if value not in PRECISIONS:
        from .errors import InvalidInput

        raise InvalidInput(f"{name} must be one of {', '.join(PRECISIONS)}, got {value!r}")
    return value


def autocast(model, precision: str):
    """The context a forward of ``model`` runs in at ``precision``: torch's autocast to bfloat16 on the model's device
    (weights stay as stored; matmuls run in bfloat16, accumulating in float32), or nothing for float32. On a CPU
    without native bfloat16 (see :func:`fast_bf16`) it is many times slower, not faster."""
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=torch.bfloat16, enabled=check_precision("precision", precision) == "bfloat16")
