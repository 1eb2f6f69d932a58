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

A plan is validated in full before anything changes (app/worker/plan_checks.py), so a refused plan
leaves no trace; releasing a slot that holds nothing is a no-op (after a failed step the scheduler
frees its sequences). A sequence refused alone is left out of the step (released, if it held a
slot), reported in StepResult.failed_slots, and its chunks in later plans (planned before the
scheduler heard) are skipped until the scheduler frees its slot. The step's other rows are computed
exactly as without it: rows are independent, so their tokens do not change.

Start-up reads top to bottom in __init__; each of its jobs is a module of its own: the model
(model_setup.py), the attention backend (attention/selection.py), the KV pool (memory_plan.py), the
CUDA graphs (graph_capture.py).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import Any

import torch

from app.config.settings import Settings
from app.protocol import (
    EngineInfo,
    NewSeq,
    SamplingParams,
    SeqChunk,
    StartupFigures,
    StepPlan,
    StepResult,
    WorkerReady,
)
from app.startup_phases import StartupClock
from app.worker import graph_capture, memory_plan
from app.worker.attention import backend_class, build_attention_batch, make_attention_backend
from app.worker.attention.selection import choose_backend, configure_pdl
from app.worker.cuda_graphs import PlanFence
from app.worker.kv_cache import GIB, KVCache
from app.worker.memory_plan import MAX_TOP_LOGPROBS, Workload
from app.worker.model_setup import build_model, resolve_model
from app.worker.models.dense import HiddenCapture
from app.worker.parallel import SINGLE, TensorParallel
from app.worker.plan_checks import PlanChecks
from app.worker.readback import PendingStep, host_tokens, start_readback, step_result
from app.worker.sampling import make_sampler
from app.worker.sampling.grammar import GrammarRows
from app.worker.sampling.prompt_logprobs import PromptLogprobs, PromptWant
from app.worker.slot_state import SlotState
from app.worker.spec.decoder import SpecDecoder, VerifyRows, make_spec_decoder
from app.worker.spec.drafter import ChainDrafter
from app.worker.spec.model_drafts import MODEL_DRAFTS, drafter_backend, load_model_drafter
from app.worker.step_batch import StepBatch, lay_out
from app.worker.transfer import upload

logger = logging.getLogger(__name__)


class ModelRunner:
    """Start-up (model, attention backend, KV pool, CUDA graphs, each from its own module), then one
    StepPlan at a time: launch() and finish()."""

    def __init__(self, settings: Settings, device: torch.device, tp: TensorParallel = SINGLE,
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
        self.pdl = configure_pdl(settings.enable_pdl, self.device, tp)
        setup = resolve_model(settings, self.device, tp)
        self.model_dir, self.config, self.dtype = setup.model_dir, setup.config, setup.dtype
        self.quant_scheme, self.kv_quant, self.kv_dtype = setup.quant_scheme, setup.kv_quant, setup.kv_dtype
        self.max_model_len, self.vocab_size, self.eos_token_ids = (
            setup.max_model_len, setup.vocab_size, setup.eos_token_ids
        )
        self.block_size = _positive("block_size", settings.block_size)
        self.max_num_seqs = _positive("max_num_seqs", settings.max_num_seqs)
        self.model, self.weights_bytes = build_model(setup, self.device, tp, settings.load_format,
                                                     self.clock.progress)
        self.load_seconds = time.perf_counter() - started
        self.sampler = make_sampler(settings.sampling_backend, self.vocab_size, self.eos_token_ids, self.device,
                                    self.max_num_seqs, seed=settings.seed)
        # Structured output (sampling/grammar.py): matchers live where the tokens are sampled, the TP leader.
        self.grammar = GrammarRows(self._grammar_info, self.vocab_size, self.device, self.max_num_seqs)
        self.drafter: ChainDrafter | None = None  # a model draft (STANDALONE, EAGLE3): its weights load here
        self.spec = self._spec_decoder()
        self.clock.enter("kernels")
        self.attention_backend_name = choose_backend(
            settings.attention_backend, self.device, self.dtype, self.model.attention_spec, self.kv_dtype,
            self.kv_quant.quantized, self.block_size, tp, build_kernels,
        )
        self.workload = Workload(
            self.model, self.attention_backend_name, self.dtype, self.kv_dtype, self.device, self.block_size,
            self.max_model_len, self.max_num_seqs, memory_plan.step_tokens(settings), self.vocab_size,
            # the draft's cache holds the same tokens in the same blocks (in the model dtype)
            self.drafter.kv_bytes_per_token(self.dtype) if self.drafter is not None else 0,
        )
        self.graph_sizes = graph_capture.decode_graph_sizes(settings, self.device, self.attention_backend_name,
                                                            self.max_num_seqs)
        self.piece_sizes = graph_capture.piece_sizes(
            settings, self.graph_sizes, self.attention_backend_name, tp, self.workload.max_step_tokens
        )
        self.clock.enter("memory_profile")
        pool, self.graph_reserve_bytes = memory_plan.size_pool(
            self.workload, self.sampler, settings.max_total_tokens, settings.gpu_memory_utilization,
            lambda: graph_capture.profile_graph_bytes(self.workload, self.graph_sizes, self.piece_sizes),
        )
        self.pool = memory_plan.agree_pool(pool, tp)
        # One block beyond the scheduler's pool: the scratch block that CUDA-graph pad rows write to.
        self.scratch_block = self.pool.num_blocks
        self.kv_cache = KVCache(self.model.kv_cache_spec(self.kv_dtype), self.pool.num_blocks + 1, self.block_size,
                                self.device, self.kv_quant.k_scales, self.kv_quant.v_scales)
        self.attention = make_attention_backend(self.attention_backend_name, self.kv_cache, self.model.attention_spec)
        self.slots = SlotState(self.max_num_seqs, math.ceil(self.max_model_len / self.block_size), self.device)
        self._refused: set[int] = set()  # slots whose sequence was refused, until the scheduler frees them
        self._prompt_want: dict[int, PromptWant] = {}  # slots whose prompt logprobs are asked
        self.checks = PlanChecks(self.slots, self.pool.num_blocks, self.block_size, self.max_model_len,
                                 self.vocab_size, self.sampler.validate, self.spec is not None)
        self.clock.enter("graph_capture")
        self._attach_drafter()
        self.graphs = graph_capture.capture_decode_graphs(
            self.workload, self.attention, self.graph_sizes, self.slots.max_blocks, self.scratch_block,
            self._capture_layers(),
        )
        self.pieces = graph_capture.capture_pieces(self.workload, self.attention, self.piece_sizes, self.scratch_block,
                                                   self._capture_layers())
        graph_capture.check_graph_memory(self._graph_bytes(), self.graph_reserve_bytes)
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

    def _spec_decoder(self) -> SpecDecoder | None:
        """Speculative decoding (app/worker/spec): drafts are made and verified on the host of one rank."""
        if self.settings.speculative_algorithm is None:
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

    def _capture_layers(self) -> tuple[int, ...]:
        """The target layers whose input the proposer reads (EAGLE-3), or none."""
        return self.spec.proposer.capture_layers if self.spec is not None else ()

    def _graph_bytes(self) -> int:
        return graph_capture.captured_bytes(self.graphs, self.pieces)

    def ready_message(self) -> WorkerReady:
        return WorkerReady(
            rank=self.tp.rank,
            num_blocks=self.pool.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=list(self.eos_token_ids),
            info=StartupFigures(
                weights_gb=round(self.weights_bytes / 1e9, 3),
                kv_pool_tokens=self.pool.tokens,
                max_concurrency=round(self.pool.max_concurrency, 2),
                load_seconds=round(self.load_seconds, 2),
                dtype=str(self.dtype).removeprefix("torch."),
                device=str(self.device),
                architecture=type(self.model).__name__,
                attention_backend=self.attention.name,
                decode_kernel=self.attention.decode_kernel_name(),
                cuda_graph_sizes=list(self.graphs.sizes) if self.graphs is not None else [],
                piecewise_graph_sizes=list(self.pieces.sizes) if self.pieces is not None else [],
                pdl=self.pdl,
                cuda_graph_gb=round(self._graph_bytes() / 1e9, 3),
                quantization=self.quant_scheme.describe() if self.quant_scheme is not None else "none",
                kv_cache_dtype=self.kv_quant.describe(),
                startup_phases={phase: round(s, 3) for phase, s in self.clock.seconds.items()},
            ),
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
        failed = self.checks.validate(plan, self._refused)
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
        result = step_result(pending, self.grammar)
        if self.spec is not None:
            self.spec.finish(pending.observed, result, pending.spec)
        return result

    def _grammar_info(self) -> Any:
        """XGrammar's view of the served tokenizer, built as the tokenizer process builds it."""
        from app.grammar.compiler import tokenizer_info
        from app.tokenizer.loader import load_tokenizer_from_settings

        return tokenizer_info(load_tokenizer_from_settings(self.settings), self.vocab_size, self.eos_token_ids)

    def _register(self, seq: NewSeq) -> None:
        self.sampler.add_seq(seq.slot, seq.rid, seq.sampling, list(seq.prompt_ids), list(seq.output_ids))
        if seq.sampling.grammar is not None and self.tp.leader:
            try:
                self.grammar.add(seq.slot, seq.sampling.grammar, list(seq.output_ids))
            except Exception:
                self.sampler.remove_seq(seq.slot)
                raise
        if self.spec is not None:  # after the grammar: a sequence it refuses is not registered anywhere
            self.spec.register(seq)
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
        step = lay_out(chunks, s.seq_len, self._prompt_want)
        num_sampled = verify.take_rows(step)  # verify rows: logits at every fed position, verified, not sampled
        if self._graphable(step, verify):
            logits, prompt = self._graph_logits(step, verify), None  # no prompt position in a graphed step
        else:
            logits, prompt = self._eager_logits(step, verify)
        for chunk in plan.chunks:  # fed tokens supersede a sampled one; sampling below sets it again
            s.has_token[chunk.slot] = False
        if self.spec is None:
            return self._sample(plan, step, logits, prompt)
        verified = self.spec.verify(logits[num_sampled:], verify, s) if verify.slots else None
        if verified is not None:
            logits = logits[:num_sampled] if num_sampled else None
            del step.sample_rows[num_sampled:]
        pending = self._sample(plan, step, logits, prompt)
        pending.spec = verified
        self.spec.trim(plan.chunks, s)
        pending.observed = self.spec.target_step(chunks, step, verify)
        pending.observed.aux_hidden = step.aux_hidden
        return pending

    def _sample(self, plan: StepPlan, step: StepBatch, logits: torch.Tensor | None,
                prompt: PromptLogprobs | None) -> PendingStep:
        """Sample the rows that ask and start reading the tokens back."""
        s = self.slots
        if logits is None:
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
        pending = start_readback(plan.step, step.sample_slots, out, self.device)
        pending.prompt = prompt
        if constrained is not None:
            constrained.read = lambda: host_tokens(pending)
            self.grammar.expect(constrained)
            pending.grammar = constrained
        return pending

    def _graphable(self, step: StepBatch, verify: VerifyRows) -> bool:
        """A step a captured decode graph covers, one graph row per fed token (cuda_graphs.py): decodes,
        and verify rows feeding their drafts."""
        if self.graphs is None or step.prompt.rows or self.graphs.size_for(len(step.token_ids)) is None:
            return False
        verifying = set(verify.slots)
        return all(n == 1 or slot in verifying for slot, n in zip(step.slots, step.query_lens, strict=True))

    def _graph_logits(self, step: StepBatch, verify: VerifyRows) -> torch.Tensor | None:
        """Replay the decode graph that holds the step's rows: logits of the rows that sample."""
        s = self.slots
        for slot, length in zip(step.slots, step.seq_lens, strict=True):
            s.seq_len[slot] = length  # the graph's own buffers get the lengths on the device
        if len(step.decode_rows) == len(step.token_ids):  # decodes alone: every row samples, in order
            logits = self.graphs.run(step.slots, step.seq_lens, s.block_tables, s.last_token)
        else:
            row_slots = [slot for slot, n in zip(step.slots, step.query_lens, strict=True) for _ in range(n)]
            row_lens = [length - n + 1 + j for length, n in zip(step.seq_lens, step.query_lens, strict=True)
                        for j in range(n)]
            input_ids, sample_rows = self._input_ids(step, verify)
            logits = self.graphs.run(row_slots, row_lens, s.block_tables, None, input_ids)
            logits = logits.index_select(0, sample_rows) if step.sample_rows else None
        if self.graphs.aux is not None:  # a copy: the next replay rewrites the buffer
            step.aux_hidden = self.graphs.aux[: len(step.token_ids)].clone()
        return logits

    def _input_ids(self, step: StepBatch, verify: VerifyRows, *extra: list[int]) -> tuple[torch.Tensor, ...]:
        """The step's fed tokens on the device (decode rows: their slot's last sampled token; drafts
        still on the device: theirs), its sample rows and any extra index lists, in one upload (no host
        sync)."""
        drafts = verify.device_tokens()
        draft_rows, draft_tokens, draft_index = drafts if drafts is not None else ([], None, [])
        parts = [step.token_ids, step.decode_rows, step.decode_slots, step.sample_rows, draft_rows, draft_index,
                 *extra]
        ids = upload([i for part in parts for i in part], torch.int64, self.device)
        input_ids, decode_rows, decode_slots, sample_rows, draft_rows_dev, draft_index_dev, *rest = ids.split(
            list(map(len, parts)))
        if step.decode_rows:
            input_ids.index_copy_(0, decode_rows, self.slots.last_token.index_select(0, decode_slots))
        if draft_rows:
            input_ids.index_copy_(0, draft_rows_dev, draft_tokens.index_select(0, draft_index_dev))
        return input_ids, sample_rows, *rest

    def _eager_logits(self, step: StepBatch, verify: VerifyRows) -> tuple[torch.Tensor | None, PromptLogprobs | None]:
        """Run the step's flat batch eagerly: logits of the rows that sample (None if none does) and the
        prompt logprobs of the rows that ask (None if none does), from the same hidden states."""
        s = self.slots
        input_ids, sample_rows, slot_index = self._input_ids(step, verify, step.slots)
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


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value
