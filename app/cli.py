"""The `tokenspeed` command: serve, download, warmup, config show, config schema, bench, version."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from collections.abc import Callable, Sequence

from app.config import ConfigError, load_settings
from app.config.cli_args import build_parser, parse_command_line
from app.config.loader import resolve
from app.config.schema import recipe_schema
from app.config.show import as_json, as_text

DISTRIBUTION = "tokenspeed-appliance"


def version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # running from a source tree that is not installed
        return "0+unknown"


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenspeed", description="TokenSpeed appliance: an OpenAI-compatible "
                                     "LLM server configured by flags, TOKENSPEED_* variables and recipes.")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    commands.add_parser("serve", help="start the server: tokenspeed serve [MODEL] [flags] (see serve --help)")
    commands.add_parser("download", help="fetch a Hub model into the cache ahead of serve: tokenspeed download "
                        "MODEL [--revision R] (see download --help)")
    commands.add_parser("warmup", help="build the kernels serve needs into the kernel caches: tokenspeed warmup "
                        "[MODEL] [serve flags] (see warmup --help)")
    commands.add_parser("config", help="config show: the resolved configuration; config schema: recipe schema")
    commands.add_parser("bench", help="bench serving|offline|latency [flags]: the benchmarks (see bench --help)")
    commands.add_parser("version", help="print the version")
    return parser


def _config_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenspeed config", description="Inspect the configuration.")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    commands.add_parser("show", help="every resolved value and its source: config show [--config F] [flags] "
                        "[--json]")
    commands.add_parser("schema", help="the JSON schema of a recipe file (for editors)")
    return parser


def _no_arguments(prog: str, description: str, argv: Sequence[str]) -> None:
    """Commands without options still answer --help and refuse stray arguments."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.parse_args(list(argv))


def _serve(argv: Sequence[str]) -> int:
    settings = load_settings(argv)
    from app.supervisor import serve  # imported late: the supervisor pulls in the whole runtime

    return int(serve(settings))


def _download(argv: Sequence[str]) -> int:
    from app.download import run  # imported late: it pulls in huggingface_hub

    return run(argv)


def _warmup(argv: Sequence[str]) -> int:
    from app.warmup import run  # imported late: it pulls in torch

    return run(argv)


def _config_show(argv: Sequence[str]) -> int:
    def add_json(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help="print JSON: {field: {value, source, where}}")

    command_line = parse_command_line(argv, build_parser("tokenspeed config show", extra=add_json))
    resolved = resolve(command_line)
    if command_line.namespace.json:
        print(json.dumps(as_json(resolved), indent=2))
    else:
        print(as_text(resolved), end="")
    return 0


def _config_schema(argv: Sequence[str]) -> int:
    _no_arguments("tokenspeed config schema", "Print the JSON schema of a recipe YAML file.", argv)
    print(json.dumps(recipe_schema(), indent=2))
    return 0


def _config(argv: Sequence[str]) -> int:
    commands: dict[str, Callable[[Sequence[str]], int]] = {"show": _config_show, "schema": _config_schema}
    if argv and argv[0] in commands:
        return commands[argv[0]](argv[1:])
    return _usage(_config_parser(), argv)


def _bench(argv: Sequence[str]) -> int:
    from app.bench import main as bench  # imported late: the in-process benchmarks pull in torch

    return bench(argv)


def _version(argv: Sequence[str]) -> int:
    _no_arguments("tokenspeed version", "Print the version.", argv)
    print(f"TokenSpeed appliance v{version()}")
    return 0


def _usage(parser: argparse.ArgumentParser, argv: Sequence[str]) -> int:
    """Help when asked for (exit 0); otherwise a usage error (exit 2)."""
    if argv and argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    parser.print_usage(sys.stderr)
    what = f"unknown command {argv[0]!r}" if argv else "a command is required"
    print(f"{parser.prog}: error: {what}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands: dict[str, Callable[[Sequence[str]], int]] = {
        "serve": _serve, "download": _download, "warmup": _warmup, "config": _config, "bench": _bench,
        "version": _version,
    }
    try:
        if argv and argv[0] in commands:
            return commands[argv[0]](argv[1:])
        return _usage(_top_parser(), argv)
    except ConfigError as exc:
        print(f"tokenspeed: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # argparse's --help (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else 0


if __name__ == "__main__":
    raise SystemExit(main())
