"""scripts/gpu/bench_moe.py: the roofline (the bytes one decode token of Qwen3-30B-A3B reads: 8 of its 128
experts a layer, one embedding row, from the model built on the meta device as the runner builds it),
which rows of the kept tuning table a partial tuning run leaves in place, and when a configuration's output
counts as the default one's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scripts.gpu.bench_moe import active_bytes_per_token, kept_rows, outputs_agree

MODEL = str(Path(__file__).resolve().parents[2] / "configs" / "models" / "qwen3-30b-a3b")


def test_active_bytes_of_qwen3_30b_a3b() -> None:
    bf16 = active_bytes_per_token(MODEL, torch.bfloat16, None)
    assert bf16["weight_bytes"] == pytest.approx(2 * 30.53e9, rel=0.01)  # 30.5B parameters
    # ~3.04B parameters a token: attention, routers, 8 experts a layer, norms and the LM head
    assert bf16["active_bytes_per_token"] == pytest.approx(6.08e9, rel=0.01)
    fp8 = active_bytes_per_token(MODEL, torch.bfloat16, "fp8")
    # one byte a decoder weight (plus scales); the LM head and the routers stay bf16
    assert 0.5 < fp8["active_bytes_per_token"] / bf16["active_bytes_per_token"] < 0.6


def test_a_partial_tuning_run_keeps_the_rows_it_does_not_measure(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from tokenspeed_kernels import moe

    rows = [{"model": m, "tokens": t, "weights": w} for m in ("a", "b") for t in (1, 2) for w in ("16", "fp8")]
    table = tmp_path / "moe_configs.json"
    table.write_text(json.dumps({"configs": rows, "choices": rows[:2]}))
    monkeypatch.setattr(moe, "TABLE_PATH", table)
    kept = kept_rows({"a"}, {1}, {"16"})
    assert {"model": "a", "tokens": 1, "weights": "16"} not in kept["configs"]
    assert len(kept["configs"]) == len(rows) - 1
    assert kept["choices"] == [rows[1]]


def test_a_configuration_agrees_with_the_default_up_to_the_order_of_its_sums() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 256, generator=gen)
    assert outputs_agree(rows + 1e-3 * torch.randn(64, 256, generator=gen), rows)
    wrong = rows.clone()
    wrong[5, 7] += 0.5  # one element off: a miscompiled tile
    assert not outputs_agree(wrong, rows)
    assert not outputs_agree(rows[:32], rows)
    # a router's (weights, ids): two experts of near-equal weight may swap places
    weights, ids = torch.tensor([[0.5, 0.25, 0.2500001]]), torch.tensor([[3, 1, 2]])
    assert outputs_agree((weights[:, [0, 2, 1]], ids[:, [0, 2, 1]]), (weights, ids))
    assert not outputs_agree((torch.tensor([[0.5, 0.3, 0.2]]), ids), (weights, ids))
