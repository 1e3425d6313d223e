"""The maps table of a process, as the kernel writes it: which model files it maps, and how far."""

from __future__ import annotations

from exporter.engines.mappings import Mapped, mapped_files

MAPS = (
    b"55d0c0a00000-55d0c0a21000 r--p 00000000 fd:01 1835020                    /usr/bin/python3.11\n"
    b"7f0000000000-7f0004000000 r--s 00000000 103:05 42                         /models/llama/1/model.gguf\n"
    b"7f0004000000-7f0008000000 r--s 04000000 103:05 42                         /models/llama/1/model.gguf\n"
    b"7f0010000000-7f0010100000 r--s 00000000 103:05 43                         /models/with space/a b.safetensors\n"
    b"7f0020000000-7f0020100000 r--s 00000000 103:05 44                         /models/bad\xff\xfe.safetensors\n"
    b"7f0030000000-7f0030100000 r--s 00000000 103:05 45                         /models/gone.safetensors (deleted)\n"
    b"7f0040000000-7f0040100000 rw-p 00000000 00:00 0                          [heap]\n"
    b"7f0050000000-7f0050100000 rw-p 00000000 00:00 0 \n"
    b"7f0060000000-7f0060100000 r--s 00000000 103:05 46                         /models/cut-by-the-bou"
)


def everything(path: str) -> bool:
    return path.startswith("/models/")


def test_a_file_mapped_in_pieces_is_one_file_as_far_as_its_furthest_byte() -> None:
    found = mapped_files(MAPS, everything)
    assert found[((0x103, 5), 42)] == Mapped("/models/llama/1/model.gguf", (0x103, 5), 42, 0x8000000)


def test_names_with_spaces_and_bytes_no_utf8_has_are_kept_whole() -> None:
    found = mapped_files(MAPS, everything)
    assert found[((0x103, 5), 43)].path == "/models/with space/a b.safetensors"
    assert found[((0x103, 5), 44)].path == b"/models/bad\xff\xfe.safetensors".decode("utf-8", "surrogateescape")


def test_deleted_files_anonymous_mappings_and_other_paths_are_left_out() -> None:
    found = mapped_files(MAPS, everything)
    assert {key[1] for key in found} == {42, 43, 44, 46}  # the last line is a path, if cut: its name tells
    assert not mapped_files(MAPS, lambda path: path.endswith(".plan"))


def test_lines_of_another_shape_are_skipped_not_raised() -> None:
    garbage = b"\n".join([b"zz-yy r--s 0 fd:01 1 /models/x", b"1-0 r--s 0 fd:01 1 /models/x",
                          b"1-2 r--s 0 fd:01 -5 /m/x", b"1-2 r--s 0 fd 1 /models/x", b"", b"\x00" * 64,
                          b"1-2 r--s 0 fd:01 1"])
    assert mapped_files(garbage, everything) == {}


def test_only_lines_under_the_directories_looked_under_are_parsed_and_all_of_them_are() -> None:
    found = mapped_files(MAPS, everything, (b"/models/with space/", b"/models/llama/"))
    assert {key[1] for key in found} == {42, 43}
    assert mapped_files(MAPS, everything, (b"/nowhere/",)) == {}
