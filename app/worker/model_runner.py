"""The model runner: the worker's device side. It loads the model, sizes and owns the KV pool,
keeps every sequence's block table and length on the device (updated from the plan's deltas), and
executes one StepPlan at a time: register new sequences, run the flat varlen forward over the
step's chunks, sample the rows that ask for it, release finished slots.

A step runs in two halves so that the worker can queue step N+1 before it reads step N's tokens
(app/worker/process.py): launch() queues all of the step's device work, the sampled tokens' update
of the slots' last_token included, and starts a non-blocking copy of the results to the host;
finish() waits for that copy and builds the StepResult. launch() uploads through page-locked
memory and does not wait for the device, with one known exception: a sampled row with top_p but no
top_k (sampling/truncation.py). tests/gpu/test_pipeline_gpu.py checks decode steps, and prefill and
mixed steps on the triton backend (flashinfer's own plan() is not checked there). Device tensors are
written in stream order, so a later launch may rewrite a slot's rows (released and re-registered)
while an earlier step still runs; what finish() needs from the host side is captured in the
PendingStep.

A plan is validated in full before anything changes, so a refused plan leaves no trace; releasing
a slot that holds nothing is a no-op (after a failed step the scheduler frees its sequences). What
concerns one sequence only (sampling parameters its sampler cannot honour, token ids outside the
vocabulary) refuses that sequence alone: it is left out of the step (released, if it held a slot),
reported in StepResult.failed_slots, and its chunks in later plans (planned before the scheduler
heard) are skipped until the scheduler frees its slot. The step's other rows are computed exactly
as without it: rows are independent, so their tokens do not change.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from app.protocol import (
    EngineInfo,
    NewSeq,
    SamplingParams,
    SeqChunk,
    StepPlan,
    StepResult,
    TokenLogprobs,
    WorkerReady,
)
from app.startup_phases import StartupClock
from app.worker.attention import (
    backend_class,
    build_attention_batch,
    make_attention_backend,
    resolve_attention_backend,
)
from app.worker.cuda_graphs import CapturedSizes, DecodeGraphs, PlanFence, capture_sizes
from app.worker.kv_cache import (
    GIB,
    KVCache,
    PoolPlan,
    cpu_pool_tokens,
    cuda_pool_bytes,
    finish_pool,
)
from app.worker.loader import (
    eos_token_ids,
    load_hf_config,
    load_weights,
    resolve_dtype,
    resolve_max_model_len,
    resolve_model_path,
)
from app.worker.models import DenseCausalLM, model_class_for
from app.worker.models.dense import HiddenCapture
from app.worker.parallel import SINGLE, TensorParallel
from app.worker.piecewise_graphs import DEFAULT_MAX_TOKENS, PiecewiseGraphs, bucket_sizes
from app.worker.quantization import (
    Fp8LinearMethod,
    fp8_kv_backend,
    resolve_kv_cache_quant,
    resolve_quantization,
)
from app.worker.sampling import SamplerOutput, make_sampler
from app.worker.sampling.grammar import Deferred, GrammarRows
from app.worker.sampling.logprobs import DeviceLogprobs
from app.worker.sampling.prompt_logprobs import PromptLogprobs, PromptRows, PromptWant
from app.worker.spec.decoder import SpecDecoder, VerifyOut, VerifyRows, make_spec_decoder
from app.worker.spec.drafter import ChainDrafter
from app.worker.spec.model_drafts import MODEL_DRAFTS, drafter_backend, load_model_drafter
from app.worker.spec.proposer import TargetStep
from app.worker.transfer import upload

logger = logging.getLogger(__name__)

# Headroom for what the profile cannot see: the caching allocator fragments further as step shapes vary
# (measured: ~0.7 GiB beyond the profiled peak for Llama-3.1-8B shapes on an H200).
CUDA_RESERVE_BYTES = 1 << 30
# Per-graph bookkeeping the graph-memory profile cannot see (graph objects, small per-size buffers).
GRAPH_OVERHEAD_BYTES = 64 << 20
# The most top logprobs a position reports: what the memory profile's heaviest sampling covers.
MAX_TOP_LOGPROBS = 20


class PlanError(ValueError):
    """The plan does not fit the worker's state (unknown slot, token outside the vocabulary, ...)."""


class SlotState:
    """Per-slot sequence state. Host lists drive planning and validation; the device tensors (block
    tables, lengths, last sampled token) are what kernels read, written only where a plan changed them."""

    def __init__(self, max_slots: int, max_blocks: int, device: torch.device) -> None:
        self.max_slots = max_slots
        self.max_blocks = max_blocks
        self.active = [False] * max_slots
        self.has_token = [False] * max_slots  # a sampled token is waiting to be fed (decode)
        self.seq_len = [0] * max_slots
        self.num_blocks = [0] * max_slots
        self.block_tables = torch.zeros(max_slots, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_slots, dtype=torch.int32, device=device)
        self.last_token = torch.zeros(max_slots, dtype=torch.int64, device=device)
        self.device = device

    def write_blocks(self, writes: list[tuple[int, int, list[int]]]) -> None:
        """Apply (slot, first column, block ids) writes to the device block tables in one scatter."""
        rows: list[int] = []
        cols: list[int] = []
        vals: list[int] = []
        for slot, first, ids in writes:
            rows += [slot] * len(ids)
            cols += range(first, first + len(ids))
            vals += ids
        if vals:
            dev = upload([rows, cols, vals], torch.int64, self.device)
            self.block_tables.index_put_((dev[0], dev[1]), dev[2].to(torch.int32))

    def set_lengths(self, slots: list[int], lengths: list[int]) -> None:
        for slot, length in zip(slots, lengths, strict=True):
            self.seq_len[slot] = length
        if slots:
            dev = upload([slots, lengths], torch.int64, self.device)
            self.seq_lens.index_copy_(0, dev[0], dev[1].to(torch.int32))

    def release(self, slot: int) -> None:
        self.active[slot] = self.has_token[slot] = False
        self.seq_len[slot] = self.num_blocks[slot] = 0


@dataclass
class _Step:
    """The host-side layout of one step's flat batch."""

    slots: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # decode rows hold a placeholder
    decode_rows: list[int] = field(default_factory=list)
    decode_slots: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_slots: list[int] = field(default_factory=list)
    prompt: PromptRows = field(default_factory=PromptRows)  # rows whose prompt logprobs are asked
    aux_hidden: torch.Tensor | None = None  # the captured states of every row, for an EAGLE-3 proposer


@dataclass
class PendingStep:
    """A launched step: its device work is queued and its results are being copied to the host.
    It holds all that finish() reads, so later launches may change the runner's state freely."""

    step: int
    slots: list[int] = field(default_factory=list)  # the slots that sampled, in row order
    readback: torch.Tensor | None = None  # host int64 [sampled ids, bad-row flags]; None: none sampled
    logprobs: DeviceLogprobs | None = None
    logprobs_host: torch.Tensor | None = None  # host copy of logprobs.packed
    copied: torch.cuda.Event | None = None  # recorded after the copies (CUDA); None: already on the host
    failed: dict[int, str] = field(default_factory=dict)  # sequences refused at launch: slot -> why
    grammar: Deferred | None = None  # constrained rows whose matchers await these tokens
    prompt: PromptLogprobs | None = None  # prompt logprobs computed in this step (TP leader)
    spec: VerifyOut | None = None  # speculative decoding: the verify rows' outcome (host)
    observed: TargetStep | None = None  # what the proposer hears once the step's tokens are known

    def ready(self) -> bool:
        """Whether finish() would return without waiting for the device."""
        return self.copied is None or self.copied.query()


class ModelRunner:
    def __init__(self, settings: Any, device: torch.device, tp: TensorParallel = SINGLE,
                 clock: StartupClock | None = None, build_kernels: bool = False) -> None:
        self.settings = settings
        self.device = torch.device(device)
        self.tp = tp  # this rank's tensor-parallel group (app/worker/parallel.py); SINGLE without TP
        # Start-up phases, logged and reported (app/startup_phases.py); warmup() ends the last one.
        self.clock = clock or StartupClock(f"worker{tp.rank}", tick_s=0)
        self.clock.enter("weights")
        self.build_kernels = build_kernels  # the default backend may build flashinfer's JIT kernels (warmup)
        started = time.perf_counter()
        if self.device.type == "cuda":
            if self.device.index is None:  # "cuda": the current device, named (set_device needs an index)
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.pdl = self._configure_pdl()
        model_dir = resolve_model_path(
            settings.model,
            settings.load_format,
            settings.revision,
            settings.download_dir,
            settings.trust_remote_code,
        )
        self.model_dir = model_dir  # a root weight updates from disk may read below
        self.config = load_hf_config(model_dir, settings.hf_overrides, settings.trust_remote_code)
        self.dtype = resolve_dtype(settings.dtype, self.config, self.device)
        # FP8 weights and KV cache (getattr: the GPU tests' plain settings may leave these out).
        self.quant_scheme = resolve_quantization(getattr(settings, "quantization", None), self.config)
        if tp.size > 1 and self.quant_scheme is not None and self.quant_scheme.block is not None:
            raise ValueError(
                "block-scaled FP8 checkpoints with --tensor-parallel-size > 1 are not supported yet (each rank "
                "would need its own slice of the 128x128 scale tiles); per-tensor and per-channel FP8 "
                "checkpoints and --quantization fp8 on a bf16 checkpoint work with tensor parallelism"
            )
        self.kv_quant = resolve_kv_cache_quant(
            getattr(settings, "kv_cache_dtype", "auto"),
            getattr(settings, "kv_cache_quant_method", "none"),
            getattr(settings, "quantization_param_path", None),
            int(self.config.num_hidden_layers),
        )
        self.kv_dtype = self.kv_quant.storage_dtype(self.dtype)
        self.max_model_len = resolve_max_model_len(settings.max_model_len, self.config)
        self.block_size = _positive("block_size", settings.block_size)
        self.max_num_seqs = _positive("max_num_seqs", settings.max_num_seqs)
        self.vocab_size = int(self.config.vocab_size)
        self.eos_token_ids = eos_token_ids(self.config, model_dir)
        self.model = self._build_model(model_dir)
        self.load_seconds = time.perf_counter() - started
        self.sampler = make_sampler(
            settings.sampling_backend,
            self.vocab_size,
            self.eos_token_ids,
            self.device,
            self.max_num_seqs,
            seed=settings.seed,
        )
        # Structured output (sampling/grammar.py): matchers live where the tokens are sampled, the TP leader.
        self.grammar = GrammarRows(self._grammar_info, self.vocab_size, self.device, self.max_num_seqs)
        self.drafter: ChainDrafter | None = None  # a model draft (STANDALONE, EAGLE3): its weights load here
        self.spec = self._spec_decoder()
        self.clock.enter("kernels")
        self.attention_backend_name = resolve_attention_backend(
            settings.attention_backend, self.device, self.dtype, self.model.attention_spec.head_dim
        )
        if self.kv_quant.quantized and settings.attention_backend is None:
            self.attention_backend_name = fp8_kv_backend(
                self.attention_backend_name, backend_class(self.attention_backend_name)
            )
        if self.attention_backend_name == "flashinfer" and settings.attention_backend is None:
            self.attention_backend_name = self._flashinfer_or_triton()
        self.graph_sizes = self._graph_sizes()
        self.piece_sizes = self._piece_sizes()
        self.graph_reserve_bytes = 0
        self.clock.enter("memory_profile")
        self.pool = self._agree_pool(self._size_pool())
        # One block beyond the scheduler's pool: the scratch block that CUDA-graph pad rows write to.
        self.scratch_block = self.pool.num_blocks
        self.kv_cache = KVCache(
            self.model.kv_cache_spec(self.kv_dtype),
            self.pool.num_blocks + 1,
            self.block_size,
            self.device,
            self.kv_quant.k_scales,
            self.kv_quant.v_scales,
        )
        self.attention = make_attention_backend(
            self.attention_backend_name, self.kv_cache, self.model.attention_spec
        )
        self.slots = SlotState(
            self.max_num_seqs, math.ceil(self.max_model_len / self.block_size), self.device
        )
        self._refused: set[int] = set()  # slots whose sequence was refused, until the scheduler frees them
        self._prompt_want: dict[int, PromptWant] = {}  # slots whose prompt logprobs are asked
        self.clock.enter("graph_capture")
        self._attach_drafter()
        self.graphs = self._capture_graphs()
        self.pieces = self._capture_pieces()
        self._check_graph_memory()
        self.plan_fence = PlanFence(self.device)  # eager steps' attention plans (graphs keep their own)
        logger.info(
            "start-up: weights %.2f GiB, CUDA graphs %.2f GiB, KV pool %d tokens (%d blocks of %d, %.2f GiB); "
            "max concurrency at max_model_len=%d: %.2fx; attention backend %s (decode kernel %s)",
            self.weights_bytes / GIB,
            self._graph_bytes() / GIB,
            self.pool.tokens,
            self.pool.num_blocks,
            self.block_size,
            self.kv_cache.nbytes / GIB,
            self.max_model_len,
            self.pool.max_concurrency,
            self.attention_backend_name,
            self.attention.decode_kernel_name(),
        )

    # ------------------------------------------------------------------ start-up

    def _spec_decoder(self) -> SpecDecoder | None:
        """Speculative decoding (app/worker/spec): drafts are made and verified on the host of one rank."""
        if getattr(self.settings, "speculative_algorithm", None) is None:  # getattr: the GPU tests' settings
            return None
        if self.tp.size > 1:
            raise ValueError("speculative decoding with --tensor-parallel-size > 1 is not supported yet")
        if self.settings.speculative_algorithm in MODEL_DRAFTS:
            self.drafter = load_model_drafter(self.settings, self.model, self.config, self.device,
                                              self.max_model_len, self.max_num_seqs)
        return make_spec_decoder(self.settings, self.block_size, self.device, self.vocab_size, self.drafter)

    def _attach_drafter(self) -> None:
        """A model draft's cache: the pool's block ids (scratch included) in the model dtype, read through the
        slots' block tables; its chain steps graphed where the target's decode steps are."""
        if self.drafter is None:
            return
        backend = drafter_backend(self.settings, self.attention_backend_name, self.model.attention_spec.head_dim,
                                  self.drafter, self.device, self.dtype)
        self.drafter.attach(self.pool.num_blocks + 1, self.block_size, self.slots.block_tables,
                            self.slots.num_blocks, self.dtype, backend)
        if self.graph_sizes and backend_class(backend).supports_cuda_graphs:
            self.drafter.capture_graphs(self.graph_sizes)

    def _configure_pdl(self) -> bool:
        """Programmatic dependent launch for the decode-path Triton kernels (--enable-pdl): on one GPU of
        compute capability 9.0 or newer with a Triton that has it (3.4+); a process-wide switch, set
        before any kernel is compiled or captured. On the H200 it takes 0 to 5% off a batch-1 step, 3 to 9%
        with FP8 weights: each kernel's launch overlaps the end of the one before."""
        if self.device.type != "cuda":
            return False
        from tokenspeed_kernels.common import PDL_AVAILABLE, set_pdl

        wanted = getattr(self.settings, "enable_pdl", True)
        usable = PDL_AVAILABLE and self.tp.size == 1 and torch.cuda.get_device_capability(self.device) >= (9, 0)
        set_pdl(wanted and usable)
        if wanted and not usable:
            logger.info("programmatic dependent launch off: it needs one GPU of compute capability 9.0+ and "
                        "Triton 3.4+")
        return wanted and usable

    def _flashinfer_or_triton(self) -> str:
        """The default flashinfer backend only if its kernels are in the JIT cache (a start compiles nothing:
        a build takes minutes; `tokenspeed warmup` builds them, with build_kernels); else triton, said in the
        log. An explicit --attention-backend flashinfer builds what it lacks, or fails."""
        from app.worker.attention.flashinfer_backend import kernels_unavailable

        problem = kernels_unavailable(self.model.attention_spec, self.kv_dtype, self.device, self.block_size,
                                      build=self.build_kernels)
        if not self.tp.failed_ranks(problem is None):  # TP ranks agree on one backend
            return "flashinfer"
        logger.warning("flashinfer's attention kernels are not in its JIT cache or cannot be loaded on every rank "
                       "(here: %s): using the triton backend; `tokenspeed warmup` builds them into the cache "
                       "(docs/deploy.md)", problem or "fine")
        return "triton"

    def _build_model(self, model_dir: Any) -> DenseCausalLM:
        cls = model_class_for(self.config)
        with torch.device(self.device):
            quant = Fp8LinearMethod(self.quant_scheme) if self.quant_scheme is not None else None
            model = cls(self.config, self.dtype, self.max_model_len, quant=quant, tp=self.tp)
        model.to(self.device)  # the RoPE tables are built on the CPU
        fmt = load_weights(model, model_dir, self.settings.load_format, self.clock.progress)
        model.eval()
        self.weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        logger.info(
            "loaded %s (%s weights, %s, %.3f GB) on %s; quantization: %s; KV cache: %s",
            cls.__name__,
            fmt,
            str(self.dtype).removeprefix("torch."),
            self.weights_bytes / 1e9,
            self.device,
            self.quant_scheme.describe() if self.quant_scheme is not None else "none",
            self.kv_quant.describe(),
        )
        return model

    def _size_pool(self) -> PoolPlan:
        bytes_per_token = self.model.kv_cache_spec(self.kv_dtype).bytes_per_token
        if self.drafter is not None:  # the draft's cache holds the same tokens in the same blocks
            bytes_per_token += self.drafter.kv_bytes_per_token(self.dtype)
        max_total = self.settings.max_total_tokens
        if self.device.type == "cuda":
            tokens, why = self._cuda_pool_tokens(bytes_per_token)
            if max_total is not None and max_total < tokens:
                tokens, why = max_total, f"--max-total-tokens {max_total}"
        elif self.device.type == "cpu":
            import psutil  # CPU sizing only; the GPU image need not carry it

            tokens, why = cpu_pool_tokens(
                bytes_per_token,
                self.max_num_seqs,
                self.max_model_len,
                max_total,
                psutil.virtual_memory().available,
            )
        else:
            raise ValueError(f"device type {self.device.type!r} is not supported (cpu or cuda)")
        return finish_pool(tokens, self.block_size, self.max_model_len, bytes_per_token, why)

    def _agree_pool(self, plan: PoolPlan) -> PoolPlan:
        """Every TP rank holds the same blocks for the same sequences: the smallest pool any rank can hold."""
        blocks = self.tp.min_int(plan.num_blocks)
        if blocks == plan.num_blocks:
            return plan
        logger.info("KV pool: %d blocks here, %d on the smallest tensor-parallel rank; using %d",
                    plan.num_blocks, blocks, blocks)
        return replace(plan, num_blocks=blocks)

    def _cuda_pool_tokens(self, bytes_per_token: int) -> tuple[int, str]:
        """Profile the largest step, then give the KV cache what the utilization budget leaves."""
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        static = torch.cuda.memory_allocated(dev)  # weights, RoPE tables, sampler state
        static_reserved = torch.cuda.memory_reserved(dev)
        profile_kv = self._profile_step()
        torch.cuda.synchronize(dev)
        # The allocator's cached segments outgrow the live tensors (fragmentation): count the larger.
        peak = max(
            torch.cuda.max_memory_allocated(dev) - static,
            torch.cuda.max_memory_reserved(dev) - static_reserved,
        )
        peak -= profile_kv
        self.graph_reserve_bytes = self._profile_graph_bytes()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        non_torch = max(total - free - torch.cuda.memory_reserved(dev), 0)
        util = self.settings.gpu_memory_utilization
        graphs = self.graph_reserve_bytes
        kv_bytes = cuda_pool_bytes(total, util, static, peak + graphs, non_torch, CUDA_RESERVE_BYTES)
        summary = (
            f"total {total / GIB:.2f} GiB x {util}; weights+state {static / GIB:.2f} GiB, activation peak "
            f"{peak / GIB:.2f} GiB, CUDA graphs {graphs / GIB:.2f} GiB, outside torch {non_torch / GIB:.2f} GiB, "
            f"reserve {CUDA_RESERVE_BYTES / GIB:.2f} GiB"
        )
        logger.info("memory: %s -> KV %.2f GiB", summary, kv_bytes / GIB)
        return max(kv_bytes, 0) // bytes_per_token, f"--gpu-memory-utilization {util}: {summary}"

    def _profile_tokens(self) -> int:
        chunk = self.settings.chunked_prefill_size
        return chunk if chunk is not None and chunk > 0 else self.settings.max_prefill_tokens

    def _profile_step(self) -> int:
        """One forward + sample of the largest step on a throwaway KV cache. The step's tokens go to
        single-token decodes plus as few long chunks as max_model_len allows, so that max_num_seqs
        rows sample (the sampler peak), and every sequence sits at max_model_len context (the
        attention peak). The sequences share one block table: what they read is irrelevant here.
        Returns the bytes of that temporary cache (not activation memory)."""
        total = max(self._profile_tokens(), 1)
        num_decodes = min(self.max_num_seqs, total) - 1
        chunks = _split(total - num_decodes, self.max_model_len)
        decodes = [1] * min(num_decodes, max(self.max_num_seqs - len(chunks), 0))
        # Decodes first, as the scheduler orders a step (a backend may run them apart from the chunks).
        query_lens = (decodes + chunks)[: self.max_num_seqs]
        seq_lens = [self.max_model_len] * len(query_lens)
        num_blocks = math.ceil(self.max_model_len / self.block_size)
        cache = KVCache(self.model.kv_cache_spec(self.kv_dtype), num_blocks, self.block_size, self.device)
        backend = make_attention_backend(self.attention_backend_name, cache, self.model.attention_spec)
        row = torch.arange(num_blocks, dtype=torch.int32, device=self.device)
        table = row.repeat(len(query_lens), 1)
        slots = list(range(len(query_lens)))
        params = self._profile_params()
        for slot in slots:
            self.sampler.add_seq(slot, f"profile-{slot}", params, [0], [])
        try:
            with torch.no_grad():
                batch = build_attention_batch(table, query_lens, seq_lens, self.block_size)
                input_ids = torch.zeros(batch.num_tokens, dtype=torch.int64, device=self.device)
                hidden = self.model(input_ids, batch.positions, backend.plan(batch))
                last_rows = torch.tensor(batch.query_start_loc[1:], device=self.device) - 1
                self.sampler.sample(self.model.compute_logits(hidden.index_select(0, last_rows)), slots)
        finally:
            for slot in slots:
                self.sampler.remove_seq(slot)
        return cache.nbytes

    # ------------------------------------------------------------------ CUDA graphs

    def _graph_sizes(self) -> list[int]:
        """Decode batch sizes to capture; none on the CPU, with --enforce-eager, or with a backend that
        cannot be captured (torch)."""
        s = self.settings
        if self.device.type != "cuda" or getattr(s, "enforce_eager", False):
            return []
        if not backend_class(self.attention_backend_name).supports_cuda_graphs:
            logger.info("CUDA graphs off: the %s attention backend runs eagerly", self.attention_backend_name)
            return []
        return capture_sizes(
            getattr(s, "cudagraph_capture_sizes", None),
            getattr(s, "max_cudagraph_capture_size", None),
            self.max_num_seqs,
        )

    def _piece_sizes(self) -> list[int]:
        """Token buckets of the piecewise graphs for prefill and mixed steps: with the decode graphs, on
        one GPU (a TP group would capture its collectives in every piece: not built), for a backend
        that attends apart from its KV write."""
        if not self.graph_sizes or self.tp.size > 1:
            return []
        if not backend_class(self.attention_backend_name).supports_piecewise_graphs:
            return []
        limit = getattr(self.settings, "piecewise_cuda_graph_max_tokens", DEFAULT_MAX_TOKENS)
        return bucket_sizes(min(limit, self._profile_tokens()))

    def _profile_graph_bytes(self) -> int:
        """Memory the CUDA graphs will take, measured before the pool is sized (they are captured after
        it, over the real KV cache): see _profile_decode_graph_bytes and _profile_piece_bytes."""
        return self._profile_decode_graph_bytes() + self._profile_piece_bytes()

    def _profile_piece_bytes(self) -> int:
        """The piecewise graphs' pool: twice an eager forward of the largest bucket (buckets never run at
        once, so they share it, but the captures fragment it: 0.62 GiB at 2048 tokens of the 8B model,
        about twice the eager peak); their static buffers come on top."""
        if not self.piece_sizes:
            return 0
        dev, size = self.device, max(self.piece_sizes)
        query_lens = _split(size, self.max_model_len)
        num_blocks = math.ceil(max(query_lens) / self.block_size)
        cache = KVCache(self.model.kv_cache_spec(self.kv_dtype), num_blocks, self.block_size, dev)
        backend = make_attention_backend(self.attention_backend_name, cache, self.model.attention_spec)
        table = torch.arange(num_blocks, dtype=torch.int32, device=dev).repeat(len(query_lens), 1)
        batch = build_attention_batch(table, query_lens, query_lens, self.block_size)
        input_ids = torch.zeros(size, dtype=torch.int64, device=dev)
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        with torch.no_grad():
            self.model(input_ids, batch.positions, backend.plan(batch))
        torch.cuda.synchronize(dev)
        spec = self.model.attention_spec
        static = size * (2 * spec.num_heads * spec.head_dim + self.model.dims.hidden) * self.dtype.itemsize
        return 2 * (torch.cuda.max_memory_allocated(dev) - base) + static + 3 * 8 * size + GRAPH_OVERHEAD_BYTES

    def _profile_decode_graph_bytes(self) -> int:
        """The attention backend's own buffers, one eager decode step of the largest capture size at
        max_model_len context (the graphs share one pool, largest captured first, so it holds about one
        such step), the static logits buffer and a per-graph allowance."""
        if not self.graph_sizes:
            return 0
        dev, size = self.device, max(self.graph_sizes)
        num_blocks = math.ceil(self.max_model_len / self.block_size)
        cache = KVCache(self.model.kv_cache_spec(self.kv_dtype), num_blocks, self.block_size, dev)
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        backend = make_attention_backend(self.attention_backend_name, cache, self.model.attention_spec)
        backend_bytes = torch.cuda.memory_allocated(dev) - before
        table = torch.arange(num_blocks, dtype=torch.int32, device=dev).repeat(size, 1)
        batch = build_attention_batch(table, [1] * size, [self.max_model_len] * size, self.block_size)
        input_ids = torch.zeros(size, dtype=torch.int64, device=dev)
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        with torch.no_grad():
            self.model.compute_logits(self.model(input_ids, batch.positions, backend.plan(batch)))
        torch.cuda.synchronize(dev)
        step_bytes = torch.cuda.max_memory_allocated(dev) - base
        logits_bytes = size * self.vocab_size * 4
        return backend_bytes + step_bytes + logits_bytes + GRAPH_OVERHEAD_BYTES

    def _capture_graphs(self) -> DecodeGraphs | None:
        if not self.graph_sizes:
            return None
        graphs = DecodeGraphs(
            self.model,
            self.attention,
            self.graph_sizes,
            self.slots.max_blocks,
            self.block_size,
            self.scratch_block,
            self.vocab_size,
            self.device,
            self._capture_layers(),
        )
        graphs.capture()
        logger.info(
            "CUDA graphs: %d decode sizes (%d..%d) captured in %.1f s, using %.2f GiB",
            len(graphs.sizes),
            graphs.sizes[0],
            graphs.max_size,
            graphs.capture_seconds,
            graphs.memory_bytes / GIB,
        )
        return graphs

    def _capture_pieces(self) -> PiecewiseGraphs | None:
        if not self.piece_sizes:
            return None
        pieces = PiecewiseGraphs(
            self.model,
            self.attention,
            self.piece_sizes,
            self.scratch_block * self.block_size,
            self.model.dims.hidden,
            self.device,
            self._capture_layers(),
        )
        try:
            pieces.capture()
        except Exception as exc:
            raise RuntimeError(f"capturing the piecewise CUDA graphs failed ({type(exc).__name__}: {exc}); "
                               "--piecewise-cuda-graph-max-tokens 0 runs prefill and mixed steps eagerly") from exc
        logger.info(
            "CUDA graphs: prefill and mixed steps in %d token buckets (%d..%d), %d pieces each, captured in "
            "%.1f s, using %.2f GiB",
            len(pieces.sizes),
            pieces.sizes[0],
            pieces.max_size,
            len(pieces.pieces[pieces.max_size].graphs),
            pieces.capture_seconds,
            pieces.memory_bytes / GIB,
        )
        return pieces

    def _captured(self) -> list[CapturedSizes]:
        return [g for g in (self.graphs, self.pieces) if g is not None]

    def _graph_bytes(self) -> int:
        return sum(g.memory_bytes for g in self._captured())

    def _check_graph_memory(self) -> None:
        used = self._graph_bytes()
        if used > self.graph_reserve_bytes:
            logger.warning("CUDA graphs use %.2f GiB, more than the %.2f GiB reserved for them before sizing the "
                           "KV pool", used / GIB, self.graph_reserve_bytes / GIB)

    def _profile_params(self) -> SamplingParams:
        """The sampler's most expensive path it accepts (sorting, penalties, top logprobs)."""
        heavy = SamplingParams(
            temperature=1.0,
            top_p=0.9,
            top_k=50,
            min_p=0.05,
            repetition_penalty=1.1,
            frequency_penalty=0.1,
            presence_penalty=0.1,
            logprobs=True,
            top_logprobs=min(MAX_TOP_LOGPROBS, self.vocab_size),
        )
        if self.sampler.validate(heavy) is None:
            return heavy
        return SamplingParams(temperature=0.0, logprobs=True, top_logprobs=min(MAX_TOP_LOGPROBS, self.vocab_size))

    def ready_message(self) -> WorkerReady:
        return WorkerReady(
            rank=self.tp.rank,
            num_blocks=self.pool.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=list(self.eos_token_ids),
            info={
                "weights_gb": round(self.weights_bytes / 1e9, 3),
                "kv_pool_tokens": self.pool.tokens,
                "max_concurrency": round(self.pool.max_concurrency, 2),
                "load_seconds": round(self.load_seconds, 2),
                "dtype": str(self.dtype).removeprefix("torch."),
                "device": str(self.device),
                "architecture": type(self.model).__name__,
                "attention_backend": self.attention.name,
                "decode_kernel": self.attention.decode_kernel_name(),
                "cuda_graph_sizes": list(self.graphs.sizes) if self.graphs is not None else [],
                "piecewise_graph_sizes": list(self.pieces.sizes) if self.pieces is not None else [],
                "pdl": self.pdl,
                "cuda_graph_gb": round(self._graph_bytes() / 1e9, 3),
                "quantization": self.quant_scheme.describe() if self.quant_scheme is not None else "none",
                "kv_cache_dtype": self.kv_quant.describe(),
                "startup_phases": {phase: round(s, 3) for phase, s in self.clock.seconds.items()},
            },
        )

    def engine_info(self) -> EngineInfo:
        """What admission checks requests against (the tokenizer and http add their parts)."""
        return EngineInfo(
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=list(self.eos_token_ids),
            num_blocks=self.pool.num_blocks,
            block_size=self.block_size,
            sampling_backend=self.settings.sampling_backend,
            max_top_logprobs=min(MAX_TOP_LOGPROBS, self.vocab_size),
        )

    def warmup(self) -> None:
        """A tiny real prefill + decode through slot 0, sampled greedily (no RNG draw); the slot
        is released afterwards, so nothing of it is visible to the first real step. It ends start-up."""
        self.clock.enter("warmup")
        prompt_len = max(1, min(8, self.max_model_len - 1))
        steps = 2 if prompt_len < self.max_model_len else 1
        num_blocks = math.ceil((prompt_len + steps - 1) / self.block_size)
        prompt = [i % self.vocab_size for i in range(prompt_len)]
        seq = NewSeq(
            slot=0,
            rid="warmup",
            sampling=SamplingParams(temperature=0.0),
            num_prompt_tokens=prompt_len,
            block_ids=list(range(num_blocks)),
            prompt_ids=prompt,
        )
        plans = [StepPlan(step=-1, new_seqs=[seq], chunks=[SeqChunk(slot=0, token_ids=prompt)])]
        if steps == 2:
            plans.append(StepPlan(step=-1, chunks=[SeqChunk(slot=0)]))
        plans[-1].free_slots.append(0)
        for plan in plans:
            self.execute(plan)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.clock.done()

    # ------------------------------------------------------------------ steps

    def execute(self, plan: StepPlan) -> StepResult:
        """One step, start to end."""
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> PendingStep:
        """Queue one step's device work (see the module docstring); plan.free_slots are released after it."""
        failed = self._validate(plan)
        plan = self._without_refused(plan, failed)
        with torch.no_grad():
            for seq in plan.new_seqs:
                self._register(seq)
            pending = self._run_chunks(plan) if plan.chunks else PendingStep(step=plan.step)
        for slot in plan.free_slots:
            self._refused.discard(slot)
            self._release(slot)
        pending.failed = failed
        return pending

    def _without_refused(self, plan: StepPlan, failed: dict[int, str]) -> StepPlan:
        """The plan less the sequences refused now (their slots released) or earlier and not yet freed."""
        for slot in failed:
            logger.warning("step %d: slot %d refused: %s", plan.step, slot, failed[slot])
            self._release(slot)
        self._refused.update(failed)
        if not self._refused:
            return plan
        return replace(
            plan,
            new_seqs=[seq for seq in plan.new_seqs if seq.slot not in self._refused],
            chunks=[chunk for chunk in plan.chunks if chunk.slot not in self._refused],
        )

    def finish(self, pending: PendingStep) -> StepResult:
        """Wait for a launched step's results and build its StepResult."""
        result = self._finish(pending)
        if pending.spec is not None:
            _merge_verified(result, pending.spec)
        if self.spec is not None and pending.observed is not None:
            self.spec.observe(pending.observed, result, pending.spec)
        return result

    def _finish(self, pending: PendingStep) -> StepResult:
        extra: dict[str, Any] = {"failed_slots": list(pending.failed), "failed_errors": list(pending.failed.values())}
        if pending.prompt is not None:
            extra["prompt_slots"], extra["prompt_logprobs"] = pending.prompt.read()
        if pending.readback is None:
            return StepResult(step=pending.step, **extra)
        if pending.copied is not None:
            pending.copied.synchronize()
        n = len(pending.slots)
        host = pending.readback.numpy()
        bad_rows = np.flatnonzero(host[n:]).tolist()
        if pending.grammar is not None:  # a token its grammar refused fails its request as a bad row would
            self.grammar.resolve(pending.grammar)
            refused = set(pending.grammar.rejected)
            bad_rows += [i for i, slot in enumerate(pending.slots) if slot in refused and i not in bad_rows]
        logprobs: list[TokenLogprobs | None] = []
        if pending.logprobs is not None and pending.logprobs_host is not None:
            rows = pending.logprobs.unpack(pending.logprobs_host.numpy(), n, bad_rows)
            logprobs = rows if any(lp is not None for lp in rows) else []
        return StepResult(
            step=pending.step,
            slots=list(pending.slots),
            token_ids=host[:n].tolist(),
            logprobs=logprobs,
            bad_slots=[pending.slots[i] for i in bad_rows],
            **extra,
        )

    def _grammar_info(self) -> Any:
        """XGrammar's view of the served tokenizer, built as the tokenizer process builds it."""
        from app.grammar.compiler import tokenizer_info
        from app.tokenizer.loader import load_tokenizer_from_settings

        return tokenizer_info(load_tokenizer_from_settings(self.settings), self.vocab_size, self.eos_token_ids)

    def _register(self, seq: NewSeq) -> None:
        self.sampler.add_seq(seq.slot, seq.rid, seq.sampling, list(seq.prompt_ids), list(seq.output_ids))
        if self.spec is not None:
            self.spec.register(seq)
        if seq.sampling.grammar is not None and self.tp.leader:
            try:
                self.grammar.add(seq.slot, seq.sampling.grammar, list(seq.output_ids))
            except Exception:
                self.sampler.remove_seq(seq.slot)
                raise
        s = self.slots
        s.active[seq.slot] = True
        s.has_token[seq.slot] = False
        s.num_blocks[seq.slot] = len(seq.block_ids)
        s.write_blocks([(seq.slot, 0, list(seq.block_ids))])
        s.set_lengths([seq.slot], [seq.num_cached_tokens])
        if seq.sampling.prompt_logprob_start >= 0:
            self._prompt_want[seq.slot] = PromptWant.of(seq)

    def _release(self, slot: int) -> None:
        if self.slots.active[slot]:
            self.sampler.remove_seq(slot)
            self.grammar.remove(slot)
            if self.spec is not None:
                self.spec.release(slot)
            self.slots.release(slot)
            self._prompt_want.pop(slot, None)

    def _layout(self, chunks: list[SeqChunk]) -> _Step:
        step = _Step()
        for chunk in chunks:
            row = len(step.token_ids)
            if chunk.token_ids:
                want = self._prompt_want.get(chunk.slot)
                if want is not None:  # before the chunk's tokens: row is its first row
                    step.prompt.add(want, chunk.slot, row, self.slots.seq_len[chunk.slot], len(chunk.token_ids))
                step.token_ids += chunk.token_ids
            else:
                step.token_ids.append(0)
                step.decode_rows.append(row)
                step.decode_slots.append(chunk.slot)
            n = len(step.token_ids) - row
            step.slots.append(chunk.slot)
            step.query_lens.append(n)
            step.seq_lens.append(self.slots.seq_len[chunk.slot] + n)
            if chunk.sample:
                step.sample_rows.append(row + n - 1)
                step.sample_slots.append(chunk.slot)
        return step

    def _run_chunks(self, plan: StepPlan) -> PendingStep:
        s = self.slots
        appends = [
            (c.slot, s.num_blocks[c.slot], list(c.append_block_ids))
            for c in plan.chunks
            if c.append_block_ids
        ]
        s.write_blocks(appends)
        for slot, first, ids in appends:
            s.num_blocks[slot] = first + len(ids)
        chunks, verify = self.spec.expand(plan.chunks) if self.spec is not None else (plan.chunks, VerifyRows())
        step = self._layout(chunks)
        num_sampled = len(step.sample_rows)
        if verify.slots:  # their logits are read at every fed position and verified, not sampled
            _verify_rows(step, verify)
            num_sampled = len(step.sample_rows)
            step.sample_rows += verify.positions()
        if self._graphable(step):
            for slot, length in zip(step.slots, step.seq_lens, strict=True):
                s.seq_len[slot] = length  # the graph's own buffers get the lengths on the device
            logits = self.graphs.run(step.slots, step.seq_lens, s.block_tables, s.last_token)
            prompt = None  # decode rows only: no prompt position
            if self.graphs.aux is not None:  # a copy: the next replay rewrites the buffer
                step.aux_hidden = self.graphs.aux[: len(step.slots)].clone()
        else:
            logits, prompt = self._eager_logits(step)
        for chunk in plan.chunks:  # fed tokens supersede a sampled one; sampling below sets it again
            s.has_token[chunk.slot] = False
        verified = None
        if verify.slots:
            assert logits is not None
            verified = self._verify(logits[num_sampled:], verify)
            logits = logits[:num_sampled]
            del step.sample_rows[num_sampled:]
        pending = self._sample(plan, step, logits, prompt)
        pending.spec = verified
        if self.spec is not None:
            self._trim_drafting(plan.chunks)
            starts = [length - n for length, n in zip(step.seq_lens, step.query_lens, strict=True)]
            pending.observed = self.spec.target_step(chunks, starts)
            pending.observed.aux_hidden = step.aux_hidden
        return pending

    def _verify(self, logits: torch.Tensor, verify: VerifyRows) -> VerifyOut:
        """Accept the verify rows' drafts; each slot keeps its fed positions up to the last accepted
        draft and will feed the token sampled after them next."""
        s = self.slots
        out = self.spec.verify(logits, verify)  # type: ignore[union-attr]
        lengths = [s.seq_len[slot] - len(d) + len(kept) for slot, d, kept in
                   zip(verify.slots, verify.drafts, out.accepted, strict=True)]
        s.set_lengths(verify.slots, lengths)
        s.last_token.index_copy_(0, upload(verify.slots, torch.int64, self.device),
                                 upload(out.next_tokens, torch.int64, self.device))
        for slot in verify.slots:
            s.has_token[slot] = True
        return out

    def _trim_drafting(self, chunks: list[SeqChunk]) -> None:
        """A drafting chunk's slot keeps the blocks of its kept tokens and the next (protocol.SeqChunk)."""
        s = self.slots
        for chunk in chunks:
            if chunk.num_draft:
                s.num_blocks[chunk.slot] = min(s.num_blocks[chunk.slot], self.spec.blocks_kept(s.seq_len[chunk.slot]))  # type: ignore[union-attr]

    def _sample(self, plan: StepPlan, step: _Step, logits: torch.Tensor | None,
                prompt: PromptLogprobs | None) -> PendingStep:
        """Sample the rows that ask and start reading the tokens back."""
        s = self.slots
        if logits is None or not step.sample_slots:
            return PendingStep(step=plan.step, prompt=prompt)
        # Sampling happens once, on the TP leader; the other ranks take its tokens (the next step's input).
        constrained = self.grammar.mask(logits, step.sample_slots) if self.tp.leader else None
        out = self.sampler.sample(logits, step.sample_slots) if self.tp.leader else None
        token_ids = out.token_ids if out is not None else logits.new_empty(len(step.sample_slots), dtype=torch.int64)
        self.tp.broadcast(token_ids)
        s.last_token.index_copy_(0, upload(step.sample_slots, torch.int64, self.device), token_ids)
        for slot in step.sample_slots:
            s.has_token[slot] = True
        if out is None:
            return PendingStep(step=plan.step)
        pending = self._read_back(plan.step, step.sample_slots, out)
        pending.prompt = prompt
        if constrained is not None:
            constrained.read = lambda: _host_tokens(pending)
            self.grammar.expect(constrained)
            pending.grammar = constrained
        return pending

    def _read_back(self, step: int, slots: list[int], out: SamplerOutput) -> PendingStep:
        """Start copying the sampled ids, bad-row flags and logprobs to the host (on the CPU: keep them)."""
        packed = torch.cat([out.token_ids, out.bad.to(torch.int64)])
        logprobs = out.device_logprobs
        pending = PendingStep(step, slots, packed, logprobs, logprobs.packed if logprobs else None)
        if self.device.type == "cuda":
            pending.readback = _to_host(packed)
            pending.logprobs_host = _to_host(logprobs.packed) if logprobs else None
            pending.copied = torch.cuda.Event()
            pending.copied.record()
        return pending

    def _graphable(self, step: _Step) -> bool:
        """A decode-only step that a captured graph covers (its rows all sample, in step order)."""
        return (
            self.graphs is not None
            and len(step.decode_rows) == len(step.slots)
            and self.graphs.size_for(len(step.slots)) is not None
        )

    def _eager_logits(self, step: _Step) -> tuple[torch.Tensor | None, PromptLogprobs | None]:
        """Run the step's flat batch eagerly: logits of the rows that sample (None if none does) and the
        prompt logprobs of the rows that ask (None if none does), from the same hidden states."""
        s = self.slots
        # One upload for every index of the step (no host sync): split into its parts on the device.
        parts = [step.token_ids, step.decode_rows, step.decode_slots, step.slots, step.sample_rows]
        ids = upload([i for part in parts for i in part], torch.int64, self.device)
        input_ids, decode_rows, decode_slots, slot_index, sample_rows = ids.split(list(map(len, parts)))
        if step.decode_rows:
            input_ids.index_copy_(0, decode_rows, s.last_token.index_select(0, decode_slots))
        s.set_lengths(step.slots, step.seq_lens)
        batch = build_attention_batch(
            s.block_tables.index_select(0, slot_index),
            step.query_lens,
            step.seq_lens,
            self.block_size,
            seq_lens_tensor=s.seq_lens.index_select(0, slot_index),
        )
        self.plan_fence.before_plan()
        meta = self.attention.plan(batch)
        self.plan_fence.after_plan()
        capture = HiddenCapture(self._capture_layers()) if self._capture_layers() else None
        if self.pieces is not None and self.pieces.size_for(batch.num_tokens) is not None:
            hidden = self.pieces.run(input_ids, batch, meta)
            if self.pieces.aux is not None:  # a copy: the next run rewrites the buffer
                step.aux_hidden = self.pieces.aux[: batch.num_tokens].clone()
        else:
            hidden = self.model(input_ids, batch.positions, meta, capture)
            step.aux_hidden = capture.concatenated() if capture is not None else None
        # Before the sampled rows' logits: a piecewise run's hidden is a static buffer, read it now.
        prompt = step.prompt.compute(hidden, self.model.compute_logits, self.device, self.tp.leader)
        if not step.sample_rows:
            return None, prompt
        return self.model.compute_logits(hidden.index_select(0, sample_rows)), prompt

    def _capture_layers(self) -> tuple[int, ...]:
        """The target layers whose input the proposer reads (EAGLE-3), or none."""
        return self.spec.proposer.capture_layers if self.spec is not None else ()

    # ------------------------------------------------------------------ validation

    def _validate(self, plan: StepPlan) -> dict[int, str]:
        """Refuse a plan that does not fit (PlanError: a scheduler fault, the step fails) before any state
        changes; returns the sequences refused alone (slot -> why: the request's own fault)."""
        new = {seq.slot: seq for seq in plan.new_seqs}
        if len(new) != len(plan.new_seqs):
            raise PlanError(f"step {plan.step}: a slot is registered twice")
        failed: dict[int, str] = {}
        for seq in plan.new_seqs:
            error = self._check_new_seq(seq)
            if error:
                failed[seq.slot] = error
        seen: set[int] = set()
        for chunk in plan.chunks:
            if chunk.slot in seen:
                raise PlanError(f"step {plan.step}: slot {chunk.slot} has two chunks")
            seen.add(chunk.slot)
            if chunk.slot in failed or chunk.slot in self._refused:
                continue
            error = self._check_chunk(chunk, new.get(chunk.slot))
            if error:
                failed[chunk.slot] = error
        for slot in plan.free_slots:
            self._check_slot(slot)
        return failed

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.max_num_seqs:
            raise PlanError(f"slot {slot!r} is outside [0, {self.max_num_seqs})")

    def _check_blocks(self, slot: int, ids: list[int], total: int) -> None:
        bad = [b for b in ids if not isinstance(b, int) or not 0 <= b < self.pool.num_blocks]
        if bad:
            raise PlanError(f"slot {slot}: block ids {bad[:8]} are outside [0, {self.pool.num_blocks})")
        if total > self.slots.max_blocks:
            raise PlanError(
                f"slot {slot}: {total} blocks exceed max_model_len {self.max_model_len} "
                f"({self.slots.max_blocks} blocks of {self.block_size})"
            )

    def _check_new_seq(self, seq: NewSeq) -> str | None:
        """PlanError for a plan fault; the reason the sequence alone is refused, or None."""
        self._check_slot(seq.slot)
        if self.slots.active[seq.slot]:
            raise PlanError(f"slot {seq.slot} is already in use (rid {seq.rid}); free it first")
        self._check_blocks(seq.slot, seq.block_ids, len(seq.block_ids))
        if not 0 <= seq.num_cached_tokens <= len(seq.block_ids) * self.block_size:
            raise PlanError(
                f"slot {seq.slot}: num_cached_tokens {seq.num_cached_tokens} is not covered by "
                f"{len(seq.block_ids)} blocks"
            )
        if seq.sampling.grammar is not None and not seq.sampling.grammar.compiled:
            return "its grammar was not compiled (the tokenizer process compiles grammars)"
        return self.sampler.validate(seq.sampling) or self._check_ids(seq.prompt_ids) or self._check_ids(seq.output_ids)

    def _check_ids(self, token_ids: list[int]) -> str | None:
        """Why these ids cannot be tokens of this model (penalties index by them), or None."""
        if not token_ids:
            return None
        ids = np.asarray(token_ids)  # a non-integer or huge id gives a non-integer dtype
        if ids.dtype.kind not in "iu" or int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            return f"a prompt token id is outside the vocabulary [0, {self.vocab_size})"
        return None

    def _check_chunk(self, chunk: SeqChunk, new: NewSeq | None) -> str | None:
        """PlanError for a plan fault; the reason the chunk's sequence alone is refused, or None."""
        self._check_slot(chunk.slot)
        s = self.slots
        if new is None and not s.active[chunk.slot]:
            raise PlanError(f"chunk for slot {chunk.slot}, which holds no sequence")
        blocks = (len(new.block_ids) if new else s.num_blocks[chunk.slot]) + len(chunk.append_block_ids)
        self._check_blocks(chunk.slot, chunk.append_block_ids, blocks)
        error = None
        if chunk.token_ids:
            error = self._check_ids(chunk.token_ids)
        elif new is not None or not s.has_token[chunk.slot]:
            raise PlanError(f"decode chunk for slot {chunk.slot}, which has no sampled token to feed")
        elif not chunk.sample:
            raise PlanError(f"decode chunk for slot {chunk.slot} must sample")
        if chunk.num_draft and (self.spec is None or chunk.token_ids or not chunk.sample):
            raise PlanError(f"slot {chunk.slot}: drafts are verified after a decode only, with speculation on")
        start = new.num_cached_tokens if new else s.seq_len[chunk.slot]
        end = start + max(len(chunk.token_ids), 1) + chunk.num_draft
        if end > blocks * self.block_size:
            raise PlanError(
                f"slot {chunk.slot}: context of {end} tokens exceeds its {blocks} blocks of {self.block_size}"
            )
        if end > self.max_model_len:
            raise PlanError(
                f"slot {chunk.slot}: context of {end} tokens exceeds max_model_len {self.max_model_len}"
            )
        return error


def _verify_rows(step: _Step, verify: VerifyRows) -> None:
    """Find the verify rows' first flat rows; they leave the rows the sampler draws."""
    first = dict(zip(step.slots, np.cumsum([0, *step.query_lens[:-1]]).tolist(), strict=True))
    verify.rows = [first[slot] for slot in verify.slots]
    kept = [(row, slot) for row, slot in zip(step.sample_rows, step.sample_slots, strict=True)
            if slot not in set(verify.slots)]
    step.sample_rows = [row for row, _ in kept]
    step.sample_slots = [slot for _, slot in kept]


def _merge_verified(result: StepResult, out: VerifyOut) -> None:
    """The verify rows' tokens join the step's result after its sampled rows (protocol.StepResult)."""
    n = len(result.slots)
    result.accepted_ids = [[] for _ in range(n)] + out.accepted
    result.draft_counts = [0] * n + out.drafted
    result.slots = result.slots + out.slots
    result.token_ids = result.token_ids + out.next_tokens
    if result.logprobs:
        result.logprobs = result.logprobs + [None] * len(out.slots)
    result.bad_slots = result.bad_slots + [slot for slot, bad in zip(out.slots, out.bad, strict=True) if bad]


def _host_tokens(pending: PendingStep) -> tuple[np.ndarray, np.ndarray]:
    """A launched step's sampled ids and bad-row flags on the host, waiting for its copy if need be."""
    if pending.copied is not None:
        pending.copied.synchronize()
    assert pending.readback is not None
    host = pending.readback.numpy()
    n = len(pending.slots)
    return host[:n], host[n:]


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A page-locked host tensor that `tensor` is being copied into (read it once the copy's event fired)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _split(total: int, limit: int) -> list[int]:
    """total tokens as pieces of at most `limit`."""
    return [limit] * (total // limit) + ([total % limit] if total % limit else [])
