"""``gpuio engines`` (exporter/tools/engines_cli.py) and ``gpuio warm`` (exporter/tools/warm_cli.py) on real files and a
real spool."""

from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest

import gpuio
from exporter.tools.engines_cli import engines_main
from exporter.tools.warm_cli import warm_main
from gpuio import metrics
from gpuio import spool as spool_format


def evicted(path: str) -> str:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    return path


def test_engines_lists_spool_and_glob_engines_without_touching_dead_files(spool_dir, tmp_path, capsys) -> None:
    plan = tmp_path / "yolo.engine"
    plan.write_bytes(os.urandom(2 << 20))
    loaded = gpuio.load(str(plan), bytes, device=0, gpu_uuid="GPU-77")
    with loaded.metrics.infer():
        pass
    dead = spool_format.SpoolFile(spool_dir)
    metrics.EngineMetrics("retired", dead).inference_seconds.observe(0.1)
    dead.close()
    other = tmp_path / "models" / "bert.plan"
    other.parent.mkdir()
    other.write_bytes(b"b" * 8192)
    evicted(str(other))
    assert engines_main(["--spool-dir", spool_dir, "--path", str(tmp_path / "models" / "*.plan"),
                         "--path-include", str(tmp_path), "--json"]) == 0
    rows = {row["engine"]: row for row in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"yolo", "bert", "retired"}
    assert rows["yolo"]["processes"] == 1 and rows["yolo"]["gpus"] == ["cuda:0 GPU-77"]
    assert rows["yolo"]["cached_ratio"] == 1.0 and rows["yolo"]["inferences"] == 1 and rows["yolo"]["loads"] == 1
    assert rows["bert"]["cached_ratio"] == 0.0 and rows["bert"]["size_bytes"] == 8192
    assert dead.path is not None and os.path.exists(dead.path)  # left for the exporter to fold
    assert engines_main(["--spool-dir", spool_dir]) == 0
    table = capsys.readouterr().out
    assert table.startswith("ENGINE") and "yolo" in table and "GPU-77" in table
    assert "WATERFALL" not in table and max(map(len, table.splitlines())) < 200  # on-call's columns first
    assert engines_main(["--spool-dir", spool_dir, "--wide"]) == 0
    assert "LAST LOAD WATERFALL" in capsys.readouterr().out


def test_a_gpu_cell_shows_what_is_known_and_a_uuid_cut_short() -> None:
    from exporter.engine_join import gpu_cell as _gpu
    from exporter.tools.engines_cli import _short_gpu

    assert _gpu(-1, "GPU-5a1e0c2b-aaaa-bbbb-cccc-dddddddddddd") == "GPU-5a1e0c2b-aaaa-bbbb-cccc-dddddddddddd"
    assert _gpu(0, "") == "cuda:0" and _gpu(1, "GPU-77") == "cuda:1 GPU-77"
    assert _short_gpu("cuda:1 GPU-5a1e0c2b-aaaa-bbbb-cccc-dddddddddddd") == "cuda:1 GPU-5a1e0c2b"


def test_warm_reads_files_into_the_page_cache(tmp_path, capsys) -> None:
    first = tmp_path / "a.engine"
    second = tmp_path / "b.engine"
    for path in (first, second):
        path.write_bytes(os.urandom(4 << 20))
        evicted(str(path))
    assert warm_main([str(tmp_path / "*.engine"), "--jobs", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bytes"] == 8 << 20
    assert [(f["cached_before"], f["cached_after"]) for f in report["files"]] == [(0.0, 1.0), (0.0, 1.0)]
    assert warm_main([str(first), str(tmp_path / "missing.engine")]) == 1
    assert "missing.engine: error" in capsys.readouterr().out
    assert warm_main([str(tmp_path / "*.nothing")]) == 2


def test_a_spool_dir_that_does_not_exist_is_an_error_not_no_engines(tmp_path, capsys) -> None:
    assert engines_main(["--spool-dir", str(tmp_path / "typo")]) == 2
    assert f"spool directory {tmp_path / 'typo'} does not exist" in capsys.readouterr().err
    assert engines_main(["--spool-dir", str(tmp_path)]) == 0  # an empty spool: no engines, no error


def test_no_spool_directory_at_the_default_is_no_error(tmp_path, monkeypatch, capsys) -> None:
    """A node (a dev box) where no process has used the library has no spool directory: that is nothing
    there, not a mistake; the line says what was looked at and where to look instead, and the exit is 0."""
    import gpuio.spool

    monkeypatch.setattr(gpuio.spool, "DEFAULT_DIR", str(tmp_path / "run" / "spool"))
    for variable in ("GPUIO_SPOOL_DIR", "GPUIO_COLLECTOR_ENGINES_SPOOL_DIR", "GPUIO_COLLECTOR_ENGINES_PATH"):
        monkeypatch.delenv(variable, raising=False)
    pods = ["--kubelet-pods-dir", str(tmp_path / "no-kubelet")]
    assert engines_main(pods) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out == (f"no engines: no spool directory at {tmp_path}/run/spool, so no process here reports through the "
                   "library (--spool-dir or GPUIO_SPOOL_DIR names another); no --path files; engines found by "
                   "discovery are a running exporter's: --url http://localhost:9817\n")
    assert engines_main([*pods, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    # --path files are shown all the same
    (tmp_path / "a.engine").write_bytes(b"e" * 4096)
    assert engines_main([*pods, "--path", str(tmp_path / "*.engine"), "--json"]) == 0
    assert [row["engine"] for row in json.loads(capsys.readouterr().out)] == ["a"]
    # a directory named on purpose that is not there is a typo, whoever named it
    monkeypatch.setenv("GPUIO_SPOOL_DIR", str(tmp_path / "typo"))
    assert engines_main(pods) == 2
    assert f"spool directory {tmp_path}/typo does not exist (named by GPUIO_SPOOL_DIR)" in capsys.readouterr().err


@pytest.mark.parametrize(("given", "environ", "expected"), [
    (None, {}, ("DEFAULT", None)),
    ("/flag", {"GPUIO_SPOOL_DIR": "/env"}, ("/flag", "--spool-dir")),
    (None, {"GPUIO_SPOOL_DIR": "/env"}, ("/env", "GPUIO_SPOOL_DIR")),
    (None, {"GPUIO_SPOOL_DIR": "/env", "GPUIO_COLLECTOR_ENGINES_SPOOL_DIR": "/twin"},
     ("/twin", "GPUIO_COLLECTOR_ENGINES_SPOOL_DIR")),
    (None, {"GPUIO_SPOOL_DIR": ""}, ("DEFAULT", None)),  # set empty: not set
])
def test_spool_directory_and_what_named_it(given, environ, expected) -> None:
    from exporter.tools.engines_cli import spool_directory
    from gpuio.spool import DEFAULT_DIR

    directory, named_by = spool_directory(given, environ)
    assert (directory, named_by) == (DEFAULT_DIR if expected[0] == "DEFAULT" else expected[0], expected[1])


def test_warm_refuses_jobs_below_one(tmp_path) -> None:
    (tmp_path / "a.engine").write_bytes(b"x" * 4096)
    for jobs in ("0", "-1", "two"):
        with pytest.raises(SystemExit) as refused:
            warm_main([str(tmp_path / "a.engine"), "--jobs", jobs])
        assert refused.value.code == 2


def test_warm_evict_makes_the_next_load_cold(spool_dir, tmp_path, capsys) -> None:
    """--evict drops the files from the page cache: the next load reads them from the disk (cold)."""
    plan = tmp_path / "cold.engine"
    plan.write_bytes(os.urandom(4 << 20))
    os.sync()
    assert warm_main([str(plan), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["files"][0]["cached_after"] == 1.0
    assert warm_main([str(plan), "--evict", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["files"][0]
    assert (report["cached_before"], report["cached_after"]) == (1.0, 0.0)
    assert warm_main([str(plan), "--evict"]) == 0
    assert "cold.engine: evicted, cached 0% -> 0%" in capsys.readouterr().out
    waterfall = gpuio.load(str(plan), bytes).waterfall
    assert waterfall is not None and waterfall.load_class == "cold" and waterfall.device_bytes >= 4 << 20




def test_engines_json_is_valid_json_for_an_absurd_throughput(spool_dir, capsys) -> None:
    """A writer's numbers are its own: 2**53 bytes read in 5e-324 s is an infinite throughput, which
    Python's json prints as ``Infinity`` (not JSON).  The row says null instead: no figure."""
    writer = spool_format.SpoolFile(spool_dir)
    engine = metrics.EngineMetrics("absurd", writer)
    engine.load_read_seconds.observe(5e-324)
    engine.load_read_bytes.inc(2.0**53)
    assert engines_main(["--spool-dir", spool_dir, "--json"]) == 0
    out = capsys.readouterr().out
    rows = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert rows[0]["engine"] == "absurd" and rows[0]["loads"] == 1
    assert rows[0]["read_mib_per_second"] is None
    writer.close()


def test_engines_walks_a_spool_directory_too_big_for_one_read(spool_dir, monkeypatch, capsys) -> None:
    """The exporter walks a huge spool directory a slice per scrape; ``gpuio engines`` is asked once, so
    it reads on until the whole directory was walked: every writer is listed."""
    from exporter.engines import spool as spool_source

    monkeypatch.setattr(spool_source, "MAX_SCANNED_ENTRIES", 2)
    writers = [spool_format.SpoolFile(spool_dir) for _ in range(5)]
    for file in writers:
        metrics.EngineMetrics("sliced", file).inference_seconds.observe(0.01)
    assert engines_main(["--spool-dir", spool_dir, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["engine"] == "sliced" and rows[0]["processes"] == 5 and rows[0]["inferences"] == 5
    for file in writers:
        file.close()


@pytest.fixture(autouse=True)
def _not_on_a_sudo_users_behalf(monkeypatch) -> None:
    """warm_main, run as root with SUDO_UID set (``sudo make test``), would make this test process that
    user for good (see exporter/tools/warm_cli.py, WARM_RULES): these tests call it in-process as root."""
    for name in ("SUDO_UID", "SUDO_GID", "SUDO_USER"):
        monkeypatch.delenv(name, raising=False)


def test_a_blocked_read_is_abandoned_after_the_stall_bound_and_stops_when_it_returns() -> None:
    """within_stall_bound on a real blocking read (a pipe nobody writes yet): Stalled once the bound
    passes without a beat; the thread stays blocked in the kernel until the read returns, then sees it
    was abandoned and ends without reading on."""
    from exporter.tools.warm_cli import Stalled, within_stall_bound

    reader, writer = os.pipe()
    reads: list[bytes] = []
    ended = threading.Event()

    def blocked(beat, abandoned) -> None:
        beat()
        while not abandoned.is_set():
            reads.append(os.read(reader, 1))
        ended.set()

    with pytest.raises(Stalled):
        within_stall_bound(blocked, 0.2)
    assert reads == [] and not ended.is_set()  # still blocked in read(2)
    os.write(writer, b"x")  # the read returns at last
    assert ended.wait(10) and reads == [b"x"]
    os.close(reader)
    os.close(writer)
    assert within_stall_bound(lambda beat, abandoned: "done", 0.2) == "done"
    with pytest.raises(ZeroDivisionError):  # the work's own failure reaches the caller
        within_stall_bound(lambda beat, abandoned: 1 / 0, 0.2)


def test_engines_shows_a_load_in_progress_and_the_mount_under_the_file(spool_dir, tmp_path, capsys) -> None:
    """A load held in its loader (deserialize) is in progress: counted, its bytes so far and its start,
    in --json and in --wide's LOADING column; the file's mount point is in both too."""
    plan = tmp_path / "slow.engine"
    plan.write_bytes(b"s" * 65536)
    release = threading.Event()
    loading = threading.Thread(target=gpuio.load, args=(str(plan), lambda data: release.wait(30) and data))
    started = time.time()
    loading.start()
    try:
        deadline = time.monotonic() + 10
        while gpuio.engine("slow").loads_in_progress() == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert engines_main(["--spool-dir", spool_dir, "--path-include", str(tmp_path), "--json"]) == 0
        row = json.loads(capsys.readouterr().out)[0]
        assert (row["engine"], row["loads_in_progress"], row["load_in_progress_read_bytes"]) == ("slow", 1, 65536)
        assert started - 1 <= row["load_in_progress_since"] <= time.time()
        assert row["mountpoint"] == mount_point_of(str(plan)) and row["fstype"]
        assert engines_main(["--spool-dir", spool_dir, "--path-include", str(tmp_path), "--wide"]) == 0
        heading, line = capsys.readouterr().out.splitlines()
        assert re.search(r"\b1 for \d+s\b", line) and "LOADING" in heading and "MOUNT" in heading
    finally:
        release.set()
        loading.join()
    assert engines_main(["--spool-dir", spool_dir, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert (row["loads_in_progress"], row["load_in_progress_since"], row["loads"]) == (0, None, 1)


def mount_point_of(path: str) -> str:
    """The mount point under ``path``, as os.path.ismount finds it walking up."""
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path
