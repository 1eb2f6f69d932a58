"""The worker side of weight updates: all-or-nothing checks, disk reloads, tensor payloads, and the
trainer group (gloo, two ranks in threads), including a trainer that builds its end the way
SGLang-compatible trainers do (torch's _new_process_group_helper over PrefixStore(group_name))."""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save, save_file

from app import protocol as p
from app.worker.loader import load_hf_config, load_weights
from app.worker.loader.update_group import open_update_group
from app.worker.loader.updates import (
    TargetMap,
    UpdateError,
    UpdateGroups,
    WeightControl,
    allowed_roots,
    decode_named_tensors,
    update_from_disk,
    update_from_tensors,
)
from app.worker.models import model_class_for
from app.worker.models.dense import DenseCausalLM
from app.worker.parallel import SINGLE
from tests.support.appliance import free_port
from tests.support.model_factory import build_tiny_model
from tests.support.settings import make_settings

SETTINGS = make_settings()  # the defaults: no download dir, no extra roots
EVERYWHERE = [Path("/")]  # roots for the tests that are not about them


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wu")
    dirs = {
        "a": build_tiny_model("llama", root / "a", seed=1, num_hidden_layers=2),
        "b": build_tiny_model("llama", root / "b", seed=2, num_hidden_layers=2),
        "wide": build_tiny_model("llama", root / "wide", seed=3, num_hidden_layers=2, intermediate_size=96),
    }
    return dirs


def loaded(model_dir: Path) -> tuple[DenseCausalLM, object]:
    config = load_hf_config(model_dir)
    model = model_class_for(config)(config, torch.float32, 64)
    load_weights(model, model_dir, "auto")
    return model, config


def snapshot(model: DenseCausalLM) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_disk_reload_to_another_checkpoint_equals_loading_it(model_dirs) -> None:
    model, config = loaded(model_dirs["a"])
    message = update_from_disk(model, config, SETTINGS, str(model_dirs["b"]), None, EVERYWHERE)
    assert message.startswith("Loaded") and "safetensors" in message
    assert same(snapshot(model), snapshot(loaded(model_dirs["b"])[0]))


def test_refused_disk_reloads_leave_the_weights_alone(model_dirs, tmp_path) -> None:
    model, config = loaded(model_dirs["a"])
    before = snapshot(model)
    with pytest.raises(UpdateError, match="different model .*intermediate_size"):
        update_from_disk(model, config, SETTINGS, str(model_dirs["wide"]), None, EVERYWHERE)
    # Same config, but one tensor missing and one of the wrong shape: both named, nothing changed.
    broken = tmp_path / "broken"
    shutil.copytree(model_dirs["b"], broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(UpdateError) as info:
        update_from_disk(model, config, SETTINGS, str(broken), "safetensors", EVERYWHERE)
    assert "down_proj.weight is missing" in str(info.value) and "k_proj.weight has shape [3, 3]" in str(info.value)
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(model_dirs["b"] / "config.json", config_only)
    with pytest.raises(UpdateError, match="no safetensors weights"):
        update_from_disk(model, config, SETTINGS, str(config_only), "safetensors", EVERYWHERE)
    with pytest.raises(UpdateError, match="is a file"):
        update_from_disk(model, config, SETTINGS, str(tmp_path / "broken" / "model.safetensors"), None, EVERYWHERE)
    with pytest.raises(UpdateError, match="dummy"):
        update_from_disk(model, config, SETTINGS, str(model_dirs["b"]), "dummy", EVERYWHERE)
    assert same(snapshot(model), before)


def test_disk_reloads_read_only_below_the_allowed_roots(model_dirs, tmp_path) -> None:
    """The served model's directory, the download cache and --weight-update-roots; a path outside them, a
    symbolic link leading out, or one that does not exist all get the same answer, naming nothing found."""
    model, config = loaded(model_dirs["a"])
    before = snapshot(model)
    settings = make_settings(download_dir=str(tmp_path / "cache"),
                             weight_update_roots=[str(model_dirs["b"].parent / "wide")])
    roots = allowed_roots(model_dirs["a"], settings)
    assert roots == [model_dirs["a"].resolve(), (tmp_path / "cache").resolve(), (model_dirs["b"].parent / "wide").resolve()]
    (tmp_path / "escape").symlink_to(model_dirs["b"])  # b exists, but is not below a root
    answers = set()
    for outside in ["/etc", "/nonexistent/model", str(model_dirs["b"]), f"{model_dirs['a']}/../b", str(tmp_path / "escape"),
                    "~/../../etc/passwd"]:
        with pytest.raises(UpdateError, match="is not below an allowed root") as info:
            update_from_disk(model, config, settings, outside, None, roots)
        answers.add(str(info.value).replace(repr(outside), "PATH"))
    assert len(answers) == 1 and "/etc" not in answers.pop()
    assert same(snapshot(model), before)
    # Below a root (the served model's own directory, a named root): read as before.
    assert update_from_disk(model, config, settings, str(model_dirs["a"]), None, roots).startswith("Loaded")
    with pytest.raises(UpdateError, match="different model"):
        update_from_disk(model, config, settings, str(model_dirs["b"].parent / "wide"), None, roots)


def test_tensor_updates_fill_fused_slices_and_refuse_as_a_whole(model_dirs) -> None:
    model, _ = loaded(model_dirs["a"])
    new_v = torch.full((32, 64), 0.5)
    new_up = torch.full((128, 64), -0.25)
    payload = save({"model.layers.0.self_attn.v_proj.weight": new_v, "model.layers.1.mlp.up_proj.weight": new_up})
    assert update_from_tensors(model, list(decode_named_tensors(payload).items())) == "Updated 2 tensors."
    targets = {t.name: t for t in TargetMap(model).check(
        [("model.layers.0.self_attn.v_proj.weight", (32, 64), "float32"),
         ("model.layers.1.mlp.up_proj.weight", (128, 64), "float32")], complete=False)}
    assert torch.equal(targets["model.layers.0.self_attn.v_proj.weight"].view(), new_v)
    assert torch.equal(targets["model.layers.1.mlp.up_proj.weight"].view(), new_up)
    before = snapshot(model)
    bad = [("model.norm.weight", torch.ones(64)), ("model.layers.0.mlp.gate_proj.weight", torch.ones(4, 4)),
           ("lm_head.bias", torch.ones(3)), ("model.embed_tokens.weight", torch.ones(model.model.embed_tokens.weight.shape, dtype=torch.int64))]
    with pytest.raises(UpdateError) as info:
        update_from_tensors(model, bad)
    text = str(info.value)
    assert "gate_proj.weight has shape [4, 4]" in text and "unknown tensor lm_head.bias" in text
    assert "embed_tokens.weight has dtype int64" in text
    assert same(snapshot(model), before)  # model.norm.weight was fine, yet nothing was applied
    with pytest.raises(UpdateError, match="not safetensors"):
        decode_named_tensors(b"garbage")


def test_bfloat16_updates_are_converted_to_the_model_dtype(model_dirs) -> None:
    model, _ = loaded(model_dirs["a"])
    update_from_tensors(model, [("model.norm.weight", torch.full((64,), 1.5, dtype=torch.bfloat16))])
    assert model.model.norm.weight.dtype == torch.float32 and torch.all(model.model.norm.weight == 1.5)
    with pytest.raises(UpdateError, match="has dtype float8_e4m3fn; updates take float64"):
        update_from_tensors(model, [("model.norm.weight", torch.zeros(64, dtype=torch.float8_e4m3fn))])


def _trainer_group(port: int, name: str, tensors: list[torch.Tensor], sglang_style: bool) -> None:
    if sglang_style:  # what an SGLang-compatible trainer's init_custom_process_group builds
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _new_process_group_helper

        timeout = datetime.timedelta(seconds=30)
        store = dist.TCPStore("127.0.0.1", port, 2, True, timeout)
        group, _ = _new_process_group_helper(2, 0, [], "gloo", dist.PrefixStore(name, store), group_name=name,
                                             timeout=timeout)
        for t in tensors:
            dist.broadcast(t, group_src=0, group=group)
    else:
        group = open_update_group("127.0.0.1", port, 0, 2, name, "gloo", timeout_s=30)
        for t in tensors:
            group.broadcast(t)


@pytest.mark.parametrize("sglang_style", [False, True])
def test_broadcast_updates_over_a_gloo_group(model_dirs, sglang_style) -> None:
    if sglang_style and "group_name" not in inspect.signature(
            __import__("torch.distributed.distributed_c10d", fromlist=["x"])._new_process_group_helper).parameters:
        pytest.skip("this torch's _new_process_group_helper has another signature")
    model, _ = loaded(model_dirs["a"])
    runner = SimpleNamespace(tp=SINGLE, device=torch.device("cpu"), model=model, quant_scheme=None)
    control = WeightControl(runner)
    port, name = free_port(), "wg"
    norm = torch.full((64,), 2.0, dtype=torch.bfloat16)
    wrong = torch.ones(7)
    trainer = threading.Thread(target=_trainer_group, args=(port, name, [norm, wrong], sglang_style))
    trainer.start()
    joined = control.handle(p.InitWeightsUpdateGroup("127.0.0.1", port, rank_offset=1, world_size=2, group_name=name,
                                                     backend="gloo"))
    assert "rank 1 of 2" in joined
    op = p.UpdateWeightsFromDistributed(["model.norm.weight"], ["bfloat16"], [[64]], group_name=name)
    assert control.handle(op) == "Updated 1 tensors."
    assert torch.all(model.model.norm.weight == 2.0)
    # A broadcast whose announced shape does not fit: received in full (the trainer is not left hanging),
    # then refused as a whole.
    bad = dataclasses.replace(op, shapes=[[7]], dtypes=["torch.float32"])
    with pytest.raises(UpdateError, match="has shape \\[7\\]"):
        control.handle(bad)
    trainer.join(30)
    assert not trainer.is_alive() and torch.all(model.model.norm.weight == 2.0)
    assert control.handle(p.DestroyWeightsUpdateGroup(name)).startswith("Destroyed")
    with pytest.raises(UpdateError, match="no weight update group"):
        control.handle(op)


def test_group_arguments_are_checked() -> None:
    groups = UpdateGroups(worker_rank=0)
    with pytest.raises(UpdateError, match="nccl' needs CUDA|outside"):
        groups.init("127.0.0.1", free_port(), 1, 2, "g", "nccl" if not torch.cuda.is_available() else "gloo")
    with pytest.raises(UpdateError, match="outside the group"):
        groups.init("127.0.0.1", free_port(), 3, 2, "g", "gloo")
    with pytest.raises(UpdateError, match="float64, float32"):
        groups.groups["g"] = SimpleNamespace(device=torch.device("cpu"))
        groups.receive(None, "g", ["x"], ["int8"], [[1]])


def test_quantized_models_refuse_weight_changes(model_dirs) -> None:
    model, _ = loaded(model_dirs["a"])
    runner = SimpleNamespace(tp=SINGLE, device=torch.device("cpu"), model=model, quant_scheme=object())
    with pytest.raises(UpdateError, match="quantized"):
        WeightControl(runner).handle(p.UpdateWeightsFromTensor(save({"model.norm.weight": torch.ones(64)})))
