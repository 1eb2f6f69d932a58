"""Speculative decoding (NGRAM) in the whole appliance on SmolLM2: greedy output equals transformers'
token for token on prompts whose answers repeat them (drafts are accepted: /metrics and the stats line
say so), and the KV pool returns to zero after aborted streams. One appliance for the module."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_golden_parity import hf_greedy, served_greedy
from tests.support.appliance import Appliance

NEW_TOKENS = 40
CODE = '''def total(items):
    result = 0
    for item in items:
        result = result + item.price * item.count
    return result
'''


@pytest.fixture(scope="module")
def app(smollm2_dir, log_dir):
    flags = ("--config", "configs/recipes/smollm2-135m-instruct.yaml", "--dtype", "float32",
             "--speculative-algorithm", "NGRAM", "--speculative-num-steps", "4", "--enable-metrics",
             "--enable-log-request-stats", "--max-num-seqs", "4")
    with Appliance(smollm2_dir, *flags, log_dir=log_dir) as appliance:
        yield appliance


def chat_prompt(smollm2_dir, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok(rendered, add_special_tokens=False)["input_ids"]


def spec_counters(app: Appliance) -> dict[str, float]:
    text = httpx.get(f"{app.base_url}/metrics", timeout=10).text
    return {s.name.removeprefix("tokenspeed:"): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if "spec_decode" in s.name and "per_pos" not in s.name}


def test_greedy_equals_transformers_and_drafts_are_accepted(app: Appliance, smollm2_dir) -> None:
    prompts = [
        chat_prompt(smollm2_dir, f"Rename the variable result to acc in this code and return the code:\n{CODE}"),
        chat_prompt(smollm2_dir, "What is the capital of France?"),
    ]
    expected = hf_greedy(smollm2_dir, prompts, NEW_TOKENS)
    assert served_greedy(app, prompts, NEW_TOKENS) == expected
    counters = spec_counters(app)
    assert counters["spec_decode_num_accepted_tokens_total"] > 0, counters
    assert counters["spec_decode_num_draft_tokens_total"] >= counters["spec_decode_num_accepted_tokens_total"]
    assert "speculative decoding (NGRAM, 4 draft tokens): one step in flight" in app.logs()
    stats = re.findall(r"acc_len=([\d.]+), acc_rate=([\d.]+)", app.logs())
    assert len(stats) >= 2 and max(float(acc_len) for acc_len, _ in stats) > 1.0


def test_pool_returns_to_zero_after_aborted_streams(app: Appliance, smollm2_dir) -> None:
    prompt = chat_prompt(smollm2_dir, f"Return this code unchanged:\n{CODE}")

    def aborted(_: int) -> int:
        body = {"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 200, "temperature": 0}}
        chunks = 0
        with httpx.stream("POST", f"{app.base_url}/generate", json=body, timeout=60) as r:
            for _ in r.iter_lines():
                chunks += 1
                if chunks == 6:
                    break  # the client goes away mid-answer
        return chunks

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(aborted, range(2))) == [6, 6]
    time.sleep(0.2)
    loads = app.wait_idle(timeout=30)
    assert loads["num_used_blocks"] == 0
