#!/usr/bin/env bash
# Everything this project checks on a real GPU, in one go (one lease of the device machine):
#   bash tests/gpu/device_session.sh            # from the repository root; OUT=dir keeps the logs
# Needs python3 with torch; everything else comes from .whl/, made beforehand on a machine with PyPI and
# Debian's prometheus package by `make gpu-wheels GPU_PYTHON=<the GPU machine's python3 version>`: the
# wheels of requirements-run.txt (the exporter's pinned runtime dependencies, pySMART's included) and
# pytest for that Python, and .whl/prometheus.xz, .whl/node_exporter.xz (the Debian binaries).  With prometheus.xz it
# also runs the dashboards/rules end-to-end test against a real Prometheus while a PyTorch process keeps
# the GPU 50 % busy, so the GPU board's panels must return data from a real H100; the SMART replay it
# relies on is checked first (smart_replay_check.py), so a missing dependency is named, not guessed.
# Parts, to run it in pieces (a lease may cap one command's time): bash tests/gpu/device_session.sh [checks]
# [ledger] [rules] [storm] [bench] -- none named: all five.
set -uo pipefail
OUT=${OUT:-/tmp/gpuio-device}
PARTS=" ${*:-checks ledger rules storm bench} "
want() { [[ "$PARTS" == *" $1 "* ]]; }
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD:$PWD/exporter/instrument
  [ -f .whl/_hotpath.abi3.so ] && cp .whl/_hotpath.abi3.so exporter/instrument/gpuio/  # gpuio's C hot path
else
  export PYTHONPATH=$PWD:$PWD/exporter/instrument
fi
status=0
# Debian's static binaries from .whl/ (prometheus, promtool, alertmanager, node_exporter), for every part
mkdir -p /tmp/gpuio-bin
for packed in .whl/*.xz; do
  [ -f "$packed" ] && xz -dc "$packed" > "/tmp/gpuio-bin/$(basename "$packed" .xz)" && chmod +x "/tmp/gpuio-bin/$(basename "$packed" .xz)"
done
if [ -d .whl/alertmanager-templates ]; then  # Debian's alertmanager reads its templates from /usr/share
  mkdir -p /usr/share/prometheus/alertmanager && cp .whl/alertmanager-templates/*.tmpl /usr/share/prometheus/alertmanager/
fi
# Every module the exporter and its smart collector import, from .whl/ or from this python3.
missing=$(python3 -c 'import importlib.util as u, sys; print(" ".join(m for m in sys.argv[1:] if u.find_spec(m) is None))' \
  fastapi uvicorn uvloop httptools bcrypt yaml rich pySMART humanfriendly chardet prometheus_client psutil pynvml pytest \
  grafana_foundation_sdk)  # the last: the rules generator's boards (storm_check.py generates its rules)
if [ -n "$missing" ]; then
  echo "MISSING Python modules: $missing (make gpu-wheels GPU_PYTHON=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])'))"
  status=1
fi
step() { echo "== $*"; "$@" 2>&1 | tee -a "$OUT/device.log" || status=1; }
nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader | tee "$OUT/device.log"
if want checks; then
step python3 tests/gpu/run_gpu_checks.py
step python3 tests/gpu/gpm_check.py
step python3 tests/gpu/test_engines_gpu.py
step python3 tests/gpu/prefork_check.py
# the library's fork and truncation guards on this host's kernel and Python (tmpfs tests need root)
step python3 -m pytest -q -p no:cacheprovider tests/e2e/test_spool.py tests/e2e/test_spool_full.py
step python3 tests/gpu/cgroup_io_check.py  # the cgroup v2 path of the cgroup_io collector (io.stat, io.pressure)
step python3 tests/gpu/discovery_check.py  # a plain PyTorch process loading a model, discovered with its GPU
step python3 tests/gpu/discovery_check.py --name-not-utf8  # the same, its model named in bytes no UTF-8 has
# discovery against hostile tenants and dead (FUSE) mounts on this host's kernel and cgroup v2 (root)
step python3 -m pytest -q -p no:cacheprovider tests/e2e/test_dead_mounts_e2e.py tests/e2e/test_discovery_attacks.py \
  tests/e2e/test_cgroup_trust_kernel.py
step python3 bench/nvml_bench.py
step python3 tests/gpu/exporter_http_check.py
step python3 tests/gpu/smart_replay_check.py
step python3 tests/gpu/load_waterfall_check.py
fi
if want ledger; then  # the GPU-time ledger against what a serving, then loading process did (root: O_DIRECT)
step python3 tests/gpu/gpu_time_check.py
fi
if want rules && [ -f .whl/prometheus.xz ]; then
  echo "$(date +%s)" | python3 tests/gpu/gpu_worker.py duty 1 0.5 90 > "$OUT/worker.log" 2>&1 &
  worker=$!
  # The worker's CUDA context must exist before the exporter starts: processes are listed every slow
  # interval (10 s), so one that appears later has its per-process series only from the next listing.
  sleep 8
  step env PATH=/tmp/gpuio-bin:$PATH python3 -m pytest -q -s -p no:cacheprovider tests/e2e/test_prometheus_rules_dashboards.py
  kill $worker 2>/dev/null; wait $worker 2>/dev/null
fi
if want storm && [ -f .whl/alertmanager.xz ] && [ -f .whl/prometheus.xz ]; then  # a real storm starving the real GPU, paged
  step env PATH=/tmp/gpuio-bin:$PATH PYTHONUNBUFFERED=1 python3 tests/gpu/storm_check.py
  step env PATH=/tmp/gpuio-bin:$PATH PYTHONUNBUFFERED=1 python3 tests/gpu/multi_gpu_check.py  # one process on 2 GPUs (skips on 1)
fi
if want bench && [ -f .whl/node_exporter.xz ]; then  # the benchmarks against their peers, on this host
  step env PATH=/tmp/gpuio-bin:$PATH python3 bench/scrape_bench.py --scrapes 1200 --with-defaults --skip-scaling
  step python3 bench/engines_bench.py --skip-residency --scrapes 20
  step env PATH=/tmp/gpuio-bin:$PATH python3 bench/memory_bench.py
fi
exit $status
