"""What the generators share (rules, dashboards, Kubernetes manifests): checked-in output that must
equal what the code generates; CI fails on drift."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping


def stale_files(files: Mapping[str, str], present: Iterable[str] = ()) -> list[str]:
    """Paths whose checked-in text differs from ``files`` (or is missing), plus ``present`` files
    that the generator no longer writes."""
    out = []
    for path, text in files.items():
        try:
            with open(path) as handle:
                if handle.read() == text:
                    continue
        except FileNotFoundError:
            pass
        out.append(path)
    return sorted(out + sorted(set(present) - set(files)))


def report_stale(paths: list[str], remedy: str) -> int:
    """``--check``: name each stale file and how to fix it; the exit status."""
    for path in paths:
        print(f"stale: {os.path.relpath(path)} (run {remedy})", file=sys.stderr)
    return 1 if paths else 0


def write(files: Mapping[str, str]) -> int:
    for path, text in files.items():
        with open(path, "w") as handle:
            handle.write(text)
        print(f"wrote {os.path.relpath(path)}")
    return 0
