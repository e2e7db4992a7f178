#!/usr/bin/env bash
# Prints the Prometheus image for compose.yaml's monitoring profile: the official one when it is present
# or can be pulled, else TAG, built here on the Debian base image from Debian's own prometheus package,
# started as the official image starts (same config path, storage in /prometheus, port 9090).
#
#   prometheus-image.sh OFFICIAL_IMAGE TAG DEBIAN_BASE_IMAGE
set -euo pipefail
OFFICIAL=${1:?official image}; TAG=${2:?local tag}; BASE=${3:?a Debian base image}

if docker image inspect "$OFFICIAL" >/dev/null 2>&1 || docker pull -q "$OFFICIAL" >/dev/null 2>&1; then
  echo "$OFFICIAL"; exit 0
fi
if ! docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "no registry: building $TAG from Debian's prometheus package" >&2
  ctx=$(mktemp -d)
  trap 'rm -rf "$ctx"' EXIT
  cat >"$ctx/Dockerfile" <<EOD
FROM $BASE
USER root
RUN apt-get update && apt-get install -y --no-install-recommends prometheus \\
    && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus", "--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
EOD
  DOCKER_BUILDKIT=0 docker build -q -t "$TAG" "$ctx" >&2
fi
echo "$TAG"
