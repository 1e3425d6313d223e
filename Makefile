# Two commands set up everything on a fresh machine: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
# `make test` and the development targets: gpuio with its [dev] extras (linters, schema validators,
# TensorRT's lean libraries).
VENV := .venv
PY := $(VENV)/bin/python
# `make run` and `make stack`: gpuio's runtime dependencies only, pinned in requirements-run.txt.  A venv of
# its own, so that running the exporter never waits for the development toolchain, and so that every
# `make run` proves the runtime lock is enough on its own.
RUN_VENV := .venv-run
ARGS ?=
# Debian packages the tests and benchmarks use as real peers (promtool, node_exporter, fio, iostat).
DEBS := prometheus prometheus-node-exporter prometheus-alertmanager victoria-metrics fio sysstat tmux smartmontools systemd
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: grafana-schema gpu-wheels run stack test unit lint fmt bench golden metrics-doc generate system-deps debs venv run-venv clean fuzz load soak image kubernetes dist version

# gpuio (the instrumentation library, exporter/instrument/) is on no index: it is installed from here too.
# Its optional C hot path (gpuio/_hotpath.c) is compiled in place by the editable install.
$(VENV)/.installed: pyproject.toml exporter/instrument/pyproject.toml exporter/instrument/setup.py \
		exporter/instrument/gpuio/_hotpath.c
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e ./exporter/instrument -e '.[dev]'
	touch $@

# The runtime venv, fast.  What costs pip time is not installing but choosing: for every requirement it
# reads and rates every file of every release on the index (~75 % of its time here, even with exact pins).
# So the pinned wheels are kept in a wheelhouse beside pip's cache and installed from there with
# --no-index (the first run fills it with `pip download`); nothing is resolved (--no-deps on the lock,
# `pip check` instead), no bytecode is compiled ahead (the interpreter writes it on first import, for the
# modules the exporter does import), pip does not upgrade itself, and no pip is copied into the venv when
# this machine's pip can install into another interpreter (--python, pip 22.3+).  The source tree goes
# on the venv's path (a .pth file, what an editable install writes), so nothing is built, and the two
# console scripts are the ones pip would write.
WHEELHOUSE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/gpuio/wheels
PIP_QUIET := --quiet --disable-pip-version-check
$(RUN_VENV)/.installed: requirements-run.txt pyproject.toml exporter/instrument/pyproject.toml
	rm -rf $(RUN_VENV)
	$(PYTHON) -m venv --without-pip $(RUN_VENV)
	@pip="$(PYTHON) -m pip --python $(RUN_VENV)/bin/python"; \
	if ! $$pip --version >/dev/null 2>&1; then \
	  $(RUN_VENV)/bin/python -m ensurepip --default-pip >/dev/null && pip="$(RUN_VENV)/bin/python -m pip"; \
	fi; \
	install="$$pip install $(PIP_QUIET) --no-deps --no-compile --no-index --find-links $(WHEELHOUSE) -r requirements-run.txt"; \
	set -x; $$install 2>/dev/null || { \
	  $$pip download $(PIP_QUIET) --no-deps --dest $(WHEELHOUSE) -r requirements-run.txt && $$install; } && \
	$$pip check --disable-pip-version-check >/dev/null
	$(RUN_VENV)/bin/python -c 'import sys, sysconfig; open(sysconfig.get_path("purelib") + "/gpuio-source.pth", "w").write("\n".join(sys.argv[1:]) + "\n")' "$(CURDIR)" "$(CURDIR)/exporter/instrument"
	@for script in gpuio-exporter:exporter_main gpuio:tools_main; do \
	  printf '#!%s\nimport sys\nfrom exporter.cli import %s\nsys.exit(%s())\n' \
	    "$(CURDIR)/$(RUN_VENV)/bin/python" "$${script#*:}" "$${script#*:}" > $(RUN_VENV)/bin/$${script%%:*}; \
	  chmod +x $(RUN_VENV)/bin/$${script%%:*}; \
	done
	touch $@

run-venv: $(RUN_VENV)/.installed

venv: $(VENV)/.installed

system-deps:
	@$(MAKE) --no-print-directory debs DEBS="$(DEBS)"

# The exporter's container image, with Docker or Podman (whichever is installed; CONTAINER_TOOL= to choose):
#   make image IMAGE=registry.example/gpuio-exporter:0.1.0 && docker push registry.example/gpuio-exporter:0.1.0
IMAGE ?=
CONTAINER_TOOL ?= $(shell command -v docker 2>/dev/null || command -v podman 2>/dev/null)
image:
	@test -n "$(IMAGE)" || { echo "make image: set IMAGE=<registry>/gpuio-exporter:<tag> (this repository publishes no image)" >&2; exit 2; }
	@test -n "$(CONTAINER_TOOL)" || { echo "make image: neither docker nor podman is installed (CONTAINER_TOOL= names another)" >&2; exit 2; }
	$(CONTAINER_TOOL) build -t "$(IMAGE)" .

# Both distributions -- gpuio-exporter and gpuio, the library inference images install -- as sdist and wheel
# in dist/: `pipx install dist/gpuio_exporter-*.whl --pip-args="--find-links dist"`, or pip (docs/deploy.md).
# The library's wheels: with its C hot path (cp311-abi3, this machine's architecture) and pure Python
# (py3-none-any: CPython 3.10, aarch64, any other machine), which pip chooses between.
dist: venv
	rm -rf dist
	$(PY) -m build --no-isolation --outdir dist exporter/instrument
	GPUIO_PURE_PYTHON=1 $(PY) -m build --wheel --no-isolation --outdir dist exporter/instrument
	rm -rf exporter/instrument/build
	$(PY) -m build --no-isolation --outdir dist .

# The one version both carry (exporter/instrument/gpuio/VERSION) and the exporter's pins on the library.
version:
	@echo "$(VERSION)" | grep -Eq '^[0-9]+\.[0-9]+\.[0-9]+([a-z0-9.+-]*)?$$' || { echo "make version: set VERSION=x.y.z" >&2; exit 2; }
	printf '%s\n' "$(VERSION)" > exporter/instrument/gpuio/VERSION
	sed -i -E 's/"gpuio(\[tensorrt\])?==[^"]*"/"gpuio\1==$(VERSION)"/' pyproject.toml

# gpuio's Kubernetes objects with your image, on standard output (deploy/kubernetes/README.md):
#   make -s kubernetes IMAGE=<ref> [COMPONENTS=discovery,residency] [OPERATOR=no] | kubectl apply -f -
kubernetes:
	@test -n "$(IMAGE)" || { echo "make kubernetes: set IMAGE=<registry>/gpuio-exporter:<tag> (make image builds it)" >&2; exit 2; }
	@$(MAKE) --no-print-directory run-venv >&2  # PyYAML is all the render needs: not the development venv
	@$(RUN_VENV)/bin/python -m deploy.kubernetes.render --image "$(IMAGE)" $(if $(COMPONENTS),--component "$(COMPONENTS)") $(if $(filter no,$(OPERATOR)),--without-operator)

# The exporter, Prometheus with deploy/prometheus/rules and Alertmanager with deploy/alertmanager's routing,
# on this machine, from Debian's packages; prints where to look; Ctrl-C stops them (deploy/local/stack.py).
# ARGS: `--help` lists the ports, intervals and rules it takes; after `--`, flags for the exporter.
stack: run-venv
	@$(MAKE) --no-print-directory debs DEBS="prometheus prometheus-alertmanager prometheus-node-exporter"
	$(RUN_VENV)/bin/python -m deploy.local $(ARGS)

debs:
	@missing=""; for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing >/dev/null; \
	fi

run: run-venv
	$(RUN_VENV)/bin/gpuio-exporter $(ARGS)

LINTED := exporter tests bench deploy
lint: venv
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/mypy exporter
	# The Grafana SDK needs 3.11 (StrEnum): the generators (deploy/, `gpuio generate`) are checked at 3.11.
	$(VENV)/bin/mypy --explicit-package-bases --python-version 3.11 deploy/grafana deploy/prometheus deploy/kubernetes deploy/local deploy/generated.py deploy/generate.py deploy/fleet_view.py deploy/exporter_modules.py deploy/victoriametrics

# What the linter can mend on its own (import order, older syntax), in place; the rest `make lint` names.
# The code is formatted by hand at 120 columns: no reformatter rewrites it.
fmt: venv
	$(VENV)/bin/ruff check --fix $(LINTED)

test: venv system-deps lint grafana-schema
	$(PY) -m pytest -q -rs tests

unit: venv
	$(PY) -m pytest -q tests/unit

bench: venv system-deps
	$(PY) bench/scrape_bench.py
	$(PY) bench/engines_bench.py
	$(PY) bench/memory_bench.py
	$(PY) bench/smart_bench.py

# Grafana's dashboard and panel schemas as JSON Schema, from the npm package @grafana/schema (the versions
# pinned in dashboards/schema/package-lock.json), for tests/unit/test_dashboard_schema.py.  Rebuilt only
# when the lock or the script changes; npm keeps its downloads in its own cache.
GRAFANA_SCHEMA := dashboards/schema
$(GRAFANA_SCHEMA)/out/.built: $(GRAFANA_SCHEMA)/package-lock.json $(GRAFANA_SCHEMA)/build.mjs
	cd $(GRAFANA_SCHEMA) && npm ci --no-audit --no-fund --loglevel=error && node build.mjs
	touch $@

grafana-schema:
	@command -v npm >/dev/null || $(MAKE) --no-print-directory debs DEBS="nodejs npm"
	@$(MAKE) --no-print-directory $(GRAFANA_SCHEMA)/out/.built

# Rules, dashboards and the Kubernetes objects made of them are generated from Python in one pass; the
# output is checked in and CI fails on drift.  ARGS: e.g. --grafana-url URL --runbook-url TEMPLATE.
generate: venv
	$(PY) -m deploy.generate $(ARGS)

# Hardening figures (docs/reliability.md): longer fuzzing, 50 scrapers for 10 minutes, a 100,000-scrape soak.
fuzz: venv
	HYPOTHESIS_PROFILE=long $(PY) -m pytest -q tests/fuzz --hypothesis-show-statistics

load: venv
	$(PY) bench/load_bench.py $(ARGS)

soak: venv system-deps
	$(SUDO) $(PY) bench/soak.py $(ARGS)

# .whl/ for tests/gpu/device_session.sh on a GPU machine without PyPI: requirements-run.txt and pytest as
# wheels for that machine's Python (GPU_PYTHON, x86_64 manylinux), and Debian's static prometheus, promtool,
# alertmanager and node_exporter binaries (the GPU route's dashboards test, its real-NVML storm and
# benchmarks; bench/fleet_bench.py on a bigger host).
GPU_PYTHON ?= 3.12
GPU_PLATFORMS := $(foreach p,manylinux_2_34 manylinux_2_28 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1,--platform $(p)_x86_64)
gpu-wheels:
	@$(MAKE) --no-print-directory debs DEBS="prometheus prometheus-node-exporter prometheus-alertmanager victoria-metrics"
	rm -rf .whl && mkdir -p .whl
	$(PYTHON) -m pip download $(PIP_QUIET) --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
	  $(GPU_PLATFORMS) --dest .whl -r requirements-run.txt pytest iniconfig pluggy packaging
	xz -T0 -c $$(command -v prometheus) > .whl/prometheus.xz
	xz -T0 -c $$(command -v promtool) > .whl/promtool.xz
	xz -T0 -c $$(command -v prometheus-node-exporter) > .whl/node_exporter.xz
	xz -T0 -c $$(command -v prometheus-alertmanager) > .whl/alertmanager.xz
	for tool in victoria-metrics vmagent vmalert; do xz -T0 -c $$(command -v $$tool) > .whl/$$tool.xz; done  # bench/fleet_bench.py
	mkdir -p .whl/alertmanager-templates  # Debian's build reads its templates from /usr/share
	cp /usr/share/prometheus/alertmanager/*.tmpl .whl/alertmanager-templates/
	# gpuio's C hot path, an abi3 build (any CPython >= 3.11): tests/gpu/device_session.sh puts it beside
	# the source it was built from.
	rm -rf .whl/gpuio-build && $(PYTHON) -m pip wheel $(PIP_QUIET) --no-deps -w .whl/gpuio-build ./exporter/instrument
	unzip -p .whl/gpuio-build/gpuio-*.whl gpuio/_hotpath.abi3.so > .whl/_hotpath.abi3.so
	rm -rf .whl/gpuio-build exporter/instrument/build
	@ls .whl | wc -l | xargs printf '%s files in .whl/ for Python $(GPU_PYTHON)\n'

golden: venv
	$(PY) -m pytest -q tests/unit/test_golden.py --update-golden

# docs/metrics.md is generated from the families' declarations (exporter/catalogue.py); CI fails on drift.
metrics-doc: venv
	$(PY) -m exporter.catalogue --write docs/metrics.md

clean:
	rm -rf $(VENV) $(RUN_VENV) .pytest_cache .mypy_cache .ruff_cache exporter/instrument/build exporter/instrument/gpuio/*.so
