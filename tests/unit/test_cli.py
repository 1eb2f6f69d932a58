"""The `tokenspeed` command line: serve, config show, config schema, version, help and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from app import cli
from app.config import Settings

VENV_BIN = Path(sys.executable).parent


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI reads os.environ: start every test without TOKENSPEED_* settings."""
    import os

    for var in list(os.environ):
        if var.startswith("TOKENSPEED_"):
            monkeypatch.delenv(var)


@pytest.fixture
def fake_supervisor(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    calls: list[Settings] = []

    def serve(settings: Settings) -> int:
        calls.append(settings)
        return 3

    monkeypatch.setitem(sys.modules, "app.supervisor", types.SimpleNamespace(serve=serve))
    return calls


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["version"]) == 0
    assert capsys.readouterr().out == "TokenSpeed appliance v0.1.0\n"
    assert cli.main(["version", "extra"]) == 2


def test_version_through_the_console_script() -> None:
    script = VENV_BIN / "tokenspeed"
    if not script.exists():
        pytest.skip("the console script is not installed in this environment")
    result = subprocess.run([str(script), "version"], capture_output=True, text=True, timeout=60, check=False)
    assert (result.returncode, result.stdout) == (0, "TokenSpeed appliance v0.1.0\n")


def test_help_and_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    assert "serve" in capsys.readouterr().out
    assert cli.main([]) == 2
    assert "a command is required" in capsys.readouterr().err
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    for argv in (["config", "--help"], ["config", "schema", "--help"], ["version", "--help"]):
        assert cli.main(argv) == 0, argv
    assert cli.main(["config"]) == 2


def test_serve_help_lists_the_seed_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--max-num-seqs" in out and "--no-enable-prefix-caching" in out and "--tp" in out
    assert "Maximum number of active sequences the scheduler may process concurrently." in " ".join(out.split())
    assert "Model loading:" in out and "Speculative decoding:" in out
    assert cli.main(["config", "show", "--help"]) == 0
    assert "--json" in capsys.readouterr().out


def test_serve_hands_the_settings_to_the_supervisor(fake_supervisor: list[Settings], tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: m\nmax_num_seqs: 4\n")
    assert cli.main(["serve", "--config", str(recipe), "--port", "9100"]) == 3  # the supervisor's exit code
    (settings,) = fake_supervisor
    assert (settings.model, settings.max_num_seqs, settings.port) == ("m", 4, 9100)


def test_serve_stops_on_a_config_error(fake_supervisor: list[Settings], capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENSPEED_MAX_NUM_SEQS", "0")
    assert cli.main(["serve", "m"]) == 2
    assert capsys.readouterr().err == (
        "tokenspeed: error: TOKENSPEED_MAX_NUM_SEQS: Input should be greater than or equal to 1 (got '0')\n")
    monkeypatch.delenv("TOKENSPEED_MAX_NUM_SEQS")
    assert cli.main(["serve", "m", "--speculative-algorithm", "MTP"]) == 2
    assert "--speculative-algorithm MTP is not supported yet" in capsys.readouterr().err
    assert fake_supervisor == []


def test_config_show_names_sources_and_masks_secrets(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: m\nmax_model_len: 1024\n")
    monkeypatch.setenv("TOKENSPEED_PORT", "9001")
    assert cli.main(["config", "show", "--config", str(recipe), "--max-num-seqs", "8", "--api-key", "sk-123"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line and not line.startswith("#")}
    assert lines["max_num_seqs"].split()[1] == "8" and lines["max_num_seqs"].endswith("[cli: --max-num-seqs]")
    assert lines["port"].endswith("[env: TOKENSPEED_PORT]")
    assert lines["max_model_len"].endswith(f"[file: {recipe}: max_model_len]")
    assert lines["block_size"].endswith("[default]")
    assert "sk-123" not in out and lines["api_key"].split()[1] == "********"
    assert "# Scheduler and memory" in out


def test_config_show_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", "show", "m", "--json", "--api-key", "sk-123"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)
    assert "sk-123" not in out
    assert data["api_key"] == {"value": "********", "source": "cli", "where": "--api-key"}
    assert data["max_num_seqs"] == {"value": 160, "source": "default", "where": "default"}
    assert data["model"]["source"] == "cli" and set(data) == set(Settings.model_fields)


def test_config_show_reports_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", "show", "m", "--block-size", "3"]) == 2
    assert capsys.readouterr().err.startswith("tokenspeed: error: --block-size: ")


def test_config_schema_is_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    assert schema["properties"]["max_num_seqs"]["type"] == "integer"
