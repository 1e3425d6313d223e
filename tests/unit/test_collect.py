"""The framework's isolation: a raising collector, a stale one, a slow or hung one beside others, and
self-metrics per collector."""

import asyncio
import logging
import threading

from exporter import collect
from exporter.collect import Collector, Pending, Scraper, StaleData
from exporter.context import Context
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


def sleeps_and_wakes(thread: threading.Thread) -> int:
    """How often the kernel switched a thread out because it blocked (its voluntary context switches)."""
    with open(f"/proc/self/task/{thread.native_id}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))


class Together(Gate):
    """Its first collect() returns once every collector sharing ``meet`` is running: one thread each."""

    def __init__(self, name: str, meet: threading.Barrier) -> None:
        super().__init__(name)
        self.meet: threading.Barrier | None = meet

    def collect(self) -> list[Family]:
        if self.meet is not None:
            self.meet.wait(timeout=5)
            self.meet = None
        return super().collect()


def test_a_scrape_of_cheap_collectors_wakes_one_worker_not_every_idle_one() -> None:
    """Four workers exist (the first scrape runs each collector, no history yet, on its own); then every
    collector is cheap and a scrape needs one.  The other three must sleep through the scrapes: woken
    for nothing, each would then want the GIL while the busy worker runs the collectors."""
    meet = threading.Barrier(4)
    scraper = Scraper([Together(name, meet) for name in ("one", "two", "three", "four")], 1.0, "")
    successes(scraper)
    workers = [t for t in threading.enumerate() if t.name.startswith("gpuio-scrape-")][-scraper._workers.threads:]
    assert len(workers) == 4
    before = [sleeps_and_wakes(t) for t in workers]
    for _ in range(100):
        assert successes(scraper) == {"one": 1, "two": 1, "three": 1, "four": 1}
    woken = sorted(sleeps_and_wakes(t) - b for t, b in zip(workers, before, strict=True))
    print(f"times each worker blocked over 100 scrapes: {woken}")
    assert sum(woken[:-1]) < 20  # all but the busiest: about none, not two per scrape


def without_durations(families: list[Family]) -> dict:
    return {key: value for key, value in parse_samples(render(families)).items()
            if key[0] != "gpuio_scrape_collector_duration_seconds"}


def test_the_loop_waiting_briefly_serves_the_same_scrape_as_awaiting(monkeypatch) -> None:
    """A batch done within the brief wait is served as the awaited one would be."""
    waits: list[bool] = []
    wait_briefly = collect.BatchDone.wait_briefly
    monkeypatch.setattr(collect.BatchDone, "wait_briefly",
                        lambda self, timeout: waits.append(wait_briefly(self, timeout)) or waits[-1])
    scraper = Scraper([Fixed("data"), Gate("gate")], 1.0, "")

    async def quick_then_awaited() -> tuple[list[Family], list[Family]]:
        await scraper.scrape()  # history: both cheap
        quick = await scraper.scrape()
        monkeypatch.setattr(collect, "QUICK_WAIT_SECONDS", 0.0)
        return quick, await scraper.scrape()

    quick, awaited = asyncio.run(quick_then_awaited())
    assert waits == [False, True, False]  # no history, done within the wait, no wait allowed
    assert without_durations(quick) == without_durations(awaited)


def test_a_collector_that_hangs_after_being_fast_holds_the_loop_one_brief_wait_at_most() -> None:
    """The loop thread waits synchronously only for a batch that was fast: when a collector then hangs,
    the loop serves other work (here: a ticker, as it would /healthz) while the scrape waits out its
    budget, and the hung collector fails alone."""
    hung, fine = Gate("hung"), Gate("fine")
    scraper = Scraper([hung, fine], 0.3, "")

    async def scrape_while_ticking() -> tuple[dict[str, float], int]:
        for _ in range(3):
            await scraper.scrape()
        hung.open.clear()
        ticks = 0
        scrape = asyncio.ensure_future(scraper.scrape())
        while not scrape.done():
            ticks += 1
            await asyncio.sleep(0.01)
        samples = parse_samples(render(scrape.result()))
        return {dict(labels)["collector"]: value for (name, labels), value in samples.items()
                if name == "gpuio_scrape_collector_success"}, ticks

    success, ticks = asyncio.run(scrape_while_ticking())
    hung.open.set()
    assert success == {"hung": 0, "fine": 1}
    print(f"ticks of the loop while the scrape waited for a hung collector: {ticks}")
    assert ticks >= 10  # the 0.3 s budget is 30 ticks; a loop held for the budget would tick once


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
