"""The flashinfer backend (CUDA, fp16/bf16 queries): paged KV in NHD layout, our per-layer
[num_blocks, block_size, Hkv, D] K and V tensors passed as a (k, v) tuple.

plan() runs once per step and is shared by all layers: a step whose sequences all feed one token
plans the decode kernel, a step of prefill chunks the batch-prefill wrapper with a causal mask
(flashinfer aligns it to the end of each context, so a chunk after a cached prefix sees the whole
prefix), and a mixed step both: its leading one-token rows on the decode kernel, the rest on the
prefill wrapper (MixedMetadata). The page list flashinfer reads (CSR indptr/indices/last_page_len)
is built from the block tables on the device by a Triton kernel. K/V rows are written by our fused
write kernel (with the rotary embedding, on CUDA), once per layer for the whole step.

CUDA graphs: each captured decode size gets its own decode wrapper in CUDA-graph mode with fixed
indptr / last_page_len buffers and one page-index buffer shared by all sizes (one graph replays at a
time); prepare_replay() re-plans it before every replay. The workspaces are shared by every wrapper
for the same reason.

Decode steps run the kernel that reads the cache fastest (scripts/gpu/bench_decode_attention.py, one
H200, 384 sequences of 1500 tokens, share of the copy bandwidth):
- a 16-bit cache: our Triton split-K decode kernel (the triton backend's decode path, 0.99), ahead
  of flashinfer's CUDA-core decode kernel (0.69) and its tensor-core path on FA3 (0.21);
- an FP8 cache on Hopper: "xqa" below (0.93 at 384 and 512 x 1500), at the price of a query rounded
  to FP8 (3.7e-2 relative error against the torch backend on the same cache, 4.9e-3 for FA2);
  elsewhere flashinfer's tensor-core path, i.e. its FA2 prefill kernels with one query row per
  sequence (0.56), ahead of Triton (0.52 with float16 operands; the offline 1000 x 1000 run ties) and the
  CUDA-core kernel (0.28). `--attention-backend triton` is the precise choice for an FP8 cache.
`decode_kernel` ("triton", "tensor_cores", "cuda_cores", "xqa") overrides the choice; "tensor_cores" is
refused for a 16-bit cache (never the faster there, and its FA2 16-bit kernels are not built or tested).
"xqa" is TensorRT-LLM's Hopper decode kernel as flashinfer ships it (flashinfer.decode.
xqa_batch_decode_with_kv_cache): compute capability 9.x, blocks of 16 to 128 tokens; FP8 tensor-core
math on an FP8 cache (the query is rounded to FP8 too), its generic kernel on a 16-bit one (slower
than Triton's there at every measured batch). It reads the block tables and lengths directly (no
plan), so its CUDA graphs need no re-planning.

FP8 KV cache (float8_e4m3fn codes, per-layer scales): the wrappers are planned with
kv_data_type=float8_e4m3fn and the query dtype (AttentionSpec.q_dtype, which must then be set: the
cache no longer tells it), and run() gets the layer's k_scale / v_scale: flashinfer folds k_scale
into the softmax scale and multiplies the output by v_scale (a torch op after the kernel, captured
with it). Prefill chunks over an FP8 cache run, on Hopper, flashinfer's FA3 kernels with FP8 queries
(`prefill_kernel="fa3"`, the default there): q . k and p . v on FP8 tensor cores, the cache read as it
is stored. The queries are rounded to e4m3 at scale 1 (kernels/fp8_quant.cast_to_e4m3, saturating at
+-448), as vLLM's FA3 path does for an FP8 cache; the probabilities go to FP8 inside the kernel. Against
FA2 with bf16 queries (`prefill_kernel="fa2"`, the choice elsewhere: FA2 takes no FP8 queries), on the
H200: 0.22 to 0.28 of the time (8 fresh 1000-token prompts: 531 ->
146 us a layer), relative error 4.3e-2 to 5.4e-2 against 1.8e-3, the precision class of xqa's decode.

Works with flashinfer-python 0.6.1 and 0.7.x (same wrapper constructors, plan and run keywords).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from app.worker.attention.base import (
    AttentionBackend,
    AttentionBatch,
    AttentionMetadata,
    AttentionSpec,
    MixedMetadata,
    build_attention_batch,
)
from app.worker.attention.triton_backend import (
    TritonAttentionBackend,
    TritonAttentionMetadata,
    write_new_tokens,
)
from app.worker.kv_cache import KVCache, KVCacheSpec
from app.worker.layers.rotary import Rope

# flashinfer's split-KV scratch grows with the batch: a graph-mode tensor-core decode plan of 512
# sequences asks for ~170 MB of it. Shared by every wrapper (their runs never overlap).
WORKSPACE_BYTES = 512 << 20
INT_WORKSPACE_BYTES = 8 << 20
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)  # query (model) dtypes
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # the head sizes flashinfer's paged kernels are built for
FP8_KV_DTYPE = torch.float8_e4m3fn
DECODE_KERNELS = ("triton", "tensor_cores", "cuda_cores", "xqa")  # see the module docstring
PREFILL_KERNELS = ("fa2", "fa3")  # for an FP8 cache: bf16 queries on FA2, FP8 queries on FA3 (Hopper)
XQA_BLOCK_SIZES = (16, 32, 64, 128)
# xqa's workspace: flashinfer takes its first 8 MiB for semaphores (zero before the first call; each
# call leaves them zero), the rest for split contexts' partial results (small: xqa splits a context
# only while SMs would idle).
XQA_WORKSPACE_BYTES = 32 << 20


def default_decode_kernel(kv_dtype: torch.dtype, device: torch.device, block_size: int, head_dim: int) -> str:
    """The fastest decode kernel that runs this cache here (see the module docstring)."""
    if kv_dtype != FP8_KV_DTYPE:
        return "triton"
    if xqa_unsupported(device, block_size, head_dim) is None:
        return "xqa"
    return "tensor_cores"


def default_prefill_kernel(kv_dtype: torch.dtype, device: torch.device) -> str:
    """flashinfer's prefill kernels for this cache here: "auto" (FA3 on Hopper, else FA2) for a 16-bit
    cache; for an FP8 one FA3 with FP8 queries on Hopper, else FA2 (see the module docstring)."""
    if kv_dtype != FP8_KV_DTYPE:
        return "auto"
    return "fa3" if fa3_unsupported(device) is None else "fa2"


def fa3_unsupported(device: torch.device) -> str | None:
    """Why flashinfer's FA3 kernels cannot run here (None: they can): they are built for sm_90a."""
    capability = torch.cuda.get_device_capability(device)
    if capability[0] != 9:
        return f"prefill kernel 'fa3' runs on compute capability 9.x (Hopper), not {capability}"
    return None


def xqa_unsupported(device: torch.device, block_size: int, head_dim: int) -> str | None:
    """Why the xqa decode kernel cannot read a cache of these blocks and heads here (None: it can)."""
    capability = torch.cuda.get_device_capability(device)
    if capability[0] != 9:
        return f"decode kernel 'xqa' runs on compute capability 9.x (Hopper), not {capability}"
    if block_size not in XQA_BLOCK_SIZES or head_dim % 16 or head_dim > 256:
        return (
            f"decode kernel 'xqa' needs --block-size in {XQA_BLOCK_SIZES} and a head size that is a "
            f"multiple of 16 up to 256, not {block_size} and {head_dim}"
        )
    return None


def import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as exc:
        raise ValueError(
            "attention backend 'flashinfer' needs the flashinfer-python package (the gpu extra: "
            "pip install 'flashinfer-python==0.6.1')"
        ) from exc
    return flashinfer


def flashinfer_available() -> bool:
    try:
        import_flashinfer()
    except ValueError:
        return False
    return True


def query_and_kv_dtypes(
    kv_dtype: torch.dtype, q_dtype: torch.dtype | None
) -> tuple[torch.dtype, torch.dtype]:
    """(query dtype, KV dtype) the wrappers are planned for: a 16-bit query over a cache of the same
    dtype, or over an FP8 cache. ValueError naming what is wrong otherwise."""
    query = q_dtype if q_dtype is not None else kv_dtype
    if kv_dtype == FP8_KV_DTYPE and q_dtype is None:
        raise ValueError(
            "attention backend 'flashinfer' reads an FP8 KV cache only when the attention spec names the "
            "query dtype (AttentionSpec.q_dtype)"
        )
    if query not in SUPPORTED_DTYPES:
        raise ValueError(
            f"attention backend 'flashinfer' supports float16 and bfloat16, not {query}; "
            "use --attention-backend triton"
        )
    if kv_dtype not in (query, FP8_KV_DTYPE):
        raise ValueError(
            f"attention backend 'flashinfer' reads a {query} or float8_e4m3fn KV cache with {query} "
            f"queries, not a {kv_dtype} one"
        )
    return query, kv_dtype


@dataclass
class FlashInferMetadata(AttentionMetadata):
    wrapper: Any = None


@dataclass
class XqaMetadata(AttentionMetadata):
    """A decode step on xqa: it reads the batch's block tables and lengths as they are."""


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graphs = True
    supports_fp8_kv = True  # reads an FP8 cache with its per-layer scales (see the module docstring)
    supports_piecewise_graphs = True

    def __init__(self, kv_cache: KVCache, spec: AttentionSpec, decode_kernel: str | None = None,
                 prefill_kernel: str | None = None) -> None:  # fmt: skip
        super().__init__(kv_cache, spec)
        self.device = kv_cache.k[0].device
        if self.device.type != "cuda":
            raise ValueError("attention backend 'flashinfer' needs a CUDA device")
        self.dtype, self.kv_dtype = query_and_kv_dtypes(kv_cache.spec.dtype, spec.q_dtype)
        if spec.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"attention backend 'flashinfer' supports head_dim {SUPPORTED_HEAD_DIMS}, not {spec.head_dim}; "
                "use --attention-backend triton"
            )
        self.fi = import_flashinfer()
        from tokenspeed_kernels.fp8_quant import cast_to_e4m3
        from tokenspeed_kernels.page_table import flatten_block_tables

        self._flatten = flatten_block_tables
        self._cast_to_e4m3 = cast_to_e4m3
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.int_workspace = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        # The decode wrapper's plan lives beside the prefill wrapper's: a mixed step plans both.
        self.decode_int_workspace = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill_kernels = self._prefill_kernels(prefill_kernel)
        # FA3 over an FP8 cache reads FP8 queries (see the module docstring).
        fp8_queries = self.prefill_kernels == "fa3" and self.kv_dtype == FP8_KV_DTYPE
        self.prefill_q_dtype = FP8_KV_DTYPE if fp8_queries else self.dtype
        self.decode_kernel = decode_kernel or default_decode_kernel(
            self.kv_dtype, self.device, kv_cache.block_size, spec.head_dim
        )
        if self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode kernel {self.decode_kernel!r} is not one of {DECODE_KERNELS}")
        if self.decode_kernel == "tensor_cores" and self.kv_dtype != FP8_KV_DTYPE:
            # Untested (its FA2 16-bit kernels take ~95 s of nvcc) and never the faster choice here.
            raise ValueError("decode kernel 'tensor_cores' serves an FP8 cache; a 16-bit cache decodes on "
                             "'triton' (0.99 of the copy bandwidth) or 'cuda_cores'")
        if self.decode_kernel == "xqa":
            problem = xqa_unsupported(self.device, kv_cache.block_size, spec.head_dim)
            if problem is not None:
                raise ValueError(problem)
        # Decode steps on the Triton kernel are planned, captured and run by a triton backend on this cache.
        self.triton = TritonAttentionBackend(kv_cache, spec) if self.decode_kernel == "triton" else None
        self.xqa_workspace = (
            torch.zeros(XQA_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
            if self.decode_kernel == "xqa"
            else None
        )
        self.decode_wrapper = (
            self._share(self._decode_wrapper(), self.decode_int_workspace)
            if self.decode_kernel in ("tensor_cores", "cuda_cores")
            else None
        )
        self.prefill_wrapper = self._share(
            self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=self.prefill_kernels)
        )
        self._graph_indices: torch.Tensor | None = None

    def _prefill_kernels(self, choice: str | None) -> str:
        """The prefill wrapper's flashinfer backend: the default for the cache here, or choice."""
        if choice is None:
            return default_prefill_kernel(self.kv_dtype, self.device)
        if choice not in PREFILL_KERNELS:
            raise ValueError(f"prefill kernel {choice!r} is not one of {PREFILL_KERNELS}")
        if choice == "fa3" and (problem := fa3_unsupported(self.device)) is not None:
            raise ValueError(problem)
        return choice

    def decode_kernel_name(self) -> str:
        return self.decode_kernel

    def _decode_wrapper(self, **graph_buffers: Any) -> Any:
        """A batch-decode wrapper: on tensor cores (flashinfer's FA2 prefill kernels, one query row per
        sequence) or the CUDA-core decode kernel."""
        tensor_cores = {"use_tensor_cores": True, "backend": "fa2"} if self.decode_kernel == "tensor_cores" else {}
        return self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=bool(graph_buffers), **graph_buffers, **tensor_cores
        )

    def _share(self, wrapper: Any, int_workspace: torch.Tensor | None = None) -> Any:
        wrapper.reset_workspace_buffer(self.workspace, self.int_workspace if int_workspace is None else int_workspace)
        return wrapper

    # ------------------------------------------------------------------ planning

    def _pages(self, batch: AttentionBatch) -> tuple[torch.Tensor, ...]:
        """(indptr host, indices device, last_page_len host) of the batch's contexts."""
        size = batch.block_size
        counts = [(n + size - 1) // size for n in batch.seq_lens]
        indptr = torch.zeros(len(counts) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(counts, dtype=torch.int32), 0, out=indptr[1:])
        last = torch.tensor([(n - 1) % size + 1 for n in batch.seq_lens], dtype=torch.int32)
        indptr_dev = indptr.to(self.device, non_blocking=True)
        indices = self._flatten(batch.block_tables, indptr_dev, int(indptr[-1]))
        return indptr, indices, last

    def _plan_decode(self, wrapper: Any, batch: AttentionBatch) -> None:
        indptr, indices, last = self._pages(batch)
        s = self.spec
        wrapper.plan(
            indptr, indices, last, s.num_heads, s.num_kv_heads, s.head_dim, batch.block_size,
            q_data_type=self.dtype, kv_data_type=self.kv_dtype, sm_scale=s.scale,
        )  # fmt: skip

    def plan(self, batch: AttentionBatch) -> AttentionMetadata:
        return self.plan_decodes_and_prefills(batch, self._plan_decode_rows, self._plan_prefill)

    def _plan_decode_rows(self, batch: AttentionBatch) -> AttentionMetadata:
        if self.triton is not None:
            return self.triton.plan(batch)
        if self.xqa_workspace is not None:
            return XqaMetadata(backend=self, batch=batch)
        self._plan_decode(self.decode_wrapper, batch)
        return FlashInferMetadata(backend=self, batch=batch, wrapper=self.decode_wrapper)

    def _plan_prefill(self, batch: AttentionBatch) -> FlashInferMetadata:
        indptr, indices, last = self._pages(batch)
        s = self.spec
        self.prefill_wrapper.plan(
            torch.tensor(batch.query_start_loc, dtype=torch.int32), indptr, indices, last,
            s.num_heads, s.num_kv_heads, s.head_dim, batch.block_size,
            causal=True, sm_scale=s.scale, q_data_type=self.prefill_q_dtype, kv_data_type=self.kv_dtype,
            o_data_type=self.dtype,
        )  # fmt: skip
        return FlashInferMetadata(backend=self, batch=batch, wrapper=self.prefill_wrapper)

    # ------------------------------------------------------------------ CUDA graphs

    def capture_metadata(self, batch: AttentionBatch) -> AttentionMetadata:
        if self.triton is not None:
            return self.triton.capture_metadata(batch)
        if self.xqa_workspace is not None:
            return XqaMetadata(backend=self, batch=batch)
        size, width = batch.num_seqs, batch.block_tables.shape[1]
        if self._graph_indices is None or self._graph_indices.numel() < size * width:
            # Sized for the first (largest) capture: every later, smaller size fits in it.
            self._graph_indices = torch.zeros(size * width, dtype=torch.int32, device=self.device)
        wrapper = self._share(
            self._decode_wrapper(
                paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=self.device),
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=torch.zeros(size, dtype=torch.int32, device=self.device),
            )
        )
        meta = FlashInferMetadata(backend=self, batch=batch, wrapper=wrapper)
        self.prepare_replay(meta, batch)
        return meta

    def prepare_replay(self, meta: AttentionMetadata, batch: AttentionBatch) -> None:
        if isinstance(meta, (TritonAttentionMetadata, XqaMetadata)):
            return  # their kernels read the persistent buffers directly
        assert isinstance(meta, FlashInferMetadata)
        self._plan_decode(meta.wrapper, batch)

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        # xqa reads q contiguous: the rotation writes it so (a copy a layer less).
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if self.xqa_workspace is not None else None
        q = write_new_tokens(self.kv_cache, layer_idx, q, k, v, meta.batch.slot_mapping, rope, q_out)
        return self.attend(layer_idx, q, meta)

    def attend(
        self, layer_idx: int, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if isinstance(meta, TritonAttentionMetadata):
            assert self.triton is not None
            return self.triton.attend(layer_idx, q, meta, out)
        if isinstance(meta, MixedMetadata):
            return self.attend_mixed(layer_idx, q, meta, out)
        k_cache, v_cache = self.kv_cache.k[layer_idx], self.kv_cache.v[layer_idx]
        k_scale, v_scale = self.kv_cache.k_scales[layer_idx], self.kv_cache.v_scales[layer_idx]
        if isinstance(meta, XqaMetadata):
            return self._xqa(q, k_cache, v_cache, k_scale, v_scale, meta.batch, out)
        assert isinstance(meta, FlashInferMetadata)
        # 1.0 for a 16-bit cache: flashinfer then leaves the softmax scale and the output as they are.
        # Without out, the wrapper would zero a fresh output first. The wrappers' kernels take q's token
        # and head strides: the fused QKV output's view needs no copy (~40 us a layer at 8,192 tokens).
        if q.stride(-1) != 1:
            q = q.contiguous()
        if meta.wrapper is self.prefill_wrapper and self.prefill_q_dtype == FP8_KV_DTYPE:
            # FA3's FP8 kernels take the (q, k, v) scales as positional arguments: q . k's go into the
            # softmax scale, v's into the output.
            return meta.wrapper.run(self._cast_to_e4m3(q), (k_cache, v_cache), 1.0, k_scale, v_scale, out=out)
        return meta.wrapper.run(q, (k_cache, v_cache), k_scale=k_scale, v_scale=v_scale, out=out)

    def _xqa(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float,
             v_scale: float, batch: AttentionBatch, out: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """xqa over the batch: its page table rows must be contiguous, its lengths uint32 (the same bits
        as our int32 ones); bmm1 scales q . k (softmax scale times k_scale), bmm2 the output (v_scale)."""
        from tokenspeed_kernels.common import pdl_enabled

        tables = batch.block_tables.contiguous()
        return self.fi.decode.xqa_batch_decode_with_kv_cache(
            q.contiguous(), (k_cache, v_cache), self.xqa_workspace, tables,
            batch.seq_lens_tensor.view(torch.uint32), tables.shape[1] * batch.block_size,
            bmm1_scale=self.spec.scale * k_scale, bmm2_scale=v_scale, out=out, enable_pdl=pdl_enabled(),
        )  # fmt: skip


PROBE_SEQ_LENS = (20, 70)  # the start-up probe's two sequences


def probe_batches(block_size: int, device: torch.device) -> tuple[int, list[AttentionBatch]]:
    """The start-up probe's cache size in blocks and its steps over two sequences of PROBE_SEQ_LENS
    tokens in blocks of block_size: a decode, then prefill chunks (a whole prompt and an extend)."""
    width = -(-max(PROBE_SEQ_LENS) // block_size)
    table = torch.arange(2 * width, dtype=torch.int32, device=device).view(2, width)
    steps = ([1, 1], [20, 3])
    return 2 * width, [build_attention_batch(table, list(q), list(PROBE_SEQ_LENS), block_size) for q in steps]


class KernelsNotCached(RuntimeError):
    """A flashinfer kernel the probe needs is not in the JIT cache, and building it was not allowed."""


@contextmanager
def refusing_jit_builds(spec_class: Any = None) -> Iterator[None]:
    """Within it, a flashinfer JIT kernel that is not compiled in the cache raises KernelsNotCached instead
    of being built (a build takes minutes of nvcc: a first start must compile nothing). A compiled one
    loads as before. `spec_class` is flashinfer's JitSpec (tests pass a stand-in)."""
    if spec_class is None:
        from flashinfer.jit.core import JitSpec as spec_class
    build = spec_class.build

    def build_if_cached(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.is_compiled:
            raise KernelsNotCached(f"kernel {self.name} is not in flashinfer's JIT cache")
        return build(self, *args, **kwargs)

    spec_class.build = build_if_cached
    try:
        yield
    finally:
        spec_class.build = build


def kernels_unavailable(
    spec: AttentionSpec, kv_dtype: torch.dtype, device: torch.device, block_size: int, build: bool = True
) -> str | None:
    """Why flashinfer cannot run this model's attention here (None: it can). Runs a decode and a prefill
    step, CUDA-graph decode included, on a two-sequence cache of the runner's block size (xqa builds a
    kernel per block size): that loads flashinfer's JIT kernels from its cache
    (FLASHINFER_WORKSPACE_BASE), or, if `build`, builds them, which needs nvcc (the runtime image has none)."""
    try:
        with refusing_jit_builds() if not build else nullcontext():
            _probe(spec, kv_dtype, device, block_size)
    except Exception as exc:  # a JIT build failure is a subprocess or RuntimeError from flashinfer
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}"
    return None


def _probe(spec: AttentionSpec, kv_dtype: torch.dtype, device: torch.device, block_size: int) -> None:
    num_blocks, steps = probe_batches(block_size, device)
    cache = KVCache(KVCacheSpec(1, spec.num_kv_heads, spec.head_dim, kv_dtype), num_blocks, block_size, device)
    backend = FlashInferAttentionBackend(cache, spec)
    query_dtype = spec.q_dtype or kv_dtype
    for batch in steps:
        q = torch.randn(batch.num_tokens, spec.num_heads, spec.head_dim, device=device, dtype=query_dtype)
        k = torch.randn(batch.num_tokens, spec.num_kv_heads, spec.head_dim, device=device, dtype=query_dtype)
        backend.forward(0, q, k, k.clone(), backend.plan(batch))
    meta = backend.capture_metadata(steps[0])
    backend.forward(0, q[:2], k[:2], k[:2].clone(), meta)
    torch.cuda.synchronize(device)
