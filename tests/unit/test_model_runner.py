"""ModelRunner driven by a small scripted scheduler, against transformers' greedy generate."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from app.config import Settings
from app.protocol import NewSeq, SamplingParams, SeqChunk, StepPlan, StepResult
from app.startup_phases import PHASES
from app.worker.kv_cache import GIB, KVPoolError, cpu_pool_tokens, cuda_pool_bytes, finish_pool
from app.worker.memory_plan import profile_step
from app.worker.model_runner import ModelRunner
from app.worker.plan_checks import PlanError
from tests.support.model_factory import build_tiny_model
from tests.support.settings import CPU_RUNNER
from tests.support.settings import make_settings as support_settings

GREEDY = SamplingParams(temperature=0.0)
CPU = torch.device("cpu")


def make_settings(model_dir: Path, **overrides: Any) -> Settings:
    """The CPU runner tests' settings (tests/support/settings.py)."""
    return support_settings(model_dir, CPU_RUNNER, **overrides)


@functools.lru_cache(maxsize=2)
def hf_model(model_dir: Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = (
        None  # generate past EOS, as the runner does (stopping is not its job)
    )
    return model


def hf_greedy(model_dir: Path, prompt: list[int], new_tokens: int, device: str = "cpu") -> list[int]:
    model = hf_model(model_dir, device)
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=device), generation_config=config)
    generated = out[0, len(prompt) :].tolist()
    assert len(generated) == new_tokens
    return generated


@dataclass
class Request:
    rid: str
    prompt: list[int]
    max_new: int
    join_step: int = 0
    shared_from: str | None = None  # reuse that request's full prompt blocks (prefix cache)
    preempt_after: int | None = None  # freed after this many outputs, then re-added
    slot: int = -1
    blocks: list[int] = field(default_factory=list)
    fed: int = 0  # tokens of `feed` already sent
    feed: list[int] = field(default_factory=list)  # what the prefill chunks must feed
    output: list[int] = field(default_factory=list)
    registered: bool = False
    preempted: bool = False


class ScriptedScheduler:
    """Admits requests at their join step, prefills in chunks under a per-step token budget while
    others decode, hands out shuffled block ids, frees finished slots in the next plan."""

    def __init__(self, runner: ModelRunner, budget: int = 16, seed: int = 0) -> None:
        self.runner = runner
        self.budget = budget
        self.bs = runner.block_size
        gen = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(runner.ready_message().num_blocks, generator=gen).tolist()
        self.free_slots = list(range(runner.max_num_seqs))[::-1]
        self.requests: dict[str, Request] = {}
        self.step = 0
        self.to_free: list[int] = []

    def add(self, req: Request) -> None:
        self.requests[req.rid] = req

    def _take_blocks(self, n: int) -> list[int]:
        taken, self.free_blocks = self.free_blocks[:n], self.free_blocks[n:]
        return taken

    def _admit(self, req: Request, plan: StepPlan) -> None:
        req.slot = self.free_slots.pop()
        cached = 0
        req.blocks = []
        if req.shared_from:
            donor = self.requests[req.shared_from]
            shared = min(len(req.prompt), len(donor.prompt)) // self.bs
            while shared and req.prompt[: shared * self.bs] != donor.prompt[: shared * self.bs]:
                shared -= 1
            shared = min(shared, (len(req.prompt) - 1) // self.bs)  # feed at least one token
            req.blocks = donor.blocks[:shared]
            cached = shared * self.bs
        req.feed = req.prompt + req.output  # after a preemption: prompt + output so far
        req.fed = cached
        plan.new_seqs.append(
            NewSeq(
                slot=req.slot, rid=req.rid, sampling=GREEDY, num_prompt_tokens=len(req.prompt),
                block_ids=list(req.blocks), num_cached_tokens=cached, output_ids=list(req.output),
                prompt_ids=list(req.prompt),
            )
        )  # fmt: skip
        req.registered = True

    def _chunk(self, req: Request, room: int) -> SeqChunk | None:
        if req.fed < len(req.feed):  # prefill chunk
            n = min(room, len(req.feed) - req.fed)
            if n <= 0:
                return None
            context, tokens = req.fed, req.feed[req.fed : req.fed + n]
            req.fed += n
            sample = req.fed == len(req.feed)
        else:  # decode: the runner feeds the token it sampled last
            context, n, tokens, sample = self._context(req), 1, [], True
        new_blocks = self._take_blocks(max(math.ceil((context + n) / self.bs) - len(req.blocks), 0))
        req.blocks += new_blocks
        return SeqChunk(slot=req.slot, token_ids=tokens, append_block_ids=new_blocks, sample=sample)

    def _context(self, req: Request) -> int:
        """Tokens in KV before this decode: everything fed, plus outputs sampled since then but one."""
        produced_after_feed = len(req.prompt) + len(req.output) - len(req.feed)
        return len(req.feed) + produced_after_feed - 1

    def _plan(self) -> StepPlan:
        plan = StepPlan(step=self.step, free_slots=self.to_free)
        self.to_free = []
        room = self.budget
        running = [r for r in self.requests.values() if r.registered and len(r.output) < r.max_new]
        for req in running:  # decodes first: they are never starved
            if req.fed >= len(req.feed):
                plan.chunks.append(self._chunk(req, 1))
                room -= 1
        waiting = [r for r in self.requests.values() if not r.registered and r.join_step <= self.step]
        for req in running + waiting:
            if room <= 0:
                break
            if not req.registered:
                if not self.free_slots:
                    break
                self._admit(req, plan)
            if req.fed < len(req.feed):
                chunk = self._chunk(req, room)
                if chunk is not None:
                    plan.chunks.append(chunk)
                    room -= len(chunk.token_ids)
        return plan

    def _apply(self, result: StepResult) -> None:
        assert result.error is None and not result.bad_slots
        by_slot = {r.slot: r for r in self.requests.values() if r.registered}
        for slot, token in zip(result.slots, result.token_ids, strict=True):
            req = by_slot[slot]
            req.output.append(token)
            done = len(req.output) >= req.max_new
            if done or (
                req.preempt_after is not None and not req.preempted and len(req.output) == req.preempt_after
            ):
                self.to_free.append(slot)  # released after the next plan's step
                req.registered = done  # a preempted request waits to be re-admitted
                req.preempted = req.preempted or not done
                if not done:
                    self.free_blocks += req.blocks  # recompute: its KV is gone
                    req.blocks = []

    def run(self, max_steps: int = 500) -> dict[str, list[int]]:
        while any(len(r.output) < r.max_new for r in self.requests.values()) or self.to_free:
            assert self.step < max_steps, "scheduler made no progress"
            plan = self._plan()
            result = self.runner.execute(plan)
            self.free_slots += plan.free_slots
            self._apply(result)
            self.step += 1
        return {rid: r.output for rid, r in self.requests.items()}


def prompts_for(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers_generate(arch: str, tmp_path: Path) -> None:
    model_dir = build_tiny_model(arch, tmp_path, seed=2)
    runner = ModelRunner(make_settings(model_dir), CPU)
    runner.warmup()
    lengths, joins = [5, 41, 12, 23], [0, 0, 3, 9]  # the 41-token prompt takes several chunks
    prompts = prompts_for(runner.vocab_size, lengths)
    sched = ScriptedScheduler(runner)
    for i, (prompt, join) in enumerate(zip(prompts, joins, strict=True)):
        sched.add(Request(f"r{i}", prompt, max_new=34, join_step=join))
    outputs = sched.run()
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(model_dir, prompt, 34), f"r{i}"
    assert not any(runner.slots.active)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), seed=5)


@pytest.fixture
def runner(llama_dir: Path) -> ModelRunner:
    return ModelRunner(make_settings(llama_dir), CPU)


def test_prefix_cache_sharing_gives_the_same_tokens(runner: ModelRunner, llama_dir: Path) -> None:
    base = prompts_for(runner.vocab_size, [22, 9])
    shared_prompt = base[0][:16] + base[1]
    sched = ScriptedScheduler(runner)
    sched.add(Request("donor", base[0], max_new=20))
    sched.add(Request("sharer", shared_prompt, max_new=20, join_step=6, shared_from="donor"))
    outputs = sched.run()
    sharer = sched.requests["sharer"]
    assert sharer.blocks[:4] == sched.requests["donor"].blocks[:4]  # really shared
    assert outputs["sharer"] == hf_greedy(llama_dir, shared_prompt, 20)
    assert outputs["donor"] == hf_greedy(llama_dir, base[0], 20)


def test_preempted_sequence_resumes_with_the_same_tokens(runner: ModelRunner, llama_dir: Path) -> None:
    prompt = prompts_for(runner.vocab_size, [13])[0]
    other = prompts_for(runner.vocab_size, [7], seed=1)[0]
    sched = ScriptedScheduler(runner)
    sched.add(Request("victim", prompt, max_new=30, preempt_after=11))
    sched.add(Request("other", other, max_new=30, join_step=2))
    outputs = sched.run()
    assert sched.requests["victim"].preempted
    assert outputs["victim"] == hf_greedy(llama_dir, prompt, 30)
    assert outputs["other"] == hf_greedy(llama_dir, other, 30)


def _new(slot: int, blocks: list[int], cached: int = 0, rid: str = "x") -> NewSeq:
    return NewSeq(
        slot=slot, rid=rid, sampling=GREEDY, num_prompt_tokens=4, block_ids=blocks, num_cached_tokens=cached
    )


def test_bad_plans_are_refused_without_changing_state(runner: ModelRunner) -> None:
    bad_plans = {
        "holds no sequence": StepPlan(step=0, chunks=[SeqChunk(slot=2, token_ids=[1])]),
        "exceeds its 1 blocks": StepPlan(
            step=0, new_seqs=[_new(0, [0])], chunks=[SeqChunk(slot=0, token_ids=[1] * 5)]
        ),
        "no sampled token": StepPlan(step=0, new_seqs=[_new(0, [0])], chunks=[SeqChunk(slot=0)]),
        "outside \\[0, 6\\)": StepPlan(step=0, new_seqs=[_new(6, [0])]),
        "block ids \\[99999\\]": StepPlan(step=0, new_seqs=[_new(0, [99999])]),
        "not covered": StepPlan(step=0, new_seqs=[_new(0, [0], cached=5)]),
        "two chunks": StepPlan(
            step=0,
            new_seqs=[_new(0, [0, 1])],
            chunks=[SeqChunk(slot=0, token_ids=[1]), SeqChunk(slot=0, token_ids=[2])],
        ),
        "129 blocks exceed max_model_len 512": StepPlan(step=0, new_seqs=[_new(0, list(range(129)))]),
    }
    for message, plan in bad_plans.items():
        with pytest.raises(PlanError, match=message):
            runner.execute(plan)
        assert not any(runner.slots.active), message
    runner.execute(StepPlan(step=1, new_seqs=[_new(0, [0])], chunks=[SeqChunk(slot=0, token_ids=[1, 2])]))
    with pytest.raises(PlanError, match="already in use"):
        runner.execute(StepPlan(step=2, new_seqs=[_new(0, [1])]))
    with pytest.raises(PlanError, match="must sample"):
        runner.execute(StepPlan(step=2, chunks=[SeqChunk(slot=0, sample=False)]))
    runner.execute(StepPlan(step=3, free_slots=[0, 0, 3]))  # releasing an empty slot is a no-op
    assert not any(runner.slots.active)


def test_result_layout_chunked_prefill_and_logprobs(runner: ModelRunner) -> None:
    wants = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    seqs = [
        NewSeq(slot=3, rid="a", sampling=wants, num_prompt_tokens=6, block_ids=[7, 8]),
        NewSeq(slot=1, rid="b", sampling=GREEDY, num_prompt_tokens=3, block_ids=[2]),
    ]
    first = runner.execute(
        StepPlan(step=0, new_seqs=seqs, chunks=[SeqChunk(3, [5, 6, 7], sample=False), SeqChunk(1, [9, 9, 4])])
    )
    assert first.slots == [1] and len(first.token_ids) == 1 and first.logprobs == []
    second = runner.execute(StepPlan(step=1, chunks=[SeqChunk(1), SeqChunk(3, [8, 9, 10])], free_slots=[1]))
    assert second.slots == [1, 3] and len(second.logprobs) == 2
    assert second.logprobs[0] is None and second.logprobs[1].token_id == second.token_ids[1]
    assert len(second.logprobs[1].top_ids) == 2
    assert runner.slots.seq_len[3] == 6 and not runner.slots.active[1]
    assert runner.slots.block_tables[3, :2].tolist() == [7, 8] and int(runner.slots.seq_lens[3]) == 6


def test_warmup_leaves_no_state_behind(runner: ModelRunner, llama_dir: Path) -> None:
    runner.warmup()
    assert not any(runner.slots.active) and not any(runner.slots.has_token)
    prompt = prompts_for(runner.vocab_size, [6])[0]
    sched = ScriptedScheduler(runner)
    sched.add(Request("after", prompt, max_new=8))
    assert sched.run()["after"] == hf_greedy(llama_dir, prompt, 8)


def test_ready_message(runner: ModelRunner) -> None:
    ready = runner.ready_message()
    assert (ready.rank, ready.block_size, ready.max_model_len) == (0, 4, 512)
    assert ready.num_blocks == 4096 // 4  # --max-total-tokens
    assert ready.vocab_size == runner.config.vocab_size and ready.eos_token_ids == [2]
    assert ready.info.kv_pool_tokens == 4096 and ready.info.dtype == "float32"
    assert ready.info.device == "cpu" and ready.info.weights_gb >= 0
    assert ready.info.attention_backend == ready.info.decode_kernel == "torch"
    assert ready.info.load_seconds >= 0 and ready.info.max_concurrency == 4096 / 512
    assert set(ready.info.startup_phases) <= set(PHASES) and ready.info.quantization == "none"


def test_cpu_pool_defaults_and_limits(llama_dir: Path) -> None:
    default = ModelRunner(
        make_settings(llama_dir, max_total_tokens=None, max_model_len=64, max_num_seqs=3), CPU
    )
    assert default.pool.tokens == 3 * 64
    with pytest.raises(KVPoolError, match="max_model_len=512"):
        ModelRunner(make_settings(llama_dir, max_total_tokens=100), CPU)
    with pytest.raises(KVPoolError, match="available"):
        ModelRunner(make_settings(llama_dir, max_total_tokens=10**12), CPU)


def test_profile_step_runs_anywhere_and_leaves_the_sampler_empty(runner: ModelRunner) -> None:
    # The CUDA sizing path's profile step is device-agnostic: run it here on the CPU.
    assert (
        profile_step(runner.workload, runner.sampler)
        == math.ceil(512 / 4) * 4 * runner.model.kv_cache_spec(torch.float32).bytes_per_token
    )
    result = runner.execute(StepPlan(step=0, new_seqs=[_new(0, [0, 1])], chunks=[SeqChunk(0, [1, 2, 3])]))
    assert result.slots == [0]


def test_pool_arithmetic() -> None:
    bpt = 1024
    assert cuda_pool_bytes(100 * GIB, 0.5, 10 * GIB, 2 * GIB, GIB, GIB) == 36 * GIB
    assert cpu_pool_tokens(bpt, 4, 100, None, 400 * bpt * 4)[0] == 400  # max_num_seqs x max_model_len
    assert cpu_pool_tokens(bpt, 4, 100, None, 1000 * bpt)[0] == 250  # a quarter of what is available
    assert cpu_pool_tokens(bpt, 4, 100, 900, 1000 * bpt)[0] == 900  # explicit: up to all of it
    plan = finish_pool(1000, 16, 100, bpt, "test")
    assert (plan.num_blocks, plan.tokens, plan.max_concurrency) == (62, 992, 9.92)
    with pytest.raises(KVPoolError, match=r"holds 96 tokens.*max_model_len=100.*needs 0.1 MiB"):
        finish_pool(100, 16, 100, bpt, "test")


def test_unknown_backends_are_refused(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # triton runs on the CPU only under the interpreter
    with pytest.raises(ValueError, match="attention backend"):
        ModelRunner(make_settings(llama_dir).model_copy(update={"attention_backend": "triton"}), CPU)


def test_default_flashinfer_falls_back_to_triton_when_its_kernels_cannot_load(monkeypatch, caplog) -> None:
    """A start builds no flashinfer kernel: without them in its cache the default backend is triton;
    warmup (build_kernels) lets the probe build them."""
    from app.worker.attention import flashinfer_backend
    from app.worker.attention.selection import flashinfer_or_triton
    from app.worker.parallel import SINGLE

    def choose(build: bool) -> str:
        return flashinfer_or_triton(None, torch.bfloat16, CPU, 32, SINGLE, build_kernels=build)

    probed = []
    monkeypatch.setattr(flashinfer_backend, "kernels_unavailable",
                        lambda *args, build: probed.append((args[3], build)))
    assert choose(False) == "flashinfer"
    assert choose(True) == "flashinfer"
    assert probed == [(32, False), (32, True)]  # the probe runs at the runner's block size
    monkeypatch.setattr(flashinfer_backend, "kernels_unavailable", lambda *_, build: "RuntimeError: nvcc not found")
    assert choose(False) == "triton"
    assert "nvcc not found" in caplog.text and "using the triton backend" in caplog.text
    assert "`tokenspeed warmup` builds them" in caplog.text


def test_refusing_jit_builds_loads_compiled_kernels_and_builds_none() -> None:
    """The probe's guard: a kernel compiled in the cache goes through flashinfer's build (ninja's no-op
    check, then load); one that is not raises instead of compiling, and the guard undoes itself."""
    from app.worker.attention.flashinfer_backend import KernelsNotCached, refusing_jit_builds

    class Spec:  # flashinfer.jit.core.JitSpec's part the guard uses
        built: list[str] = []

        def __init__(self, name: str, compiled: bool) -> None:
            self.name, self.is_compiled = name, compiled

        def build(self, verbose: bool, need_lock: bool = True) -> None:
            Spec.built.append(self.name)

    original = Spec.build
    with refusing_jit_builds(Spec):
        Spec("cached", True).build(False, need_lock=False)
        with pytest.raises(KernelsNotCached, match="kernel missing is not in flashinfer's JIT cache"):
            Spec("missing", False).build(False)
    assert Spec.build is original and Spec.built == ["cached"]
    Spec("missing", False).build(False)
    assert Spec.built == ["cached", "missing"]
