"""The CPU's weight layout for linears: the transpose of a contiguous [in, out], same shape, same numbers."""

from __future__ import annotations

import torch

from app.worker.layers.linear import GateUpLinear, Linear, use_cpu_weight_layout
from app.worker.loader.weights import load_tensors


def test_linears_keep_their_shape_and_outputs() -> None:
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(Linear(24, 40, True, torch.float32), GateUpLinear(40, 16, False, torch.float32))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(5, 24, generator=gen)
    want = model(x)
    weights = [m.weight for m in model]
    assert use_cpu_weight_layout(model) == 2
    for module, param in zip(model, weights, strict=True):
        assert module.weight is param  # the same Parameter (its loader attributes kept)
        assert module.weight.t().is_contiguous() and not module.weight.is_contiguous()
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
