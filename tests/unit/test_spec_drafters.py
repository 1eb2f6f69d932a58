"""The model drafts (a draft model, an EAGLE-3 head) in a minimal greedy verify loop written here: the
target verifies [last token, drafts] in one extend over its paged cache, keeps the longest matching
prefix plus its own next token, and tells the proposer. The output must equal plain greedy decoding
token for token; a model drafting for itself must be accepted (almost) always."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.config import Settings
from app.worker.attention import build_attention_batch, make_attention_backend
from app.worker.kv_cache import KVCache
from app.worker.loader import load_hf_config, load_weights
from app.worker.models import model_class_for
from app.worker.models.dense import DenseCausalLM, HiddenCapture
from app.worker.spec.draft_model import DraftModelProposer
from app.worker.spec.drafter import ChainDrafter, Feed, _split_feed
from app.worker.spec.eagle3 import Eagle3Proposer
from app.worker.spec.proposer import TargetStep
from tests.support.eagle3_factory import build_eagle3_head
from tests.support.model_factory import build_tiny_model
from tests.support.settings import make_settings

BLOCK, MAX_LEN, SLOTS = 4, 128, 2
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("spec") / "target", seed=7, num_hidden_layers=4)


def load_target(model_dir: Path) -> DenseCausalLM:
    config = load_hf_config(model_dir)
    model = model_class_for(config)(config, torch.float32, MAX_LEN)
    load_weights(model, model_dir, "auto")
    return model.eval()


def settings(path: Path, **kw: object) -> Settings:
    return make_settings(path, speculative_algorithm="STANDALONE", speculative_draft_model_path=str(path), **kw)


class Target:
    """The target's side of the loop: its paged cache (slot s owns blocks s * W .. s * W + W - 1, W the
    blocks of MAX_LEN), greedy verification, and the TargetStep the proposer observes."""

    def __init__(self, model: DenseCausalLM, capture: tuple[int, ...]) -> None:
        self.model, self.capture = model, capture
        width = MAX_LEN // BLOCK
        self.cache = KVCache(model.kv_cache_spec(torch.float32), SLOTS * width + 1, BLOCK, CPU)
        self.backend = make_attention_backend(None, self.cache, model.attention_spec)
        self.block_tables = torch.arange(SLOTS * width, dtype=torch.int32).view(SLOTS, width)

    def forward(self, slots: list[int], fed: list[list[int]], starts: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All fed positions' argmax [T] and (if capturing) their captured states [T, 3h]."""
        qlens = [len(f) for f in fed]
        seq_lens = [s + n for s, n in zip(starts, qlens, strict=True)]
        batch = build_attention_batch(self.block_tables[slots], qlens, seq_lens, BLOCK)
        capture = HiddenCapture(self.capture) if self.capture else None
        ids = torch.tensor([t for f in fed for t in f])
        with torch.no_grad():
            hidden = self.model(ids, batch.positions, self.backend.plan(batch), capture)
            argmax = self.model.compute_logits(hidden).argmax(-1)
        return argmax, capture.concatenated() if capture else None


def greedy(model: DenseCausalLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Plain greedy decoding, one token a step (the output speculation must reproduce)."""
    target = Target(model, ())
    out = [[] for _ in prompts]
    fed, starts = [list(p) for p in prompts], [0] * len(prompts)
    for _ in range(n):
        argmax, _ = target.forward(list(range(len(prompts))), fed, starts)
        ends = torch.tensor([len(f) for f in fed]).cumsum(0) - 1
        for i, token in enumerate(argmax[ends].tolist()):
            out[i].append(token)
            starts[i] += len(fed[i])
            fed[i] = [token]
    return out


def speculate(model: DenseCausalLM, proposer: ChainDrafter, prompts: list[list[int]], n: int, k: int
              ) -> tuple[list[list[int]], float]:
    """The greedy verify loop; -> (the first n output tokens of each prompt, accepted / drafted)."""
    target = Target(model, proposer.capture_layers)
    slots = list(range(len(prompts)))
    proposer.attach(target.cache.num_blocks, BLOCK, target.block_tables, [MAX_LEN // BLOCK] * SLOTS,
                    torch.float32, "torch")
    for slot, prompt in zip(slots, prompts, strict=True):
        proposer.register(slot, list(prompt))
    # the prefill, in two chunks: the proposer catches up over both
    out: list[list[int]] = [[] for _ in prompts]
    cut = [len(p) // 2 for p in prompts]
    for chunk in range(2):
        fed = [p[:c] if chunk == 0 else p[c:] for p, c in zip(prompts, cut, strict=True)]
        starts = [0 if chunk == 0 else c for c in cut]
        argmax, aux = target.forward(slots, fed, starts)
        ends = torch.tensor([len(f) for f in fed]).cumsum(0) - 1
        new = [[t] for t in argmax[ends].tolist()] if chunk == 1 else [[] for _ in slots]
        for i, tokens in enumerate(new):
            out[i] += tokens
        proposer.observe(TargetStep(slots, fed, starts, [len(f) for f in fed], new, None, aux))
    drafted = accepted = 0
    lengths = [len(p) + 1 for p in prompts]
    while min(len(o) for o in out) < n:
        draft = proposer.propose(slots, k)
        ids = draft.token_ids.tolist()
        fed = [[o[-1], *d] for o, d in zip(out, ids, strict=True)]
        starts = [n_ - 1 for n_ in lengths]
        argmax, aux = target.forward(slots, fed, starts)
        rows = argmax.view(len(slots), k + 1).tolist()
        new, kept = [], []
        for i, (d, row) in enumerate(zip(ids, rows, strict=True)):
            a = 0
            while a < draft.length(i) and d[a] == row[a]:
                a += 1
            drafted += draft.length(i)
            accepted += a
            new.append([*d[:a], row[a]])
            kept.append(1 + a)
            out[i] += new[-1]
            lengths[i] += len(new[-1])
        proposer.observe(TargetStep(slots, fed, starts, kept, new, None, aux))
    return [o[:n] for o in out], accepted / max(drafted, 1)


PROMPTS = [[5, 60, 17, 3, 88, 41, 9, 60, 22, 13, 71, 2], [30, 8, 99, 45, 12, 64, 7]]


def test_draft_model_drafting_for_itself_matches_greedy(target_dir: Path) -> None:
    model = load_target(target_dir)
    want = greedy(model, PROMPTS, 24)
    # max_tokens 5: the prefill catch-up is cut into several forwards
    proposer = DraftModelProposer.load(settings(target_dir), load_hf_config(target_dir), CPU, torch.float32,
                                       MAX_LEN, SLOTS, 5)
    got, rate = speculate(model, proposer, PROMPTS, 24, k=3)
    assert got == want
    assert rate > 0.9, f"a model drafting for itself should be accepted (almost) always, got {rate:.2f}"
    assert len(set(want[0])) > 3  # the output is not one repeated token: drafts were tested


def test_eagle3_head_output_matches_greedy(target_dir: Path, tmp_path: Path) -> None:
    model = load_target(target_dir)
    want = greedy(model, PROMPTS, 20)
    head_dir = build_eagle3_head(target_dir, tmp_path / "head", draft_vocab=60, seed=2)
    proposer = Eagle3Proposer.load(settings(head_dir), model, CPU, torch.float32, MAX_LEN, SLOTS, 64)
    assert proposer.capture_layers == (2, 2, 1)  # (2, L // 2, L - 3) for the 4-layer target
    got, rate = speculate(model, proposer, PROMPTS, 20, k=3)
    assert got == want  # a random head is rarely right: exactness is what is tested
    assert 0 <= rate < 1


def test_draft_model_refusals(target_dir: Path, tmp_path: Path) -> None:
    config = load_hf_config(target_dir)
    other = build_tiny_model("llama", tmp_path / "other", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary"):
        DraftModelProposer.load(settings(other), config, CPU, torch.float32, MAX_LEN, SLOTS, 64)


def test_split_feed_cuts_long_rows_in_order() -> None:
    feed = Feed()
    feed.add(0, 0, list(range(12)), True)
    feed.add(1, 3, [7, 8], True)
    parts = _split_feed(feed, 5)
    assert [(p.slots, p.starts, [len(t) for t in p.tokens], p.sample) for p in parts] == [
        ([0], [0], [5], [False]), ([0], [5], [5], [False]), ([0, 1], [10, 3], [2, 2], [True, True])]


def test_fp8_draft_model_is_exact(target_dir: Path) -> None:
    """--speculative-draft-model-quantization fp8: the draft's linears quantized at load; still exact."""
    model = load_target(target_dir)
    want = greedy(model, PROMPTS, 16)
    proposer = DraftModelProposer.load(settings(target_dir, speculative_draft_model_quantization="fp8"),
                                       load_hf_config(target_dir), CPU, torch.float32, MAX_LEN, SLOTS, 64)
    assert type(proposer.model.model.layers[0].mlp.down_proj.quant).__name__ == "Fp8LinearMethod"
    got, rate = speculate(model, proposer, PROMPTS, 16, k=3)
    assert got == want
    assert rate > 0.1  # an FP8 copy of the target still agrees with it at times (0.3 on this random model)


def test_drafter_attention_backend(target_dir: Path) -> None:
    """--drafter-attention-backend is resolved for the draft (refused naming the flag where unusable);
    unset, the target's backend, but not flashinfer for a draft of another head size."""
    from app.worker.spec.model_drafts import drafter_backend

    proposer = DraftModelProposer.load(settings(target_dir), load_hf_config(target_dir), CPU, torch.float32,
                                       MAX_LEN, SLOTS, 64)
    head_dim = proposer.attention_spec.head_dim
    choose = settings(Path("draft"), drafter_attention_backend="torch")
    assert drafter_backend(choose, "triton", head_dim, proposer, CPU, torch.float32) == "torch"
    with pytest.raises(ValueError, match="--drafter-attention-backend: attention backend 'flashinfer'"):
        drafter_backend(settings(Path("draft"), drafter_attention_backend="flashinfer"), "torch", head_dim, proposer, CPU,
                        torch.float32)
    unset = settings(Path("draft"))
    assert drafter_backend(unset, "flashinfer", head_dim, proposer, CPU, torch.float32) == "flashinfer"
    assert drafter_backend(unset, "flashinfer", 2 * head_dim, proposer, CPU, torch.float32) == "triton"
