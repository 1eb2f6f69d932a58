"""ModelRunner on CUDA (skipped without it): greedy parity, bf16 defaults, KV pool sizing at 8B scale."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from app.config import Settings
from app.protocol import NewSeq, SamplingParams, SeqChunk, StepPlan
from app.worker.model_runner import ModelRunner
from tests.support.model_factory import build_tiny_model
from tests.support.settings import GPU_RUNNER, make_settings
from tests.unit.test_model_runner import Request, ScriptedScheduler, hf_greedy, hf_model, prompts_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda", 0)

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
}


def settings(model_dir: Path, **overrides: Any) -> Settings:
    """The GPU runner tests' settings (tests/support/settings.py)."""
    return make_settings(model_dir, GPU_RUNNER, **overrides)


# The MoE families run kernels/moe.py here (float32: IEEE dots).
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "mixtral"])
def test_cuda_float32_greedy_matches_transformers(arch: str, tmp_path: Path) -> None:
    model_dir = build_tiny_model(arch, tmp_path, seed=2)
    runner = ModelRunner(settings(model_dir, dtype="float32", block_size=4), CUDA)
    runner.warmup()
    prompts = prompts_for(runner.vocab_size, [5, 41, 12])
    sched = ScriptedScheduler(runner)
    for i, prompt in enumerate(prompts):
        sched.add(Request(f"r{i}", prompt, max_new=32, join_step=3 * i))
    outputs = sched.run()
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(model_dir, prompt, 32, device="cuda"), f"r{i}"


def test_cuda_auto_dtype_is_bfloat16_and_close_to_transformers(tmp_path: Path) -> None:
    model_dir = build_tiny_model("qwen2", tmp_path, seed=3)
    runner = ModelRunner(settings(model_dir), CUDA)
    assert runner.ready_message().info["dtype"] == "bfloat16"
    prompt = prompts_for(runner.vocab_size, [20])[0]
    plan = StepPlan(
        step=0,
        new_seqs=[NewSeq(0, "a", SamplingParams(temperature=0.0), 20, [0, 1])],
        chunks=[SeqChunk(0, prompt)],
    )
    first = runner.execute(plan).token_ids[0]
    reference = hf_model(model_dir, "cuda", torch.bfloat16)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
    # bf16 kernels differ in summation order: the chosen token must be (near) the reference's best.
    assert logits.max() - logits[first] <= 0.05 * logits.abs().max()


def test_llama_8b_dummy_pool_sizing(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    util = 0.6
    runner = ModelRunner(
        settings(
            tmp_path,
            load_format="dummy",
            max_model_len=8192,
            max_total_tokens=None,
            gpu_memory_utilization=util,
            max_num_seqs=64,
            chunked_prefill_size=8192,
        ),
        CUDA,
    )
    ready = runner.ready_message()
    free, total = torch.cuda.mem_get_info(CUDA)
    used = total - free
    print(ready, f"used {used / 2**30:.2f} GiB of {total / 2**30:.2f}")
    assert ready.info["dtype"] == "bfloat16" and 15.5 < ready.info["weights_gb"] < 16.5
    assert ready.eos_token_ids == [128001, 128008, 128009]
    assert ready.info["kv_pool_tokens"] > 100_000
    assert used <= total * util + (1 << 30)  # within budget (allowing the context outside torch)
    runner.warmup()
    plan = StepPlan(
        step=0,
        new_seqs=[
            NewSeq(
                s, f"r{s}", SamplingParams(temperature=0.7, top_p=0.9), 300, list(range(s * 20, s * 20 + 20))
            )
            for s in range(4)
        ],
        chunks=[SeqChunk(s, list(range(1, 301))) for s in range(4)],
    )
    result = runner.execute(plan)
    assert result.slots == [0, 1, 2, 3] and all(0 <= t < 128256 for t in result.token_ids)
    result = runner.execute(StepPlan(step=1, chunks=[SeqChunk(s) for s in range(4)]))
    assert len(result.token_ids) == 4 and not result.bad_slots
