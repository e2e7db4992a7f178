#!/usr/bin/env bash
# `make test-chaos`: the chaos suite (tests/chaos) through make test-compose's machinery (tests/compose/run.sh:
# the same Docker engine, base image and project image - Docker's layer cache makes a second build a no-op),
# on a compose project of its own (epdserve-chaos), which it always takes down.
#
# Beyond what run.sh needs, the faults need root on the host (nsenter into containers' network namespaces)
# and iptables there (installed here from Debian's packages when missing, as run.sh installs Docker). Where
# containers cannot run at all, or this is not root, it says so in one line and passes (unless
# EPDSERVE_REQUIRE_DOCKER=1). Arguments go to pytest after tests/chaos, e.g. `-k kill-decode`.
set -uo pipefail
cd "$(dirname "$0")/../.."
SUITE="make test-chaos"

skipped() {
  echo "$SUITE: SKIPPED - $1"
  [ "${EPDSERVE_REQUIRE_DOCKER:-0}" = 1 ] && exit 1
  exit 0
}

if ! command -v iptables >/dev/null || ! command -v nsenter >/dev/null; then
  [ "$(id -u)" = 0 ] || skipped "network faults need root (nsenter, iptables) and this is not root"
  command -v apt-get >/dev/null || skipped "no iptables or nsenter here, and no apt-get to install them"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends iptables util-linux >/dev/null \
    || { echo "$SUITE: installing iptables failed"; exit 1; }
fi
[ "$(id -u)" = 0 ] || skipped "network faults need root (nsenter into containers' network namespaces)"

EPDSERVE_SUITE="$SUITE" EPDSERVE_COMPOSE_PROJECT=epdserve-chaos exec tests/compose/run.sh tests/chaos "$@"
