# Two commands do all set-up on a fresh machine (both create .venv idempotently):
#   make run    serve the embedded default model (SmolLM2-135M-Instruct) on 127.0.0.1:8080
#   make test   run the test suite
VENV := .venv
STAMP := $(VENV)/.llamactor-installed
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install run test bench clean

$(STAMP): pyproject.toml ops/setup_venv.sh
	bash ops/setup_venv.sh
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/llamactor serve $(ARGS)

test: $(STAMP)
	bash ops/typecheck.sh
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)
