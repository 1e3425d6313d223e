# Two commands set up everything on a fresh machine: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=
# Debian packages the tests and benchmarks use as real peers (promtool, node_exporter, fio, iostat).
DEBS := prometheus prometheus-node-exporter prometheus-alertmanager fio sysstat tmux smartmontools systemd
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: run test unit lint bench golden rules dashboards system-deps venv clean fuzz load soak

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

system-deps:
	@missing=""; for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing >/dev/null; \
	fi

run: venv
	$(VENV)/bin/gpuio-exporter $(ARGS)

lint: venv
	$(VENV)/bin/ruff check exporter tests bench dashboards deploy
	$(VENV)/bin/mypy exporter
	# The Grafana SDK needs 3.11 (StrEnum); the dashboards are generated at build time, not on nodes.
	$(VENV)/bin/mypy --explicit-package-bases --python-version 3.11 dashboards deploy/prometheus deploy/kubernetes deploy/generated.py

test: venv system-deps lint
	$(PY) -m pytest -q -rs tests

unit: venv
	$(PY) -m pytest -q tests/unit

bench: venv system-deps
	$(PY) bench/scrape_bench.py
	$(PY) bench/engines_bench.py
	$(PY) bench/smart_bench.py

# Rules and dashboards are generated from Python; the output is checked in and CI fails on drift.
rules: venv
	$(PY) -m deploy.prometheus.generate
	$(PY) -m deploy.kubernetes.generate

dashboards: venv
	$(PY) -m dashboards
	$(PY) -m deploy.kubernetes.generate

# Hardening figures (docs/reliability.md): longer fuzzing, 50 scrapers for 10 minutes, a 100,000-scrape soak.
fuzz: venv
	HYPOTHESIS_PROFILE=long $(PY) -m pytest -q tests/fuzz --hypothesis-show-statistics

load: venv
	$(PY) bench/load_bench.py $(ARGS)

soak: venv system-deps
	$(SUDO) $(PY) bench/soak.py $(ARGS)

golden: venv
	$(PY) -m pytest -q tests/unit/test_golden.py --update-golden

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
