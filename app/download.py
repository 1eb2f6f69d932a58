"""`tokenspeed download [MODEL] [serve flags]`: fetch a Hub model into the cache ahead of `serve`.

It takes serve's command line (flags, TOKENSPEED_* variables, --config recipe) and fetches exactly
what `serve` with the same arguments would read (app/model_files.py: the model's serving files at
--revision, into --download-dir or the Hugging Face cache, and a separate --tokenizer repo), with
progress bars, then prints the snapshot's path. A later `serve`, even with HF_HUB_OFFLINE=1, starts
from that copy.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from app import model_files
from app.config.cli_args import build_parser, parse_command_line
from app.config.loader import resolve

PROG = "tokenspeed download"


def run(argv: Sequence[str]) -> int:
    """Exit 0 with the snapshot path on stdout; 1 with one line on stderr if the model cannot be had.
    Bad flags raise ConfigError (the CLI's exit 2)."""
    parser = build_parser(PROG)
    parser.description = ("Download a Hugging Face Hub model into the cache, as `tokenspeed serve` with the "
                          "same arguments would read it. " + (parser.description or ""))
    settings = resolve(parse_command_line(argv, parser)).settings
    started = time.perf_counter()
    paths = []
    try:
        for source, load_format in model_files.hub_sources(settings):
            print(f"{PROG}: fetching {source} into {model_files.hub_cache_dir(settings.download_dir)}",
                  file=sys.stderr)
            paths.append(model_files.fetch(settings, source, load_format))
    except ValueError as exc:  # ModelUnavailable too
        print(f"tokenspeed: error: {exc}", file=sys.stderr)
        return 1
    if not paths:
        print(f"{PROG}: {settings.model} is a local directory: nothing to download", file=sys.stderr)
        return 0
    print(f"{PROG}: done in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    for path in paths:
        print(path)
    return 0
