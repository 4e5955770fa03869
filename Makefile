# gpuorch developer entry points. `make demo` runs a simulated fleet through the real services; `make test` tests.
UV ?= uv
export PATH := $(HOME)/.local/bin:$(PATH)

.PHONY: demo test lint bench schemas asyncapi-check env servers clean chaos security sim

env:
	@command -v $(UV) >/dev/null 2>&1 || python3 -m pip install --quiet uv
	@$(UV) sync --frozen --quiet

servers:
	@bash deploy/local/ensure-servers.sh

demo: env servers  ## a 3-node simulated fleet runs a mixed workload of real processes through every service
	@$(UV) run gpuctl demo

# Workers of pytest-xdist for `make test` (--dist loadscope from pyproject's addopts: a module per worker): most tests
# wait on the broker, the database or service processes, so 4 workers pay on 2 cores too. TEST_WORKERS=0: serially.
TEST_WORKERS ?= 4
test: env servers  ## the whole suite against the real RabbitMQ and PostgreSQL, on TEST_WORKERS pytest-xdist workers
	@$(UV) run pytest -q -p no:cacheprovider -n $(TEST_WORKERS)

lint: env
	@$(UV) run ruff check .
	@$(UV) run mypy libs/*/src services/*/src

chaos: env servers  ## faults and hostile input against real processes, checked by the invariant checker (docs/RELIABILITY.md)
	@$(UV) run pytest -q -p no:cacheprovider -m chaos tests/chaos

security: env servers  ## each escalation of issue 29 performed against the real services and seen refused (docs/SECURITY.md); also in make test
	@$(UV) run pytest -q -p no:cacheprovider -m security tests/security

SEEDS ?= 1000
sim: env  ## deterministic simulation of the control plane, SEEDS seeds (a failing seed prints its replay command; docs/RELIABILITY.md)
	@$(UV) run python -m gpuorch_dst --seeds $(SEEDS) $(SIM_ARGS)

bench: env servers  ## speed and scale figures, written as tables under bench/results/
	@$(UV) run python bench/run_all.py

schemas: env  ## regenerate the checked-in JSON Schemas and AsyncAPI document from the models
	@$(UV) run gpuctl schema export --out libs/contracts/schemas

asyncapi-check:  ## parse the checked-in AsyncAPI document with the official parser (node + npm); fails on any error
	@cd deploy/asyncapi-check && npm ci --ignore-scripts --no-audit --no-fund --silent
	@node deploy/asyncapi-check/check.mjs libs/contracts/schemas/asyncapi.json

clean:
	rm -rf var .pytest_cache
