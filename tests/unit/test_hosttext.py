"""Host names in bytes that are not UTF-8: read without loss, shown as \\xNN, valid wherever they go."""

from __future__ import annotations

import os

from exporter.engines import spool as spool_source
from exporter.exposition import label_string
from exporter.host import hosttext, mounts
from gpuio import spool as spool_format
from gpuio.metrics import EngineMetrics

BAD = os.fsdecode(b"models/bad\xff\xfe.plan")  # as os.readlink and os.scandir give it


def test_a_name_that_is_not_utf8_shows_each_odd_byte_as_an_escape() -> None:
    assert hosttext.visible(BAD) == "models/bad\\xff\\xfe.plan"
    assert hosttext.visible("\ud800x") == "\\ud800x"  # a lone surrogate from elsewhere (a JSON escape)
    for valid in ("plain", "mödel-☃.plan", "tab\there", ""):
        assert hosttext.visible(valid) == valid  # what is valid comes out as it went in
    assert hosttext.decode(b"bad\xff") == os.fsdecode(b"bad\xff")  # the os module's reading, for any source


def test_a_label_of_such_a_name_is_valid_utf8_and_escaped_once() -> None:
    rendered = label_string({"path": BAD, "quote": 'a"b\\c\nd'})
    rendered.encode("utf-8")  # strict: raises on a surrogate
    assert rendered == '{path="models/bad\\\\xff\\\\xfe.plan",quote="a\\"b\\\\c\\nd"}'


def test_a_mount_point_escaped_by_the_kernel_reads_as_the_paths_under_it() -> None:
    """mountinfo writes the bytes of a name raw, space/tab/newline/backslash as \\ooo: the mount point must
    equal what os.readlink gives for a file under it, so a file is placed on its mount."""
    line = b"36 25 254:0 / /mnt/odd\\040dir\xff rw,relatime shared:1 - ext4 /dev/vda rw\n"
    table = mounts.parse(hosttext.decode(line))
    (mount,) = table.mounts
    assert mount.mountpoint == os.fsdecode(b"/mnt/odd dir\xff")
    assert mounts.unescape("\\377") == os.fsdecode(b"\xff")


def test_a_spool_record_whose_key_is_not_utf8_is_read_not_refused(tmp_path) -> None:
    """A writer (in any language) naming an engine in such bytes: its record is kept, and the records after
    it are read too (a strict decode refused it as a bad record and stopped reading the file there)."""
    file = spool_format.SpoolFile(str(tmp_path), spool_format.DEFAULT_FILE_BYTES)
    EngineMetrics("badXY", file).inference_seconds.observe(0.01)
    EngineMetrics("after", file).inference_seconds.observe(0.02)
    assert file.path is not None
    with open(file.path, "r+b") as handle:  # the first record's key: "bad" then two bytes no UTF-8 has
        handle.seek(spool_format.HEADER_SIZE + spool_format.RECORD_HEAD.size + 3)
        handle.write(b"\xff\xfe")
    reader = spool_source.SpoolReader(str(tmp_path))
    totals = reader.read()
    assert set(totals.engines) == {os.fsdecode(b"bad\xff\xfe"), "after"}
    assert reader.errors == {}
    file.close()


def test_the_library_never_raises_on_a_name_python_read_from_the_os(tmp_path) -> None:
    """A path or an engine name from os.listdir may hold such bytes: the library writes them as they are."""
    file = spool_format.SpoolFile(str(tmp_path), spool_format.DEFAULT_FILE_BYTES)
    metrics = EngineMetrics(os.fsdecode(b"bad\xff"), file)
    metrics.set_info(os.fsdecode(b"/models/bad\xff.plan"))
    metrics.record_mount((8, 0), os.fsdecode(b"/mnt/\xff"), "ext4", "/dev/sda", "")
    totals = spool_source.SpoolReader(str(tmp_path)).read()
    (info,) = totals.infos[os.fsdecode(b"bad\xff")]
    assert info.path == os.fsdecode(b"/models/bad\xff.plan")
    file.close()
