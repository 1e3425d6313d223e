# syntax=docker/dockerfile:1
# gpuio-exporter: one per GPU node.  docs/deploy.md explains the mounts, flags and privileges.
#
#   docker build -t gpuio-exporter .
#   docker run -d --name gpuio-exporter -p 9817:9817 --gpus all --read-only --cap-drop ALL \
#     -v /proc:/host/proc:ro -v /sys:/host/sys:ro -v /:/host/root:ro,rslave \
#     -v /run/gpuio/spool:/run/gpuio/spool \
#     gpuio-exporter --path.procfs=/host/proc --path.sysfs=/host/sys --path.rootfs=/host/root
#
# Runs as uid 65532 with no capabilities: disks, IO pressure, GPUs (NVML opens /dev/nvidia*, mode 0666)
# and engines all work so.  SMART does not: smartctl needs CAP_SYS_RAWIO (ATA/SCSI pass-through),
# CAP_SYS_ADMIN (NVMe admin commands) and the disks' device nodes, which only root can open
# (/dev/nvme0 is root:root 0600).  For SMART run it as root with exactly those two capabilities:
#   --user 0 --cap-drop ALL --cap-add SYS_RAWIO --cap-add SYS_ADMIN --device /dev/nvme0 --device /dev/sda ...
# Without them the smart collector reports gpuio_smart_permission_denied 1 and nothing else changes.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

# --- build: a virtual environment with gpuio and its dependencies (all wheels: no compiler needed) ----
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/gpuio
WORKDIR /src
COPY pyproject.toml README.md ./
COPY exporter/ exporter/
# A regular install (not editable): the environment holds copies and byte-code, nothing points at /src.
# gpuio, the instrumentation library the exporter reads the spool format from, is its own distribution.
# Its optional C hot path is for inference processes and needs a compiler, which this image lacks: pip
# warns that it skipped it, and the exporter, which only reads the spool, does not use it.
RUN /opt/gpuio/bin/pip install ./exporter/instrument . \
 && /opt/gpuio/bin/pip uninstall --yes pip

# --- runtime: the base image, smartctl, the environment, an unprivileged user ------------------------
FROM ${PYTHON_IMAGE} AS runtime
# smartctl for the smart collector (Debian's smartmontools; the base image fixes the Debian release,
# the package follows its security updates, hence no version pin).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends smartmontools \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 65532 gpuio \
 && useradd --system --uid 65532 --gid gpuio --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin gpuio
COPY --from=build /opt/gpuio /opt/gpuio
# NVIDIA_*: the NVIDIA container runtime mounts the driver's NVML library and every GPU's device node
# (utility = nvidia-smi and NVML, no CUDA).  A monitoring agent must see every GPU of the node.
ENV PATH=/opt/gpuio/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility
# Numeric, so that Kubernetes' runAsNonRoot can check it.
USER 65532:65532
EXPOSE 9817
# Another listen address or TLS (--web.config.file): set GPUIO_HEALTHCHECK_URL to match.
HEALTHCHECK --interval=30s --timeout=5s --start-period=15s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('GPUIO_HEALTHCHECK_URL', 'http://127.0.0.1:9817/healthz'), timeout=4)"]
ENTRYPOINT ["gpuio-exporter"]
