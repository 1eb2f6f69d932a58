"""deploy/kubernetes: every object validates against the Kubernetes API's own types (the `kubernetes`
Python client's models, a dev dependency: required fields, and no field the API does not have), and the
manifests agree with the appliance: probes on its routes, the recipe and env overrides valid Settings,
volumes mounted where the image keeps its caches, the Service and ServiceMonitor wired to the pod."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes
import pydantic
import pytest
import yaml

from app.config import load_settings, meta
from app.config.names import NON_SETTING_ENV_VARS, env_of
from app.http.health import OPEN_PATHS

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
CORE_TYPES = {  # (apiVersion, kind) -> the client's model
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
    ("v1", "Service"): "V1Service",
    ("apps/v1", "Deployment"): "V1Deployment",
}


def _objects() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]
    return docs


def _by_kind(kind: str) -> list[dict[str, Any]]:
    return [o for o in _objects() if o["kind"] == kind]


class UnknownFields(ValueError):
    pass


def _validated(doc: dict[str, Any]) -> Any:
    """The client's model of `doc`: pydantic models of the API's OpenAPI types, which refuse a missing
    required field and a value of the wrong type (strict). A field the API does not have is dropped on
    the way in, so the model written back must be the document itself."""
    model = getattr(kubernetes.client, CORE_TYPES[(doc["apiVersion"], doc["kind"])]).from_dict(doc)
    back = kubernetes.client.ApiClient().sanitize_for_serialization(model)
    if back != doc:
        raise UnknownFields(f"{doc['kind']} has fields the API does not: {_diff(doc, back)}")
    return model


def _diff(doc: Any, back: Any, path: str = "") -> list[str]:
    if isinstance(doc, dict) and isinstance(back, dict):
        return [f"{path}.{k}" for k in doc if k not in back] + [
            d for k in doc if k in back for d in _diff(doc[k], back[k], f"{path}.{k}")]
    if isinstance(doc, list) and isinstance(back, list) and len(doc) == len(back):
        return [d for i, (a, b) in enumerate(zip(doc, back, strict=True)) for d in _diff(a, b, f"{path}[{i}]")]
    return [] if doc == back else [path]


def test_every_manifest_is_listed_and_every_core_object_validates() -> None:
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    kinds = {(o["apiVersion"], o["kind"]) for o in _objects()}
    assert kinds == set(CORE_TYPES) | {("monitoring.coreos.com/v1", "ServiceMonitor")}
    for doc in _objects():
        if (doc["apiVersion"], doc["kind"]) in CORE_TYPES:
            _validated(doc)


@pytest.mark.parametrize("change", ["unknown field", "missing name", "port as string"])
def test_the_validation_catches_what_the_api_would_refuse(change: str) -> None:
    (deployment,) = _by_kind("Deployment")
    doc = json.loads(json.dumps(deployment))
    container = doc["spec"]["template"]["spec"]["containers"][0]
    if change == "unknown field":
        container["startupProbes"] = container.pop("startupProbe")
    elif change == "missing name":
        del container["name"]
    else:
        container["ports"][0]["containerPort"] = "8000"
    with pytest.raises(UnknownFields if change == "unknown field" else pydantic.ValidationError,
                       match="startupProbes" if change == "unknown field" else None):
        _validated(doc)


def _container() -> dict[str, Any]:
    (deployment,) = _by_kind("Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_probes_use_the_appliance_routes_and_port() -> None:
    c = _container()
    (port,) = c["ports"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert port["containerPort"] == int(env["TOKENSPEED_PORT"]) and port["name"] == "http"
    assert c["startupProbe"]["httpGet"]["path"] == "/readiness"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] in OPEN_PATHS and c[probe]["httpGet"]["port"] == "http"
    # Long enough for a first download of an 8B model, as compose's start period.
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 15 * 60
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_recipe_and_env_overrides_are_valid_settings(tmp_path: Path) -> None:
    maps = {o["metadata"]["name"]: o for o in _by_kind("ConfigMap")}
    recipe_map, env_map = maps["tokenspeed-recipe"], maps["tokenspeed-env"]
    c = _container()
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    mount = next(m for m in c["volumeMounts"] if m["name"] == "recipe")
    assert env["TOKENSPEED_CONFIG"] == f"{mount['mountPath']}/recipe.yaml"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(recipe_map["data"]["recipe.yaml"])
    overrides = {k: v for k, v in {**env, **env_map["data"]}.items() if k.startswith("TOKENSPEED_")}
    known = {env_of(name) for name in meta.fields()} | NON_SETTING_ENV_VARS
    assert set(overrides) <= known
    # The ConfigMap's recipe is configs/recipes/qwen3-0.6b-bf16.yaml, value for value.
    shipped = load_settings([], {"TOKENSPEED_CONFIG": str(ROOT / "configs/recipes/qwen3-0.6b-bf16.yaml")})
    assert load_settings([], {"TOKENSPEED_CONFIG": str(recipe)}) == shipped
    settings = load_settings([], {**overrides, "TOKENSPEED_CONFIG": str(recipe)})
    assert settings.enable_metrics and settings.port == 8000 and settings.host == "0.0.0.0"
    assert [r["configMapRef"]["name"] for r in c["envFrom"]] == [env_map["metadata"]["name"]]


def test_caches_shm_and_claims_are_wired() -> None:
    (deployment,) = _by_kind("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in _container()["volumeMounts"]}
    assert {m["name"] for m in mounts.values()} == set(volumes)
    # The image's HF_HOME and kernel caches (docker/Dockerfile) live on the claim.
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    for path in ("/var/cache/tokenspeed/huggingface", "/var/cache/tokenspeed/kernels"):
        assert path in dockerfile and mounts[path]["name"] == "cache"
    (claim,) = _by_kind("PersistentVolumeClaim")
    assert volumes["cache"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and mounts["/dev/shm"]["name"] == "dshm"
    assert pod["securityContext"]["runAsUser"] == 10001 and "USER ${UID}:${UID}" in dockerfile
    assert deployment["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"][
        "labels"].items()
    assert deployment["spec"]["strategy"]["type"] == "Recreate"  # the GPU and a ReadWriteOnce claim


def test_service_and_servicemonitor_reach_the_pod() -> None:
    (deployment,) = _by_kind("Deployment")
    (service,) = _by_kind("Service")
    (monitor,) = _by_kind("ServiceMonitor")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"
