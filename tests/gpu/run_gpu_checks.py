"""Run the real-GPU checks of the nvml collector without pytest; exit 1 if one fails, 2 if no GPU.

    python tests/gpu/run_gpu_checks.py            # all checks
    python tests/gpu/run_gpu_checks.py busy pcie  # the checks whose names contain these words
"""

from __future__ import annotations

import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.gpu import gpu_checks  # noqa: E402  (after the path is set)


def main(words: list[str]) -> int:
    reason = gpu_checks.unavailable()
    if reason is not None:
        print(f"SKIPPED: {reason}")
        return 2
    failed = 0
    for check in gpu_checks.CHECKS:
        if words and not any(word in check.name for word in words):
            continue
        started = time.monotonic()
        try:
            lines = check.run()
        except Exception as exc:  # report every check, then fail
            failed += 1
            detail = str(exc) if isinstance(exc, AssertionError) else traceback.format_exc()
            print(f"FAIL {check.name} ({time.monotonic() - started:.1f} s)\n{detail}\n", flush=True)
            continue
        print(f"PASS {check.name} ({time.monotonic() - started:.1f} s)", *lines, "", sep="\n", flush=True)
    print("all checks passed" if not failed else f"{failed} check(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
