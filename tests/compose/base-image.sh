#!/usr/bin/env bash
# Prints the base image for the project's Dockerfile: the Dockerfile's own default when it is present or
# can be pulled, else TAG, a minimal Debian 12 with Python 3.11 made here without any registry.
#
#   base-image.sh DEFAULT_IMAGE TAG WORKDIR
#
# The local image carries what pip inside a build needs to reach this host's package index: the host's
# extra CA certificates and pip configuration, and the wheel folder that configuration names (find-links).
# Python headers are in it, as in the official python images (the C++ kernels compile against them).
set -euo pipefail
DEFAULT=${1:?default base image}; TAG=${2:?local tag}; DIR=$(mkdir -p "${3:?work folder}" && cd "$3" && pwd)

if docker image inspect "$DEFAULT" >/dev/null 2>&1 || docker pull -q "$DEFAULT" >/dev/null 2>&1; then
  echo "$DEFAULT"; exit 0
fi
if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "$TAG"; exit 0
fi
echo "no registry: making $TAG with mmdebstrap" >&2
command -v mmdebstrap >/dev/null || { apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null; }

rm -rf "$DIR/base"; mkdir -p "$DIR/base"; cd "$DIR/base"
mirror=$(grep -h -m1 -E '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' || true)
mirror=${mirror:-http://deb.debian.org/debian}
sources=("deb $mirror bookworm main" "deb $mirror bookworm-updates main"
         "deb ${mirror%/debian}/debian-security bookworm-security main")
nice -n 19 mmdebstrap --quiet --variant=minbase \
  --include=python3,python3-venv,python3-dev,python-is-python3,ca-certificates bookworm rootfs.tar "${sources[@]}" >&2
docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' -c 'CMD ["python3"]' \
  rootfs.tar "$TAG-rootfs" >/dev/null
rm rootfs.tar

mkdir certs wheels
cp /usr/local/share/ca-certificates/*.crt certs/ 2>/dev/null || true
pip_get() { python3 -m pip config get "global.$1" 2>/dev/null || true; }
find_links=$(pip_get find-links)
[ -d "$find_links" ] && cp "$find_links"/*.whl wheels/ 2>/dev/null || true
{ echo "[global]"; echo "cert = /etc/ssl/certs/ca-certificates.crt"
  [ -n "$(ls wheels)" ] && echo "find-links = /opt/wheels"
  index=$(pip_get index-url); [ -n "$index" ] && echo "index-url = $index"
} >pip.conf
cat >Dockerfile <<EOD
FROM $TAG-rootfs
COPY certs/ /usr/local/share/ca-certificates/
COPY pip.conf /etc/pip.conf
COPY wheels/ /opt/wheels/
RUN update-ca-certificates >/dev/null 2>&1
EOD
DOCKER_BUILDKIT=0 docker build -q -t "$TAG" . >&2
docker rmi "$TAG-rootfs" >/dev/null 2>&1 || true
cd "$DIR" && rm -rf "$DIR/base"
echo "$TAG"
