"""Hypothesis profiles for the fuzz suite.

``ci`` (the default, used by ``make test``): a fixed set of examples per test (derandomized, so a
run is reproducible and CI never fails on a newly drawn example), the whole suite in well under 60 s.
``long``: many more random examples (20,000 per test unless GPUIO_FUZZ_EXAMPLES says otherwise), for
a fuzzing session::

    HYPOTHESIS_PROFILE=long GPUIO_FUZZ_EXAMPLES=3000 .venv/bin/python -m pytest -q tests/fuzz \
        --hypothesis-show-statistics
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=300, derandomize=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=int(os.environ.get("GPUIO_FUZZ_EXAMPLES", "20000")), deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
