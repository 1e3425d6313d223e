"""Host strings as text every reader accepts: the one way a name from the host becomes a label or JSON value.

Linux names are bytes: a file, a cgroup, a mount point or a process may be named in bytes that are not
UTF-8 (``bad\\xff.plan``), and any tenant chooses them.  Python reads such names with the
``surrogateescape`` error handler (``os.readlink``, ``os.scandir``, ``os.fsdecode``), so each byte that is
not UTF-8 becomes a lone surrogate (U+DC80-U+DCFF): a str that cannot be encoded as UTF-8.  One of them in
one label value made every scrape fail to encode, for every collector.

:func:`visible` is applied where host strings leave the exporter -- every label value
(:func:`exporter.exposition.label_string`) and every string of the JSON API and ``gpuio engines --json``
-- so no reader has to remember it.  It writes each such byte as the four characters ``\\xff`` (what
``ls -b`` and Python's ``repr`` show), keeps every valid character, and changes nothing else: a name
that is valid UTF-8, which is every name in practice, comes out as it went in.
"""

from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")


def decode(raw: bytes | memoryview) -> str:
    """Bytes a host or a writer gave as str, as the os module reads names: each byte that is not UTF-8 kept
    as a lone surrogate, so nothing is lost or raises (and :func:`visible` shows it as ``\\xNN``)."""
    return bytes(raw).decode("utf-8", "surrogateescape")


def visible(value: str) -> str:
    """``value`` with each undecodable byte (a lone surrogate) written ``\\xNN``; valid UTF-8 otherwise."""
    if value.isascii():  # the common case, a few ns: nothing to look for
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub(_escaped, value)
    return value


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    if 0xDC80 <= code <= 0xDCFF:  # surrogateescape's stand-in for the byte code - 0xDC00
        return f"\\x{code - 0xDC00:02x}"
    return f"\\u{code:04x}"  # any other lone surrogate (from a JSON \ud800 escape): its code point
