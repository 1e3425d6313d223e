"""cgroup_io: the kernel's formats, which cgroups rank, the bounds, and who is served on real tree layouts.

The trees are tests/fixtures/cgroup-trees (containerd and CRI-O nodes with the kubelet's systemd driver on
cgroup v2, a systemd host, a cgroup v1 blkio host with the cgroupfs driver), copied so that a test can make
cgroups do IO between two walks: it rewrites their files in the kernel's format with higher counters.
"""

from __future__ import annotations

import errno
import os
import shutil

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from exporter.collect import Absent, Pending, Scraper
from exporter.collectors import cgroup_io
from exporter.collectors.cgroup_io import CgroupIoCollector, Selection
from exporter.config import ConfigError, parse_args
from exporter.context import Context
from exporter.exposition import render
from exporter.host import cgroups
from exporter.host.cgroups import NO_IO, DeviceIo, Pressure
from exporter.host.lines import BadLine
from tests.conftest import REPO, parse_samples, undeclared

TREES = os.path.join(REPO, "tests", "fixtures", "cgroup-trees")
GIB = 1 << 30
KUBEPODS = "/kubepods.slice/kubepods-burstable.slice"
TRITON = (f"{KUBEPODS}/kubepods-burstable-pod6f1c2d3e_4a5b_4c6d_8e7f_90a1b2c3d4e5.slice/"
          "cri-containerd-3b8e5f0c1d2a4e6f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f7.scope")
SYNC = (f"{KUBEPODS}/kubepods-burstable-pod9a8b7c6d_5e4f_4a3b_8c2d_1e0f9a8b7c6d.slice/cri-containerd-"
        "c0ffee00d15ea5e0c0ffee00d15ea5e0c0ffee00d15ea5e0c0ffee00d15ea5e0.scope")
VLLM = ("/kubepods.slice/kubepods-podc4d5e6f7_8091_4a2b_9c3d_4e5f60718293.slice/cri-containerd-"
        "5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c.scope")


class Bad(list):
    """Collects what the parsers report: (source, reason, line)."""

    def __call__(self, source: str, reason: str, line: str) -> None:
        self.append((source, reason, line))

    @property
    def reasons(self) -> list[str]:
        return [reason for _, reason, _ in self]


# --- a tree that does IO between walks ----------------------------------------------------------------


class Tree:
    """A copy of a fixture tree whose cgroups a test makes do IO, as the kernel would count it."""

    def __init__(self, tmp_path, name: str) -> None:
        self.sysfs = str(tmp_path / name / "sys")
        shutil.copytree(os.path.join(TREES, name, "sys"), self.sysfs, symlinks=True)
        self.v1 = os.path.isdir(os.path.join(self.sysfs, "fs", "cgroup", "blkio"))
        self.root = os.path.join(self.sysfs, "fs", "cgroup", *(["blkio"] if self.v1 else []))

    def directory(self, cgroup: str) -> str:
        return os.path.join(self.root, cgroup.lstrip("/"))

    def read(self, cgroup: str, device: str, read: int = 0, written: int = 0, reads: int = 0,
             writes: int = 0) -> None:
        """The cgroup reads and writes on ``device`` (MAJ:MIN); in v2, its ancestors count it too."""
        if self.v1:
            self._add_v1(cgroup, device, read, written, reads, writes)
            return
        path = cgroup
        while path not in ("", "/"):
            self._add_v2(path, device, {"rbytes": read, "wbytes": written, "rios": reads, "wios": writes})
            path = os.path.dirname(path)

    def stall(self, cgroup: str, some_us: int, full_us: int = 0) -> None:
        file = os.path.join(self.directory(cgroup), "io.pressure")
        with open(file) as handle:
            lines = handle.read().splitlines()
        totals = {line.split()[0]: int(line.rsplit("total=", 1)[1]) for line in lines}
        totals["some"] += some_us
        totals["full"] += full_us
        with open(file, "w") as handle:
            handle.writelines(f"{kind} avg10=1.00 avg60=1.00 avg300=1.00 total={totals[kind]}\n"
                              for kind in ("some", "full"))

    def _add_v2(self, cgroup: str, device: str, add: dict[str, int]) -> None:
        file = os.path.join(self.directory(cgroup), "io.stat")
        with open(file) as handle:
            lines = [line for line in handle.read().splitlines() if line]
        numbers = [line.partition(" ")[0] for line in lines]
        if device not in numbers:
            numbers.append(device)
            lines.append(f"{device} ")
        index = numbers.index(device)
        rest = lines[index].partition(" ")[2]
        items = [item.partition("=") for item in rest.split()]
        values = {key: int(value) for key, _, value in items if key in cgroups.IO_STAT_KEYS}
        extra = "".join(f" {key}={value}" for key, _, value in items if key not in cgroups.IO_STAT_KEYS)
        counters = {key: values.get(key, 0) + add.get(key, 0) for key in cgroups.IO_STAT_KEYS}
        lines[index] = f"{device} " + " ".join(f"{key}={value}" for key, value in counters.items()) + extra
        with open(file, "w") as handle:
            handle.write("".join(line + "\n" for line in lines))

    def _add_v1(self, cgroup: str, device: str, read: int, written: int, reads: int, writes: int) -> None:
        for name, add in (("blkio.throttle.io_service_bytes", (read, written)),
                          ("blkio.throttle.io_serviced", (reads, writes))):
            file = os.path.join(self.directory(cgroup), name)
            with open(file) as handle:
                rows = [line.split() for line in handle.read().splitlines() if line]
            per_device: dict[str, dict[str, int]] = {}
            for row in rows:
                if len(row) == 3:
                    per_device.setdefault(row[0], {})[row[1]] = int(row[2])
            ops = per_device.setdefault(device, dict.fromkeys(cgroups.BLKIO_OPERATIONS, 0))
            ops["Read"] += add[0]
            ops["Write"] += add[1]
            ops["Sync"] += add[0] + add[1]
            ops["Total"] += add[0] + add[1]
            text = "".join(f"{dev} {op} {value}\n" for dev, ops_ in per_device.items() for op, value in ops_.items())
            total = sum(ops_["Total"] for ops_ in per_device.values())
            with open(file, "w") as handle:
                handle.write(text + f"Total {total}\n")


def collector(sysfs: str, **options: object) -> CgroupIoCollector:
    settings = {option.name: option.parse(option.default) for option in CgroupIoCollector.options}
    settings.update({key.replace("_", "-"): value for key, value in options.items()})
    made = CgroupIoCollector(Context(sysfs=sysfs), settings)
    made.first_gap = 0.0  # the test makes the IO between walks itself
    return made


def walk_now(made: CgroupIoCollector) -> str:
    """One walk, and what a scrape then serves, checked against the declarations."""
    snapshot = made.sampler.sample_now()
    assert snapshot.error is None, snapshot.error
    text = render(made.collect())
    assert undeclared(text) == []
    list(parse_openmetrics(render(made.collect(), openmetrics=True)))
    return text


def series(text: str, name: str) -> dict[tuple[str, ...], float]:
    """A family's samples keyed by their label values in the declared order."""
    from exporter import catalogue

    labels = catalogue.by_name(name).labels
    return {tuple(dict(key)[label] for label in labels): value
            for (found, key), value in parse_samples(text).items() if found == name}


def info(text: str) -> dict[str, dict[str, str]]:
    return {dict(key)["cgroup"]: dict(key) for (name, key), _ in parse_samples(text).items()
            if name == "gpuio_cgroup_info"}


# --- the formats ---------------------------------------------------------------------------------------


def test_io_stat_lines_as_the_kernel_writes_them() -> None:
    parse = cgroups.parse_io_stat_line
    assert parse("259:1 rbytes=68719476736 wbytes=0 rios=524288 wios=0 dbytes=0 dios=0") == (
        (259, 1), DeviceIo(68719476736, 0, 524288, 0, 0, 0))
    # iocost (and iolatency, debug) append keys of their own; a kernel before 4.19 writes no discards.
    assert parse("8:0 rbytes=1 wbytes=2 rios=3 wios=4 dbytes=5 dios=6 cost.vrate=100.00 cost.usage=77") == (
        (8, 0), DeviceIo(1, 2, 3, 4, 5, 6))
    assert parse("8:16 rbytes=1 wbytes=2 rios=3 wios=4") == ((8, 16), DeviceIo(1, 2, 3, 4))
    # A device whose counters are all zero: the kernel writes its number and nothing (or a policy's keys).
    assert parse("259:0 ") == ((259, 0), NO_IO)
    assert parse("259:0  cost.usage=0") == ((259, 0), NO_IO)


@pytest.mark.parametrize(("line", "reason"), [
    ("sda rbytes=1 wbytes=2 rios=3 wios=4", "bad_device"),
    ("259:x rbytes=1 wbytes=2 rios=3 wios=4", "bad_device"),
    (f"259:0 rbytes={'9' * 1000} wbytes=2 rios=3 wios=4", "non_numeric"),  # past 20 digits: no int() of it
    (f"259:0 rbytes={'9' * 5000} wbytes=2 rios=3 wios=4", "too_long"),
    ("259:0 rbytes=-1 wbytes=2 rios=3 wios=4", "non_numeric"),
    ("259:0 rbytes=\u00b2 wbytes=2 rios=3 wios=4", "non_numeric"),
    ("259:0 rbytes=1 rbytes=1 wbytes=2 rios=3 wios=4", "repeated"),
    ("259:0 rbytes=1 wbytes=2", "incomplete"),
    ("259:0 rbytes=1 wbytes=2 rios=3 wios=4 " + "x" * 5000, "too_long"),
])
def test_a_bad_io_stat_line_is_bad_alone(line: str, reason: str) -> None:
    with pytest.raises(BadLine) as raised:
        cgroups.parse_io_stat_line(line)
    assert raised.value.reason == reason
    bad = Bad()
    text = f"8:0 rbytes=10 wbytes=0 rios=1 wios=0\n{line}\n8:16 rbytes=20 wbytes=0 rios=2 wios=0\n"
    assert cgroups.parse_io_stat(text, False, bad) == {(8, 0): DeviceIo(10, 0, 1, 0), (8, 16): DeviceIo(20, 0, 2, 0)}
    assert bad.reasons == [reason]


def test_v1_blkio_files_make_one_count_per_device() -> None:
    service_bytes = ("8:0 Read 4096\n8:0 Write 8192\n8:0 Sync 12288\n8:0 Async 0\n8:0 Discard 512\n8:0 Total 12800\n"
                     "8:16 Read 1\n8:16 Write 2\n8:16 Sync 3\n8:16 Async 0\n8:16 Total 3\nTotal 12803\n")
    serviced = ("8:0 Read 1\n8:0 Write 2\n8:0 Sync 3\n8:0 Async 0\n8:0 Discard 1\n8:0 Total 4\n"
                "8:16 Read 1\n8:16 Write 1\n8:16 Total 2\n7:3 Read 5\n7:3 Write 0\nTotal 11\n")
    bad = Bad()
    joined = cgroups.join_blkio(cgroups.parse_blkio(service_bytes, False, cgroups.BLKIO_BYTES, bad),
                                cgroups.parse_blkio(serviced, False, cgroups.BLKIO_IOS, bad))
    # 8:16 as a kernel before 4.19 writes it (no Discard); 7:3 only in one file (used between the reads).
    assert joined == {(8, 0): DeviceIo(4096, 8192, 1, 2, 512, 1), (8, 16): DeviceIo(1, 2, 1, 1)}
    assert bad == []
    assert cgroups.parse_blkio("Total 0\n", False, cgroups.BLKIO_BYTES, bad) == {}  # a cgroup that did no IO


@pytest.mark.parametrize(("line", "reason"), [
    ("8:0 Read", "field_count"), ("8:0 Read 1 2", "field_count"), ("8:0 Peek 1", "unknown_operation"),
    ("8:0 Read 1e3", "non_numeric"), (f"8:0 Read {'1' * 1000}", "non_numeric"), ("Total x", "non_numeric"),
    ("x:0 Read 1", "bad_device"),
])
def test_a_bad_blkio_line_is_bad_alone(line: str, reason: str) -> None:
    bad = Bad()
    parsed = cgroups.parse_blkio(f"8:0 Read 1\n{line}\n8:0 Write 2\nTotal 3\n", False, cgroups.BLKIO_BYTES, bad)
    assert parsed == {(8, 0): {"Read": 1, "Write": 2}}
    assert bad.reasons == [reason]


def test_io_pressure_and_its_bad_lines() -> None:
    bad = Bad()
    text = ("some avg10=0.50 avg60=0.20 avg300=0.05 total=912334201\n"
            "full avg10=0.10 avg60=0.05 avg300=0.01 total=402118774\nfull total=1\nsoon total=3\n")
    assert cgroups.parse_pressure(text, False, bad) == Pressure(912334201, 402118774)
    assert bad.reasons == ["repeated", "unknown_kind"]
    assert cgroups.parse_pressure("full avg10=0.00 total=1\n", False, bad) is None  # no "some": nothing to rank


def test_a_file_past_the_byte_bound_is_read_up_to_it(tmp_path) -> None:
    """Millions of lines: the first MAX_FILE_BYTES are parsed, the line cut there is reported."""
    path = tmp_path / "io.stat"
    line = "259:0 rbytes=1 wbytes=2 rios=3 wios=4 dbytes=0 dios=0\n"
    path.write_text(line + "".join(f"{n}:1 rbytes=1 wbytes=2 rios=3 wios=4\n" for n in range(1, 200_000)))
    text, cut = cgroups.read_bounded(str(path)) or ("", False)
    assert cut and len(text) == cgroups.MAX_FILE_BYTES
    bad = Bad()
    parsed = cgroups.parse_io_stat(text, cut, bad)
    assert parsed[(259, 0)] == DeviceIo(1, 2, 3, 4, 0, 0) and len(parsed) > 1000
    assert bad.reasons == ["truncated"]


# --- the walk ----------------------------------------------------------------------------------------


def ranked(tree: str) -> tuple[set[str], set[str], cgroups.Walk]:
    hierarchy = cgroups.find_hierarchy(os.path.join(TREES, tree, "sys"))
    assert hierarchy is not None
    walk = cgroups.walk(hierarchy, 5000, Bad())
    return ({r.path for r in walk.cgroups if r.ranks_io}, {r.path for r in walk.cgroups if r.ranks_pressure}, walk)


def test_v2_ranks_the_deepest_cgroups_that_count_io() -> None:
    ranks_io, ranks_pressure, walk = ranked("v2-containerd")
    assert walk.hierarchy.version == cgroups.V2 and walk.skipped == 0
    assert {TRITON, SYNC, VLLM, "/system.slice/containerd.service", "/init.scope"} <= ranks_io
    # Parents repeat their children's IO: never ranked.
    assert not ranks_io & {"/kubepods.slice", KUBEPODS, os.path.dirname(TRITON), "/system.slice"}
    # Where systemd enables no io controller below a slice, the slice is where its children's IO is counted.
    assert {"/system.slice/system-getty.slice", "/user.slice"} <= ranks_io
    assert "/system.slice/system-getty.slice/getty@tty1.service" not in ranks_io
    assert "/system.slice/system-getty.slice/getty@tty1.service" in ranks_pressure
    assert "/user.slice" not in ranks_pressure and TRITON in ranks_pressure


def test_v1_ranks_every_cgroup_by_its_own_io() -> None:
    ranks_io, ranks_pressure, walk = ranked("v1-cgroupfs")
    assert walk.hierarchy.version == cgroups.V1  # the hybrid host's unified tree has no IO counters
    assert ranks_io == {reading.path for reading in walk.cgroups} and ranks_pressure == set()
    trainer = next(r for r in walk.cgroups if r.path.endswith("7e" * 32))
    assert trainer.io == {(8, 16): DeviceIo(50 * GIB, 5 * GIB, 409600, 40960, 0, 0)}
    assert next(r for r in walk.cgroups if r.path == "/kubepods").io == {}  # its own tasks did no IO


def test_the_walk_reads_at_most_max_cgroups_breadth_first(tmp_path) -> None:
    tree = Tree(tmp_path, "v2-containerd")
    walk = cgroups.walk(cgroups.find_hierarchy(tree.sysfs), 4, Bad())  # type: ignore[arg-type]
    assert [reading.path for reading in walk.cgroups] == ["/init.scope", "/kubepods.slice", "/system.slice",
                                                          "/user.slice"]
    assert walk.skipped >= 1


def test_deep_and_odd_names_stay_bounded_and_apart(tmp_path) -> None:
    root = tmp_path / "sys" / "fs" / "cgroup"
    root.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("io\n")
    deep = root
    for _ in range(cgroups.MAX_DEPTH + 8):
        deep = deep / ("n" * 40)
    deep.mkdir(parents=True)
    os.mkdir(os.path.join(os.fsencode(root), b"bad-\xff\xfe.scope"))
    os.mkdir(os.path.join(os.fsencode(root), b"bad-\xfe\xff.scope"))
    os.mkdir(os.path.join(os.fsencode(root), b"bad-\\xff\\xfe.scope"))  # spelt as the first is shown
    walk = cgroups.walk(cgroups.find_hierarchy(str(tmp_path / "sys")), 5000, Bad())  # type: ignore[arg-type]
    paths = [reading.path for reading in walk.cgroups]
    assert max(len(path) for path in paths) <= cgroups.MAX_PATH_CHARS
    deep_paths = [path for path in paths if path.startswith("/nnnn")]
    assert len(deep_paths) == cgroups.MAX_DEPTH and walk.skipped == 1
    assert len(set(deep_paths)) == len(deep_paths)  # the cut paths keep a hash of the whole
    for path in paths:
        path.encode("utf-8")  # every label is valid UTF-8
    # A byte that is not UTF-8 is shown \xNN (hosttext.visible), so a name can read as another's shown: the
    # collector serves the first only.
    assert sorted(path for path in paths if path.startswith("/bad-")) == [
        "/bad-\\xfe\\xff.scope", "/bad-\\xff\\xfe.scope", "/bad-\\xff\\xfe.scope"]
    made = collector(str(tmp_path / "sys"))
    walk_now(made)
    # Each walk (three: the first sample walks twice) drops the repeated label and what lies past MAX_DEPTH.
    assert series(walk_now(made), "gpuio_cgroup_io_dropped_series_total")[("cgroup",)] == 3 * 2


# --- the collector on whole trees --------------------------------------------------------------------


def test_who_storms_on_a_containerd_node(tmp_path) -> None:
    """An image pull by containerd, a pod syncing models onto the engine disk, the engine's reads."""
    tree = Tree(tmp_path, "v2-containerd")
    made = collector(tree.sysfs)
    idle = walk_now(made)
    assert series(idle, "gpuio_cgroup_io_read_bytes_total") == {}  # nothing grew: nobody is served
    assert series(idle, "gpuio_cgroup_io_walk_cgroups") == {("v2",): 25.0}

    tree.read("/system.slice/containerd.service", "259:0", written=5 * GIB, writes=40960)
    tree.read(SYNC, "259:1", written=10 * GIB, writes=81920)
    tree.read(TRITON, "259:1", read=2 * GIB, reads=16384)
    text = walk_now(made)
    written = series(text, "gpuio_cgroup_io_written_bytes_total")
    assert written == {("/system.slice/containerd.service", "nvme0n1"): 25 * GIB,  # the kernel's counters, as is
                       (SYNC, "nvme1n1"): 138 * GIB, (TRITON, "nvme1n1"): 0}
    assert series(text, "gpuio_cgroup_io_read_bytes_total")[(TRITON, "nvme1n1")] == 66 * GIB
    assert series(text, "gpuio_cgroup_io_reads_completed_total")[(TRITON, "nvme1n1")] == 524288 + 16384
    assert series(text, "gpuio_cgroup_io_discarded_bytes_total")[(SYNC, "nvme1n1")] == 0
    labels = info(text)
    assert labels[TRITON] == {"cgroup": TRITON, "pod_uid": "6f1c2d3e-4a5b-4c6d-8e7f-90a1b2c3d4e5",
                              "container_id": TRITON[-70:-6], "service": ""}
    assert labels["/system.slice/containerd.service"]["service"] == "containerd.service"
    # Pressure is served for every cgroup served for IO; the slices above them are never served.
    assert series(text, "gpuio_cgroup_io_pressure_waiting_seconds_total")[(TRITON,)] == 912334201 / 1000.0 / 1000.0
    assert set(labels) == {"/system.slice/containerd.service", SYNC, TRITON}


def test_the_top_n_per_device_and_the_hold(tmp_path) -> None:
    tree = Tree(tmp_path, "v2-containerd")
    made = collector(tree.sysfs, top=2)
    walk_now(made)
    tree.read(SYNC, "259:1", written=3 * GIB)
    tree.read(TRITON, "259:1", read=2 * GIB)
    tree.read(VLLM, "259:1", read=1 * GIB)
    tree.read("/system.slice/kubelet.service", "259:0", written=1 << 20)
    text = walk_now(made)
    served = set(series(text, "gpuio_cgroup_io_read_bytes_total"))
    assert served == {(SYNC, "nvme1n1"), (TRITON, "nvme1n1"), ("/system.slice/kubelet.service", "nvme0n1")}

    tree.read(VLLM, "259:1", read=5 * GIB)  # now the top reader; the others are held, at their counters
    text = walk_now(made)
    read = series(text, "gpuio_cgroup_io_read_bytes_total")
    assert set(read) == served | {(VLLM, "nvme1n1")} and read[(VLLM, "nvme1n1")] == 46 * GIB
    assert read[(TRITON, "nvme1n1")] == 66 * GIB


def test_a_pair_is_held_then_let_go_and_slots_are_bounded() -> None:
    selection = Selection(count=2, hold=600.0, slots=3)
    assert selection.choose(0.0, {"nvme1n1": {"a": 30, "b": 20, "c": 10, "d": 0}}, {}) == 0
    assert selection.io_pairs() == [("a", "nvme1n1"), ("b", "nvme1n1")]  # c is third, d did nothing
    assert selection.choose(599.0, {"nvme1n1": {"c": 5}}, {"p": 9, "q": 0}) == 0
    assert selection.io_pairs() == [("a", "nvme1n1"), ("b", "nvme1n1"), ("c", "nvme1n1")]
    assert selection.pressure_cgroups() == {"p"}
    # A fourth in the slots of three: the one chosen least recently goes first (counted), never this walk's.
    assert selection.choose(600.0, {"nvme1n1": {"d": 1}}, {}) == 1
    assert selection.io_pairs() == [("b", "nvme1n1"), ("c", "nvme1n1"), ("d", "nvme1n1")]
    assert selection.choose(1198.0, {}, {}) == 0  # a chosen at 0: past the hold
    assert selection.io_pairs() == [("c", "nvme1n1"), ("d", "nvme1n1")] and selection.pressure_cgroups() == {"p"}
    selection.choose(1300.0, {}, {})
    assert selection.io_pairs() == [] and selection.pressure_cgroups() == set()


def test_a_cgroup_made_again_serves_its_new_counter(tmp_path) -> None:
    """A systemd service restarting gets a new cgroup under the same path: its counter starts again, which
    Prometheus sees as the reset it is; its whole new count is what it did since the walk before."""
    tree = Tree(tmp_path, "v2-containerd")
    made = collector(tree.sysfs, top=1)
    walk_now(made)
    tree.read("/system.slice/kubelet.service", "259:0", written=GIB)
    assert series(walk_now(made), "gpuio_cgroup_io_written_bytes_total") == {
        ("/system.slice/kubelet.service", "nvme0n1"): int(GIB * 0.7) + GIB}
    with open(os.path.join(tree.directory("/system.slice/kubelet.service"), "io.stat"), "w") as handle:
        handle.write("259:0 rbytes=4096 wbytes=3221225472 rios=1 wios=24576 dbytes=0 dios=0\n")
    tree.read("/system.slice/containerd.service", "259:0", written=2 * GIB)  # less than kubelet's 3 GiB anew
    written = series(walk_now(made), "gpuio_cgroup_io_written_bytes_total")
    assert written[("/system.slice/kubelet.service", "nvme0n1")] == 3 * GIB


def test_who_suffers_on_a_crio_node(tmp_path) -> None:
    tree = Tree(tmp_path, "v2-crio")
    app = ("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0d9e8f7a_6b5c_4d3e_9f2a_1b0c9d8e7f6a.slice/"
           "crio-9f8e7d6c5b4a39281706f5e4d3c2b1a09f8e7d6c5b4a39281706f5e4d3c2b1a0.scope")
    made = collector(tree.sysfs)
    walk_now(made)
    tree.stall(app, some_us=4_000_000, full_us=3_000_000)  # stalls, without doing IO of its own
    tree.read("/system.slice/crio.service", "253:0", written=GIB)
    tree.read("/system.slice/crio.service", "8:0", written=GIB)
    text = walk_now(made)
    assert series(text, "gpuio_cgroup_io_pressure_waiting_seconds_total") == {
        (app,): 3_304_412_009 / 1000.0 / 1000.0, ("/system.slice/crio.service",): 9.10002}
    assert series(text, "gpuio_cgroup_io_pressure_stalled_seconds_total")[(app,)] == 2_803_100_223 / 1000.0 / 1000.0
    assert set(series(text, "gpuio_cgroup_io_written_bytes_total")) == {("/system.slice/crio.service", "dm-0"),
                                                                        ("/system.slice/crio.service", "sda")}
    assert info(text)[app]["container_id"] == "9f8e7d6c5b4a39281706f5e4d3c2b1a09f8e7d6c5b4a39281706f5e4d3c2b1a0"
    assert info(text)[app]["pod_uid"] == "0d9e8f7a-6b5c-4d3e-9f2a-1b0c9d8e7f6a"


def test_a_backup_and_fstrim_on_a_systemd_host_with_iocost(tmp_path) -> None:
    tree = Tree(tmp_path, "v2-systemd-host")
    made = collector(tree.sysfs)
    walk_now(made)
    tree.read("/system.slice/backup.service", "259:0", read=40 * GIB, reads=327680)
    tree.read("/user.slice", "259:0", read=GIB)
    text = walk_now(made)
    read = series(text, "gpuio_cgroup_io_read_bytes_total")
    assert read == {("/system.slice/backup.service", "nvme0n1"): 350 * GIB, ("/user.slice", "nvme0n1"): 5 * GIB}
    assert info(text)["/system.slice/backup.service"]["service"] == "backup.service"
    assert info(text)["/user.slice"]["service"] == ""
    assert made.dropped_lines.counts() == []  # iocost's keys are no bad lines


def test_a_cgroup_v1_host_with_the_cgroupfs_driver(tmp_path) -> None:
    tree = Tree(tmp_path, "v1-cgroupfs")
    trainer = "/kubepods/pod8c7b6a59-4d3e-4f2a-9b1c-0d9e8f7a6b5c/" + "7e" * 32
    made = collector(tree.sysfs)
    walk_now(made)
    tree.read(trainer, "8:16", read=3 * GIB, reads=24576)
    tree.read("/system.slice/k3s.service", "8:0", written=GIB, writes=8192)
    text = walk_now(made)
    assert series(text, "gpuio_cgroup_io_read_bytes_total")[(trainer, "sdb")] == 53 * GIB
    assert series(text, "gpuio_cgroup_io_writes_completed_total")[("/system.slice/k3s.service", "sda")] == 158214
    assert series(text, "gpuio_cgroup_io_pressure_waiting_seconds_total") == {}  # v1 has no per-cgroup PSI
    assert info(text)[trainer] == {"cgroup": trainer, "pod_uid": "8c7b6a59-4d3e-4f2a-9b1c-0d9e8f7a6b5c",
                                   "container_id": "7e" * 32, "service": ""}
    assert series(text, "gpuio_cgroup_io_walk_cgroups") == {("v1",): 15.0}


def test_an_unknown_device_keeps_its_number_and_devices_are_capped(tmp_path) -> None:
    tree = Tree(tmp_path, "v2-containerd")
    made = collector(tree.sysfs)
    walk_now(made)
    lines = "".join(f"{major}:0 rbytes={major} wbytes=0 rios=1 wios=0\n" for major in range(1, 41))
    with open(os.path.join(tree.directory(TRITON), "io.stat"), "a") as handle:
        handle.write(lines)
    text = walk_now(made)
    devices = {device for cgroup, device in series(text, "gpuio_cgroup_io_read_bytes_total") if cgroup == TRITON}
    # nvme0n1 and nvme1n1 were named first (other cgroups' lines); 30 more fit, each with its own top N.
    assert devices == {f"{major}:0" for major in range(1, cgroup_io.MAX_DEVICES - 1)}
    assert series(text, "gpuio_cgroup_io_dropped_series_total")[("device",)] == 40 - 30


def test_states_absent_and_pending(tmp_path) -> None:
    made = collector(str(tmp_path))  # no fs/cgroup: a container without the host's /sys
    made.sampler.sample_now()
    with pytest.raises(Absent, match="no cgroup tree"):
        made.collect()
    tree = Tree(tmp_path, "v2-containerd")
    made = collector(tree.sysfs)
    made.first_gap = 5.0
    scraper = Scraper([made], 2.0, "")
    try:
        scraper.start()
        with pytest.raises(Pending):
            made.collect()
        scraper.scrape_sync()
        assert scraper.states["cgroup_io"].last_state == "pending"
    finally:
        scraper.stop()


def test_flags_and_their_environment_twins() -> None:
    environ = {"GPUIO_COLLECTOR_CGROUP_IO_HOLD": "15m", "GPUIO_COLLECTOR_CGROUP_IO_MAX_CGROUPS": "200"}
    config = parse_args(["--collector.cgroup_io.top=3", "--collector.cgroup_io.interval=30s"], environ=environ)
    assert config.collector_options["cgroup_io"] == {"interval": 30.0, "top": 3, "hold": 900.0, "max-cgroups": 200}
    assert config.enabled["cgroup_io"] is True
    assert parse_args(["--no-collector.cgroup_io"], environ={}).enabled["cgroup_io"] is False
    assert parse_args([], environ={"GPUIO_COLLECTOR_CGROUP_IO": "false"}).enabled["cgroup_io"] is False
    with pytest.raises(ConfigError, match="collector.cgroup_io.top"):
        parse_args(["--collector.cgroup_io.top=0"], environ={})


def test_the_pressure_of_an_engine_pods_cgroups_is_served_whatever_its_rank(tmp_path) -> None:
    """Top 1 by pressure is crio.service; the inference pod stalls less but serves engines (a spool writer of
    its UID): its cgroup's pressure is served too, so the Starvation board shows it stalling.  Without the
    writer's UID it is left out, as any cgroup below the top."""
    tree = Tree(tmp_path, "v2-crio")
    app = ("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0d9e8f7a_6b5c_4d3e_9f2a_1b0c9d8e7f6a.slice/"
           "crio-9f8e7d6c5b4a39281706f5e4d3c2b1a09f8e7d6c5b4a39281706f5e4d3c2b1a0.scope")
    made = collector(tree.sysfs, top=1)
    walk_now(made)
    tree.stall(app, some_us=1_000_000, full_us=500_000)
    tree.stall("/system.slice/crio.service", some_us=9_000_000, full_us=1_000_000)
    assert (app,) not in series(walk_now(made), "gpuio_cgroup_io_pressure_waiting_seconds_total")
    made.context.pods.update_writer_pods([("0d9e8f7a-6b5c-4d3e-9f2a-1b0c9d8e7f6a", "serving", "resnet-7d9f")])
    tree.stall(app, some_us=1_000_000, full_us=500_000)
    tree.stall("/system.slice/crio.service", some_us=9_000_000, full_us=1_000_000)  # still the top one
    text = walk_now(made)
    waiting = series(text, "gpuio_cgroup_io_pressure_waiting_seconds_total")
    assert (app,) in waiting and ("/system.slice/crio.service",) in waiting
    assert info(text)[app]["pod_uid"] == "0d9e8f7a-6b5c-4d3e-9f2a-1b0c9d8e7f6a"


def test_a_cgroup_past_path_max_is_read_and_odd_names_never_fail_the_walk(tmp_path) -> None:
    """A tenant nests cgroups until the path passes PATH_MAX (4096 bytes): a path that long cannot be opened,
    so the walk opens each directory relative to one it holds (openat), and the deepest cgroup's IO is read
    like any other's.  Names that are not UTF-8 on the way (and beside it) are kept as str, never a crash."""
    sysfs = tmp_path / "sys"
    root = sysfs / "fs" / "cgroup"
    root.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("io\n")
    names = [os.fsencode("d" * 200 + f"{level:02d}") for level in range(22)]
    names[3] = b"odd-\xff\xfe" + b"o" * 200  # not UTF-8
    os.mkdir(os.path.join(os.fsencode(root), b"bad-\xff.scope"))

    def write(fd: int, name: str, text: str) -> None:
        file = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=fd)
        try:
            os.write(file, text.encode())
        finally:
            os.close(file)

    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in names:  # each level one level down from the last: no path is ever spelt out whole
            os.mkdir(name, dir_fd=fd)
            below = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = below
        write(fd, "io.stat", "259:1 rbytes=4096 wbytes=0 rios=1 wios=0 dbytes=0 dios=0\n")
        write(fd, "io.pressure", "some avg10=0.00 avg60=0.00 avg300=0.00 total=10\n"
                                 "full avg10=0.00 avg60=0.00 avg300=0.00 total=5\n")
        deepest = len(os.fsencode(root)) + sum(len(name) + 1 for name in names)
        assert deepest > 4096  # past PATH_MAX: open() of it fails with ENAMETOOLONG
        with pytest.raises(OSError, match="too long"):
            os.open(os.path.join(os.fsencode(root), *names, b"io.stat"), os.O_RDONLY)

        walk = cgroups.walk(cgroups.find_hierarchy(str(sysfs)), 5000, Bad())  # type: ignore[arg-type]
        assert walk.skipped == 0 and len(walk.cgroups) == len(names) + 1
        deep = [reading for reading in walk.cgroups if reading.io]
        assert [reading.io for reading in deep] == [{(259, 1): DeviceIo(4096, 0, 1, 0, 0, 0)}]
        assert deep[0].pressure == Pressure(10, 5) and deep[0].ranks_io and deep[0].ranks_pressure
        for reading in walk.cgroups:
            assert isinstance(reading.path, str) and len(reading.path) <= cgroups.MAX_PATH_CHARS
            reading.path.encode("utf-8")

        made = collector(str(sysfs))
        walk_now(made)
        write(fd, "io.stat", "259:1 rbytes=1073745920 wbytes=0 rios=2 wios=0 dbytes=0 dios=0\n")
        text = walk_now(made)
    finally:
        os.close(fd)
    assert series(text, "gpuio_cgroup_io_read_bytes_total") == {(deep[0].path, "259:1"): 1073745920}
    assert series(text, "gpuio_cgroup_io_dropped_series_total")[("cgroup",)] == 0


def test_a_hierarchy_root_that_is_a_symlink_is_followed_and_a_cgroup_not_opened_is_counted(tmp_path,
                                                                                           monkeypatch) -> None:
    """A v1 host may mount blkio jointly and link its name to the mount (``blkio -> blkio,cpu``): the root is
    followed, as the admin's; below it nothing is (a cgroup is never a symlink).  A cgroup there that cannot be
    opened (EACCES, or swapped for a symlink between the listing and the open: ELOOP) is counted with what the
    walk left out; one removed meanwhile (ENOENT) is simply gone."""
    tree = Tree(tmp_path, "v1-cgroupfs")
    joint = os.path.join(os.path.dirname(tree.root), "blkio,cpu")
    os.rename(tree.root, joint)
    os.symlink("blkio,cpu", tree.root)
    hierarchy = cgroups.find_hierarchy(tree.sysfs)
    assert hierarchy is not None and hierarchy.version == cgroups.V1
    walk = cgroups.walk(hierarchy, 5000, Bad())
    assert len(walk.cgroups) == 15 and walk.skipped == 0

    opened = cgroups.open_directory
    failing = {"system.slice": errno.EACCES, "burstable": errno.ELOOP, "user.slice": errno.ENOENT}

    def open_directory(path: str, follow: bool = False) -> int:
        code = failing.get(os.path.basename(path))
        if code is not None:
            raise OSError(code, os.strerror(code), path)
        return opened(path, follow)

    monkeypatch.setattr(cgroups, "open_directory", open_directory)
    walk = cgroups.walk(hierarchy, 5000, Bad())
    read = {reading.path for reading in walk.cgroups}
    assert walk.skipped == 2  # system.slice and burstable: there, not opened; user.slice: gone
    assert not any(path.startswith(("/system.slice", "/user.slice", "/kubepods/burstable")) for path in read)
    assert "/kubepods" in read and "/kubepods/besteffort" in read and len(read) == 8  # 15 less 7
