"""What the generators share (rules, dashboards, Kubernetes manifests): checked-in output that must
equal what the code generates; CI fails on drift."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable, Mapping


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


def main(argv: list[str] | None, prog: str, description: str | None, rendered: Callable[[], Mapping[str, str]],
         stale: Callable[[], list[str]], remedy: str) -> int:
    """A generator's command line: write its files, or with ``--check`` report the stale ones."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--check", action="store_true", help="report stale files instead of writing them")
    args = parser.parse_args(argv)
    return report_stale(stale(), remedy) if args.check else write(rendered())
