"""Write dashboards/<uid>.json from the Python beside it; ``--check`` only reports files that differ.

    python -m dashboards          # rewrite the JSON (make dashboards)
    python -m dashboards --check  # exit 1 if a checked-in file is stale or stray
"""

from __future__ import annotations

import argparse
import glob
import os

from deploy.generated import report_stale, stale_files, write

from . import HERE, rendered


def stale() -> list[str]:
    return stale_files(rendered(), glob.glob(os.path.join(HERE, "*.json")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards", description=__doc__)
    parser.add_argument("--check", action="store_true", help="report stale files instead of writing them")
    args = parser.parse_args(argv)
    if args.check:
        return report_stale(stale(), "make dashboards")
    return write(rendered())


if __name__ == "__main__":
    raise SystemExit(main())
