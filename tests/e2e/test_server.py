"""The real server over HTTP: formats, compression, filtering, errors, landing page, isolation."""

import concurrent.futures
import gzip
import json
import os
import re
import shutil
import signal
import time

from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from tests.conftest import parse_samples, root

PROC, SYS = root("linux-6.8")
# The two path-rooted collectors only: the others (nvml, smart, engines) would see this machine.
ONLY_PATH_COLLECTORS = ("--collector.disable-defaults", "--collector.diskstats", "--collector.pressure")
FIXTURE = (f"--path.procfs={PROC}", f"--path.sysfs={SYS}", *ONLY_PATH_COLLECTORS)


def success(samples: dict) -> dict[str, float]:
    return {dict(labels)["collector"]: value for (name, labels), value in samples.items()
            if name == "gpuio_scrape_collector_success"}


def test_text_by_default_openmetrics_when_asked_gzip_when_asked(exporter) -> None:
    server = exporter(*FIXTURE)
    status, headers, body = server.get()
    assert status == 200 and headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "content-encoding" not in headers
    assert success(parse_samples(body.decode())) == {"diskstats": 1, "pressure": 1}

    status, headers, body = server.get(headers={"Accept": "application/openmetrics-text;version=1.0.0,text/plain;q=0.5",
                                                "Accept-Encoding": "gzip"})
    assert headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert headers["content-encoding"] == "gzip"
    families = {f.name: f for f in parse_openmetrics(gzip.decompress(body).decode())}
    assert families["gpuio_disk_reads_completed"].type == "counter"


def test_collect_filter_limits_the_scrape(exporter) -> None:
    server = exporter(*FIXTURE)
    text = server.scrape("/metrics?collect[]=pressure")
    samples = parse_samples(text)
    assert success(samples) == {"pressure": 1}
    assert not any(name.startswith("gpuio_disk_") for name, _ in samples)
    status, _, body = server.get("/metrics?collect[]=pressure&collect[]=nvml-typo")
    assert status == 400 and b"nvml-typo is not an enabled collector" in body


def test_methods_health_and_landing_page(exporter) -> None:
    server = exporter(*FIXTURE, "--no-collector.pressure")
    server.scrape()
    status, _, body = server.get("/healthz")
    assert (status, body) == (200, b"ok\n")
    status, _, page = server.get("/")
    assert status == 200
    page_text = page.decode()
    assert "<td>diskstats</td><td>on</td><td>ok</td>" in page_text
    assert "<td>pressure</td><td>off</td><td>off</td>" in page_text
    assert " ms</td>" in page_text
    import urllib.request

    request = urllib.request.Request(server.base + "/metrics", method="HEAD")
    with urllib.request.urlopen(request) as response:
        assert response.status == 200 and response.read() == b""
    request = urllib.request.Request(server.base + "/metrics", method="POST", data=b"x")
    try:
        urllib.request.urlopen(request)
        raise AssertionError("POST accepted")
    except urllib.error.HTTPError as error:
        assert error.code == 405


def test_the_landing_page_before_any_scrape_shows_each_collectors_state(exporter) -> None:
    """Nothing has scraped /metrics yet (Prometheus not pointed at it, a user trying `make run`): the first
    visit of the landing page scrapes once, so it says what each collector found rather than "not
    scraped yet"."""
    server = exporter(*FIXTURE, "--no-collector.pressure")
    page = server.get("/")[2].decode()
    assert "<td>diskstats</td><td>on</td><td>ok</td>" in page and "not scraped yet" not in page


def test_ctrl_c_stops_the_exporter_without_a_traceback(exporter) -> None:
    server = exporter(*FIXTURE)
    server.scrape()
    assert server.process is not None
    server.process.send_signal(signal.SIGINT)
    output, _ = server.process.communicate(timeout=10)
    assert server.process.returncode == 0 and "Traceback" not in output, output
    assert "stopped by an interrupt" in output


def test_only_the_documented_endpoints_are_served(exporter) -> None:
    """FastAPI's interactive docs (scripts from a public CDN) and schema are not part of the exporter."""
    server = exporter(*FIXTURE)
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        assert server.get(path)[0] == 404, path
    for path in ("/", "/healthz", "/metrics"):
        assert server.get(path)[0] == 200, path


def loaded_libraries(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as handle:
        return handle.read()


def test_fastapi_is_loaded_only_when_a_request_needs_it(exporter) -> None:
    """Scrapes, health checks and the landing page are served without FastAPI and pydantic in memory
    (pydantic's compiled core shows in the process's mappings once imported); the first request only
    FastAPI answers loads it, and gets FastAPI's answer."""
    server = exporter(*FIXTURE)
    for path in ("/metrics", "/healthz", "/", "/metrics"):
        assert server.get(path)[0] == 200, path
    assert server.process is not None
    assert "pydantic_core" not in loaded_libraries(server.process.pid)
    status, headers, body = server.get("/no-such-page")
    assert (status, headers["content-type"], body) == (404, "application/json", b'{"detail":"Not Found"}')
    assert "pydantic_core" in loaded_libraries(server.process.pid)
    status, headers, body = server.get("/healthz")
    assert (status, headers["content-type"], body) == (200, "text/plain; charset=utf-8", b"ok\n")


def collector_states(samples: dict) -> dict[str, str]:
    """collector -> the state whose gpuio_scrape_collector_state series is 1 (exactly one must be)."""
    states: dict[str, list[str]] = {}
    for (name, labels), value in samples.items():
        if name == "gpuio_scrape_collector_state":
            label = dict(labels)
            states.setdefault(label["collector"], [])
            if value == 1:
                states[label["collector"]].append(label["state"])
    assert all(len(current) == 1 for current in states.values()), states
    return {collector: current[0] for collector, current in states.items()}


def test_absent_sources_are_told_apart_from_ok_ones(exporter, tmp_path) -> None:
    """A host without a spool directory, GPU, smartctl, PSI, mount table or cgroup tree: every collector succeeds
    (no such hardware is no failure), but its state says absent, the landing page says why, and the
    log says it once per source."""
    proc = tmp_path / "proc"
    proc.mkdir()
    shutil.copy(os.path.join(PROC, "diskstats"), proc / "diskstats")
    server = exporter(f"--path.procfs={proc}", f"--path.sysfs={SYS}",
                      f"--collector.engines.spool-dir={tmp_path / 'no-spool'}", "--collector.engines.discover=false",
                      "--smartctl.path=no-such-smartctl", "--collector.smart.interval=50ms",
                      "--collector.nvml.interval=50ms", env={"LD_LIBRARY_PATH": str(tmp_path)})
    time.sleep(0.5)  # the smart and nvml samplers' first sweeps
    for _ in range(3):
        samples = parse_samples(server.scrape())
    assert set(success(samples).values()) == {1}
    states = collector_states(samples)
    absent = {"engines", "pressure", "smart", "mountstats", "pods", "cgroup_io"}  # the fixture's sys has no fs/cgroup
    if not shutil.which("nvidia-smi"):
        absent.add("nvml")
    assert {name for name, state in states.items() if state == "absent"} == absent, states
    assert states["diskstats"] == "ok"
    page = server.get("/")[2].decode()
    assert "<td>engines</td><td>on</td><td>absent</td>" in page
    assert f"spool directory {tmp_path / 'no-spool'} does not exist" in page
    assert "<td>diskstats</td><td>on</td><td>ok</td>" in page
    log = server.stop()
    for name in absent:
        assert len(re.findall(rf"source absent.*collector={name}\b", log)) == 1, (name, log)
    assert "instrumented processes cannot report" in log


def test_the_real_binary_help_is_node_exporter_style() -> None:
    import subprocess
    import sys

    from tests.conftest import REPO

    result = subprocess.run([sys.executable, "-m", "exporter", "--help"], cwd=REPO, capture_output=True,
                            text=True, timeout=30, env={**os.environ, "COLUMNS": "120"})
    assert result.returncode == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0] == "usage: gpuio-exporter [flags]" and lines[1] == ""
    assert any(line.strip().startswith('--web.listen-address=":9817"') for line in lines)
    assert "VALUE" not in result.stdout and "default )" not in result.stdout


def test_a_misspelt_environment_variable_is_logged_at_start_up(exporter) -> None:
    server = exporter(*FIXTURE, env={"GPUIO_WEB_TELEMETRY_PAHT": "/gpuio"})
    assert server.get("/metrics")[0] == 200  # the misspelt twin is not read: the default path serves
    log = server.stop()
    assert "GPUIO_WEB_TELEMETRY_PAHT is not read by gpuio-exporter; did you mean GPUIO_WEB_TELEMETRY_PATH?" in log


def test_a_repeated_listen_address_listens_on_each(exporter) -> None:
    import urllib.request

    from tests.conftest import free_port

    second = free_port()
    server = exporter(*FIXTURE, f"--web.listen-address=127.0.0.1:{second}")  # the fixture gives the first
    assert server.get("/healthz")[0] == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{second}/metrics", timeout=10) as response:
        assert b"gpuio_disk_reads_completed_total" in response.read()
    assert f"127.0.0.1:{server.port},127.0.0.1:{second}" in server.stop()


def test_telemetry_path_from_environment_twin(exporter) -> None:
    server = exporter(*FIXTURE, env={"GPUIO_WEB_TELEMETRY_PATH": "/gpuio"})
    assert "gpuio_disk_reads_completed_total" in server.scrape("/gpuio")
    assert server.get("/metrics")[0] == 404


def test_a_hung_source_costs_one_budget_then_is_skipped_and_the_rest_is_served(exporter, tmp_path) -> None:
    """A FIFO with no writer as /proc/diskstats: open() blocks forever, as on a hung FUSE/NFS procfs."""
    proc = tmp_path / "proc"
    proc.mkdir()
    os.mkfifo(proc / "diskstats")
    (proc / "pressure").mkdir()
    (proc / "pressure" / "io").write_text("some avg10=0 avg60=0 avg300=0 total=1000000\n")
    server = exporter(f"--path.procfs={proc}", f"--path.sysfs={SYS}", "--collector.timeout=500ms",
                      *ONLY_PATH_COLLECTORS)
    timings, results = [], []
    for _ in range(3):
        start = time.monotonic()
        results.append(parse_samples(server.scrape()))
        timings.append(time.monotonic() - start)
    print(f"scrape times with a hung diskstats: {[round(t, 3) for t in timings]} s")
    # First scrape: diskstats holds its worker until the budget ends; pressure, on another, is served.
    assert success(results[0]) == {"diskstats": 0, "pressure": 1}
    assert 0.4 < timings[0] < 2.0
    # Later scrapes skip the stuck collector at once and serve the rest.
    for samples, elapsed in zip(results[1:], timings[1:], strict=True):
        assert success(samples) == {"diskstats": 0, "pressure": 1}
        assert samples[("gpuio_pressure_io_waiting_seconds_total", frozenset())] == 1.0
        assert elapsed < 0.4
    failures = {(dict(labels)["collector"], dict(labels)["reason"]): v for (name, labels), v in results[2].items()
                if name == "gpuio_scrape_collector_failures_total"}
    # Collectors run concurrently: the hung read failed diskstats alone, in every scrape.
    assert failures == {("diskstats", "timeout"): 3}
    log = server.stop()
    assert "collector failed" in log and "collector=diskstats" in log


def diskstats_that_hangs_after_being_fast(exporter, tmp_path, timeout: str):
    """An exporter whose diskstats reads a real file for a few scrapes (so it counts as cheap: it shares
    a worker with pressure, and the loop waits for them briefly), then finds /proc/diskstats a FIFO with
    no writer, as a procfs that hangs mid-life.  Returns the exporter and the FIFO's path."""
    proc = tmp_path / "proc"
    (proc / "pressure").mkdir(parents=True)
    (proc / "diskstats").write_text("   8       0 sda 1 0 8 1 0 0 0 0 0 1 1\n")
    (proc / "pressure" / "io").write_text("some avg10=0 avg60=0 avg300=0 total=2000000\n")
    server = exporter(f"--path.procfs={proc}", f"--path.sysfs={SYS}", f"--collector.timeout={timeout}",
                      *ONLY_PATH_COLLECTORS)
    for _ in range(5):
        assert success(parse_samples(server.scrape())) == {"diskstats": 1, "pressure": 1}
    (proc / "diskstats").unlink()
    os.mkfifo(proc / "diskstats")
    return server, proc / "diskstats"


def test_a_source_that_hangs_after_being_fast_fails_only_its_own_collector(exporter, tmp_path) -> None:
    server, fifo = diskstats_that_hangs_after_being_fast(exporter, tmp_path, "500ms")
    for _ in range(3):
        samples = parse_samples(server.scrape())
        assert success(samples) == {"diskstats": 0, "pressure": 1}
        assert samples[("gpuio_pressure_io_waiting_seconds_total", frozenset())] == 2.0
    with open(fifo, "w"):  # a writer at last: the hung open returns, the read sees EOF
        pass
    server.stop()


def test_healthz_answers_while_a_scrape_waits_for_a_source_that_hung_after_being_fast(exporter, tmp_path) -> None:
    """Fast collectors are waited for on the event loop's thread for a moment: when one then hangs, the
    loop must still answer other requests (here /healthz) while that scrape waits out its budget."""
    server, fifo = diskstats_that_hangs_after_being_fast(exporter, tmp_path, "2s")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        hung_scrape = pool.submit(server.scrape)
        time.sleep(0.2)  # the scrape is in, its diskstats read blocked
        assert server.get("/healthz")[0] == 200
        assert not hung_scrape.done()  # answered while the scrape still waited, not after it
        assert success(parse_samples(hung_scrape.result())) == {"diskstats": 0, "pressure": 1}
    with open(fifo, "w"):  # a writer at last: the hung open returns
        pass
    server.stop()


def test_a_failing_source_reports_success_0_and_the_scrape_answers_200(exporter, tmp_path) -> None:
    proc = tmp_path / "proc"
    (proc / "diskstats").mkdir(parents=True)  # reading it raises IsADirectoryError
    server = exporter(f"--path.procfs={proc}", f"--path.sysfs={SYS}", *ONLY_PATH_COLLECTORS)
    samples = parse_samples(server.scrape())
    assert success(samples) == {"diskstats": 0, "pressure": 1}  # no /proc/pressure here: no data, not failure
    log = server.stop()
    assert "IsADirectoryError" in log


def test_log_formats_json_and_logfmt(exporter) -> None:
    """--log.format: every line of a json log is one JSON object with node_exporter's keys; a logfmt
    line carries the same keys as key=value, and structured fields come along in both."""
    args = ("--collector.disable-defaults", "--collector.diskstats", "--log.level=debug")
    json_log = exporter(*args, "--log.format=json").stop()
    records = [json.loads(line) for line in json_log.splitlines() if line.strip()]
    assert records and all({"ts", "level", "logger", "msg"} <= set(record) for record in records)
    (start,) = [record for record in records if record["msg"] == "starting gpuio-exporter"]
    assert start["level"] == "info" and start["logger"] == "gpuio" and start["collectors"] == "diskstats"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", start["ts"])
    logfmt_log = exporter(*args, "--log.format=logfmt").stop()
    (line,) = [line for line in logfmt_log.splitlines() if 'msg="starting gpuio-exporter"' in line]
    assert re.match(r"ts=\S+Z level=info logger=gpuio msg=\"starting gpuio-exporter\" .*collectors=diskstats", line)
