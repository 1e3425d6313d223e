"""Fuzz what the smart collector does with smartctl's output: the recordings of real drives, mutated.

In process, for speed: a Runner whose ``_run`` answers from tests/fixtures/smartctl/recordings (the
same lookup as the fake smartctl executable) and then applies generated mutations to the text -
lines dropped, repeated, truncated or replaced by junk, numbers made huge, negative or non-ASCII,
bytes flipped - and a generated exit status.  pySMART itself may refuse such output (poll() turns
that into ``state="error"``); the oracles are on gpuio's own code:

* ``check``/``decode`` raise nothing but SmartctlError;
* once pySMART has built a Device, gpuio's readers (values, classify, info labels) never raise;
* poll() returns one of the known states;
* the device's rendered families are valid Prometheus text and OpenMetrics with no repeated series;
* ``parse_scan`` on mutated --scan-open output raises nothing but SmartctlError.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from exporter.collectors import smart
from exporter.exposition import Family, render
from exporter.host import smartctl
from tests.conftest import parse_samples
from tests.fixtures.smartctl.fake import BANNER, SINGLE, recording_name, strip_powermode

ALL = re.compile(r"^_(?:-d_(?P<kind>.+?)_)?--all_(?P<path>_.+)$")


def _cases() -> list[tuple[str, smart.Target]]:
    """(recording directory, the target it answers for): from each ``--all`` recording's file name."""
    cases = []
    for name in sorted(os.listdir(SINGLE)):
        directory = os.path.join(SINGLE, name)
        for entry in sorted(os.listdir(directory)):
            match = ALL.match(entry)
            if match:
                path = match["path"].replace("_", "/")
                cases.append((directory, smart.Target(path, match["kind"], (name,))))
                break
    return cases


CASES = _cases()

JUNK = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=60)
NUMBERS = st.sampled_from(["0", "-1", "18446744073709551616", "99999999999999999999999", "1,234,567",
                           "\u0663", "\u00b2", "nan", "inf", "0x7fffffff", "1e308", ""])
MUTATION = st.one_of(
    st.tuples(st.just("drop"), st.floats(0, 1)),
    st.tuples(st.just("repeat"), st.floats(0, 1)),
    st.tuples(st.just("replace"), st.floats(0, 1), JUNK),
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("numbers"), st.floats(0, 1), NUMBERS),
    st.tuples(st.just("flip"), st.floats(0, 1), st.integers(0, 255)),
)


def mutate(lines: list[str], mutations: list[tuple]) -> list[str]:
    lines = list(lines)
    for operation, where, *argument in mutations:
        if not lines:
            break
        index = min(int(where * len(lines)), len(lines) - 1)
        if operation == "drop":
            del lines[index]
        elif operation == "repeat":
            lines.insert(index, lines[index])
        elif operation == "replace":
            lines[index] = argument[0]
        elif operation == "truncate":
            lines = lines[:index]
        elif operation == "numbers":
            lines[index] = re.sub(r"\d+", argument[0], lines[index])
        else:  # flip one byte of the line, decoded as smartctl's output is
            raw = bytearray(lines[index].encode("utf-8", "replace") or b" ")
            raw[int(where * (len(raw) - 1))] ^= argument[0]
            lines[index] = smartctl.decode(bytes(raw))[0] if smartctl.decode(bytes(raw)) else ""
    return lines


class MutatingRunner(smartctl.Runner):
    """Answers from one recording directory, mutated; what ``check`` makes of it is the real code's."""

    directory = ""
    mutations: list[tuple] = []
    status = 0

    def _run(self, argv: list[str]) -> tuple[list[str], list[str], int]:
        args, _ = strip_powermode(argv[1:])
        path = os.path.join(self.directory, recording_name(args))
        if not os.path.isfile(path):
            return smartctl.decode(f"{BANNER}Smartctl open device: {args[-1]} failed: No such device\n".encode()), [], 2
        with open(path, "rb") as handle:
            lines = smartctl.decode(handle.read())
        return mutate(lines, self.mutations), [], self.status


@contextlib.contextmanager
def mutating(directory: str, mutations: list[tuple], status: int) -> Iterator[None]:
    MutatingRunner.directory, MutatingRunner.mutations, MutatingRunner.status = directory, mutations, status
    original, smart.Runner = smart.Runner, MutatingRunner  # type: ignore[misc]
    try:
        yield
    finally:
        smart.Runner = original  # type: ignore[misc]


def families_of(device: str, result: smart.PollResult) -> list[Family]:
    lines: dict[smart.Desc, list[str]] = {desc: [] for desc in smart.DESCS}
    record = smart.Record(result.state, result.detail, result.seconds, result.reading,
                          1.0 if result.reading is not None else None)
    smart.SmartCollector._render_device(lines, device, record)
    return [Family(desc, lines[desc]) for desc in smart.DESCS]


STATUS = st.sampled_from([0, 0, 0, 4, 64, 192, 1, 2, -9])


@given(st.sampled_from(CASES), st.lists(MUTATION, max_size=6), STATUS)
def test_mutated_recordings(case: tuple[str, smart.Target], mutations: list[tuple], status: int) -> None:
    directory, target = case
    with mutating(directory, mutations, status):
        result = smart.poll(target, "smartctl", "standby", 30.0, smartctl.Processes())
        assert result.state in smart.STATES
        if not mutations and status == 0:  # the recording as the drive gave it
            assert result.state in ("ok", "unsupported"), result.detail
        # gpuio's own readers on whatever pySMART made of it: never an exception.
        from pySMART import Device

        runner = MutatingRunner("smartctl", "standby", 30.0)
        try:
            device = Device(target.path, interface=target.kind, smartctl=smart.pysmart_smartctl(runner))
        except smartctl.SmartctlError:
            device = None
        except Exception:  # pySMART's parser refusing the text: poll() said error, as it must
            assert result.state == "error"
            device = None
        if device is not None:
            values = smart.common_values(device) + smart.interface_values(device.if_attributes)
            smart.classify(device, values)
            smart.info_labels(device, target)
    families = families_of(target.devices[0], result)
    samples = [(sample.name, tuple(sorted(sample.labels.items())))
               for family in parse_openmetrics(render(families, openmetrics=True)) for sample in family.samples]
    assert len(samples) == len(set(samples)), "a series repeated"
    assert parse_samples(render(families))


SCAN_LINE = st.one_of(
    st.sampled_from(["/dev/sda -d sat # /dev/sda [SAT], ATA device", "/dev/nvme0 -d nvme # /dev/nvme0, NVMe device",
                     "/dev/bus/0 -d megaraid,16 # /dev/bus/0 [megaraid_disk_16], SCSI device",
                     "# /dev/sdb -d scsi # /dev/sdb, SCSI device open failed: Permission denied"]),
    JUNK)


@given(st.lists(SCAN_LINE, max_size=8))
def test_scan_output(lines: list[str]) -> None:
    try:
        targets = smart.parse_scan(lines, "/nonexistent")
    except smartctl.SmartctlError:
        return
    assert all(target.path and target.devices for target in targets)


@given(st.binary(max_size=512), st.lists(st.sampled_from(["--all", "-i", "--scan-open", "-d", "test"]), max_size=3),
       STATUS)
def test_check_raises_only_smartctl_error(raw: bytes, params: list[str], status: int) -> None:
    lines = smartctl.decode(raw)
    with contextlib.suppress(smartctl.SmartctlError):
        smartctl.check(params, lines, [], status)
