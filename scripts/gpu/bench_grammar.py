#!/usr/bin/env python3
"""Structured output's cost: the decode step with every row constrained by a JSON schema against the same
step unconstrained, and the compile of a typical 20-field schema, first and cached.

In process, like `tokenspeed bench latency` (no scheduler, no HTTP). For each batch size B, B prompts of
--input-len random tokens are prefilled, then --steps decode steps run pipelined as the worker runs them
(launch step N+1, then finish step N: app/worker/process.py), greedy; once with no grammar and once with
every row matching the 20-field schema (app/worker/sampling/grammar.py masks the rows before sampling).
Reported per B: the median ms per step over --trials runs of each mode, the overhead in percent, and
for the constrained mode the worker's host time per step in the grammar code (GrammarRows.host_s:
matcher updates, bitmask fill, copy and mask launch; and wait_s: its wait for step N's tokens).
--grammar-threads sets the bitmask fill's threads (default: app.worker.sampling.grammar.fill_threads).
Compile figures: XGrammar's compile of the schema, its serialization (size and time), the worker's
deserialization, and a cached answer (the tokenizer's cache lookup plus the worker's deserialized LRU):
what a repeated schema costs a request.

The vocabulary: the model dir's tokenizer when it has one; else (configs/models/* hold only a config)
a synthetic byte-level vocabulary of the model's size (256 single bytes, then strings of 2 to 8
characters drawn from letters, digits, spaces and JSON punctuation), which gives XGrammar a mask to
compute of the real width. Dummy weights make greedy pick arbitrary allowed tokens; a row whose grammar
completes ends on EOS and is counted ("completed_rows": the 20 string-valued fields keep rows open).

  python scripts/gpu/bench_grammar.py --model configs/models/llama-3.1-8b --load-format dummy \\
      --dtype bfloat16 --batch-sizes 1,64 --json grammar.json
  (CPU check: --model ~/.cache/tokenspeed/models/smollm2-135m-instruct --batch-sizes 1,4 --steps 8)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from app.bench.latency import add_common_flags, make_runner, prefill, runner_settings, sync  # noqa: E402
from app.grammar.cache import GrammarCache, Outcome  # noqa: E402
from app.grammar.compiler import Compiler, tokenizer_info  # noqa: E402
from app.protocol import GrammarSpec, NewSeq, SamplingParams, SeqChunk, StepPlan  # noqa: E402
from app.worker.sampling.grammar import GrammarRows  # noqa: E402

FIELD_TYPES = [{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
               {"type": "string", "enum": ["low", "medium", "high"]}]


def schema_20() -> dict[str, Any]:
    """A typical API object: 20 required fields of mixed types, strings the most common."""
    props = {f"field_{i:02d}": FIELD_TYPES[0] if i % 2 == 0 else FIELD_TYPES[1 + i // 2 % 4] for i in range(20)}
    return {"type": "object", "properties": props, "required": list(props)}


def synthetic_info(vocab_size: int, eos: list[int]) -> Any:
    import xgrammar as xgr

    rng = random.Random(0)
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \"{}[]:,._-"
    vocab: list[bytes] = [bytes([i]) for i in range(256)]
    while len(vocab) < vocab_size:
        vocab.append("".join(rng.choice(chars) for _ in range(rng.randint(2, 8))).encode())
    for token in eos:
        vocab[token] = f"<eos{token}>".encode()
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=eos)


def vocabulary(runner: Any, model: str) -> tuple[Any, str]:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError):
        return synthetic_info(runner.vocab_size, runner.eos_token_ids), "synthetic"
    return tokenizer_info(tok, runner.vocab_size, runner.eos_token_ids), "model tokenizer"


def compile_figures(info: Any, spec: GrammarSpec) -> tuple[dict[str, float], str]:
    compiler = Compiler(info)
    t0 = time.perf_counter()
    compiled = compiler.compile(spec)
    t1 = time.perf_counter()
    text = compiler.serialize(compiled)
    t2 = time.perf_counter()
    compiler.deserialize(text)
    t3 = time.perf_counter()
    cache = GrammarCache(64, 256 << 20)
    cache.put(("json_schema", spec.value), Outcome(compiled=text))
    rows = GrammarRows(lambda: info, info.vocab_size, torch.device("cpu"), 1)
    rows.add(0, GrammarSpec("json_schema", spec.value, compiled=text), [])  # the worker's first sight
    t4 = time.perf_counter()
    hit = cache.get(("json_schema", spec.value))
    rows.add(0, GrammarSpec("json_schema", spec.value, compiled=hit.compiled), [])  # its LRU answers
    t5 = time.perf_counter()
    return {"compile_first_ms": (t1 - t0) * 1e3, "serialize_ms": (t2 - t1) * 1e3,
            "serialized_bytes": len(text), "deserialize_ms": (t3 - t2) * 1e3,
            "cached_ms": (t5 - t4) * 1e3}, text


def decode_ms(runner: Any, batch: int, args: argparse.Namespace, sampling: SamplingParams,
              gen: torch.Generator) -> tuple[float, int, float, float]:
    """Median ms per pipelined decode step of `batch` sequences, how many rows ended on EOS, and the
    grammar's host and wait ms per step (medians; trial by trial)."""
    trials, completed, host, wait = [], 0, [], []
    eos = set(runner.eos_token_ids)
    for _ in range(args.trials):
        prompts = [torch.randint(0, runner.vocab_size, (args.input_len,), generator=gen).tolist()
                   for _ in range(batch)]
        blocks = -(-(args.input_len + args.steps + 1) // runner.block_size)
        seqs = [NewSeq(slot=i, rid=f"r{i}", sampling=sampling, num_prompt_tokens=args.input_len,
                       block_ids=list(range(i * blocks, (i + 1) * blocks)), prompt_ids=prompts[i])
                for i in range(batch)]
        prefill(runner, seqs, prompts, batch, last=True)
        decode = StepPlan(step=1, chunks=[SeqChunk(slot=i) for i in range(batch)])
        sync(runner.device)
        host_s, wait_s = runner.grammar.host_s, runner.grammar.wait_s
        started = time.perf_counter()
        pending = runner.launch(decode)
        for _ in range(args.steps - 1):
            following = runner.launch(decode)
            completed += sum(t in eos for t in runner.finish(pending).token_ids)
            pending = following
        completed += sum(t in eos for t in runner.finish(pending).token_ids)
        sync(runner.device)
        trials.append((time.perf_counter() - started) * 1e3 / args.steps)
        host.append((runner.grammar.host_s - host_s) * 1e3 / args.steps)
        wait.append((runner.grammar.wait_s - wait_s) * 1e3 / args.steps)
        runner.execute(StepPlan(step=2, free_slots=list(range(batch))))
    return statistics.median(trials), completed, statistics.median(host), statistics.median(wait)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(parser)
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--chunked-prefill-size", type=int, default=8192)
    parser.add_argument("--grammar-threads", type=int, default=None, help="bitmask fill threads")
    args = parser.parse_args(argv)
    if args.tensor_parallel_size != 1:
        parser.error("--tensor-parallel-size: this benchmark runs one rank")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    need = -(-(args.input_len + args.steps + 1) // args.block_size) * args.block_size  # whole blocks
    settings = runner_settings(args, max_num_seqs=max(batches), max_model_len=args.max_model_len or need,
                               chunked_prefill_size=max(args.chunked_prefill_size, args.input_len * max(batches)))
    device = torch.device(args.device)
    runner = make_runner(settings, device)
    info, vocab = vocabulary(runner, args.model)
    runner.grammar = GrammarRows(lambda: info, runner.vocab_size, runner.device, runner.max_num_seqs,
                                 args.grammar_threads)
    spec = GrammarSpec("json_schema", json.dumps(schema_20()), "bench")
    compile_info, compiled = compile_figures(info, spec)
    constrained = SamplingParams(temperature=0.0, grammar=GrammarSpec("json_schema", spec.value, compiled=compiled))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        plain, _, _, _ = decode_ms(runner, batch, args, SamplingParams(temperature=0.0, ignore_eos=True), gen)
        masked, completed, host_ms, wait_ms = decode_ms(runner, batch, args, constrained, gen)
        rows.append({"batch": batch, "unconstrained_ms": plain, "json_schema_ms": masked,
                     "overhead_pct": (masked / plain - 1) * 100, "completed_rows": completed,
                     "grammar_host_ms": host_ms, "grammar_wait_ms": wait_ms})
    result = {"model": args.model, "device": str(runner.device), "dtype": str(runner.dtype), "vocab": vocab,
              "vocab_size": runner.vocab_size, "input_len": args.input_len, "steps": args.steps,
              "trials": args.trials, "grammar_threads": runner.grammar.threads, "cuda_graphs": runner.graphs is not None, "compile": compile_info,
              "decode": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"vocab: {vocab} ({runner.vocab_size}); 20-field schema: compile {compile_info['compile_first_ms']:.1f} ms "
          f"first, {compile_info['cached_ms']:.3f} ms cached; serialized {compile_info['serialized_bytes']} B, "
          f"deserialize {compile_info['deserialize_ms']:.1f} ms")
    print(f"grammar fill threads: {runner.grammar.threads}")
    print(f"{'batch':>5} {'unconstrained ms':>17} {'json_schema ms':>15} {'overhead %':>11} "
          f"{'grammar host ms':>16} {'grammar wait ms':>16}")
    for row in rows:
        print(f"{row['batch']:>5} {row['unconstrained_ms']:>17.3f} {row['json_schema_ms']:>15.3f} "
              f"{row['overhead_pct']:>11.2f} {row['grammar_host_ms']:>16.3f} {row['grammar_wait_ms']:>16.3f}")


if __name__ == "__main__":
    main()
