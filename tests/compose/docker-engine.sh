#!/usr/bin/env bash
# A Docker engine for `make test-compose`.
#
#   docker-engine.sh start DIR   use the running engine, or install and start one (root, Debian); when it
#                                starts one, its pid goes to DIR/dockerd.pid and its log to DIR/dockerd.log
#   docker-engine.sh stop DIR    stop the engine `start` started (by its pid), if any
#
# `start` exits 0 when an engine answers, 3 when this environment cannot run one (not root, no apt, or
# dockerd cannot start here: no privileges for namespaces or mounts), anything else on a real failure.
#
# compose.yaml's `healthcheck.start_interval` needs engine >= 25. Debian 13 packages one; on Debian 12,
# whose own engine is 20.10, Debian 13's engine is unpacked into DIR and runs beside Debian 12's runc.
set -euo pipefail
ACTION=${1:?start or stop}
DIR=$(mkdir -p "${2:?work folder}" && cd "$2" && pwd)
MIN_ENGINE_MAJOR=25

cannot() { echo "no Docker engine: $*"; exit 3; }

engine_major() { docker version --format '{{.Server.Version}}' 2>/dev/null | cut -d. -f1; }

debian_mirror() {
  local uri
  uri=$(grep -h -m1 -E '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' || true)
  [ -n "$uri" ] || uri=$(grep -h -m1 -E '^deb ' /etc/apt/sources.list 2>/dev/null | awk '{print $2}' || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

# Debian 13's engine, its containerd and (when missing) its CLI, unpacked into DIR/root.
unpack_trixie_engine() {
  local opts pkgs
  mkdir -p "$DIR/apt/lists/partial" "$DIR/apt/cache/archives/partial" "$DIR/debs" "$DIR/root"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $(debian_mirror) trixie main" \
    >"$DIR/apt/sources.list"
  opts=(-o Dir::Etc::SourceList="$DIR/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o Dir::State::Lists="$DIR/apt/lists" -o Dir::Cache="$DIR/apt/cache")
  apt-get "${opts[@]}" update -qq
  pkgs=(docker.io containerd)
  command -v docker >/dev/null || pkgs+=(docker-cli)
  (cd "$DIR/debs" && apt-get "${opts[@]}" download -qq "${pkgs[@]}")
  for deb in "$DIR"/debs/*.deb; do dpkg-deb -x "$deb" "$DIR/root"; done
  # Debian 13's runc needs a newer glibc than Debian 12's: keep the system's runc and tini.
  rm -f "$DIR/root/usr/sbin/runc" "$DIR/root/usr/bin/runc"
  ln -sf /usr/bin/tini-static "$DIR/root/usr/bin/docker-init"
  touch "$DIR/root/.unpacked"
}

start() {
  if docker info >/dev/null 2>&1; then
    [ "$(engine_major)" -ge "$MIN_ENGINE_MAJOR" ] || { echo "the running Docker engine is older than $MIN_ENGINE_MAJOR"; exit 1; }
    echo "using the running Docker engine $(docker version --format '{{.Server.Version}}')"
    return
  fi
  [ "$(id -u)" = 0 ] || cannot "none answers here and starting one needs root"
  command -v apt-get >/dev/null || cannot "none answers here and this is not a Debian system to install one"
  export DEBIAN_FRONTEND=noninteractive
  local codename bin
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  if [ "$codename" = bookworm ]; then
    if [ ! -e "$DIR/root/.unpacked" ]; then
      apt-get update -qq
      apt-get install -y -qq --no-install-recommends runc tini iptables ca-certificates >/dev/null
      unpack_trixie_engine
    fi
    [ -x "$DIR/root/usr/bin/docker" ] && ! command -v docker >/dev/null && export PATH="$DIR/root/usr/bin:$PATH"
    bin="$DIR/root/usr/sbin"
    export PATH="$DIR/root/usr/sbin:$DIR/root/usr/bin:$PATH"
  else
    command -v dockerd >/dev/null || { apt-get update -qq
      apt-get install -y -qq --no-install-recommends docker.io iptables ca-certificates >/dev/null; }
    bin=$(dirname "$(command -v dockerd)")
  fi
  nice -n 19 "$bin/dockerd" --data-root "$DIR/data" --exec-root "$DIR/exec" --pidfile "$DIR/dockerd.pid" \
    >"$DIR/dockerd.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 120); do
    docker info >/dev/null 2>&1 && break
    kill -0 "$pid" 2>/dev/null || { tail -n 5 "$DIR/dockerd.log"; cannot "dockerd exited at start (log: $DIR/dockerd.log)"; }
    sleep 0.5
  done
  docker info >/dev/null 2>&1 || { kill "$pid"; cannot "dockerd did not answer in 60 s (log: $DIR/dockerd.log)"; }
  echo "$pid" >"$DIR/dockerd.pid"
  echo "started Docker engine $(docker version --format '{{.Server.Version}}') (pid $pid)"
}

stop() {
  [ -f "$DIR/dockerd.pid" ] || return 0
  local pid
  pid=$(cat "$DIR/dockerd.pid")
  # Only the dockerd started here: a stale file's pid may belong to another process by now.
  if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = dockerd ] && kill "$pid" 2>/dev/null; then
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  fi
  rm -f "$DIR/dockerd.pid"
  ip link delete docker0 2>/dev/null || true
  echo "stopped the Docker engine (pid $pid)"
}

"$ACTION"
