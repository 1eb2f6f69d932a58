"""The model drafts on the GPU (skipped without CUDA): the chain's captured graphs (a draft model, an
EAGLE-3 head; float32, triton backend) draft exactly what its eager steps draft, features included; and
the whole engine, every graph on, gives the plain engine's greedy output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


@pytest.fixture(scope="module")
def cuda_runners(dirs: tuple[Path, Path]) -> dict[str, Any]:
    from app.worker.model_runner import ModelRunner
    from tests.unit.test_model_runner import make_settings

    target, head = dirs
    common = {"max_num_seqs": 4, "chunked_prefill_size": 32, "max_model_len": 160, "seed": 0,
              "attention_backend": "triton"}
    spec = {"speculative_num_steps": 3}
    return {
        "plain": ModelRunner(make_settings(target, **common), CUDA),
        "draft": ModelRunner(make_settings(target, **common, **spec, speculative_algorithm="STANDALONE",
                                           speculative_draft_model_path=str(target)), CUDA),
        "eagle3": ModelRunner(make_settings(target, **common, **spec, speculative_algorithm="EAGLE3",
                                            speculative_draft_model_path=str(head)), CUDA),
        "ngram": ModelRunner(make_settings(target, **common, **spec, speculative_algorithm="NGRAM"), CUDA),
    }


@pytest.mark.parametrize("method", ["draft", "eagle3", "ngram"])
def test_speculation_is_greedy_on_the_gpu(cuda_runners: dict[str, Any], method: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode graphs (verify rows beside decodes, one graph row per fed token), piecewise graphs (steps
    with a prefill, with the hidden-state capture for EAGLE-3) and a model draft's own chain graphs:
    greedy output equals the plain engine's; a model drafting for itself is accepted (almost) always."""
    from tests.unit.test_speculative_engine import Engine, prompts

    runner = cuda_runners[method]
    assert runner.graphs is not None and runner.pieces is not None
    assert method == "ngram" or runner.drafter.graphs is not None
    replays = {"verify": 0}
    run = runner.graphs.run

    def counting_run(*args: Any) -> torch.Tensor:
        replays["verify"] += len(args) > 4 and args[4] is not None  # tokens given: a step with verify rows
        return run(*args)

    monkeypatch.setattr(runner.graphs, "run", counting_run)
    outs = {}
    for name in ("plain", method):
        engine = Engine(cuda_runners[name], name != "plain")
        for rid, prompt in prompts(runner.vocab_size).items():
            engine.add(rid, prompt, max_new_tokens=30, ignore_eos=True)
        engine.run()
        outs[name] = engine.outputs
    assert outs[method] == outs["plain"]
    counters = engine.scheduler.take_counters()
    assert counters.spec_draft_tokens > 0
    assert replays["verify"] > 0
    if method == "draft":
        assert counters.spec_accepted_tokens / counters.spec_draft_tokens > 0.9
