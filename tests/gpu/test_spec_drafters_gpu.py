"""The model drafts on the GPU (skipped without CUDA): the chain's captured graphs (a draft model, an
EAGLE-3 head; float32, triton backend) draft exactly what its eager steps draft, features included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.worker.loader import load_hf_config
from app.worker.spec.draft_model import DraftModelProposer
from app.worker.spec.eagle3 import Eagle3Proposer
from tests.support.eagle3_factory import build_eagle3_head
from tests.support.model_factory import build_tiny_model
from tests.unit import test_spec_drafters as cpu

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("spec_gpu")
    target = build_tiny_model("llama", root / "target", seed=7, num_hidden_layers=4)
    return target, build_eagle3_head(target, root / "head", draft_vocab=60, seed=2)


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_graphed_chain_equals_eager(dirs: tuple[Path, Path], method: str) -> None:
    target_dir, head_dir = dirs
    model = cpu.load_target(target_dir).to(CUDA)
    if method == "draft_model":
        proposer = DraftModelProposer.load(cpu.settings(target_dir), load_hf_config(target_dir), CUDA, torch.float32,
                                           cpu.MAX_LEN, cpu.SLOTS, 64)
    else:
        proposer = Eagle3Proposer.load(cpu.settings(head_dir), model, CUDA, torch.float32, cpu.MAX_LEN, cpu.SLOTS, 64)
    width = cpu.MAX_LEN // cpu.BLOCK
    tables = torch.arange(cpu.SLOTS * width, dtype=torch.int32, device=CUDA).view(cpu.SLOTS, width)
    proposer.attach(cpu.SLOTS * width + 1, cpu.BLOCK, tables, [width] * cpu.SLOTS, torch.float32, "triton")
    ids = torch.tensor([3, 9], device=CUDA)
    feature = torch.randn(2, proposer.feature.shape[1], device=CUDA)
    with torch.no_grad():
        eager = [proposer._step([0, 1], [20, 33], j, ids, feature) for j in (1, 2)]
        proposer.capture_graphs([1, 2, 4])
        graphed = [proposer._step([0, 1], [20, 33], j, ids, feature) for j in (1, 2)]
    for (e_ids, e_feat), (g_ids, g_feat) in zip(eager, graphed, strict=True):
        assert e_ids.tolist() == g_ids.tolist()
        torch.testing.assert_close(e_feat, g_feat, rtol=1e-4, atol=1e-4)
