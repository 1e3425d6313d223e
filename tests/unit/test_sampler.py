"""PeriodicSampler: snapshots, kept values on failure, one log line per distinct error."""

import logging
import time

from exporter.sampler import PeriodicSampler


def test_keeps_last_good_value_and_records_the_error(caplog) -> None:
    results = iter([1, RuntimeError("device gone"), RuntimeError("device gone"), 2])

    def sample() -> int:
        result = next(results)
        if isinstance(result, Exception):
            raise result
        return result

    sampler = PeriodicSampler("test", 60.0, sample, logging.getLogger("t"))
    assert sampler.snapshot().value is None
    first = sampler.sample_now()
    assert (first.value, first.error) == (1, None) and first.taken_at is not None
    with caplog.at_level(logging.WARNING):
        failed = sampler.sample_now()
        sampler.sample_now()
    assert (failed.value, failed.taken_at) == (1, first.taken_at)
    assert failed.error == "RuntimeError: device gone"
    assert len(caplog.records) == 1  # the same error again is not news
    recovered = sampler.sample_now()
    assert (recovered.value, recovered.error, recovered.samples) == (2, None, 4)


def test_background_thread_samples_on_its_cadence() -> None:
    count = iter(range(1000))
    sampler = PeriodicSampler("tick", 0.02, lambda: next(count), logging.getLogger("t"))
    sampler.start()
    time.sleep(0.25)
    sampler.stop()
    assert 5 <= sampler.snapshot().samples <= 20
