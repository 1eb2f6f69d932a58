#!/usr/bin/env python3
"""transformers' generate on the same model shape and dtype (random weights), batch B, greedy with
every token generated (no EOS stop): the reference figure for the latency benchmark."""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(args.model)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.input_len), device="cuda")
    gen = GenerationConfig(do_sample=False, max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                           pad_token_id=0, eos_token_id=None)  # fmt: skip
    with torch.no_grad():
        model.generate(
            ids, generation_config=GenerationConfig(do_sample=False, max_new_tokens=4, pad_token_id=0)
        )
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, generation_config=gen)
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    new = (out.shape[1] - args.input_len) * args.batch_size
    result = {"reference": "transformers generate", "batch_size": args.batch_size, "input_len": args.input_len,
              "output_len": args.output_len, "elapsed_s": elapsed, "tokens_per_s": new / elapsed}  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
