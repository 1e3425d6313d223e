"""The mountstats collector on mountstats of real kernels (prometheus/procfs's fixtures), and against
Debian's node_exporter on the same file: every node_mountstats_nfs_X equals gpuio_mountstats_nfs_X."""

from __future__ import annotations

import os

import pytest

from exporter.collect import Absent
from exporter.collectors import mountstats
from exporter.context import Context
from exporter.exposition import render
from tests.conftest import REPO, Samples, parse_samples

FIXTURES = os.path.join(REPO, "tests", "fixtures", "mounts")
KUBELET_POINT = ("/var/lib/kubelet/pods/1c2215a7-0d92-4df5-83ce-a807bcc2f8c8/volumes/kubernetes.io~nfs/"
                 "home-automation--node-red-data--pv0001")


def fixture(name: str) -> str:
    with open(os.path.join(FIXTURES, name)) as handle:
        return handle.read()


def procfs_with(tmp_path, mountstats_text: str, mountinfo_text: str = "") -> str:
    """A procfs whose self links to a pid directory, as node_exporter's procfs library wants it."""
    pid = tmp_path / "proc" / "26231"
    pid.mkdir(parents=True)
    (pid / "mountstats").write_text(mountstats_text)
    (pid / "mountinfo").write_text(mountinfo_text)
    os.symlink("26231", tmp_path / "proc" / "self")
    return str(tmp_path / "proc")


def collect(procfs: str, **options) -> Samples:
    collector = mountstats.MountstatsCollector(Context(procfs=procfs), options)
    return parse_samples(render(collector.collect()))


def test_kubelet_nfs4_mount_of_a_real_kernel(tmp_path) -> None:
    samples = collect(procfs_with(tmp_path, fixture("kubelet-nfs4.mountstats")))
    base = {"export": "fs.example.com:/volume4/apps/home-automation/node-red-data", "protocol": "tcp",
            "mountaddr": "", "mountpoint": KUBELET_POINT}

    def value(name: str, **extra: str) -> float:
        return samples[(f"gpuio_mountstats_nfs_{name}", frozenset({**base, **extra}.items()))]

    assert value("age_seconds_total") == 83520
    assert value("total_read_bytes_total") == 1788561151
    read = {"operation": "READ"}
    assert value("operations_requests_total", **read) == 34096
    assert value("operations_received_bytes_total", **read) == 1792122744
    assert value("operations_response_time_seconds_total", **read) == 464.84  # RTT, ms -> s
    assert value("operations_request_time_seconds_total", **read) == 467.945
    assert value("operations_errors_total", operation="OPEN") == 394
    assert value("transport_sends_total", transport="0") == 938505
    assert value("event_vfs_open_total") == 2104
    # Operations never used (zero requests) are left out: 28 of the file's 63 remain.
    operations = {dict(labels)["operation"] for (name, labels) in samples
                  if name == "gpuio_mountstats_nfs_operations_requests_total"}
    assert len(operations) == 28 and "OPEN_CONFIRM" not in operations
    assert samples[("gpuio_mountstats_malformed_lines_total", frozenset())] == 0


def test_mountaddr_comes_from_mountinfo_and_wrapped_times_as_node_exporter(tmp_path) -> None:
    samples = collect(procfs_with(tmp_path, fixture("procfs-26231.mountstats"), fixture("procfs-26231.mountinfo")))
    labels = frozenset({"export": "192.168.1.1:/srv/test", "protocol": "tcp", "mountaddr": "192.168.1.1",
                        "mountpoint": "/mnt/nfs/test", "operation": "ACCESS"}.items())
    # 18446743919241604546 ms modulo 2**53, then / 1000
    assert samples[("gpuio_mountstats_nfs_operations_queue_time_seconds_total", labels)] == (
        18446743919241604546 % 2**53) / 1000.0
    info = {dict(ls)["mountpoint"]: dict(ls)["fstype"] for (name, ls) in samples if name == "gpuio_mount_info"}
    assert info == {"/mnt/nfs/test": "nfs"}  # the visible (last) of three stacked mounts


def test_malformed_lines_are_counted_and_the_rest_is_read(tmp_path) -> None:
    text = fixture("kubelet-nfs4.mountstats")
    text = text.replace("\tage:    83520", "\tage:    eighty").replace("READ: 34096 34096", "READ: 34096 x")
    text += "device garbage here\ndevice 10.0.0.1:/e mounted on /m with fstype nfs statvers=1.1\n\tbytes: 1 2\n"
    samples = collect(procfs_with(tmp_path, text))
    assert samples[("gpuio_mountstats_malformed_lines_total", frozenset())] == 4
    names = {name for name, _ in samples}
    assert "gpuio_mountstats_nfs_total_read_bytes_total" in names
    ops = [dict(ls) for (name, ls) in samples if name == "gpuio_mountstats_nfs_operations_requests_total"]
    assert len(ops) == 27 and not any(op["operation"] == "READ" for op in ops)


def test_caps_bound_mounts_and_operations(tmp_path) -> None:
    block = fixture("kubelet-nfs4.mountstats").strip("\n")
    text = "\n".join(block.replace(KUBELET_POINT, f"/m/{index}") for index in range(5)) + "\n"
    samples = collect(procfs_with(tmp_path, text), **{"max-mounts": 3, "max-operations": 10})
    points = {dict(ls)["mountpoint"] for (name, ls) in samples if name == "gpuio_mountstats_nfs_age_seconds_total"}
    assert points == {"/m/0", "/m/1", "/m/2"}
    ops = [ls for (name, ls) in samples if name == "gpuio_mountstats_nfs_operations_requests_total"]
    assert len(ops) == 30
    dropped = {dict(ls)["kind"]: value for (name, ls), value in samples.items()
               if name == "gpuio_mountstats_dropped_series_total"}
    assert dropped == {"mount": 2, "operation": 3 * 18}


def test_no_nfs_and_no_file_is_no_failure(tmp_path) -> None:
    with pytest.raises(Absent, match="no mount table"):  # no mount table in this procfs: no such source
        collect(str(tmp_path))
    samples = collect(procfs_with(tmp_path, "device /dev/sda1 mounted on / with fstype ext4\n"))
    assert not any(name.startswith("gpuio_mountstats_nfs_") for name, _ in samples)




def test_a_number_of_thousands_of_digits_costs_only_its_own_line(tmp_path) -> None:
    """One 5,000-digit number (past Python's 4,300-digit int() limit) in mountstats and in mountinfo: its
    line is skipped and counted, every other line is read (it failed the whole collector)."""
    huge = "9" * 5000
    stats = fixture("kubelet-nfs4.mountstats").replace("READ: 34096 34096", f"READ: 34096 {huge}")
    info = fixture("procfs-26231.mountinfo").replace(" 0:", f" {huge}:", 1)
    samples = collect(procfs_with(tmp_path, stats, info))
    assert samples[("gpuio_mountstats_malformed_lines_total", frozenset())] == 2
    ops = [dict(ls) for (name, ls) in samples if name == "gpuio_mountstats_nfs_operations_requests_total"]
    assert len(ops) == 27 and not any(op["operation"] == "READ" for op in ops)
