"""Which dtype a map's matmul runs in: the stored dtype where the device has fast kernels for it, else float32.

A bfloat16 map is applied as if its inputs and weights were rounded to bfloat16 and its output rounded to bfloat16
(that is what its evidence measured). Products of two bfloat16 numbers are exact in float32 and the kernels
accumulate in float32 either way, so running such a map in float32 gives the same result up to summation order. It
matters on CPUs without AVX-512: there torch has no oneDNN bfloat16 GEMM and falls back to a scalar loop that
measured 40-70x slower than float32.
"""

from __future__ import annotations

import functools

import torch


def _cpu_has_fast_bf16() -> bool:
    """What torch's own CPU matmul dispatch asks before taking the oneDNN bfloat16 GEMM (AVX-512 BW/VL/DQ, AMX, or
    Arm's BF16 extension)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the op: AVX-512 is what the GEMM needs
        return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


@functools.cache
def _fast_bf16(device: torch.device) -> bool:
    if device.type == "cpu":
        return _cpu_has_fast_bf16()
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return True  # other accelerators: trust the stored dtype


def fast_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices at least as fast as float32 ones (asked once per device: apply
    asks on every matmul)."""
    return _fast_bf16(torch.device(device))


def matmul_dtype(map_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype a map stored in ``map_dtype`` is multiplied in on ``device``; the result is then rounded to
    ``map_dtype``, so the output is the one the evidence measured."""
    if map_dtype == torch.bfloat16 and not fast_bf16(device):
        return torch.float32
    return map_dtype
