"""The CPU's run-time form of the linears' weights (app/worker/layers/cpu_weights.py): float32 as the
transpose of a contiguous [in, out] (same shape, same numbers); bf16 on a CPU with native bf16 matmuls
packed for oneDNN (same shape and attributes, F.linear's outputs within bf16 rounding), unpacked and
packed again around weight updates."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save

from app import protocol as p
from app.protocol import NewSeq, SamplingParams, SeqChunk, StepPlan
from app.worker.layers import SHARD_ROWS, LMHead, VocabEmbedding, cpu_weights
from app.worker.layers import linear as linear_module
from app.worker.layers.cpu_weights import packs, plain_weights, use_cpu_weight_layout
from app.worker.layers.linear import FP16_MAX_ROWS, GateUpLinear, Linear, fp16_linear
from app.worker.loader import load_hf_config, load_weights
from app.worker.loader.updates import UpdateError, WeightControl
from app.worker.loader.weights import load_tensors
from app.worker.model_runner import ModelRunner
from app.worker.models import model_class_for
from app.worker.parallel import SINGLE
from tests.support.model_factory import build_tiny_model
from tests.support.settings import CPU_RUNNER, make_settings

native_bf16 = pytest.mark.skipif(not packs(torch.bfloat16), reason="this CPU has no native bf16 matmuls")


def filled(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    return model


def close_in_bf16(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within a few bf16 roundings of the output's scale (the two kernels sum in different orders)."""
    return (got.float() - want.float()).abs().max().item() <= 2**-6 * want.float().abs().max().item()


def test_linears_keep_their_shape_and_outputs() -> None:
    model = filled(torch.nn.Sequential(Linear(24, 40, True, torch.float32), GateUpLinear(40, 16, False, torch.float32)))
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(1))
    want = model(x)
    weights = [m.weight for m in model]
    assert use_cpu_weight_layout(model) == 2
    for module, param in zip(model, weights, strict=True):
        assert module.weight is param  # the same Parameter (its loader attributes kept)
        assert module.weight.t().is_contiguous() and not module.weight.is_contiguous()
        assert not module.weight.is_mkldnn  # float32 is never packed
    assert model[0].weight.shape == (40, 24) and model[1].weight.shape == (32, 40)
    assert torch.allclose(model(x), want, rtol=1e-5, atol=1e-5)


def test_a_fused_weight_still_loads_shard_by_shard() -> None:
    layer = GateUpLinear(8, 4, False, torch.float32)
    use_cpu_weight_layout(layer)

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = layer

        def checkpoint_names(self, param: str):
            return [("gate", "gate"), ("up", "up")] if param == "mlp.weight" else []

        def checkpoint_target(self, name: str):
            return "mlp.weight", name

        def ignores_checkpoint_tensor(self, name: str) -> bool:
            return False

    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    assert load_tensors(Holder(), iter([("gate", gate), ("up", up)])) == 2
    assert torch.equal(layer.weight, torch.cat([gate, up]))
    assert layer.weight.t().is_contiguous()


def test_packing_needs_a_native_half_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not packs(torch.float32)
    monkeypatch.setattr(cpu_weights, "native_half", lambda dtype: False)  # an AVX2 host
    model = filled(torch.nn.Sequential(Linear(16, 8, False, torch.bfloat16)))
    use_cpu_weight_layout(model)
    assert not model[0].weight.is_mkldnn and model[0].weight.t().is_contiguous()


def test_a_torch_without_the_ops_falls_back_to_the_plain_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_weights, "packing_available", lambda: False)
    model = filled(torch.nn.Sequential(Linear(16, 8, False, torch.bfloat16)))
    use_cpu_weight_layout(model)
    assert not model[0].weight.is_mkldnn


@native_bf16
@pytest.mark.parametrize("rows", [1, 8, 37])
def test_packed_linears_equal_f_linear(rows: int) -> None:
    model = filled(torch.nn.Sequential(Linear(64, 96, True, torch.bfloat16), GateUpLinear(96, 48, False, torch.bfloat16)))
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = model(x)
    shard_rows = getattr(model[1].weight, SHARD_ROWS)
    assert use_cpu_weight_layout(model) == 2
    assert model[0].weight.is_mkldnn and model[1].weight.is_mkldnn
    assert model[1].weight.shape == (96, 96) and getattr(model[1].weight, SHARD_ROWS) == shard_rows
    assert close_in_bf16(model(x), want)
    assert [name for name, _ in model.named_parameters()] == ["0.weight", "0.bias", "1.weight"]


@native_bf16
def test_a_tied_head_packs_a_copy_and_keeps_the_table_plain() -> None:
    embed = filled(VocabEmbedding(300, 64, torch.bfloat16))
    head = LMHead(300, 64, torch.bfloat16, embed)
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    want = head(hidden)
    table = embed.weight
    assert use_cpu_weight_layout(model) == 1
    assert embed.weight is table and not table.is_mkldnn and head.weight is table
    assert head.packed is not None and head.packed.is_mkldnn
    assert close_in_bf16(head(hidden), want)
    out = torch.empty(3, 300, dtype=torch.bfloat16)
    assert head(hidden, out) is out and close_in_bf16(out, want)


@native_bf16
def test_an_untied_head_is_packed_in_place() -> None:
    head = filled(LMHead(300, 64, torch.bfloat16, None))
    hidden = torch.randn(2, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    want = head(hidden)
    assert use_cpu_weight_layout(head) == 1
    assert head.weight.is_mkldnn and head.packed is None
    assert close_in_bf16(head(hidden), want)


@native_bf16
def test_plain_weights_unpacks_exactly_and_packs_again() -> None:
    model = filled(torch.nn.Sequential(Linear(32, 48, False, torch.bfloat16)))
    plain = model[0].weight.detach().clone()
    use_cpu_weight_layout(model)
    with plain_weights(model):
        assert not model[0].weight.is_mkldnn and torch.equal(model[0].weight, plain)
        model[0].weight.data.narrow(0, 0, 4).fill_(1.0)  # an update writing one shard's rows
    assert model[0].weight.is_mkldnn
    plain[:4] = 1.0
    assert torch.equal(model[0].weight.to_dense(), plain)


def mlp_and_attention(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """Linears under the names a dense layer gives them."""
    mlp = torch.nn.ModuleDict({"gate_up_proj": GateUpLinear(64, 48, False, dtype), "down_proj": Linear(48, 64, True, dtype)})
    attention = torch.nn.ModuleDict({"o_proj": Linear(64, 64, False, dtype)})
    return filled(torch.nn.ModuleDict({"mlp": mlp, "self_attn": attention}))


fp16_copies = pytest.mark.skipif(not cpu_weights.fp16_copies_available(), reason="this torch has no fbgemm")


@native_bf16
@fp16_copies
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_the_mlp_gate_up_multiplies_small_batches_by_an_fp16_copy(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to FP16_MAX_ROWS rows, the MLP's gate_up multiplies by fbgemm's fp16 copy, within bf16 rounding
    of the oneDNN weight (both sum in float32 and round once); more rows, and the other linears, by
    oneDNN."""
    model = mlp_and_attention()
    use_cpu_weight_layout(model)
    gate_up, down, o_proj = model["mlp"]["gate_up_proj"], model["mlp"]["down_proj"], model["self_attn"]["o_proj"]
    assert gate_up.fp16 is not None and down.fp16 is None and o_proj.fp16 is None
    assert gate_up.weight.is_mkldnn  # the oneDNN weight stays for larger steps
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    h = torch.randn(rows, 48, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    calls = []
    monkeypatch.setattr(linear_module, "fp16_linear", lambda *a: calls.append(1) or fp16_linear(*a))
    got_gate_up, _, _ = gate_up(x), down(h), o_proj(x)
    assert len(calls) == (1 if rows <= FP16_MAX_ROWS else 0)
    monkeypatch.setattr(linear_module, "FP16_MAX_ROWS", 0)
    assert close_in_bf16(got_gate_up, gate_up(x))
    assert got_gate_up.dtype == torch.bfloat16


@native_bf16
@fp16_copies
@pytest.mark.parametrize("value", [1e-6, 7e4])
def test_no_fp16_copy_of_a_weight_fp16_cannot_hold(value: float) -> None:
    """A bf16 value below fp16's normal range or beyond its largest would change in the copy: none is made."""
    model = mlp_and_attention()
    with torch.no_grad():
        model["mlp"]["gate_up_proj"].weight[3, 5] = value
    use_cpu_weight_layout(model)
    assert model["mlp"]["gate_up_proj"].fp16 is None and model["mlp"]["gate_up_proj"].weight.is_mkldnn


def test_no_fp16_copy_without_fbgemm_or_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    model = mlp_and_attention(torch.float32)
    use_cpu_weight_layout(model)
    assert all(m.fp16 is None for m in model.modules() if isinstance(m, Linear))
    if packs(torch.bfloat16):
        monkeypatch.setattr(cpu_weights, "fp16_copies_available", lambda: False)
        model = mlp_and_attention()
        use_cpu_weight_layout(model)
        assert model["mlp"]["gate_up_proj"].weight.is_mkldnn and model["mlp"]["gate_up_proj"].fp16 is None


@native_bf16
@fp16_copies
def test_plain_weights_makes_the_fp16_copies_again_from_the_update() -> None:
    model = mlp_and_attention()
    use_cpu_weight_layout(model)
    gate_up = model["mlp"]["gate_up_proj"]
    with plain_weights(model):
        assert gate_up.fp16 is None
        gate_up.weight.data.fill_(0.5)
    assert gate_up.fp16 is not None and model["self_attn"]["o_proj"].fp16 is None
    assert torch.equal(gate_up(torch.ones(1, 64, dtype=torch.bfloat16)), torch.full((1, 96), 32.0, dtype=torch.bfloat16))


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("bf16"), seed=1, num_hidden_layers=2,
                            tie_word_embeddings=True)


def bf16_model(model_dir: Path, layout: bool) -> torch.nn.Module:
    config = load_hf_config(model_dir)
    model = model_class_for(config)(config, torch.bfloat16, 64)
    load_weights(model, model_dir, "auto")
    if layout:
        use_cpu_weight_layout(model)
    return model


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    """Every position's logits for one 12-token prompt, the dense model's hidden states through the head
    (no attention backend needed: the layers' linears and the head are what packing changes)."""
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(12, model.dims.hidden, generator=gen).to(torch.bfloat16)
    layer, queries = model.model.layers[0], model.dims.num_heads * model.dims.head_dim
    with torch.no_grad():
        attn = layer.self_attn.o_proj(layer.self_attn.qkv_proj(hidden)[:, :queries])
        return model.compute_logits(layer.mlp(layer.post_attention_layernorm(attn)))


@native_bf16
def test_weight_updates_repack(tiny_bf16: Path) -> None:
    model, reference = bf16_model(tiny_bf16, layout=True), bf16_model(tiny_bf16, layout=False)
    assert model.lm_head.tied and model.lm_head.packed is not None
    assert close_in_bf16(logits_of(model), logits_of(reference))
    gen = torch.Generator().manual_seed(6)
    new = {name: torch.randn(t.shape, generator=gen) for name, t in [
        ("model.layers.0.self_attn.k_proj.weight", reference.model.layers[0].self_attn.qkv_proj.weight[64:96]),
        ("model.layers.0.mlp.down_proj.weight", reference.model.layers[0].mlp.down_proj.weight),
        ("model.embed_tokens.weight", reference.model.embed_tokens.weight),
    ]}
    runner = SimpleNamespace(tp=SINGLE, device=torch.device("cpu"), model=model, quant_scheme=None)
    assert WeightControl(runner).handle(p.UpdateWeightsFromTensor(save(new))) == "Updated 3 tensors."
    reference_runner = SimpleNamespace(tp=SINGLE, device=torch.device("cpu"), model=reference, quant_scheme=None)
    WeightControl(reference_runner).handle(p.UpdateWeightsFromTensor(save(new)))
    layers = model.model.layers[0]
    assert layers.self_attn.qkv_proj.weight.is_mkldnn and layers.mlp.down_proj.weight.is_mkldnn
    assert model.lm_head.packed is not None and not model.model.embed_tokens.weight.is_mkldnn
    assert torch.equal(layers.self_attn.qkv_proj.weight.to_dense(), reference.model.layers[0].self_attn.qkv_proj.weight)
    assert torch.equal(model.lm_head.packed.to_dense(), reference.model.embed_tokens.weight)
    assert close_in_bf16(logits_of(model), logits_of(reference))
    # a refused update leaves the packed weights packed and unchanged
    before = layers.mlp.down_proj.weight.to_dense()
    with pytest.raises(UpdateError):
        WeightControl(runner).handle(p.UpdateWeightsFromTensor(save({"model.norm.weight": torch.ones(7)})))
    assert layers.mlp.down_proj.weight.is_mkldnn and torch.equal(layers.mlp.down_proj.weight.to_dense(), before)


def greedy(runner: ModelRunner, prompt: list[int], new_tokens: int, step: int) -> list[int]:
    """One sequence in slot 0: its prefill, then decodes; the slot is freed after."""
    blocks = list(range(math.ceil((len(prompt) + new_tokens) / runner.block_size)))
    seq = NewSeq(slot=0, rid="r", sampling=SamplingParams(temperature=0.0), num_prompt_tokens=len(prompt),
                 block_ids=blocks)
    result = runner.execute(StepPlan(step, new_seqs=[seq], chunks=[SeqChunk(slot=0, token_ids=prompt)]))
    tokens = list(result.token_ids)
    for i in range(new_tokens - 1):
        tokens += runner.execute(StepPlan(step + 1 + i, chunks=[SeqChunk(slot=0)])).token_ids
    runner.execute(StepPlan(step + new_tokens, free_slots=[0]))
    return tokens


@native_bf16
def test_a_bf16_runner_packs_and_decodes_as_unpacked(tiny_bf16: Path) -> None:
    """The runner packs its bf16 linears and tied head, and greedy decoding gives the tokens the plain
    F.linear weights give."""
    runner = ModelRunner(make_settings(tiny_bf16, CPU_RUNNER, dtype="bfloat16"), torch.device("cpu"))
    layer = runner.model.model.layers[0]
    assert layer.mlp.gate_up_proj.weight.is_mkldnn and runner.model.lm_head.packed is not None
    prompt = torch.randint(3, runner.vocab_size, (21,), generator=torch.Generator().manual_seed(7)).tolist()
    packed = greedy(runner, prompt, 12, step=1)
    with plain_weights(runner.model):
        assert not layer.mlp.gate_up_proj.weight.is_mkldnn and runner.model.lm_head.packed is None
        plain = greedy(runner, prompt, 12, step=100)
    assert len(packed) == 12 and packed == plain
