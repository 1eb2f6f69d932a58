"""Tensor parallelism through the whole appliance on CPU (gloo): greedy output equals transformers' (and so
the one-worker run's), on one node and on two "nodes" that rendezvous over loopback."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.test_golden_parity import NEW_TOKENS, hf_greedy, prompts_for, served_greedy
from tests.support.appliance import Appliance, free_port
from tests.support.model_factory import build_tiny_model

FLAGS = ("--block-size", "4", "--chunked-prefill-size", "24", "--max-total-tokens", "2048")


# TP alone (qwen3, 2), four ranks (qwen2, 4), TP under DP (llama, 2 x 2); tests/unit/test_tensor_parallel.py
# covers each family at TP 2 in one process.
@pytest.mark.parametrize(("arch", "tp", "dp"), [("qwen3", 2, 1), ("qwen2", 4, 1), ("llama", 2, 2)])
def test_tp_greedy_matches_transformers(arch: str, tp: int, dp: int, tiny_model_dirs, log_dir) -> None:
    model_dir = tiny_model_dirs[arch]
    prompts = prompts_for(400)
    expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
    with Appliance(model_dir, "--tp", str(tp), "--data-parallel-size", str(dp), *FLAGS, log_dir=log_dir) as app:
        got = served_greedy(app, prompts, NEW_TOKENS)
        logs = app.logs()
    assert got == expected
    assert logs.count(f"tensor parallel rank {tp - 1} of {tp} joined") == dp


def test_tp3_matches_transformers(tmp_path, log_dir) -> None:
    """6 query and 3 KV heads, 96 MLP rows (as SmolLM2's 9 and 3 heads): TP 3, a size that is no power of two."""
    model_dir = build_tiny_model("llama", tmp_path / "tp3", seed=2, hidden_size=96, num_attention_heads=6,
                                 num_key_value_heads=3, intermediate_size=96)
    prompts = prompts_for(400)[:2]
    expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
    with Appliance(model_dir, "--tp", "3", *FLAGS, log_dir=log_dir) as app:
        assert served_greedy(app, prompts, NEW_TOKENS) == expected


def test_a_tp_size_that_does_not_divide_the_heads_stops_start_up(smollm2_dir, log_dir) -> None:
    app = Appliance(smollm2_dir, "--tp", "2", "--max-total-tokens", "2048", "--max-model-len", "512", log_dir=log_dir)
    with pytest.raises(RuntimeError, match="exited with 1"):
        app.wait_ready()
    assert "--tensor-parallel-size 2 must divide the 9 attention heads" in app.logs()
    app.stop()


def test_two_nodes_on_loopback(tiny_model_dirs, log_dir) -> None:
    """Node 0 serves the API and TP rank 0; node 1 runs rank 1 and a health endpoint only. Stopping node 0
    brings node 1 down (its group is gone)."""
    model_dir = tiny_model_dirs["llama"]
    multi = ("--tp", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}", *FLAGS)
    prompts = prompts_for(400)[:2]
    expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
    node1 = Appliance(model_dir, *multi, "--node-rank", "1", log_dir=log_dir)
    try:
        with Appliance(model_dir, *multi, "--node-rank", "0", log_dir=log_dir) as node0:
            node1.wait_ready()
            health = httpx.get(f"{node1.base_url}/readiness", timeout=5).json()
            assert health["status"] == "ready" and health["node_rank"] == 1
            assert httpx.get(f"{node1.base_url}/v1/models", timeout=5).status_code == 404
            assert served_greedy(node0, prompts, NEW_TOKENS) == expected
        assert node1.proc.wait(60) != 0
        assert "worker1" in node1.logs() and not node1.leftover_processes()
    finally:
        node1.kill()


def test_tp_weight_updates_reach_every_rank(tmp_path, log_dir) -> None:
    """A reload from disk and a tensor update under TP=2: every rank takes its slices, the leader answers."""
    import base64

    from safetensors.torch import load_file, save

    from tests.integration.test_weight_updates import hf_greedy as hf_prompt_greedy
    from tests.integration.test_weight_updates import post, served
    from tests.support.model_factory import build_tiny_model

    base = build_tiny_model("llama", tmp_path / "base", seed=1)
    second = build_tiny_model("llama", tmp_path / "second", seed=2)
    with Appliance(base, "--tp", "2", *FLAGS, "--weight-update-roots", str(tmp_path), log_dir=log_dir) as app:
        r = post(app, "/update_weights_from_disk", {"model_path": str(second), "weight_version": "disk"})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert served(app) == (hf_prompt_greedy(second), "disk")
        payload = base64.b64encode(save(load_file(str(base / "model.safetensors")))).decode()
        r = post(app, "/update_weights_from_tensor", {"serialized_named_tensors": [payload], "weight_version": "t"})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert served(app) == (hf_prompt_greedy(base), "t")
