#!/usr/bin/env bash
# Everything this project checks on a real GPU, in one go (one lease of the device machine):
#   bash tests/gpu/device_session.sh            # from the repository root; OUT=dir keeps the logs
# Needs python3 with torch, nvidia-ml-py, prometheus-client, psutil; the web stack comes from .whl/
# (wheels downloaded beforehand: pip download -d .whl fastapi uvicorn httptools bcrypt PyYAML rich pySMART pytest).
# With .whl/prometheus.xz (xz -c /usr/bin/prometheus > .whl/prometheus.xz: the Debian binary, static) it
# also runs the dashboards/rules end-to-end test against a real Prometheus while a PyTorch process keeps
# the GPU 50 % busy, so the GPU board's panels must return data from a real H100.
set -uo pipefail
OUT=${OUT:-/tmp/gpuio-device}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
status=0
step() { echo "== $*"; "$@" 2>&1 | tee -a "$OUT/device.log" || status=1; }
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader | tee "$OUT/device.log"
step python3 tests/gpu/run_gpu_checks.py
step python3 tests/gpu/test_engines_gpu.py
step python3 bench/nvml_bench.py
step python3 tests/gpu/exporter_http_check.py
if [ -f .whl/prometheus.xz ]; then
  mkdir -p /tmp/gpuio-bin && xz -dc .whl/prometheus.xz > /tmp/gpuio-bin/prometheus && chmod +x /tmp/gpuio-bin/prometheus
  echo "$(date +%s)" | python3 tests/gpu/gpu_worker.py duty 1 0.5 90 > "$OUT/worker.log" 2>&1 &
  worker=$!
  step env PATH=/tmp/gpuio-bin:$PATH python3 -m pytest -q -s -p no:cacheprovider tests/e2e/test_prometheus_rules_dashboards.py
  kill $worker 2>/dev/null; wait $worker 2>/dev/null
fi
exit $status
