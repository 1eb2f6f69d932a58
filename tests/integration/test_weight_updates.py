"""Weight updates on the whole appliance, checked against transformers on the same weights: a gloo
trainer broadcasting new weights, a refused update, a chunked update whose version waits for
finish_weight_update, a reload from disk, and pause/continue. One appliance for the module; the
test process plays the trainer (rank 0 of the group)."""

from __future__ import annotations

import base64
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save, save_file
from transformers import AutoModelForCausalLM

from app.worker.loader.update_group import open_update_group
from tests.support.appliance import Appliance, free_port
from tests.support.model_factory import build_tiny_model

PROMPT = [17, 5, 92, 41, 8, 33, 60, 2, 71]
NEW_TOKENS = 12


def hf_greedy(model_dir: Path, ids: list[int] = PROMPT, new_tokens: int = NEW_TOKENS) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(ids)))
    return out[0, len(ids):].tolist()


def perturbed_copy(src: Path, dst: Path, seed: int) -> dict[str, torch.Tensor]:
    """A copy of the checkpoint with every tensor moved by noise; returns the new tensors."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    new = {name: (t + 0.3 * torch.randn(t.shape, generator=gen)).contiguous() for name, t in tensors.items()}
    save_file(new, dst / "model.safetensors", metadata={"format": "pt"})
    return new


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weights")
    base = build_tiny_model("llama", root / "base", seed=1)
    return {
        "base": base,
        "second": build_tiny_model("llama", root / "second", seed=2),
        "other_arch": build_tiny_model("llama", root / "other", seed=3, intermediate_size=96),
        "root": root,
    }


@pytest.fixture(scope="module")
def app(models, log_dir):
    flags = ("--weight-version", "v0", "--block-size", "4", "--max-total-tokens", "2048",
             "--weight-update-roots", str(models["root"]))  # the other checkpoints lie beside the served one
    with Appliance(models["base"], *flags, log_dir=log_dir) as appliance:
        yield appliance


def served(app: Appliance, ids: list[int] = PROMPT, new_tokens: int = NEW_TOKENS) -> tuple[list[int], str]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(f"{app.base_url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"], r.json()["meta_info"]["weight_version"]


def post(app: Appliance, path: str, body: dict | None = None, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{app.base_url}{path}", json=body, timeout=timeout)


def version(app: Appliance) -> str:
    return httpx.get(f"{app.base_url}/get_weight_version", timeout=10).json()["weight_version"]


@pytest.fixture(scope="module")
def group(app):
    """The trainer's end of a gloo group with the appliance's worker (rank 1)."""
    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        trainer: Future = pool.submit(open_update_group, "127.0.0.1", port, 0, 2, "trainer", "gloo", 60)
        r = post(app, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                      "rank_offset": 1, "world_size": 2, "group_name": "trainer",
                                                      "backend": "gloo"})
        assert r.status_code == 200 and r.json()["success"], r.text
        yield trainer.result(60)
    assert post(app, "/destroy_weights_update_group", {"group_name": "trainer"}).json()["success"]


def broadcast_update(app: Appliance, group, names: list[str], tensors: list[torch.Tensor], **body) -> httpx.Response:
    """POST update_weights_from_distributed while the trainer broadcasts the tensors, as a trainer does."""
    request = {"names": names, "dtypes": [str(t.dtype) for t in tensors], "shapes": [list(t.shape) for t in tensors],
               "group_name": "trainer", **body}
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(post, app, "/update_weights_from_distributed", request)
        for t in tensors:
            group.broadcast(t)
        return reply.result(120)


def test_broadcast_update_serves_the_new_weights_and_version(app, models, group) -> None:
    before, v = served(app)
    assert v == "v0" and before == hf_greedy(models["base"])
    new = perturbed_copy(models["base"], models["root"] / "step1", seed=11)
    r = broadcast_update(app, group, list(new), list(new.values()), weight_version="step-1")
    assert r.status_code == 200 and r.json()["success"], r.text
    assert "Weight version updated to step-1" in r.json()["message"]
    out, v = served(app)
    assert v == "step-1" == version(app)
    assert out == hf_greedy(models["root"] / "step1") != before


def test_a_refused_broadcast_changes_neither_output_nor_version(app, group) -> None:
    before, _ = served(app)
    good = torch.ones(64)
    wrong = torch.ones(7, 64)  # announced and sent as it is: the worker receives it, then refuses the update
    r = broadcast_update(app, group, ["model.norm.weight", "model.layers.0.mlp.down_proj.weight"], [good, wrong],
                         weight_version="never")
    assert r.status_code == 400 and r.json()["success"] is False and "down_proj.weight has shape [7, 64]" in (
        r.json()["message"])
    assert served(app) == (before, "step-1") and version(app) == "step-1"


def test_a_chunked_update_advertises_its_version_only_at_finish(app, models) -> None:
    new = perturbed_copy(models["base"], models["root"] / "step2", seed=22)
    names = list(new)
    chunks = [names[: len(names) // 2], names[len(names) // 2:]]

    def payload(part: list[str]) -> str:
        return base64.b64encode(save({n: new[n] for n in part})).decode()

    assert post(app, "/start_weight_update").json()["success"]
    r = post(app, "/update_weights_from_tensor", {"serialized_named_tensors": [payload(chunks[0])],
                                                  "weight_version": "step-2"})
    assert r.status_code == 200 and "deferred" in r.json()["message"]
    assert version(app) == "step-1"  # partially updated weights never advertise the new version
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(served, app)  # generation waits for the update to finish
        time.sleep(1.0)
        assert not waiting.done()
        assert post(app, "/update_weights_from_tensor", {"serialized_named_tensors": [payload(chunks[1])]}).json()[
            "success"]
        assert version(app) == "step-1"
        done = post(app, "/finish_weight_update")
        assert done.status_code == 200 and "step-2" in done.json()["message"]
        out, v = waiting.result(60)
    expected = hf_greedy(models["root"] / "step2")
    assert v == "step-2" == version(app) and out == expected
    assert served(app) == (expected, "step-2")  # the prefix cache was flushed: no stale KV


def test_reload_from_disk(app, models) -> None:
    failed = post(app, "/update_weights_from_disk", {"model_path": str(models["other_arch"]), "weight_version": "x"})
    assert failed.status_code == 400 and "intermediate_size" in failed.json()["message"]
    assert version(app) == "step-2"
    r = post(app, "/update_weights_from_disk", {"model_path": str(models["second"]), "weight_version": "disk-1"})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert served(app) == (hf_greedy(models["second"]), "disk-1")
    info = httpx.get(f"{app.base_url}/model_info", timeout=10).json()
    assert info == {"model_path": str(models["second"]), "weight_version": "disk-1"}
    # Without a weight_version the version stays.
    assert post(app, "/update_weights_from_disk", {"model_path": str(models["base"])}).json()["success"]
    assert served(app) == (hf_greedy(models["base"]), "disk-1")


def test_pause_holds_requests_until_continue(app) -> None:
    assert post(app, "/pause_generation").json() == {"success": True, "message": "Paused generation."}
    result: list = []
    worker = threading.Thread(target=lambda: result.append(served(app, new_tokens=3)))
    worker.start()
    worker.join(1.0)
    assert worker.is_alive() and not result
    assert post(app, "/continue_generation").json()["success"]
    worker.join(60)
    assert result and len(result[0][0]) == 3
    assert post(app, "/update_weight_version", {"new_version": "manual"}).json()["new_version"] == "manual"
    assert served(app)[1] == "manual"
