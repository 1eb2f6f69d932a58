"""Tensor parallelism on CPU (gloo), real processes: each rank's weight shards against slices of the full
checkpoint tensors (computed here independently of the layers' own bookkeeping), and greedy outputs of a
TP group, driven through the leader's relay (the worker's real follow loop on the other ranks), against
the single-process run."""

from __future__ import annotations

import math
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from app.worker.model_runner import ModelRunner
from tests.support.model_factory import build_tiny_model, write_fp8_checkpoint
from tests.support.ranks import run_ranks
from tests.unit.test_model_runner import CPU, Request, ScriptedScheduler, make_settings, prompts_for

JOIN_TIMEOUT_S = 120

pytestmark = pytest.mark.slow  # spawns a process per TP rank and loads each model twice


def expected_shards(full: dict[str, torch.Tensor], config: dict[str, Any], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Parameter name -> what rank `rank` must hold, from the checkpoint's full tensors."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    inter, vocab = config["intermediate_size"], config["vocab_size"]

    def rows(t: torch.Tensor, first: int, n: int) -> torch.Tensor:
        return t[first : first + n]

    q_heads = heads // size
    kv_first, kv_n = (rank * kv_heads // size, kv_heads // size) if kv_heads >= size else (rank * kv_heads // size, 1)
    vocab_rows = math.ceil(vocab / size)
    want: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        if ".q_proj." in name:
            target = name.replace(".q_proj.", ".qkv_proj.")
            k, v = full[name.replace(".q_proj.", ".k_proj.")], full[name.replace(".q_proj.", ".v_proj.")]
            want[target] = torch.cat([rows(t, rank * q_heads * head_dim, q_heads * head_dim),
                                      rows(k, kv_first * head_dim, kv_n * head_dim),
                                      rows(v, kv_first * head_dim, kv_n * head_dim)])
        elif ".gate_proj." in name:
            up = full[name.replace(".gate_proj.", ".up_proj.")]
            n = inter // size
            want[name.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat([rows(t, rank * n, n), rows(up, rank * n, n)])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            n = t.shape[1] // size
            want[name] = t[:, rank * n : (rank + 1) * n]
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            held = t[rank * vocab_rows : (rank + 1) * vocab_rows]
            want[name] = torch.cat([held, held.new_zeros(vocab_rows - len(held), t.shape[1])])
        elif not any(part in name for part in (".k_proj.", ".v_proj.", ".up_proj.")):
            want[name] = t  # norms and row-parallel biases: whole on every rank
    return want


def _rank_main(rank: int, init: str, size: int, model_dir: str, prompts: list[list[int]], check_shards: bool,
               queue: Any) -> None:
    try:
        torch.set_num_threads(1)
        from app.worker.parallel import TensorParallel
        from app.worker.process import follow_steps
        from app.worker.tp_group import LeaderRunner

        tp = TensorParallel.join(rank, size, CPU, init, custom_all_reduce=True)
        runner = ModelRunner(make_settings(Path(model_dir)), CPU, tp)
        runner.warmup()
        import json

        wrong = [] if tp.failed_ranks(rank != size - 1) == [size - 1] else ["failed_ranks"]
        if check_shards:
            config = json.loads(Path(model_dir, "config.json").read_text())
            want = expected_shards(load_file(str(Path(model_dir, "model.safetensors"))), config, rank, size)
            params = dict(runner.model.named_parameters())
            wrong = sorted(n for n, t in want.items() if not same(params[n].detach(), t))
        if not tp.leader:
            follow_steps(runner, tp)
            queue.put((rank, wrong, None))
            return
        leader = LeaderRunner(runner, tp, followers=[])  # relays each plan, as the worker loop does
        sched = ScriptedScheduler(leader)
        for i, prompt in enumerate(prompts):
            sched.add(Request(f"r{i}", prompt, max_new=10, join_step=2 * i))
        outputs = sched.run()
        leader.close()
        queue.put((rank, wrong, outputs))
    except Exception:
        queue.put((rank, ["error"], traceback.format_exc()))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (FP8 codes compare as bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)


def run_group(model_dir: Path, size: int, prompts: list[list[int]],
              check_shards: bool = True) -> dict[int, tuple[list[str], Any]]:
    return run_ranks(_rank_main, size, size, str(model_dir), prompts, check_shards, timeout_s=JOIN_TIMEOUT_S)


@pytest.mark.parametrize(("arch", "size"), [("llama", 2), ("qwen2", 2), ("qwen3", 2)])  # 4 ranks: the integration test
def test_tp_shards_and_greedy_outputs_match_one_process(arch: str, size: int, tmp_path: Path) -> None:
    model_dir = build_tiny_model(arch, tmp_path / arch, seed=3)
    single = ModelRunner(make_settings(model_dir), CPU)
    single.warmup()
    prompts = prompts_for(single.vocab_size, [5, 23, 12, 9], seed=4)  # 23 tokens: two prefill chunks
    sched = ScriptedScheduler(single)
    for i, prompt in enumerate(prompts):
        sched.add(Request(f"r{i}", prompt, max_new=10, join_step=2 * i))
    expected = sched.run()

    results = run_group(model_dir, size, prompts)
    for rank, (wrong, outputs) in results.items():
        assert wrong == [], f"rank {rank}: {wrong} {outputs if wrong == ['error'] else ''}"
    assert results[0][1] == expected


def test_tp_with_an_fp8_checkpoint_holds_its_slices(tmp_path: Path) -> None:
    """Per-channel FP8: each rank holds its slices of the codes and, column-parallel, of the scales (row-
    parallel scales are per output channel: whole). Outputs are not compared token for token: dynamic
    activation scales are per rank's slice of the input, a different (valid) quantization than TP=1's."""
    model_dir = write_fp8_checkpoint(build_tiny_model("llama", tmp_path / "float", seed=3, initializer_range=0.1),
                                     tmp_path / "fp8", "fp8-channel")
    prompts = prompts_for(400, [9, 23], seed=5)
    results = run_group(model_dir, 2, prompts)
    for rank, (wrong, outputs) in results.items():
        assert wrong == [], f"rank {rank}: {wrong} {outputs if wrong == ['error'] else ''}"
    assert [len(tokens) for tokens in results[0][1].values()] == [10, 10]


def test_block_scaled_fp8_checkpoints_are_refused_under_tp(tmp_path: Path) -> None:
    model_dir = write_fp8_checkpoint(build_tiny_model("llama", tmp_path / "float", seed=3), tmp_path / "fp8",
                                     "fp8-block")
    results = run_group(model_dir, 2, [], check_shards=False)
    assert "block-scaled FP8 checkpoints with --tensor-parallel-size > 1" in results[0][1]


def test_tp_sizes_that_do_not_divide_the_model_are_refused(tmp_path: Path) -> None:
    from app.worker.models.dense import DenseDims

    dims = DenseDims(hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=96, num_layers=1,
                     vocab_size=100, eps=1e-6)
    dims.check_tp(2)
    dims.check_tp(4)  # KV heads replicated
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 must divide the 4 attention heads"):
        dims.check_tp(3)
    with pytest.raises(ValueError, match="intermediate rows"):
        DenseDims(64, 8, 8, 8, 100, 1, 100, 1e-6).check_tp(8)


def test_a_control_reply_fails_when_another_rank_failed() -> None:
    from app import protocol as p
    from app.worker.process import _agreed

    ok = p.ControlReply("r", True, "Loaded 12 tensors.")
    assert _agreed(ok, "update_weights_from_disk", []) is ok
    failed = _agreed(ok, "update_weights_from_disk", [1, 3])
    assert not failed.success and "rank(s) 1, 3" in failed.message and "weights may differ" in failed.message
    refused = p.ControlReply("r", False, "weights not updated: unknown tensor x")
    assert _agreed(refused, "update_weights_from_tensor", [0, 1]) is refused
