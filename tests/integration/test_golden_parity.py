"""Greedy output through HTTP equals transformers' generate, token for token."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.appliance import Appliance

NEW_TOKENS = 32


def hf_greedy(model_dir, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(
                torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, attention_mask=torch.ones(1, len(ids))
            )
            outs.append(gen[0, len(ids) :].tolist())
    return outs


def served_greedy(app: Appliance, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    def one(ids: list[int]) -> list[int]:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0}}
        r = httpx.post(f"{app.base_url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:  # a concurrent batch
        return list(pool.map(one, prompts))


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = [3, 11, 17, 40, 29]
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_transformers(arch, tiny_model_dirs, log_dir) -> None:
    model_dir = tiny_model_dirs[arch]
    prompts = prompts_for(400)
    expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
    # A small chunk budget and block size make the batch mix chunked prefills with decodes.
    flags = ("--block-size", "4", "--chunked-prefill-size", "24", "--max-total-tokens", "2048")
    with Appliance(model_dir, *flags, log_dir=log_dir) as app:
        got = served_greedy(app, prompts, NEW_TOKENS)
    assert got == expected


def test_smollm2_matches_transformers(smollm2, smollm2_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    prompts = [tok(t)["input_ids"] for t in texts]
    expected = hf_greedy(smollm2_dir, prompts, NEW_TOKENS)
    got = served_greedy(smollm2, prompts, NEW_TOKENS)
    assert got == expected
