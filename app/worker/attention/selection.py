"""Which attention backend a worker runs, probed at start-up, and the kernels' launch mode (PDL).

The choice: --attention-backend if given (it must be usable here), else the device's default
(resolve_attention_backend), moved off a default that cannot read an FP8 KV cache, and off flashinfer
when its kernels are not in the JIT cache on every tensor-parallel rank (a start compiles nothing).
"""

from __future__ import annotations

import logging

import torch

from app.worker.attention import backend_class, resolve_attention_backend
from app.worker.attention.base import AttentionSpec
from app.worker.parallel import TensorParallel
from app.worker.quantization.kv import fp8_kv_backend

logger = logging.getLogger(__name__)


def choose_backend(requested: str | None, device: torch.device, dtype: torch.dtype, spec: AttentionSpec,
                   kv_dtype: torch.dtype, kv_quantized: bool, block_size: int, tp: TensorParallel,
                   build_kernels: bool) -> str:
    """The attention backend's name for this worker (see the module docstring); TP ranks agree on it."""
    name = resolve_attention_backend(requested, device, dtype, spec.head_dim)
    if requested is not None:
        return name
    if kv_quantized:
        name = fp8_kv_backend(name, backend_class(name))
    if name == "flashinfer":
        name = flashinfer_or_triton(spec, kv_dtype, device, block_size, tp, build_kernels)
    return name


def flashinfer_or_triton(spec: AttentionSpec | None, kv_dtype: torch.dtype, device: torch.device, block_size: int,
                         tp: TensorParallel, build_kernels: bool) -> str:
    """The default flashinfer backend only if its kernels are in the JIT cache (a start compiles nothing:
    a build takes minutes; `tokenspeed warmup` builds them, with build_kernels); else triton, said in the
    log. An explicit --attention-backend flashinfer builds what it lacks, or fails."""
    from app.worker.attention.flashinfer_backend import kernels_unavailable

    problem = kernels_unavailable(spec, kv_dtype, device, block_size, build=build_kernels)
    if not tp.failed_ranks(problem is None):  # TP ranks agree on one backend
        return "flashinfer"
    logger.warning("flashinfer's attention kernels are not in its JIT cache or cannot be loaded on every rank "
                   "(here: %s): using the triton backend; `tokenspeed warmup` builds them into the cache "
                   "(docs/deploy.md)", problem or "fine")
    return "triton"


def configure_pdl(wanted: bool, device: torch.device, tp: TensorParallel) -> bool:
    """Programmatic dependent launch for the decode-path Triton kernels (--enable-pdl): on one GPU of
    compute capability 9.0 or newer with a Triton that has it (3.4+); a process-wide switch, set
    before any kernel is compiled or captured. On the H200 it takes 0 to 5% off a batch-1 step, 3 to 9%
    with FP8 weights: each kernel's launch overlaps the end of the one before. Returns whether it is on."""
    if device.type != "cuda":
        return False
    from tokenspeed_kernels.common import PDL_AVAILABLE, set_pdl

    usable = PDL_AVAILABLE and tp.size == 1 and torch.cuda.get_device_capability(device) >= (9, 0)
    set_pdl(wanted and usable)
    if wanted and not usable:
        logger.info("programmatic dependent launch off: it needs one GPU of compute capability 9.0+ and "
                    "Triton 3.4+")
    return wanted and usable
