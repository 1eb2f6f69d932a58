"""Give a config-only model directory a tokenizer that covers its whole vocabulary.

Benchmarks on dummy weights (configs/models/*, no tokenizer files) need every token id to decode to
non-empty text, so that each streamed token is a visible SSE chunk. This writes a word-level
tokenizer whose token i is the word `t<i>` into a copy of the directory.

    python scripts/gpu/wordlevel_tokenizer.py configs/models/llama-3.1-8b /tmp/llama-3.1-8b
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def main(src: str, dst: str) -> None:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    vocab_size = json.loads(Path(src, "config.json").read_text())["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1").save_pretrained(dst)


if __name__ == "__main__":
    main(*sys.argv[1:3])
