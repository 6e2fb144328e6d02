# Developer entry points. GNU make. `make test` works on a fresh clone: it builds .venv, starts the local
# stack (compose/stack, no Docker needed) and runs the tests against it.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
STACK := compose/stack
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# pytest-xdist processes for `make test`. The suite mostly waits (leases, sessions, restarts), so more processes
# than the 2 cores pay off: with 4 the suite's processes used 0.75 of the 2 cores and pytest took 548 s here.
# With 5 it took 412-439 s, but 2 of 3 runs failed a test that judges a share or a timing under that load
# (a tier's share with three workers, a delayed task forwarded twice while a cluster broker was killed).
TEST_WORKERS ?= 4
# make test-fast's processes: its tests compute, and start-up costs each process a couple of seconds.
FAST_WORKERS ?= 2

.PHONY: help .venv venv stack-up stack-down stack-status test test-fast demo lint bench clean-venv browser docs

help:
	@echo "make venv          create .venv and install kafka-taskq[dev] (re-run when pyproject.toml changes)"
	@echo "make stack-up      start Postgres, Kafka, schema registry (compose/stack up)"
	@echo "make stack-down    stop them (data kept in .stack/)"
	@echo "make stack-status  show what runs"
	@echo "make test          venv + lint + browser + stack + every test, TEST_WORKERS in parallel (PYTEST_ARGS=...)"
	@echo "make test-fast     unit and contract tests on the in-memory fakes: no services, under a minute"
	@echo "make browser       install Debian's chromium and chromium-driver if missing (the console's tests)"
	@echo "make demo          venv + stack + python -m taskq.demo"
	@echo "make lint          ruff check + mypy over taskq and compose/_stack.py"
	@echo "make bench         venv + stack + taskq bench produce"
	@echo "make docs          build the documentation site into site/ (mkdocs build --strict)"

# The stamp is rebuilt whenever pyproject.toml changes, so new dependencies get installed.
# Quietly: pip's and the build backend's notices (setuptools warns about every editable install) go to
# install.log, which is printed only if the install fails.
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing kafka-taskq[dev] into $(VENV) (log: $(VENV)/install.log)"
	@{ $(VENV)/bin/pip install -q --upgrade pip && $(VENV)/bin/pip install -q -e '.[dev]'; } \
		> $(VENV)/install.log 2>&1 || { cat $(VENV)/install.log; exit 1; }
	@touch $@

.venv venv: $(VENV)/.installed

stack-up:
	$(STACK) up

stack-down:
	$(STACK) down

stack-status:
	$(STACK) status

# `compose/stack up` prints only `export NAME=value` lines on stdout; evaluating them in the same shell
# line hands the stack's addresses to the command that follows.
# Lint first: the packages are held to ruff and mypy --strict (STYLE.md), and it takes seconds.
# Tests run in TEST_WORKERS processes; --dist loadgroup keeps each xdist_group (a module sharing a private stack,
# a cluster or a browser) on one of them, in order. Then the tests marked `quiet` run alone: they judge the
# order in which tasks ran, which a CPU shared with the other test processes blurs.
test: $(VENV)/.installed lint docs browser
	stack_env="$$($(STACK) up)"; eval "$$stack_env"; \
	$(PY) -m pytest -q tests -n $(TEST_WORKERS) --dist loadgroup -m "not quiet" --durations=25 $(PYTEST_ARGS) && \
	$(PY) -m pytest -q tests -m quiet $(PYTEST_ARGS)

# The edit-run loop: everything that needs no service (unit tests, and the contract tests against the fakes).
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q tests/unit tests/contract -m "not integration" -n $(FAST_WORKERS) $(PYTEST_ARGS)

demo: $(VENV)/.installed
	stack_env="$$($(STACK) up)"; eval "$$stack_env"; $(PY) -m taskq.demo

bench: $(VENV)/.installed
	stack_env="$$($(STACK) up)"; eval "$$stack_env"; $(VENV)/bin/taskq bench produce

# The console's browser tests drive the system's Chromium through its chromedriver (Debian packages; CI runs
# as root). Installed once: the step does nothing when the driver is there.
browser:
	@test -x /usr/bin/chromedriver || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; }

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check taskq compose/_stack.py compose/stack
	$(VENV)/bin/mypy taskq compose/_stack.py

# --strict turns every warning (a broken link, a page missing from the nav, a name mkdocstrings cannot
# resolve) into a failure. The theme's banner about MkDocs 2.0 is news, not a warning about these docs.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean-venv:
	rm -rf $(VENV)
