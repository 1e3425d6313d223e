"""An inference pod with no hostPath, end to end on this machine: a real writer process as the pod's
user, with the pod's Downward API environment, writes into an emptyDir (bind-mounted into its view, as
a container runtime does) laid out and owned as the kubelet makes it
(/var/lib/kubelet/pods/<uid>/volumes/kubernetes.io~empty-dir/gpuio-spool, the directories root:root
0750, the emptyDir 0777); the real exporter runs as nobody with no capability,
first without and then with group root, as the DaemonSet does (supplementalGroups: [0]).

Without the group the exporter cannot traverse the kubelet's directories: it says so (a gauge and one
log line) and serves nothing of the pod.  With it, the pod's engine and its pod are served.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import LIBRARY, REPO, free_port, parse_samples
from tests.e2e.test_privilege import NOBODY, WRITER_UID, _serve_as, _skip_unless_importable_as, _stop, _wait_scrape
from tests.unit.test_pods import generated, kubelet  # noqa: F401  (fixtures)

pytestmark = pytest.mark.e2e

POD_UID = "6f1c2d3e-4a5b-4c6d-8e7f-90a1b2c3d4e5"
WRITER = """
import sys
sys.path.insert(0, {repo!r})
import gpuio
loaded = gpuio.load({engine!r}, lambda data: len(data), gpu_uuid="GPU-a4f34abc-7715-3560-dcea-7238b9611a45")
with loaded.metrics.infer(batch_size=1):
    pass
print("ready", flush=True)
sys.stdin.read()
"""


def kubelet_tree(work: Path) -> tuple[Path, Path]:
    pods = work / "var" / "lib" / "kubelet" / "pods"
    spool = pods / POD_UID / "volumes" / "kubernetes.io~empty-dir" / "gpuio-spool"
    spool.mkdir(parents=True)
    for directory in (work / "var" / "lib" / "kubelet", pods, pods / POD_UID, pods / POD_UID / "volumes",
                      spool.parent):
        os.chown(directory, 0, 0)
        os.chmod(directory, 0o750)  # as the kubelet makes them
    os.chmod(spool, 0o777)  # an emptyDir
    return pods, spool


@pytest.mark.root
def test_an_emptydir_spool_is_found_by_a_nobody_exporter_in_group_root() -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to play the kubelet, the pod's user and the exporter's")
    _skip_unless_importable_as(NOBODY)
    _skip_unless_importable_as(WRITER_UID)
    work = Path(tempfile.mkdtemp(prefix="gpuio-pod-spools-"))
    os.chmod(work, 0o755)
    pods, spool = kubelet_tree(work)
    # The container sees its emptyDir through a bind mount (the runtime's), not through the kubelet's
    # directories, which its user may not enter.
    mounted = work / "container-run-gpuio-spool"
    mounted.mkdir()
    subprocess.run(["mount", "--bind", str(spool), str(mounted)], check=True)
    engine = work / "detector.onnx"
    engine.write_bytes(os.urandom(1 << 16))
    os.chmod(engine, 0o644)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": "/nonexistent", "PYTHONPATH": LIBRARY,
           "GPUIO_SPOOL_DIR": str(mounted),
           "POD_NAMESPACE": "serving", "POD_NAME": "detector-7d9f-x2x9q", "CONTAINER_NAME": "server",
           "POD_UID": POD_UID}
    writer = subprocess.Popen(
        ["setpriv", f"--reuid={WRITER_UID}", f"--regid={WRITER_UID}", "--clear-groups", "--no-new-privs",
         sys.executable, "-c", WRITER.format(repo=str(REPO), engine=str(engine))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=work, env=env)
    args = ["--collector.disable-defaults", "--collector.engines", f"--collector.engines.kubelet-pods-dir={pods}",
            f"--collector.engines.spool-dir={work / 'no-hostpath'}", "--collector.engines.pod-spool-interval=200ms"]
    unprivileged = ["--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready", writer.communicate()
        assert [p.name for p in spool.iterdir()], "the writer made its spool file"

        port = free_port()
        exporter = _serve_as(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *unprivileged],
                             port, *args)
        try:
            text = _wait_scrape(exporter, port, lambda text: "gpuio_engine_pod_spool_scan_failed 1" in text)
        finally:
            output = _stop(exporter)
        assert "gpuio_engine_pod_info{" not in text and 'engine="detector"' not in text
        assert output.count("cannot read the kubelet's pods directory") == 1, output[-2000:]

        port = free_port()
        exporter = _serve_as(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--groups=0", *unprivileged],
                             port, *args)
        try:
            text = _wait_scrape(exporter, port, lambda text: "gpuio_engine_pod_info{" in text)
        finally:
            _stop(exporter)
        samples = parse_samples(text)
        pod = {("engine", "detector"), ("gpu_uuid", "GPU-a4f34abc-7715-3560-dcea-7238b9611a45"),
               ("namespace", "serving"), ("pod", "detector-7d9f-x2x9q"), ("container", "server"), ("pod_uid", POD_UID)}
        assert samples[("gpuio_engine_pod_info", frozenset(pod))] == 1
        assert samples[("gpuio_engine_load_read_bytes_total", frozenset({("engine", "detector")}))] == 1 << 16
        assert samples[("gpuio_engine_pod_spool_scan_failed", frozenset())] == 0
        served = sum(1 for line in text.splitlines() if "detector" in line)
        print(f"as nobody: the pod's spool found only with group root; {served} series of its engine served")
    finally:
        if writer.stdin is not None:
            writer.stdin.close()
        writer.wait(timeout=10)
        subprocess.run(["umount", str(mounted)], check=False)
        shutil.rmtree(work, ignore_errors=True)


def test_the_real_exporter_polls_the_kubelet_in_the_background_never_in_a_scrape(generated, kubelet) -> None:  # noqa: F811
    """The real exporter process against a gRPC server generated from the kubelet's proto: the GPU's pod
    is served; then the kubelet hangs (each call 3 s, past the 1 s timeout) and scrapes still answer at
    once, with the last answer and the failures counted (dcgm-exporter's #599 was a lookup per scrape)."""
    import time

    from tests.conftest import ExporterProcess

    server, socket_path = kubelet
    exporter = ExporterProcess(["--collector.disable-defaults", "--collector.pods",
                                f"--collector.pods.pod-resources-socket={socket_path}",
                                "--collector.pods.pod-resources-interval=200ms",
                                "--collector.pods.pod-resources-timeout=1s"]).start()
    try:
        deadline = time.monotonic() + 20
        while "gpuio_gpu_pod_info{" not in (text := exporter.scrape()):
            assert time.monotonic() < deadline, text[-2000:]
            time.sleep(0.1)
        assert 'pod="detector-7d9f",container="server"' in text
        server.delay = 3.0
        durations = []
        while 'gpuio_kubelet_pod_resources_failures_total{reason="deadline_exceeded"}' not in text:
            assert time.monotonic() < deadline + 20, text[-2000:]
            started = time.perf_counter()
            text = exporter.scrape()
            durations.append(time.perf_counter() - started)
            time.sleep(0.2)
        assert 'gpuio_scrape_collector_state{collector="pods",state="stale"} 1' in text
        assert "gpuio_gpu_pod_info{" in text  # the last answer, still served
        print(f"scrapes while the kubelet hung: {len(durations)}, slowest {max(durations) * 1000:.1f} ms")
    finally:
        server.delay = 0
        exporter.stop()
