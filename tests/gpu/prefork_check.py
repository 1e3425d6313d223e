"""Prefork serving on a real GPU: a gunicorn --preload shape, with CUDA in the workers only.

The parent makes the engine's metrics and keeps its handles (``observe``, ``infer``), as a preloaded app
does; CUDA cannot be used across fork(), so each of WORKERS forked workers initialises CUDA itself and
serves its own number of requests (a matmul on the GPU, timed by the inherited ``with infer():`` and
CUDA-event GPU time through the inherited ``observe``).  Then every worker's spool file must hold exactly
its own requests, the parent's none of them, and the exporter's reader must sum them all; and a live
worker's file truncated under it (a same-uid sidecar) must not kill it.

    python tests/gpu/prefork_check.py       # needs torch with CUDA; prints what it found, exits 1 on a miss
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "exporter", "instrument"))

import gpuio  # noqa: E402
from exporter.engines import model, parse  # noqa: E402
from exporter.engines import spool as spool_source  # noqa: E402

WORKERS = 4
WIDTH = 2048


def serve(requests: int, observe_gpu, infer, report, cut: bool) -> None:  # type: ignore[no-untyped-def]
    import torch

    weights = torch.randn(WIDTH, WIDTH, device="cuda")
    batch = torch.randn(64, WIDTH, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if cut:  # a sidecar of the same uid cuts this worker's live file
        subprocess.run(["truncate", "-s", "0", gpuio.describe()["spool"]], check=True)
    for _ in range(requests):
        with infer():
            start.record()
            (batch @ weights).relu_()
            end.record()
            end.synchronize()
        observe_gpu(start.elapsed_time(end) / 1000.0)
    report.put((os.getpid(), gpuio.describe()["spool"], gpuio.describe()["spool_error"],
                torch.cuda.get_device_name(0)))


def per_file_counts(directory: str, engine: str) -> dict[str, float]:
    counts = {}
    for name in os.listdir(directory):
        if name.endswith(".spool"):
            path = os.path.join(directory, name)
            with open(path, "rb") as handle:
                data = handle.read()
            if not data:
                counts[path] = -1.0  # the cut one
                continue
            parsed = parse.parse(data)
            values = parsed.engines.get(engine)
            counts[path] = model.histogram_count_and_sum(values, "inference_seconds")[0] if values else 0.0
    return counts


def main() -> int:
    directory = tempfile.mkdtemp(prefix="gpuio-prefork-")
    gpuio.configure(directory)
    metrics = gpuio.engine("prefork-matmul")  # --preload: made in the parent, before any fork
    observe_gpu, infer = metrics.inference_gpu_seconds.observe, metrics.infer
    parent_file = gpuio.describe()["spool"]
    fork = multiprocessing.get_context("fork")
    report = fork.Queue()
    plan = [100 * (number + 1) for number in range(WORKERS)]
    workers = [fork.Process(target=serve, args=(requests, observe_gpu, infer, report, number == WORKERS - 1))
               for number, requests in enumerate(plan)]
    for worker in workers:
        worker.start()
    answers = [report.get(timeout=300) for _ in workers]
    for worker in workers:
        worker.join()
    misses = [f"worker exit code {worker.exitcode}" for worker in workers if worker.exitcode != 0]
    counts = per_file_counts(directory, "prefork-matmul")
    by_pid = {pid: (path, error) for pid, path, error, _ in answers}
    print(f"GPU: {answers[0][3]}; parent file: {counts.get(parent_file)} inferences")
    for worker, requests in zip(workers, plan, strict=True):
        path, error = by_pid[worker.pid]
        print(f"  worker {worker.pid}: served {requests}, its file holds {counts.get(path)}; spool_error {error!r}")
        cut = worker is workers[-1]
        if cut and not (error or "").startswith("the spool file was truncated"):
            misses.append(f"the cut worker's describe() said {error!r}")
        if not cut and counts.get(path) != requests:
            misses.append(f"worker {worker.pid}: {counts.get(path)} != {requests}")
    if counts.get(parent_file) != 0.0:
        misses.append(f"the parent's file counted {counts.get(parent_file)}")
    totals = spool_source.SpoolReader(directory, remove_dead=False).read()
    merged = model.histogram_count_and_sum(totals.engines["prefork-matmul"], "inference_seconds")[0]
    expected = sum(plan[:-1])
    print(f"  reader: {merged} inferences merged (expected {expected}: the cut worker's stayed in its memory)")
    if merged != expected:
        misses.append(f"merged {merged} != {expected}")
    print("MISSES: " + "; ".join(misses) if misses else "prefork on the GPU: every worker exact, the cut one alive")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
