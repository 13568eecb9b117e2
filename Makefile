# The two commands of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup demo test test-serial test-fast nightly frameworks frameworks-venv lint proto proto-check chart-schema bench clean

setup:
	PYTHON=$(PYTHON) scripts/setup.sh

demo: setup
	$(VENV)/bin/tide demo

proto: setup
	$(PY) scripts/gen_protos.py
	$(PY) scripts/gen_api_docs.py

proto-check: setup
	$(PY) scripts/gen_protos.py --check

# The settings maps of deploy/helm/tide/values.schema.json, from the services' settings.
chart-schema: setup
	$(PY) scripts/gen_chart_schema.py

LINT_PATHS := tide bench scripts tests deploy/compat

lint: setup
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy tide bench scripts
	# The tree itself, not wherever the venv's editable install points.
	PYTHONPATH=. $(VENV)/bin/lint-imports

# The tests run in TEST_WORKERS pytest-xdist processes: most of their time is spent
# waiting on the processes and sockets they start, so more workers than cores pays. Then
# the tests marked serial run, two at a time: each asserts a latency or detection-time
# bound, which measures the machine, and three busy tests beside it would be what it
# measured; one other of them, mostly waiting too, is not (docs/reliability.md "The suite").
TEST_WORKERS ?= 6
SERIAL_WORKERS ?= 2
# Bytecode is written during the tests even where PYTHONDONTWRITEBYTECODE is set (this
# project's machines and CI): otherwise each pytest process rewrote every test module's
# asserts again (a collection took 10.9 s against 6.3 s with them kept) and each service,
# launcher and worker process the tests start compiled tide's modules from source.
TEST_ENV_BASE := TIDE_TEST_STRICT=1 PYTHONDONTWRITEBYTECODE=
TEST_ENV := $(TEST_ENV_BASE) TIDE_TEST_PG_URL=postgresql+psycopg://postgres@127.0.0.1:5432/tide_test

# The frameworks' venv is built beside the serial tests, which leave the machine mostly
# idle, on one core (uv takes every core otherwise), and the lint runs beside the
# frameworks' tests, not before the suite. The serial tests get nothing busier: beside a
# loaded core, the lint and uv's full speed made a failover overrun its bound
# (docs/reliability.md "The suite" has the figures). --output-sync keeps each one's output
# whole.
test: setup proto-check
	scripts/ensure_postgres.sh
	scripts/ensure_prometheus.sh
	$(TEST_ENV) $(PY) -m pytest -m "not nightly and not serial" -n $(TEST_WORKERS) --dist worksteal
	UV_CONCURRENT_INSTALLS=1 UV_CONCURRENT_BUILDS=1 \
		$(MAKE) -j2 --output-sync=target test-serial frameworks-venv
	$(MAKE) -j2 --output-sync=target frameworks lint

# The serial tests start no Paddle template (tests/support/paddle_template.py): its import
# at their start, beside the frameworks' venv, made a failover overrun its bound.
test-serial: setup
	$(TEST_ENV) TIDE_TEST_PADDLE_TEMPLATE=0 $(PY) -m pytest -m "serial and not nightly" \
		-n $(SERIAL_WORKERS) --dist worksteal

# The full-length reliability runs (docs/reliability.md: the 10-minute soak, the long
# write contention), left out of `make test` for its 30-minute budget.
nightly: setup
	scripts/ensure_postgres.sh
	$(TEST_ENV) $(PY) -m pytest -m nightly --timeout 1800

# PaddleFormers' Trainer under Tide (docs/migrate.md), in its own venv: the paddleformers
# extra pins numpy <= 1.26.4 while constraints.txt holds numpy 2, and the datasets release
# that fits its pyarrow < 21 (4.0) wants an older fsspec. .venv's pytest skips these tests;
# `make test` ends with this target.
frameworks-venv:
	PYTHON=$(PYTHON) VENV=.venv-frameworks EXTRAS=services,trainer,paddle-cpu,dev,demo,paddleformers \
		UNPINNED='numpy|pyarrow|fsspec' scripts/setup.sh

frameworks: frameworks-venv
	$(TEST_ENV_BASE) .venv-frameworks/bin/python -m pytest -m paddleformers

test-fast: setup
	$(PY) -m pytest -m "unit or component"

bench: setup
	$(PY) -m bench.ingest --quick
	$(PY) -m bench.agent --quick
	$(PY) -m bench.coordinator --quick
	$(PY) -m bench.rescale --quick
	$(PY) -m bench.parity --quick
	$(PY) -m bench.hybrid --quick
	$(PY) -m bench.preemption --quick
	$(PY) -m bench.simulate --quick
	$(PY) -m bench.soak --quick
	$(PY) -m bench.contention --quick
	$(PY) -m bench.history --quick
	$(PY) -m bench.scale --quick
	$(PY) -m bench.tick --quick
	$(PY) -m bench.security --quick
	$(PY) -m bench.k8s --quick

clean:
	rm -rf $(VENV) .venv-frameworks .mypy_cache .ruff_cache .pytest_cache .tide
