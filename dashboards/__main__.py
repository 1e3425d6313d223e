"""Write dashboards/<uid>.json from the Python beside it; ``--check`` only reports files that differ.

    python -m dashboards          # rewrite the JSON (make dashboards)
    python -m dashboards --check  # exit 1 if a checked-in file is stale or stray
"""

from __future__ import annotations

import glob
import os

from deploy.generated import main as generator_main
from deploy.generated import stale_files

from . import HERE, rendered


def stale() -> list[str]:
    return stale_files(rendered(), glob.glob(os.path.join(HERE, "*.json")))


def main(argv: list[str] | None = None) -> int:
    return generator_main(argv, "python -m dashboards", __doc__, rendered, stale, "make dashboards")


if __name__ == "__main__":
    raise SystemExit(main())
