# Two commands do all set-up on a fresh machine (both create .venv idempotently):
#   make run          serve the embedded default model (SmolLM2-135M-Instruct) on 127.0.0.1:8080
#   make test         everything, stopping at the first failure: `make check`, then the whole suite
#                     (on two pytest workers, then the `serial` tests alone: ops/run_suite.sh)
# Both build llama.cpp for the instruction sets this CPU really runs (ops/setup/cpuprobe.py) and check
# the build by decoding a prompt with it (ops/setup/buildcheck.py). BACKEND=cuda (or vulkan, rocm,
# metal) adds that GPU backend: `make run BACKEND=cuda`; CMAKE_ARGS=... is passed through to
# llama.cpp's CMake (docs/gpu.md).
# and while working:
#   make test-fast    the fast tier: every test not marked `slow` (well under a minute)
#   make check        the static checks alone: ruff lint, ruff format, mypy, the layer contracts
#   make docs         build the documentation site (mkdocs, strict) into .venv/site
#   make test-random  the suite in a shuffled order, to catch tests that depend on each other's
#                     order (the seed is printed; SEED=n repeats a run; PYTEST_ARGS='-m "not slow"')
#   make conformance  llama.cpp's own server test suite against llama-server and llamactor, compared
#                     (writes docs/conformance.md; not part of `make test`; ARGS='-- -k metrics')
VENV := .venv
BACKEND ?= cpu
# what ops/setup_venv.sh reads beside BACKEND (docs/gpu.md): extra CMake arguments, GPU architectures
export CMAKE_ARGS CUDA_ARCHITECTURES AMDGPU_TARGETS
# one stamp per backend: `make run BACKEND=cuda` after a CPU set-up runs the set-up again
STAMP := $(VENV)/.llamactor-installed-$(BACKEND)
ARGS ?=
PYTEST_ARGS ?=
SEED ?=
# Bytecode is cached under .venv/pycache, never beside the sources, even where the environment
# says not to write any (PYTHONDONTWRITEBYTECODE): compiling every module afresh on each run
# doubled pytest's collection time (8 s against 4 on 2 cores).
PYTEST := env PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(CURDIR)/$(VENV)/pycache $(VENV)/bin/python -m pytest

.PHONY: install run check docs test test-fast test-random conformance clean

$(STAMP): pyproject.toml ops/setup_venv.sh ops/setup/cpuprobe.py ops/setup/cpusets.py ops/setup/gpubackends.py ops/setup/buildcheck.py
	BACKEND=$(BACKEND) bash ops/setup_venv.sh
	rm -f $(VENV)/.llamactor-installed-*
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/llamactor serve $(ARGS)

# In this order, each stopping the run when it fails: lint, format, types, layers.
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	bash ops/typecheck.sh
	$(VENV)/bin/lint-imports --no-cache

# The suite in two parts (ops/run_suite.sh): the tests not marked `serial` on two workers
# (pytest-xdist), then the `serial` ones alone. pytest exits 5 when it ran no test: that fails
# here like any other non-zero exit (unless only one of the two parts selected nothing).
test: check docs
	bash ops/run_suite.sh $(PYTEST) -- $(PYTEST_ARGS)

# The documentation site, built strictly (a broken link or a missing example file fails it),
# into the venv: nothing is written to the repository.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -q -d $(VENV)/site

test-fast: $(STAMP)
	$(PYTEST) -q -m "not slow" $(PYTEST_ARGS)

test-random: $(STAMP)
	@seed=$(or $(SEED),$$(od -An -N3 -tu4 /dev/urandom | tr -d ' ')); echo "random order, seed $$seed (SEED=$$seed repeats it)"; \
	$(PYTEST) -q --random-order-bucket=module --random-order-seed=$$seed $(PYTEST_ARGS)

# The vendored llama.cpp's tools/server/tests, once per server, on local models (ops/conformance/run.py).
conformance: $(STAMP)
	$(VENV)/bin/python -m llamactor.ops.conformance.run $(ARGS)

clean:
	rm -rf $(VENV)
