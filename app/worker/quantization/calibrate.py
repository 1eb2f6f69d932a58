"""Calibrate FP8 KV cache scales: run the model over sample text and write a --quantization-param-path file.

    python -m app.worker.quantization.calibrate MODEL_DIR TEXT_FILE --out kv_scales.json \\
        [--device cpu|cuda] [--dtype auto] [--seq-len 512] [--max-tokens 8192]

Each layer's K (V) scale is the largest |K| (|V|) the text produced, divided by 448: the calibration
text maps onto the whole e4m3 range and nothing it produced is clipped (larger values when serving
saturate at 448 x scale). An FP8 checkpoint runs with its FP8 weights, as it will be served.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from app.worker.attention import TorchAttentionBackend, build_attention_batch
from app.worker.kv_cache import KVCache
from app.worker.loader import load_hf_config, load_weights, resolve_dtype
from app.worker.models import DenseCausalLM, model_class_for
from app.worker.quantization.fp8 import FP8_MAX
from app.worker.quantization.linear import Fp8LinearMethod
from app.worker.quantization.scheme import resolve_quantization

_BLOCK = 16
_MIN_SCALE = 1e-8  # a layer whose K or V stayed zero still gets a usable scale


def kv_amax(
    model: DenseCausalLM, sequences: list[list[int]], device: torch.device
) -> tuple[list[float], list[float]]:
    """Per-layer largest |K| and |V| over the sequences, each run as one prefill through the torch backend.
    The cache is in the model's dtype, so after each prefill it holds exactly the K (rotated) and V the
    layers wrote: their maxima are read there, and the backend runs unchanged."""
    longest = max(len(s) for s in sequences)
    blocks = math.ceil(longest / _BLOCK)
    cache = KVCache(model.kv_cache_spec(model.dtype), blocks, _BLOCK, device)
    backend = TorchAttentionBackend(cache, model.attention_spec)
    table = torch.arange(blocks, dtype=torch.int32, device=device).unsqueeze(0)
    k_amax = [0.0] * cache.spec.num_layers
    v_amax = [0.0] * cache.spec.num_layers
    with torch.no_grad():
        for seq in sequences:
            batch = build_attention_batch(table, [len(seq)], [len(seq)], _BLOCK)
            model(torch.tensor(seq, device=device), batch.positions, backend.plan(batch))
            # A later, shorter sequence overwrites only the first slots: every value is read before that.
            for layer in range(cache.spec.num_layers):
                k_amax[layer] = max(k_amax[layer], float(cache.k[layer].abs().max()))
                v_amax[layer] = max(v_amax[layer], float(cache.v[layer].abs().max()))
    return k_amax, v_amax


def scales_document(k_amax: list[float], v_amax: list[float]) -> dict[str, Any]:
    """The --quantization-param-path document (k_scale / v_scale layout) for these maxima."""

    def scales(amax: list[float]) -> dict[str, float]:
        return {str(i): max(a / FP8_MAX, _MIN_SCALE) for i, a in enumerate(amax)}

    return {"kv_cache": {"dtype": "float8_e4m3fn", "k_scale": scales(k_amax), "v_scale": scales(v_amax)}}


def load_model(model_dir: Path, device: torch.device, dtype: str, max_positions: int) -> DenseCausalLM:
    config = load_hf_config(model_dir)
    scheme = resolve_quantization(None, config)
    cls = model_class_for(config)
    with torch.device(device):
        model = cls(config, resolve_dtype(dtype, config, device), max_positions,
                    quant=Fp8LinearMethod(scheme) if scheme is not None else None)  # fmt: skip
    model.to(device)
    load_weights(model, model_dir, "auto")
    return model.eval()


def calibrate_kv_scales(
    model_dir: Path, sequences: list[list[int]], device: torch.device, dtype: str = "auto"
) -> dict[str, Any]:
    model = load_model(model_dir, device, dtype, max(len(s) for s in sequences))
    return scales_document(*kv_amax(model, sequences, device))


def token_chunks(model_dir: Path, text: str, seq_len: int, max_tokens: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"][:max_tokens]
    if not ids:
        raise ValueError("the calibration text gives no tokens")
    return [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Calibrate FP8 KV cache scales (--quantization-param-path).")
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("text_file", type=Path, help="calibration text, representative of the traffic")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=8192)
    args = parser.parse_args(argv)
    sequences = token_chunks(args.model_dir, args.text_file.read_text(), args.seq_len, args.max_tokens)
    doc = calibrate_kv_scales(args.model_dir, sequences, torch.device(args.device), args.dtype)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {len(doc['kv_cache']['k_scale'])} layers of K/V scales to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
