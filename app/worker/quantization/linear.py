"""FP8 linear layers: the parameters a quantized `Linear` holds, how checkpoint tensors fill them,
and its forward.

`Fp8LinearMethod` plugs into `app.worker.layers.Linear` (and its fused subclasses): the layer calls
`create_weights` instead of allocating a float weight, and `apply` instead of F.linear. Run-time
parameters: `weight` [N, K] float8_e4m3fn, `weight_scale` [N] float32 (one per output channel) and,
with static activations, `input_scale` [] float32.

Loading (app.worker.loader.weights) hands each checkpoint tensor to the parameter's weight loader
with its shard id (q/k/v, gate/up, or None), so per-shard scales land on their own rows:
- float checkpoint: the weight loader quantizes each shard per output channel as it arrives
  (`weight_scale` is derived, not read from the checkpoint);
- FP8 checkpoint, per-tensor or per-channel scales: codes are copied, a per-tensor scale is expanded
  over its shard's rows (exact), and a fused layer's static `input_scale` is the largest of its
  shards' (they quantize the same input);
- FP8 checkpoint, block scales: codes and tile scales are held as loaded; `finish` requantizes each
  shard per output channel and drops the tile scales (documented in docs/quantization.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch
from torch import nn

from app.worker.layers.linear import FROM_CHECKPOINT, WEIGHT_LOADER
from app.worker.quantization.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Rows,
    block_scale_shape,
    quantize_rows,
    requantize_blocks_to_rows,
)
from app.worker.quantization.gemm import EMULATED, fp8_linear, gemm_backend
from app.worker.quantization.scheme import Fp8Scheme

Shard = str | int | None
DUMMY_RANGE = 1e-3  # the loader's dummy weights are uniform(-1e-3, 1e-3) before quantization


def _param(
    data: torch.Tensor, loader: Callable[[torch.Tensor, Shard], None] | None, from_checkpoint: bool = True
) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    if loader is not None:
        setattr(param, WEIGHT_LOADER, loader)
    setattr(param, FROM_CHECKPOINT, from_checkpoint)
    return param


def _expect_shape(tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"has shape {tuple(tensor.shape)}, the model expects {shape}")


class Fp8LinearMethod:
    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    # ------------------------------------------------------------------ parameters

    def create_weights(
        self, layer: nn.Module, in_features: int, shard_rows: dict[Shard, tuple[int, int]]
    ) -> None:
        """Register the layer's FP8 parameters. shard_rows: {shard id: (first row, rows)}."""
        out_features = sum(rows for _, rows in shard_rows.values())
        s = self.scheme
        layer.fp8_shards = dict(shard_rows)
        layer.fp8_backend = EMULATED  # chosen in finish(), once the device is final
        layer.register_parameter(
            "weight",
            _param(
                torch.empty(out_features, in_features, dtype=FP8_DTYPE), partial(self._load_weight, layer)
            ),
        )
        if s.block is not None:
            layer.fp8_tile_rows = self._tile_rows(shard_rows, s.block)
            total = sum(n for _, n in layer.fp8_tile_rows.values())
            tiles = torch.empty(total, block_scale_shape(1, in_features, s.block)[1], dtype=torch.float32)
            layer.register_parameter(s.scale_name, _param(tiles, partial(self._load_tile_scales, layer)))
        else:
            loader = partial(self._load_weight_scale, layer) if s.serialized else None
            scale = torch.ones(out_features, dtype=torch.float32)
            layer.register_parameter("weight_scale", _param(scale, loader, from_checkpoint=s.serialized))
        if s.static_activations:
            zero = torch.zeros((), dtype=torch.float32)  # the largest shard scale wins; 0 = not loaded
            layer.register_parameter("input_scale", _param(zero, partial(self._load_input_scale, layer)))

    @staticmethod
    def _tile_rows(
        shard_rows: dict[Shard, tuple[int, int]], block: tuple[int, int]
    ) -> dict[Shard, tuple[int, int]]:
        """Each shard's tile-scale rows: shards keep their own tiles (a shard need not fill its last tile)."""
        tiles, first = {}, 0
        for shard, (_, rows) in shard_rows.items():
            n = -(-rows // block[0])
            tiles[shard] = (first, n)
            first += n
        return tiles

    # ------------------------------------------------------------------ weight loaders

    def _load_weight(self, layer: nn.Module, tensor: torch.Tensor, shard: Shard) -> None:
        first, rows = layer.fp8_shards[shard]
        target = layer.weight.data.narrow(0, first, rows)
        _expect_shape(tensor, tuple(target.shape))
        if self.scheme.serialized:
            if tensor.dtype != FP8_DTYPE:
                raise ValueError(
                    f"has dtype {tensor.dtype}; a {self.scheme.method} checkpoint stores linear weights "
                    f"as {FP8_DTYPE}"
                )
            target.copy_(tensor)
            return
        if tensor.dtype == FP8_DTYPE:
            raise ValueError(
                "is FP8, but the checkpoint's config.json has no quantization_config to scale it"
            )
        codes, scales = quantize_rows(tensor.to(target.device))
        target.copy_(codes)
        layer.weight_scale.data.narrow(0, first, rows).copy_(scales.view(-1))

    def _load_weight_scale(self, layer: nn.Module, tensor: torch.Tensor, shard: Shard) -> None:
        first, rows = layer.fp8_shards[shard]
        if tensor.numel() == 1:  # per-tensor: expanded over the shard's rows, exactly
            value = tensor.reshape(()).float()
        elif tuple(tensor.shape) in ((rows,), (rows, 1)):
            value = tensor.reshape(rows).float()
        else:
            raise ValueError(
                f"has shape {tuple(tensor.shape)}; a weight scale is per-tensor (1 value) "
                f"or per-channel ({rows},)"
            )
        layer.weight_scale.data.narrow(0, first, rows).copy_(value)

    def _load_tile_scales(self, layer: nn.Module, tensor: torch.Tensor, shard: Shard) -> None:
        first, n = layer.fp8_tile_rows[shard]
        target = getattr(layer, self.scheme.scale_name).data.narrow(0, first, n)
        _expect_shape(tensor, tuple(target.shape))
        target.copy_(tensor.float())

    def _load_input_scale(self, layer: nn.Module, tensor: torch.Tensor, shard: Shard) -> None:
        if tensor.numel() != 1:
            raise ValueError(
                f"has shape {tuple(tensor.shape)}; only a per-tensor input scale (1 value) is supported"
            )
        value = tensor.reshape(()).float().to(layer.input_scale.device)
        layer.input_scale.data.copy_(torch.maximum(layer.input_scale.data, value))

    # ------------------------------------------------------------------ after loading

    def init_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        """Dummy weights (--load-format dummy): uniform(-1e-3, 1e-3) floats quantized per channel."""
        weight = layer.weight
        values = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        values.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=generator)
        codes, scales = quantize_rows(values)
        weight.data.copy_(codes)
        self._set_row_scales(layer, scales.view(-1))
        if self.scheme.static_activations:
            layer.input_scale.data.fill_(1.0 / FP8_MAX)  # inputs up to 1.0 in magnitude are not clipped

    def finish(self, layer: nn.Module) -> None:
        """Convert what the checkpoint's layout needs converting, check the scales, pick the GEMM."""
        if self.scheme.block is not None and hasattr(layer, "fp8_tile_rows"):
            self._tiles_to_rows(layer)
        _check_scale(layer, "weight_scale")
        if self.scheme.static_activations:
            _check_scale(layer, "input_scale")
        layer.fp8_backend = gemm_backend(layer.weight.device, layer.weight.shape[1], layer.weight.shape[0])

    def _tiles_to_rows(self, layer: nn.Module) -> None:
        tiles = getattr(layer, self.scheme.scale_name).data
        scales = torch.empty(layer.weight.shape[0], dtype=torch.float32, device=layer.weight.device)
        for shard, (first, rows) in layer.fp8_shards.items():
            tile_first, n = layer.fp8_tile_rows[shard]
            codes = layer.weight.data.narrow(0, first, rows)
            requantized, row_scales = requantize_blocks_to_rows(
                codes, tiles.narrow(0, tile_first, n), self.scheme.block
            )
            codes.copy_(requantized)
            scales.narrow(0, first, rows).copy_(row_scales.view(-1))
        self._set_row_scales(layer, scales)

    def _set_row_scales(self, layer: nn.Module, scales: torch.Tensor) -> None:
        """Install the run-time per-channel scales, dropping block tile scales if the layer had them."""
        if self.scheme.block is not None and hasattr(layer, "fp8_tile_rows"):
            delattr(layer, self.scheme.scale_name)
            del layer.fp8_tile_rows
        if "weight_scale" in layer._parameters:
            layer.weight_scale.data.copy_(scales)
        else:
            layer.register_parameter("weight_scale", _param(scales.clone(), None, from_checkpoint=False))

    # ------------------------------------------------------------------ forward

    def takes_quantized_rows(self) -> bool:
        """Whether apply() quantizes its input per token (dynamic scales): the kernel that makes the input
        may then hand it over quantized (Fp8Rows), saving a launch and a pass over the activations."""
        return not self.scheme.static_activations

    def apply(self, layer: nn.Module, x: torch.Tensor | Fp8Rows, bias: torch.Tensor | None) -> torch.Tensor:
        input_scale = layer.input_scale if self.scheme.static_activations else None
        return fp8_linear(
            x, layer.weight, layer.weight_scale.view(1, -1), input_scale, bias, layer.fp8_backend
        )


def _check_scale(layer: nn.Module, name: str) -> None:
    scale = getattr(layer, name)
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        raise ValueError(f"{name} has values that are not positive and finite")


def quantized_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in model.named_modules():
        if isinstance(getattr(module, "quant", None), Fp8LinearMethod):
            yield name, module


def finish_loading(model: nn.Module, dummy_seed: int | None = None) -> None:
    """After the checkpoint is loaded (or, with dummy_seed, instead of it): bring every quantized
    linear to its run-time form. Dummy values come from one generator per device seeded dummy_seed."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, layer in quantized_layers(model):
        if dummy_seed is not None:
            device = layer.weight.device
            if device not in generators:
                generators[device] = torch.Generator(device=device).manual_seed(dummy_seed)
            layer.quant.init_dummy(layer, generators[device])
        try:
            layer.quant.finish(layer)
        except ValueError as exc:
            raise ValueError(f"FP8 layer {name}: {exc}") from exc
