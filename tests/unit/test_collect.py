"""The framework's isolation: a raising collector, a stale one, a slow or hung one beside others, and
self-metrics per collector."""

import asyncio
import logging
import threading

from exporter.collect import Collector, Context, Pending, Scraper, StaleData
from exporter.exposition import GAUGE, Desc, Family, render
from exporter.sampler import PeriodicSampler
from tests.conftest import parse_samples

LAST = Desc("gpuio_test_last_value", GAUGE, "The last value the source gave.")


class Fixed(Collector):
    """A collector whose outcome the test chooses: data, an error, or stale data."""

    name = "fixed"

    def __init__(self, outcome: str) -> None:
        super().__init__(Context(), {})
        self.outcome = outcome

    def collect(self) -> list[Family]:
        families = [LAST.family([LAST.sample("", 7)])]
        if self.outcome == "error":
            raise OSError("source gone")
        if self.outcome == "stale":
            raise StaleData("source hung", families)
        return families


def scrape(outcome: str) -> dict:
    collector = Fixed(outcome)
    return parse_samples(render(Scraper([collector], 1.0, "").scrape_sync()))


def test_success_serves_data_and_reports_success() -> None:
    samples = scrape("data")
    assert samples[("gpuio_scrape_collector_success", frozenset({("collector", "fixed")}))] == 1
    assert samples[("gpuio_test_last_value", frozenset())] == 7


def test_error_reports_failure_and_serves_nothing_of_that_collector() -> None:
    samples = scrape("error")
    assert samples[("gpuio_scrape_collector_success", frozenset({("collector", "fixed")}))] == 0
    assert ("gpuio_test_last_value", frozenset()) not in samples
    assert samples[("gpuio_scrape_collector_failures_total",
                    frozenset({("collector", "fixed"), ("reason", "error")}))] == 1


def test_stale_data_reports_failure_and_still_serves_the_last_values() -> None:
    samples = scrape("stale")
    assert samples[("gpuio_scrape_collector_success", frozenset({("collector", "fixed")}))] == 0
    assert samples[("gpuio_test_last_value", frozenset())] == 7


class Gate(Collector):
    """A collector that returns at once until the test closes its gate, then blocks until it reopens:
    a source that hangs (a dead NFS procfs, a stuck sysfs read) after working."""

    def __init__(self, name: str) -> None:
        super().__init__(Context(), {})
        self.name = name  # type: ignore[misc]
        self.open = threading.Event()
        self.open.set()

    def collect(self) -> list[Family]:
        self.open.wait()
        desc = Desc(f"gpuio_test_{self.name}", GAUGE, "A value.")
        return [desc.family([desc.sample("", 1)])]


def successes(scraper: Scraper) -> dict[str, float]:
    """One scrape as the server runs it (on its event loop)."""
    samples = parse_samples(render(asyncio.run(scraper.scrape())))
    return {dict(labels)["collector"]: value for (name, labels), value in samples.items()
            if name == "gpuio_scrape_collector_success"}


def test_a_collector_that_hangs_fails_alone_and_holds_one_thread() -> None:
    """First the hung collector blocks on its first run (no history), then one that was cheap blocks
    in front of the cheap ones queued behind it: the others succeed in every scrape, and the hung ones
    hold one worker thread each however many scrapes follow."""
    first, cheap, other = Gate("first"), Gate("cheap"), Gate("other")
    scraper = Scraper([first, cheap, other], 0.3, "")
    first.open.clear()
    for _ in range(3):
        assert successes(scraper) == {"first": 0, "cheap": 1, "other": 1}
    cheap.open.clear()
    for _ in range(20):
        assert successes(scraper) == {"first": 0, "cheap": 0, "other": 1}
    hung_threads = 2
    print(f"worker threads after 23 scrapes with two hung collectors: {scraper._workers.threads}")
    assert scraper._workers.threads <= hung_threads + 3  # the rest run on a few threads, reused
    first.open.set()
    cheap.open.set()


def test_scrape_sync_keeps_the_budget_too() -> None:
    """`gpuio scrape` and `gpuio top` scrape without an event loop: a hung collector must not hang them."""
    hung, fine = Gate("hung"), Gate("fine")
    hung.open.clear()
    scraper = Scraper([hung, fine], 0.3, "")
    samples = parse_samples(render(scraper.scrape_sync()))
    assert samples[("gpuio_scrape_collector_success", frozenset({("collector", "hung")}))] == 0
    assert samples[("gpuio_scrape_collector_success", frozenset({("collector", "fine")}))] == 1
    hung.open.set()


class FirstSweep(Collector):
    """A collector fed by a background sampler whose first sample waits for the test: an NVML or SMART
    sweep, or the engine files' scan, still running just after start-up."""

    name = "sweeping"

    def __init__(self) -> None:
        super().__init__(Context(), {})
        self.release = threading.Event()
        self.sampler: PeriodicSampler[int] = PeriodicSampler("sweeping", 3600.0, self._sweep,
                                                            logging.getLogger("test"))

    def _sweep(self) -> int:
        self.release.wait(10)
        return 5

    def start(self) -> None:
        self.sampler.start()

    def stop(self) -> None:
        self.release.set()
        self.sampler.stop()

    def collect(self) -> list[Family]:
        value = self.sampler.snapshot().value
        if self.sampler.first_pending():
            raise Pending("the first sweep is still running")
        return [LAST.family([LAST.sample("", value or 0)])]


def states(samples: dict, collector: str) -> dict[str, float]:
    return {dict(labels)["state"]: value for (name, labels), value in samples.items()
            if name == "gpuio_scrape_collector_state" and dict(labels)["collector"] == collector}


def test_a_collector_whose_first_background_sample_is_running_is_pending_not_ok_and_not_failing() -> None:
    collector = FirstSweep()
    scraper = Scraper([collector], 1.0, "")
    scraper.start()
    try:
        samples = parse_samples(render(scraper.scrape_sync()))
        assert states(samples, "sweeping") == {"ok": 0, "pending": 1, "absent": 0, "failing": 0, "stale": 0}
        assert samples[("gpuio_scrape_collector_success", frozenset({("collector", "sweeping")}))] == 1
        assert scraper.states["sweeping"].last_error == "the first sweep is still running"  # the landing page's why
        collector.release.set()
        settled = parse_samples(render(scraper.scrape_settled(timeout=10)))
        assert states(settled, "sweeping")["ok"] == 1
        assert settled[("gpuio_test_last_value", frozenset())] == 5
    finally:
        scraper.stop()


def test_settling_gives_up_at_its_timeout_and_says_pending() -> None:
    collector = FirstSweep()
    scraper = Scraper([collector], 1.0, "")
    scraper.start()
    try:
        samples = parse_samples(render(scraper.scrape_settled(timeout=0.3)))
        assert states(samples, "sweeping")["pending"] == 1
    finally:
        scraper.stop()
