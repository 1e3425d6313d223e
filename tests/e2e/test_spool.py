"""Spool writers as processes: killed mid-write, forked, a pid reused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from exporter.engines import parse
from exporter.engines import spool as spool_source
from tests.conftest import REPO
from tests.unit.test_spool import LAYOUT, count, spool_files, total

pytestmark = pytest.mark.e2e

HAMMER = textwrap.dedent("""
    import sys, os
    sys.path.insert(0, {repo!r})
    import gpuio
    gpuio.configure({directory!r})
    metrics = gpuio.engine("hammer")
    metrics.inference_seconds.observe(0.25)
    print(os.getpid(), flush=True)
    sys.stdout.close()
    index = 0
    while True:
        metrics.inference_seconds.observe(0.25)
        metrics.load_read_bytes.inc(1)
        index += 1
        if index % 1000 == 0:
            metrics.error(f"reason{{index // 1000 % 40}}")
""")


def start_hammer(directory: str) -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-c", HAMMER.format(repo=REPO, directory=directory)],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    process.stdout.readline()  # the spool file exists and has one observation
    return process


def test_a_process_killed_mid_write_is_folded_consistently(tmp_path) -> None:
    directory = str(tmp_path)
    process = start_hammer(directory)
    reader = spool_source.SpoolReader(directory)
    seen = []
    for _ in range(5):
        time.sleep(0.05)
        values = reader.read().engines["hammer"]
        seen.append((count(values, "inference_seconds"), values[LAYOUT.counters["load_read_bytes"]]))
    process.send_signal(signal.SIGKILL)
    process.wait()
    totals = reader.read()
    values = totals.engines["hammer"]
    final = count(values, "inference_seconds")
    assert [a for a, _ in seen] == sorted(a for a, _ in seen) and seen[-1][0] <= final  # never backwards
    assert final > 1000, "the process ran long enough to be killed mid-loop"
    # Killed between two stores: the count and the sum disagree by one observation at most.
    assert abs(total(values, "inference_seconds") - 0.25 * final) <= 0.25
    assert abs(values[LAYOUT.counters["load_read_bytes"]] - (final - 1)) <= 1
    assert reader.errors == {} and reader.folded_processes == 1
    assert spool_files(directory) == []
    assert sum(v for (engine, _), v in totals.errors.items() if engine == "hammer") >= (final - 1) // 1000 - 1


def _set_next_pid(pid: int) -> None:
    with open("/proc/sys/kernel/ns_last_pid", "w") as handle:
        handle.write(str(pid - 1))


@pytest.mark.root
def test_real_pid_reuse_cannot_mix_two_processes(tmp_path) -> None:
    """Process A dies; process B is given A's pid (ns_last_pid); the reader keeps them apart."""
    if os.geteuid() != 0:
        pytest.skip("setting the next pid needs root")
    directory = str(tmp_path)
    reader = spool_source.SpoolReader(directory)
    first = start_hammer(directory)
    reader.read()
    first.send_signal(signal.SIGKILL)
    first.wait()
    for _ in range(20):
        _set_next_pid(first.pid)
        second = start_hammer(directory)
        if second.pid == first.pid:
            break
        second.kill()
        second.wait()
    else:
        pytest.skip("could not get the same pid again (busy machine)")
    names = spool_files(directory)
    assert len(names) == 2 and all(name.startswith(f"gpuio-{first.pid}-") for name in names)
    totals = reader.read()
    time.sleep(0.05)
    after = reader.read()
    second.send_signal(signal.SIGKILL)
    second.wait()
    final = reader.read()
    assert reader.folded_processes == 2 and reader.errors == {}
    # A's totals were folded once; B's kept growing on top of them; nothing went backwards.
    assert count(totals.engines["hammer"], "inference_seconds") <= count(after.engines["hammer"], "inference_seconds")
    assert count(after.engines["hammer"], "inference_seconds") <= count(final.engines["hammer"], "inference_seconds")
    assert after.processes["hammer"] == 1


def test_a_forked_child_reports_in_a_file_of_its_own(tmp_path) -> None:
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {REPO!r})
        import gpuio
        gpuio.configure({str(tmp_path)!r})
        metrics = gpuio.engine("forky")
        metrics.inference_seconds.observe(0.01)
        metrics.error("boom")
        pid = os.fork()
        if pid == 0:
            child = gpuio.engine("forky")
            child.inference_seconds.observe(0.01)
            child.inference_seconds.observe(0.01)
            child.error("boom")
            assert child.inference_seconds.count() == 2, child.inference_seconds.count()
            assert child.errors() == {{"boom": 1.0}}, child.errors()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert status == 0, "the child's checks failed"
        assert metrics.inference_seconds.count() == 1
        print(gpuio.describe()["spool"])
    """)
    parent_file = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    reader = spool_source.SpoolReader(str(tmp_path))
    totals = reader.read()
    assert count(totals.engines["forky"], "inference_seconds") == 3
    assert totals.errors[("forky", "boom")] == 2
    assert reader.folded_processes == 2 and parent_file.strip()


@pytest.mark.parametrize("hot_path", ["c", "python"])
def test_a_handle_kept_across_fork_counts_the_childs_work_in_the_childs_file(tmp_path, hot_path: str) -> None:
    """The spool is a MAP_SHARED mapping: a handle taken before fork() (a gunicorn --preload app keeps
    them) would add the child's observations to the parent's file.  The child maps a file of its own at the
    same address, so the kept handle works and counts the child's work there."""
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {REPO!r})
        import gpuio
        from gpuio import metrics as m
        assert m.HOT_PATH == {hot_path!r} or (m._hotpath is None and {hot_path!r} == "c"), m.HOT_PATH
        gpuio.configure({str(tmp_path)!r})
        metrics = gpuio.engine("forky")
        kept = metrics.inference_seconds.observe
        kept(0.01)
        pid = os.fork()
        if pid == 0:
            kept(0.01)
            kept(0.01)
            with metrics.infer():
                pass
            os._exit(0 if metrics.inference_seconds.count() == 3 else 4)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
        kept(0.01)  # the parent's handle still writes the parent's file
        assert metrics.inference_seconds.count() == 2, metrics.inference_seconds.count()
        print(gpuio.describe()["spool"])
    """)
    parent_file = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                                 env={**os.environ, "GPUIO_HOT_PATH": hot_path}).stdout.strip()
    by_file = counts_by_file(tmp_path, "forky")
    assert len(by_file) == 2 and by_file.pop(parent_file) == 2.0 and list(by_file.values()) == [3.0]
    totals = spool_source.SpoolReader(str(tmp_path)).read()
    assert count(totals.engines["forky"], "inference_seconds") == 5  # parent 2, child 3


PREFORK = textwrap.dedent("""
    import multiprocessing, os, sys
    sys.path.insert(0, {repo!r})
    import gpuio
    gpuio.configure({directory!r})
    # --preload: the app, its engine and its handles are made once, in the parent
    metrics = gpuio.engine("served")
    observe, infer = metrics.inference_seconds.observe, metrics.infer
    metrics.error("warmup")

    def serve(requests, report):
        for index in range(requests):
            with infer():
                pass
            observe(0.002)
            if index % 10 == 0:
                metrics.error("timeout")
        report.put((os.getpid(), gpuio.describe()["spool"]))

    if __name__ == "__main__":
        fork = multiprocessing.get_context("fork")
        report = fork.Queue()
        workers = [fork.Process(target=serve, args=(100 * (number + 1), report)) for number in range({workers})]
        for worker in workers:
            worker.start()
        files = [report.get(timeout=60) for _ in workers]
        for worker in workers:
            worker.join()
            assert worker.exitcode == 0, worker.exitcode
        for _, path in files:
            print(path)
        print(gpuio.describe()["spool"])
""")


def counts_by_file(directory, engine: str) -> dict[str, float]:
    """Each spool file's own count of the engine's inferences (not merged: what each process wrote)."""
    counts = {}
    for name in spool_files(str(directory)):
        path = os.path.join(str(directory), name)
        with open(path, "rb") as handle:
            parsed = parse.parse(handle.read())
        counts[path] = count(parsed.engines[engine], "inference_seconds") if engine in parsed.engines else 0.0
    return counts


def test_preforked_workers_each_report_as_their_own_process_with_exact_counts(tmp_path) -> None:
    """gunicorn --preload's shape with multiprocessing's fork: engine and handles made in the parent, four
    workers serve 100, 200, 300 and 400 requests through the inherited handles.  Each worker's file holds
    exactly its own requests (two observations each); the parent's holds none of them."""
    workers = 4
    done = subprocess.run([sys.executable, "-c", PREFORK.format(repo=REPO, directory=str(tmp_path), workers=workers)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    *worker_files, parent_file = done.stdout.split()
    assert len(set(worker_files)) == workers and parent_file not in worker_files
    by_file = counts_by_file(tmp_path, "served")
    assert by_file[parent_file] == 0.0
    assert sorted(by_file[path] for path in worker_files) == [200.0, 400.0, 600.0, 800.0]
    reader = spool_source.SpoolReader(str(tmp_path))
    totals = reader.read()
    assert count(totals.engines["served"], "inference_seconds") == 2000
    assert totals.errors[("served", "timeout")] == 10 + 20 + 30 + 40
    assert totals.errors[("served", "warmup")] == 1  # the parent's, not copied into the workers
    assert reader.folded_processes == workers + 1


def test_a_child_that_cannot_take_its_spool_over_refuses_the_inherited_handles(tmp_path) -> None:
    """Where MAP_FIXED is refused (the one call a child cannot do without), the child gets a new file and
    new handles from gpuio.engine(), and a handle kept from the parent raises rather than write the
    parent's file."""
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {REPO!r})
        import gpuio
        from gpuio import spool
        gpuio.configure({str(tmp_path)!r})
        metrics = gpuio.engine("forky")
        kept = metrics.inference_seconds.observe
        kept(0.01)
        spool._map_fixed = lambda address, length, fd: False
        pid = os.fork()
        if pid == 0:
            try:
                kept(0.01)
            except ValueError:
                pass
            else:
                os._exit(3)
            gpuio.engine("forky").inference_seconds.observe(0.01)
            os._exit(0 if metrics.inference_seconds.count() == 1 else 4)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
        kept(0.01)
    """)
    for hot_path in ("c", "python"):
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                       env={**os.environ, "GPUIO_HOT_PATH": hot_path})
    totals = spool_source.SpoolReader(str(tmp_path)).read()
    assert count(totals.engines["forky"], "inference_seconds") == 2 * 3  # parent 2, child 1, per hot path


@pytest.fixture
def big_directory(tmp_path):
    """A directory on tmpfs where there is one (200,000 names cost ~3 s to make there), else tmp_path."""
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(dir="/dev/shm") if os.path.isdir("/dev/shm") else str(tmp_path / "spool")
    os.makedirs(directory, exist_ok=True)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def test_a_directory_of_200000_names_is_walked_a_bounded_slice_a_read_and_in_full_over_a_few(big_directory) -> None:
    """A writer that fills the spool directory with names must not make every read walk them all: a read
    looks at ``scan_entries`` entries (65,536) and the next one goes on from there, so the writers made
    before and after 200,000 junk names are all found within ceil(200,003 / 65,536) = 4 reads, whatever
    the directory's order, and later passes count nothing twice."""
    from gpuio import spool as spool_format
    from gpuio.metrics import EngineMetrics

    def made(observations: int) -> spool_format.SpoolFile:
        file = spool_format.SpoolFile(big_directory, 64 * 1024)
        metrics = EngineMetrics("busy", file)
        for _ in range(observations):
            metrics.inference_seconds.observe(0.01)
        return file

    first = made(1)
    dead = made(10)
    dead.close()  # exited before the exporter came: folded once, left in place (a tool's reader)
    for index in range(200_000):
        os.close(os.open(os.path.join(big_directory, f"junk-{index:06d}"), os.O_CREAT | os.O_WRONLY, 0o644))
    last = made(100)
    reader = spool_source.SpoolReader(big_directory, remove_dead=False)
    budget = getattr(reader, "scan_entries", 65_536)
    order = {entry.name: position for position, entry in enumerate(os.scandir(big_directory))}
    position = {file: order[os.path.basename(str(file.path))] for file in (first, dead, last)}
    assert max(position.values()) >= budget  # made first and last: one of them is past the first slice

    totals = reader.read()
    in_first_slice = [n for file, n in ((first, 1), (dead, 10), (last, 100)) if position[file] < budget]
    assert count(totals.engines.get("busy", [0.0] * LAYOUT.size), "inference_seconds") == sum(in_first_slice)
    assert totals.unfinished_listings == 1
    reads = 1
    while totals.unfinished_listings:
        totals = reader.read()
        reads += 1
    assert reads == -(-len(order) // budget) == 4
    assert count(totals.engines["busy"], "inference_seconds") == 111
    assert totals.live_files == 2 and reader.folded_processes == 1
    for _ in range(2 * reads):  # two more passes: the dead file's totals are not folded again
        totals = reader.read()
    assert count(totals.engines["busy"], "inference_seconds") == 111 and reader.folded_processes == 1
    assert "vanished" not in reader.errors
    first.close()
    last.close()
