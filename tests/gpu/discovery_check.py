"""Engine discovery on a real GPU machine: a plain PyTorch process, without the gpuio library, loading a
model from a Triton-layout repository onto its GPU, seen by a real exporter.

1. A model file of MODEL_MIB MiB is saved with torch.save to ``<work>/models/resnet-like/1/model.pt``
   (Triton's layout for its PyTorch backend) and evicted from the page cache.
2. gpuio-exporter runs as a process (engines and nvml collectors, discovery every 250 ms, NVML's process
   list every second), the work directory in its path-include.
3. The loader, a plain ``python3`` with torch and nothing of gpuio, makes its CUDA context on cuda:0,
   waits for the exporter to list it on its GPU, then ``torch.load(path, map_location="cuda")`` and
   reports the load's wall time, and serves (sleeps) SERVE_S seconds before exiting.

Expected, read from /metrics: while it loads, ``gpuio_engine_loads_in_progress{engine="resnet-like",
gpu_uuid=<the loader's GPU>} 1`` and ``gpuio_engine_info`` with that GPU's UUID (the one torch reports for
cuda:0) and the file's path; after, one load in ``gpuio_engine_load_read_seconds`` whose duration is the
loader's own within one discovery pass plus 0.5 s, its bytes the file's within 5 %,
``gpuio_engine_processes{source="proc"} 1`` and the loader's pid in ``gpuio_engine_process_info``; the JSON
API (``/api/v1/engines``, and ``gpuio engines --url``) tells the same file, GPU and load; once the loader
exits, its engine has no live process and no load was abandoned.

    python3 tests/gpu/discovery_check.py          # from the repository root (as root, for the eviction)
    python3 tests/gpu/discovery_check.py --name-not-utf8   # the model's directory named in bytes no UTF-8 has

With ``--name-not-utf8`` the model sits in ``<work>/models/bad\\xff\\xfe-model/1/`` (a tenant's choice): every
answer (/metrics read as strict UTF-8, the API's JSON, ``gpuio engines --url``) must stay whole and name the
engine ``bad\\xff\\xfe-model``, during the load and after the loader exited.

Prints the figures and PASS/FAIL lines; exit 1 on a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "exporter", "instrument"))

from exporter.host.hosttext import visible  # noqa: E402
from tests.gpu.cgroup_io_check import Check, parse_exposition  # noqa: E402

MODEL_MIB = 4096
SERVE_S = 6.0
PASS_S = 0.25

SAVE = textwrap.dedent("""
    import os, sys, torch
    path, mib = sys.argv[1], int(sys.argv[2])
    layers = {f"layer{index}.weight": torch.randn((mib << 20) // 16 // 4) for index in range(16)}
    torch.save(layers, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
""")

LOADER = textwrap.dedent("""
    import json, sys, time, torch
    torch.zeros(1, device="cuda")  # the CUDA context first, as a server makes it before loading
    print(json.dumps({"uuid": str(torch.cuda.get_device_properties(0).uuid)}), flush=True)
    sys.stdin.readline()
    started = time.time()
    state = torch.load(sys.argv[1], map_location="cuda")
    torch.cuda.synchronize()
    print(json.dumps({"load_s": time.time() - started, "started": started,
                      "tensors": len(state)}), flush=True)
    time.sleep(float(sys.argv[2]))
""")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def samples(port: int) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return parse_exposition(response.read().decode())


def ready(port: int) -> bool:
    try:
        samples(port)
    except OSError:
        return False
    return True


def engine_series(found: dict, name: str, engine: str) -> dict[frozenset, float]:
    return {labels: value for (metric, labels), value in found.items()
            if metric == name and ("engine", engine) in labels}


def main(directory: str = "resnet-like") -> int:
    check = Check()
    work = tempfile.mkdtemp(prefix="gpuio-discovery-", dir="/var/tmp")
    path = os.path.join(work, "models", directory, "1", "model.pt")
    os.makedirs(os.path.dirname(path))
    subprocess.run([sys.executable, "-c", SAVE, path, str(MODEL_MIB)], check=True)
    size = os.path.getsize(path)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (REPO, os.path.join(REPO, "exporter", "instrument"),
                                                                    os.environ.get("PYTHONPATH"))))}
    exporter = subprocess.Popen([sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{port}",
                                 "--collector.disable-defaults", "--collector.engines", "--collector.nvml",
                                 f"--collector.engines.path-include={work}",
                                 f"--collector.engines.spool-dir={work}/spool", "--collector.nvml.slow-interval=1s",
                                 f"--collector.engines.discover-interval={int(PASS_S * 1000)}ms"],
                                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    engine = visible(directory)  # as labels and the API show it: a byte that is not UTF-8 as \\xNN
    shown_path = visible(path)
    loader = None
    try:
        deadline = time.monotonic() + 30
        while not ready(port):  # the exporter runs before the inference pod starts, as a DaemonSet does
            assert time.monotonic() < deadline and exporter.poll() is None, "the exporter did not start"
            time.sleep(0.2)
        loader = subprocess.Popen([sys.executable, "-c", LOADER, path, str(SERVE_S)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert loader.stdout is not None and loader.stdin is not None
        uuid = "GPU-" + json.loads(loader.stdout.readline())["uuid"]
        while not any(name == "gpuio_gpu_process_memory_used_bytes" and ("pid", str(loader.pid)) in labels
                      for name, labels in samples(port)):  # NVML lists the loader on its GPU
            assert time.monotonic() < deadline + 30, "NVML never listed the loader"
            time.sleep(0.2)
        loader.stdin.write("go\n")
        loader.stdin.flush()
        seen_loading: set[str] = set()
        infos: list[dict[str, str]] = []
        while loader.poll() is None:
            found = samples(port)
            for labels, value in engine_series(found, "gpuio_engine_loads_in_progress", engine).items():
                if value >= 1:
                    seen_loading.add(dict(labels)["gpu_uuid"])
            infos = [dict(labels) for labels in engine_series(found, "gpuio_engine_info", engine)] or infos
            if sum(engine_series(found, "gpuio_engine_load_read_seconds_count", engine).values()) >= 1:
                break
            time.sleep(0.1)
        figures = json.loads(loader.stdout.readline())
        time.sleep(2 * PASS_S + 0.2)
        found = samples(port)
        count = sum(engine_series(found, "gpuio_engine_load_read_seconds_count", engine).values())
        seconds = sum(engine_series(found, "gpuio_engine_load_read_seconds_sum", engine).values())
        read = sum(engine_series(found, "gpuio_engine_load_read_bytes_total", engine).values())
        device = engine_series(found, "gpuio_engine_last_load_read_bytes", engine)
        by_source = {dict(labels)["source"]: value for labels, value in device.items()}
        processes = {dict(labels)["source"]: value
                     for labels, value in engine_series(found, "gpuio_engine_processes", engine).items()}
        pids = {dict(labels)["pid"] for labels in engine_series(found, "gpuio_engine_process_info", engine)}
        print(f"model {size / 2**20:.0f} MiB at {shown_path}; loader pid {loader.pid} on {uuid}: torch.load "
              f"{figures['load_s']:.2f} s; exporter: {count:g} load(s) of {seconds:.2f} s, {read / 2**20:.0f} MiB "
              f"(device {by_source.get('device', 0) / 2**20:.0f} MiB, page cache "
              f"{by_source.get('page_cache', 0) / 2**20:.0f} MiB); seen loading on {sorted(seen_loading)}; "
              f"info {infos}", flush=True)
        check.verdict(uuid in seen_loading, "the load was seen in progress on the loader's GPU")
        check.verdict(any(info.get("gpu_uuid") == uuid and info.get("path") == shown_path for info in infos),
                      "gpuio_engine_info names the file and the GPU torch reports for cuda:0")
        check.verdict(count == 1 and abs(seconds - figures["load_s"]) <= PASS_S + 0.5,
                      f"one load, {seconds:.2f} s against torch.load's {figures['load_s']:.2f} s")
        check.verdict(abs(read - size) <= 0.05 * size, f"its bytes {read:.0f} within 5 % of the file's {size}")
        check.verdict(processes.get("proc") == 1 and str(loader.pid) in pids,
                      f"the process, by source {processes}, pids {sorted(pids)}")
        # The JSON API (what `gpuio engines --url` reads) tells the same engine: its file and GPU, the load.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/engines", timeout=10) as response:
            rows = [row for row in json.load(response)["engines"] if row["engine"] == engine]
        print(f"/api/v1/engines: {json.dumps(rows)[:600]}", flush=True)
        check.verdict(len(rows) == 1 and rows[0]["path"] == shown_path
                      and any(uuid in gpu for gpu in rows[0]["gpus"])
                      and rows[0]["last_load_seconds"] is not None
                      and abs(rows[0]["last_load_seconds"] - seconds) <= PASS_S + 0.5,
                      "the API's row names the file, the loader's GPU and the load /metrics counted")
        remote = subprocess.run([sys.executable, "-c", "from exporter.cli import tools_main; tools_main()",
                                 "engines", "--url", f"http://127.0.0.1:{port}"],
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        print(remote.stdout[-1500:], remote.stderr[-500:], flush=True)
        check.verdict(remote.returncode == 0 and engine in remote.stdout, "gpuio engines --url prints the engine")
        loader.wait(timeout=SERVE_S + 30)
        time.sleep(2 * PASS_S + 0.2)
        found = samples(port)
        abandoned = sum(engine_series(found, "gpuio_engine_loads_abandoned_total", engine).values())
        left = engine_series(found, "gpuio_engine_processes", engine)
        check.verdict(abandoned == 0 and not any(left.values()),
                      f"after the loader exited: no live process ({left}), {abandoned:g} loads abandoned")
    finally:
        for process in (loader, exporter):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        shutil.rmtree(work, ignore_errors=True)
    if check.failures and exporter.stderr is not None:
        print(exporter.stderr.read().decode()[-3000:])
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main(os.fsdecode(b"bad\xff\xfe-model") if "--name-not-utf8" in sys.argv[1:] else "resnet-like"))
