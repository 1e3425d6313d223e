"""The framework's isolation: a raising collector, a stale one, and self-metrics per collector."""

from exporter.collect import Collector, Context, Scraper, StaleData
from exporter.exposition import GAUGE, Desc, Family, render
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
