"""Write dashboards/<uid>.json from the Python beside it; ``--check`` only reports files that differ.

    python -m dashboards          # rewrite the JSON (make dashboards)
    python -m dashboards --check  # exit 1 if a checked-in file is stale or stray
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

from . import HERE, rendered


def stale() -> list[str]:
    files = rendered()
    out = []
    for path, text in files.items():
        try:
            with open(path) as handle:
                if handle.read() == text:
                    continue
        except FileNotFoundError:
            pass
        out.append(path)
    return sorted(out + sorted(set(glob.glob(os.path.join(HERE, "*.json"))) - set(files)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards", description=__doc__)
    parser.add_argument("--check", action="store_true", help="report stale files instead of writing them")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale()
        for path in bad:
            print(f"stale: {os.path.relpath(path)} (run make dashboards)", file=sys.stderr)
        return 1 if bad else 0
    for path, text in rendered().items():
        with open(path, "w") as handle:
            handle.write(text)
        print(f"wrote {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
