"""Model files (app/model_files.py): which files a Hub download takes, how a model is resolved, and the
one-line errors of a model that cannot be had, down to `tokenspeed serve` and `tokenspeed download`
exiting at once without a traceback. There is no network here: the unreachable Hub is the real one
(an endpoint on a closed local port), a downloaded snapshot is laid out in a temporary cache."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app import model_files
from app.model_files import ModelUnavailable, looks_local, serving_files

REPO = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"

LLAMA_31 = [  # the files of meta-llama/Llama-3.1-8B-Instruct
    ".gitattributes", "LICENSE", "README.md", "USE_POLICY.md", "config.json", "generation_config.json",
    "model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors", "model-00003-of-00004.safetensors",
    "model-00004-of-00004.safetensors", "model.safetensors.index.json", "original/consolidated.00.pth",
    "original/params.json", "original/tokenizer.model", "special_tokens_map.json", "tokenizer.json",
    "tokenizer_config.json",
]
EVERY_FORMAT = [  # a repo with one model in every format (gpt2-like)
    "config.json", "generation_config.json", "merges.txt", "vocab.json", "tokenizer.json", "model.safetensors",
    "pytorch_model.bin", "tf_model.h5", "flax_model.msgpack", "rust_model.ot", "model.gguf", "onnx/model.onnx",
    "64-8bits.tflite", "coreml/model.mlpackage/Data/weights.bin", "chat_template.jinja", "modeling_x.py",
]


def test_serving_files_take_safetensors_configs_and_tokenizer_only() -> None:
    assert serving_files(LLAMA_31) == [
        "config.json", "generation_config.json", "model-00001-of-00004.safetensors",
        "model-00002-of-00004.safetensors", "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors",
        "model.safetensors.index.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
    ]
    assert serving_files(EVERY_FORMAT) == [
        "chat_template.jinja", "config.json", "generation_config.json", "merges.txt", "model.safetensors",
        "tokenizer.json", "vocab.json",
    ]


def test_serving_files_fall_back_to_pt_and_follow_the_load_format() -> None:
    bin_only = ["config.json", "tokenizer.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
                "pytorch_model.bin.index.json", "model.gguf"]
    assert serving_files(bin_only) == sorted(set(bin_only) - {"model.gguf"})
    assert "pytorch_model.bin" in serving_files(EVERY_FORMAT, "pt")
    assert "model.safetensors" not in serving_files(EVERY_FORMAT, "pt")
    assert serving_files(bin_only, "safetensors") == ["config.json", "tokenizer.json"]
    dummy = serving_files(LLAMA_31, "dummy")
    assert not [f for f in dummy if f.endswith((".safetensors", ".bin", ".pth"))] and "config.json" in dummy
    assert "modeling_x.py" in serving_files(EVERY_FORMAT, trust_remote_code=True)
    assert "modeling_x.py" not in serving_files(EVERY_FORMAT)


def test_serving_files_drop_consolidated_weights_beside_an_index() -> None:
    mistral = ["config.json", "consolidated.safetensors", "model-00001-of-00002.safetensors",
               "model-00002-of-00002.safetensors", "model.safetensors.index.json", "params.json",
               "tokenizer.model", "tokenizer.model.v3", "tokenizer.json"]
    picked = serving_files(mistral)
    assert "consolidated.safetensors" not in picked and "model-00002-of-00002.safetensors" in picked
    assert serving_files(["config.json", "consolidated.safetensors"]) == ["config.json", "consolidated.safetensors"]


@pytest.mark.parametrize(("model", "local"), [
    ("Qwen/Qwen3-0.6B", False), ("gpt2", False), ("meta-llama/Llama-3.1-8B-Instruct", False),
    ("/nonexistent/models/my-llama-8b", True), ("./my-model", True), ("../m", True), ("~/models/x", True),
    ("models/org/name", True), ("org/name with space", True), ("C:\\models\\x", True),
])
def test_looks_local(model: str, local: bool) -> None:
    assert looks_local(model) is local


def test_resolve_local_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert model_files.resolve(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match="--revision"):
        model_files.resolve(str(tmp_path), revision="main")
    with pytest.raises(ValueError, match="is a file"):
        model_files.resolve(str(tmp_path / "config.json"))
    with pytest.raises(ModelUnavailable, match=r"/nonexistent/models/my-llama-8b does not exist: give an existing"):
        model_files.resolve("/nonexistent/models/my-llama-8b")
    monkeypatch.setenv(model_files.DEFAULT_MODEL_ENV, str(tmp_path / "elsewhere"))
    with pytest.raises(ModelUnavailable, match="run `make model`"):
        model_files.resolve(str(tmp_path / "smollm2-135m-instruct"))
    with pytest.raises(ModelUnavailable, match="run `make model`"):
        model_files.resolve(str(tmp_path / "elsewhere"))


def _cached_snapshot(cache: Path, repo: str, files: list[str]) -> Path:
    """A snapshot as huggingface_hub lays one out: refs/main names the commit, snapshots/<commit>/ has
    the files (real downloads link them to blobs/; plain files read the same)."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT)
    snapshot = folder / "snapshots" / COMMIT
    for name in files:
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_text("{}")
    return snapshot


def test_offline_resolve_uses_the_cached_snapshot_and_names_the_cache_when_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = _cached_snapshot(tmp_path, "org/tiny", ["config.json", "model.safetensors"])
    assert model_files.resolve("org/tiny", download_dir=str(tmp_path)) == snapshot
    with pytest.raises(ModelUnavailable) as missing:
        model_files.resolve("org/absent", download_dir=str(tmp_path))
    message = str(missing.value)
    assert "\n" not in message
    for part in ("model org/absent", f"cache at {tmp_path}", "HF_HUB_OFFLINE=1", "tokenspeed download org/absent"):
        assert part in message


def test_an_unreachable_hub_falls_back_to_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def unreachable(self, *args, **kwargs):
        raise OSError("connection refused")

    calls: list[dict] = []
    real = huggingface_hub.snapshot_download

    def recording(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    snapshot = _cached_snapshot(tmp_path, "org/tiny", ["config.json"])
    assert model_files.resolve("org/tiny", download_dir=str(tmp_path)) == snapshot
    assert calls[-1]["local_files_only"] is True
    with pytest.raises(ModelUnavailable, match="the Hub cannot be reached .no network.*tokenspeed download org/gone"):
        model_files.resolve("org/gone", download_dir=str(tmp_path))


def test_an_online_download_asks_for_the_serving_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    calls: list[dict] = []
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    siblings = [huggingface_hub.hf_api.RepoSibling(rfilename=name) for name in LLAMA_31]
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info",
                        lambda self, repo, **kw: huggingface_hub.hf_api.ModelInfo(id=repo, siblings=[
                            {"rfilename": s.rfilename} for s in siblings]))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kw: calls.append(kw) or str(tmp_path))
    got = model_files.resolve("org/llama", revision="v1", download_dir="/cache", load_format="auto")
    assert got == tmp_path
    call = calls[0]
    assert (call["repo_id"], call["revision"], call["cache_dir"], call["local_files_only"]) == \
        ("org/llama", "v1", "/cache", False)
    assert call["allow_patterns"] == serving_files(LLAMA_31)


def test_prepare_fetches_once_and_sends_children_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.config import Settings

    fetched: list[tuple] = []
    monkeypatch.setenv("HF_HUB_OFFLINE", "")  # restored after the test: prepare() sets it
    real_resolve = model_files.resolve
    monkeypatch.setattr(model_files, "resolve", lambda source, **kw: fetched.append((source, kw["load_format"])))
    model_files.prepare(Settings(model=str(tmp_path)))  # a local directory: nothing to fetch
    assert fetched == [] and os.environ["HF_HUB_OFFLINE"] == ""
    model_files.prepare(Settings(model="org/m", tokenizer="org/tok", load_format="safetensors"))
    assert fetched == [("org/m", "safetensors"), ("org/tok", "dummy")]
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    monkeypatch.setattr(model_files, "resolve", real_resolve)
    with pytest.raises(ModelUnavailable, match="^--tokenizer /nonexistent/tok: model directory /nonexistent/tok "):
        model_files.prepare(Settings(model=str(tmp_path), tokenizer="/nonexistent/tok"))


def _run(args: list[str], home: Path, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """The real command, with no network to the Hub (a closed local port) and an empty cache."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TOKENSPEED_"))}
    full.update(HOME=str(home), HF_HOME=str(home / "hf"), HF_ENDPOINT="http://127.0.0.1:9", **env)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=60)
    return done, time.monotonic() - started


def _one_line_error(done: subprocess.CompletedProcess, *parts: str) -> None:
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, done.stderr
    for part in parts:
        assert part in errors[0], errors[0]


def test_serve_stops_at_once_on_a_missing_local_model(tmp_path: Path) -> None:
    done, seconds = _run(["serve", "/nonexistent/models/my-llama-8b", "--device", "cpu"], tmp_path)
    _one_line_error(done, "model directory /nonexistent/models/my-llama-8b does not exist")
    assert seconds < 15 and "started http" not in done.stderr
    done, _ = _run(["serve", "/nonexistent/models/my-llama-8b", "--device", "cpu", "--log-level", "debug"], tmp_path)
    assert done.returncode == 1 and "Traceback" in done.stderr


def test_serve_of_the_missing_default_model_says_make_model(tmp_path: Path) -> None:
    done, _ = _run(["serve", "--config", "configs/recipes/smollm2-135m-instruct.yaml", "--device", "cpu"], tmp_path)
    _one_line_error(done, "embedded default model", "make model")


def test_serve_and_download_of_an_unreachable_hub_model(tmp_path: Path) -> None:
    done, seconds = _run(["serve", "Qwen/Qwen3-0.6B", "--device", "cpu"], tmp_path)
    _one_line_error(done, "Qwen/Qwen3-0.6B", "cannot be reached", "tokenspeed download Qwen/Qwen3-0.6B",
                    str(tmp_path / "hf" / "hub"))
    assert seconds < 15
    done, _ = _run(["serve", "Qwen/Qwen3-0.6B", "--device", "cpu"], tmp_path, HF_HUB_OFFLINE="1")
    _one_line_error(done, "HF_HUB_OFFLINE=1", "tokenspeed download Qwen/Qwen3-0.6B")
    done, _ = _run(["download", "Qwen/Qwen3-0.6B", "--revision", "v2"], tmp_path)
    _one_line_error(done, "Qwen/Qwen3-0.6B at revision v2", "cannot be reached")


def test_download_fetches_what_serve_would_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    from app import download

    fetched: list[tuple] = []

    def fake_resolve(source: str, **kw) -> Path:
        fetched.append((source, kw["load_format"], kw["revision"], kw["download_dir"], kw["progress"]))
        return tmp_path / source.replace("/", "--")

    monkeypatch.setattr(model_files, "resolve", fake_resolve)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: org/m\nload_format: safetensors\n")
    assert download.run(["--config", str(recipe), "--revision", "v2", "--download-dir", "/cache"]) == 0
    assert fetched == [("org/m", "safetensors", "v2", "/cache", True)]
    assert capsys.readouterr().out.strip() == str(tmp_path / "org--m")
    assert download.run([str(tmp_path)]) == 0  # a local directory: nothing to fetch
    assert "nothing to download" in capsys.readouterr().err and len(fetched) == 1
