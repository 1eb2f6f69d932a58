"""The FP8 KV cache (--kv-cache-dtype fp8_e4m3): pool capacity, scales files, the bytes stored, the
attention read path, and greedy agreement with the full-precision run.

Documented figures (docs/quantization.md): the pool holds 2x the tokens of a bf16/fp16 cache and 4x
those of a float32 one (the CPU default) in the same memory; on the tiny test models (initializer_range
0.1) teacher-forced greedy agreement with the full-precision run is >= TEACHER_FORCED_AGREEMENT (each
step is fed the full-precision run's token and its greedy choice compared with the next one, so one
near-tie does not derail the rest of the comparison).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from app.protocol import NewSeq, SeqChunk, StepPlan
from app.worker.attention import TorchAttentionBackend, build_attention_batch
from app.worker.kv_cache import KVCache, KVCacheSpec
from app.worker.model_runner import ModelRunner
from app.worker.quantization import FP8_DTYPE, KVQuantError, fp8_kv_backend, resolve_kv_cache_quant
from app.worker.quantization.calibrate import calibrate_kv_scales, kv_amax, load_model
from app.worker.quantization.calibrate import main as calibrate_main
from app.worker.quantization.kv import load_kv_scales
from tests.support.model_factory import build_tiny_model
from tests.unit.test_model_runner import CPU, GREEDY, Request, ScriptedScheduler, make_settings, prompts_for

TEACHER_FORCED_AGREEMENT = 0.8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kv")
    return {
        arch: build_tiny_model(arch, root / arch, seed=2, initializer_range=0.1)
        for arch in ("llama", "qwen3")
    }


def write_scales(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(json.dumps(doc))
    return path


# ---------------------------------------------------------------- pool capacity


def test_pool_holds_twice_the_bf16_tokens_and_four_times_the_float32_ones(
    tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import psutil

    available = 64 << 20  # the CPU pool takes a quarter of what is available: memory-bound here
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=available))
    pools = {}
    for name, overrides in {
        "float32": {}, "bf16": {"dtype": "bfloat16"}, "fp8": {"kv_cache_dtype": "fp8"},
        "bf16+fp8": {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3"},
    }.items():  # fmt: skip
        runner = ModelRunner(
            make_settings(tiny["llama"], max_total_tokens=None, max_num_seqs=256, **overrides), CPU
        )
        pools[name] = runner
        assert (
            runner.kv_cache.nbytes
            <= available // 4 + runner.kv_cache.spec.bytes_per_token * runner.block_size
        )
    tokens = {name: r.pool.tokens for name, r in pools.items()}
    block = pools["fp8"].block_size
    assert tokens["fp8"] == tokens["bf16+fp8"]  # the KV dtype decides, not the model dtype
    assert abs(tokens["fp8"] - 2 * tokens["bf16"]) <= 2 * block  # whole blocks only
    assert abs(tokens["fp8"] - 4 * tokens["float32"]) <= 4 * block
    fp8 = pools["fp8"]
    assert fp8.kv_cache.k[0].dtype == FP8_DTYPE and fp8.kv_cache.spec.bytes_per_token == 2 * 3 * 2 * 16
    assert fp8.ready_message().info.kv_cache_dtype == "fp8_e4m3 (scales: default 1.0)"
    assert fp8.ready_message().info.kv_pool_tokens == tokens["fp8"]


# ---------------------------------------------------------------- scales files


def test_scales_files_in_both_layouts(tmp_path: Path) -> None:
    sf = {"0": {"0": 0.5, "1": 2, "2": 1.5}}
    shared = {"model_type": "llama", "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": sf}}
    assert load_kv_scales(write_scales(tmp_path / "a.json", shared), 3) == ((0.5, 2.0, 1.5), (0.5, 2.0, 1.5))
    split = {
        "kv_cache": {"dtype": "float8_e4m3fn", "k_scale": {"0": 0.25, "1": 4.0}, "v_scale": {"1": 3, "0": 1}}
    }
    assert load_kv_scales(write_scales(tmp_path / "b.json", split), 2) == ((0.25, 4.0), (1.0, 3.0))
    quant = resolve_kv_cache_quant("fp8", "none", str(tmp_path / "b.json"), 2)
    assert (quant.dtype, quant.k_scales) == (FP8_DTYPE, (0.25, 4.0))
    assert quant.describe() == f"fp8_e4m3 (scales: --quantization-param-path {tmp_path / 'b.json'})"


FP8 = {"dtype": "float8_e4m3fn"}
ONES = {"0": 1, "1": 1}


@pytest.mark.parametrize(
    ("kv", "message"),
    [
        ({"dtype": "float16", "scaling_factor": {"0": ONES}}, 'dtype must be "float8_e4m3fn"'),
        ({**FP8, "scaling_factor": {"0": {"0": 1}}}, r"every layer index 0..1 to a scale, got \['0'\]"),
        ({**FP8, "scaling_factor": {"1": ONES}}, 'map rank "0"'),
        ({**FP8, "k_scale": ONES}, "both k_scale and v_scale"),
        ({**FP8, "k_scale": {"0": 1, "1": -2}, "v_scale": ONES}, "k_scale.1 must be a positive"),
        ({**FP8, "k_scale": {"0": 1, "1": True}, "v_scale": ONES}, "k_scale.1 must be"),
        ({**FP8, "scale": {}}, r"unknown kv_cache keys \['scale'\]"),
    ],
)
def test_bad_scales_files_are_refused(kv: dict[str, Any], message: str, tmp_path: Path) -> None:
    path = write_scales(tmp_path / "s.json", {"kv_cache": kv})
    with pytest.raises(KVQuantError, match=message) as refused:
        load_kv_scales(path, 2)
    assert str(refused.value).startswith(f"{path}: ")


def test_kv_settings_that_cannot_run_are_refused(tmp_path: Path) -> None:
    with pytest.raises(KVQuantError, match="cannot read KV cache scales from"):
        resolve_kv_cache_quant("fp8", "none", str(tmp_path / "absent.json"), 2)
    with pytest.raises(KVQuantError, match="it needs --kv-cache-dtype fp8_e4m3"):
        resolve_kv_cache_quant("auto", "none", str(tmp_path / "absent.json"), 2)
    with pytest.raises(KVQuantError, match="per-token-head scales are not built"):
        resolve_kv_cache_quant("fp8", "per_token_head", None, 2)
    with pytest.raises(KVQuantError, match="Blackwell"):
        resolve_kv_cache_quant("mxfp8", "none", None, 2)
    with pytest.raises(ValueError, match="need an FP8 cache"):
        KVCache(KVCacheSpec(1, 1, 4, torch.float32), 1, 4, CPU, k_scales=[2.0])
    with pytest.raises(ValueError, match="2 KV scales given for 1 layers"):
        KVCache(KVCacheSpec(1, 1, 4, FP8_DTYPE), 1, 4, CPU, v_scales=[2.0, 1.0])


# ---------------------------------------------------------------- bytes stored and the read path

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def attend(cache: KVCache, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, context: int) -> torch.Tensor:
    """Write k/v for positions [context, context + n) of one sequence in blocks 0.. and attend."""
    n = q.shape[0]
    spec = SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, scale=DIM**-0.5)
    backend = TorchAttentionBackend(cache, spec)
    table = torch.arange(cache.num_blocks, dtype=torch.int32).unsqueeze(0)
    batch = build_attention_batch(table, [n], [context + n], BLOCK)
    return backend.forward(0, q, k, v, backend.plan(batch))


def test_a_scale_of_two_halves_the_stored_values() -> None:
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(6, KV_HEADS, DIM, generator=gen) * 20 for _ in range(2))
    q = torch.randn(6, HEADS, DIM, generator=gen)
    caches = {}
    for k_scale, v_scale in [(1.0, 1.0), (2.0, 0.5)]:
        cache = KVCache(KVCacheSpec(1, KV_HEADS, DIM, FP8_DTYPE), 2, BLOCK, CPU, [k_scale], [v_scale])
        attend(cache, k, v, q, context=0)
        stored_k = cache.k[0].view(-1, KV_HEADS, DIM)[:6]
        stored_v = cache.v[0].view(-1, KV_HEADS, DIM)[:6]
        assert torch.equal(
            stored_k.view(torch.uint8), (k / k_scale).clamp(-448, 448).to(FP8_DTYPE).view(torch.uint8)
        )
        assert torch.equal(
            stored_v.view(torch.uint8), (v / v_scale).clamp(-448, 448).to(FP8_DTYPE).view(torch.uint8)
        )
        caches[k_scale] = stored_k
    assert not torch.equal(caches[1.0].view(torch.uint8), caches[2.0].view(torch.uint8))
    # The codes for scale 2 are the values halved: reading them back with the scale gives k again (to e4m3).
    assert torch.allclose(caches[2.0].float() * 2, k, rtol=2**-4, atol=2**-9 * 2)


def test_reading_an_fp8_cache_dequantizes_with_the_scales() -> None:
    """Prefill then decode on an FP8 cache with scales != 1 equals attention over a float cache holding
    the dequantized values (scales fold into q and the output: exact up to float rounding)."""
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(7, KV_HEADS, DIM, generator=gen) * 3 for _ in range(2))
    q = torch.randn(7, HEADS, DIM, generator=gen)
    k_scale, v_scale = 0.03, 0.011
    fp8 = KVCache(KVCacheSpec(1, KV_HEADS, DIM, FP8_DTYPE), 2, BLOCK, CPU, [k_scale], [v_scale])
    ref = KVCache(KVCacheSpec(1, KV_HEADS, DIM, torch.float32), 2, BLOCK, CPU)
    k_deq = (k / k_scale).clamp(-448, 448).to(FP8_DTYPE).float() * k_scale
    v_deq = (v / v_scale).clamp(-448, 448).to(FP8_DTYPE).float() * v_scale
    got = [attend(fp8, k[:6], v[:6], q[:6], 0), attend(fp8, k[6:], v[6:], q[6:], 6)]  # prefill, decode
    want = [attend(ref, k_deq[:6], v_deq[:6], q[:6], 0), attend(ref, k_deq[6:], v_deq[6:], q[6:], 6)]
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got[0], attend(ref, k[:6], v[:6], q[:6], 0), rtol=1e-3, atol=1e-4)  # really FP8


# ---------------------------------------------------------------- greedy agreement


def greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    sched = ScriptedScheduler(runner)
    sched.add(Request("g", prompt, max_new=n))
    return sched.run()["g"]


def teacher_forced(runner: ModelRunner, prompt: list[int], reference: list[int]) -> list[int]:
    """The runner's greedy pick after the prompt and after each reference token, one decode-shaped step
    (a one-token chunk) at a time, so the FP8 cache is read by the decode path."""
    blocks = list(range(math.ceil((len(prompt) + len(reference)) / runner.block_size)))
    seq = NewSeq(slot=0, rid="tf", sampling=GREEDY, num_prompt_tokens=len(prompt), block_ids=blocks,
                 prompt_ids=prompt)  # fmt: skip
    picks = runner.execute(StepPlan(0, new_seqs=[seq], chunks=[SeqChunk(0, list(prompt))])).token_ids
    for step, token in enumerate(reference[:-1], start=1):
        picks += runner.execute(StepPlan(step, chunks=[SeqChunk(0, [token])])).token_ids
    runner.execute(StepPlan(len(reference), free_slots=[0]))
    return picks


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_agreement_with_the_full_precision_run(
    arch: str, tiny: dict[str, Path], tmp_path: Path
) -> None:
    model_dir = tiny[arch]
    full = ModelRunner(make_settings(model_dir), CPU)
    scales = calibrate_kv_scales(model_dir, prompts_for(full.vocab_size, [40, 40], seed=9), CPU, "float32")
    scales_file = str(write_scales(tmp_path / "kv.json", scales))
    fp8 = ModelRunner(
        make_settings(model_dir, kv_cache_dtype="fp8", quantization_param_path=scales_file), CPU
    )
    assert fp8.kv_cache.k_scales != (1.0,) * 3 and fp8.kv_cache.k[0].dtype == FP8_DTYPE
    matches = total = 0
    for prompt in prompts_for(full.vocab_size, [5, 30, 12], seed=1):
        reference = greedy(full, prompt, 16)
        assert teacher_forced(full, prompt, reference) == reference  # the harness itself is exact
        picks = teacher_forced(fp8, prompt, reference)
        matches += sum(a == b for a, b in zip(picks, reference, strict=True))
        total += len(reference)
    assert matches / total >= TEACHER_FORCED_AGREEMENT


def test_calibration_keeps_every_sequences_maxima(tiny: dict[str, Path]) -> None:
    """The maxima are read from the cache after each prefill: a shorter sequence after a longer one
    overwrites only the first slots, and what was there has been counted."""
    model = load_model(tiny["llama"], CPU, "float32", max_positions=64)
    long_seq, short_seq = prompts_for(model.dims.vocab_size, [40, 7], seed=3)
    k_both, v_both = kv_amax(model, [long_seq, short_seq], CPU)
    (k_long, v_long), (k_short, v_short) = (kv_amax(model, [s], CPU) for s in (long_seq, short_seq))
    assert k_both == [max(a, b) for a, b in zip(k_long, k_short, strict=True)]
    assert v_both == [max(a, b) for a, b in zip(v_long, v_short, strict=True)]
    assert min(k_both + v_both) > 0 and k_long != k_short


def test_calibration_cli_writes_a_scales_file_the_runner_reads(tiny: dict[str, Path], tmp_path: Path) -> None:
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "kv.json"
    assert calibrate_main([str(tiny["qwen3"]), str(text), "--out", str(out), "--device", "cpu",
                           "--dtype", "float32", "--seq-len", "64"]) == 0  # fmt: skip
    k_scales, v_scales = load_kv_scales(out, 3)
    assert all(0 < s < 1 for s in k_scales + v_scales)  # amax / 448 of O(1..100) activations
    runner = ModelRunner(
        make_settings(tiny["qwen3"], kv_cache_dtype="fp8", quantization_param_path=str(out)), CPU
    )
    assert runner.kv_cache.k_scales == k_scales and runner.kv_cache.v_scales == v_scales


def test_backends_without_fp8_kv_fall_back_to_torch() -> None:
    class Fast:
        supports_fp8_kv = False

    class Ready:
        supports_fp8_kv = True

    assert fp8_kv_backend("flashinfer", Fast) == "torch"
    assert fp8_kv_backend("triton", Ready) == "triton"
    assert fp8_kv_backend("torch", TorchAttentionBackend) == "torch"


SMOLLM_DIR = os.environ.get("TOKENSPEED_DEFAULT_MODEL_DIR")


@pytest.mark.slow  # SmolLM2-135M
@pytest.mark.skipif(
    not SMOLLM_DIR or not Path(SMOLLM_DIR).is_dir(),
    reason="TOKENSPEED_DEFAULT_MODEL_DIR is not a prepared model",
)
def test_default_model_answers_the_same_with_a_calibrated_fp8_cache(tmp_path: Path) -> None:
    """SmolLM2's first layer writes V values of ~0.02: with scale 1.0 most are e4m3 subnormals and the
    answer changes; calibrated scales keep the full-precision answer."""
    from transformers import AutoTokenizer

    model_dir = Path(SMOLLM_DIR or "")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    calibration = tokenizer("The capital of Italy is Rome. def f(x): return x * 2. " * 8)["input_ids"]
    scales = write_scales(tmp_path / "kv.json", calibrate_kv_scales(model_dir, [calibration], CPU, "float32"))
    settings = {"block_size": 16, "chunked_prefill_size": 64, "max_model_len": 256}
    full = greedy(ModelRunner(make_settings(model_dir, **settings), CPU), prompt, 8)
    fp8 = ModelRunner(
        make_settings(model_dir, kv_cache_dtype="fp8", quantization_param_path=str(scales), **settings), CPU
    )
    assert "Paris" in tokenizer.decode(full)
    assert greedy(fp8, prompt, 8) == full
