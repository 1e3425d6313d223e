"""Flags and their GPUIO_* twins: precedence, and errors that name flag, value and what is accepted."""


import pytest

from exporter import collectors  # noqa: F401  (registers the collectors, which creates their flags)
from exporter.assemble import build_scraper
from exporter.collect import REGISTRY
from exporter.config import ConfigError, env_name, parse_args, parse_listen_address, parse_seconds


def test_defaults() -> None:
    config = parse_args([], environ={})
    assert (config.listen_host, config.listen_port) == ("", 9817)
    assert config.telemetry_path == "/metrics"
    assert config.enabled == {name: cls.default_enabled for name, cls in REGISTRY.items()}
    assert config.enabled["diskstats"] and config.enabled["pressure"]
    assert config.collector_timeout == 2.0


def test_command_line_beats_environment_beats_default() -> None:
    environ = {"GPUIO_WEB_LISTEN_ADDRESS": "127.0.0.1:9999", "GPUIO_LOG_LEVEL": "debug"}
    config = parse_args(["--web.listen-address=[::1]:9001"], environ=environ)
    assert (config.listen_host, config.listen_port) == ("::1", 9001)
    assert config.log_level == "debug"


def test_repeated_listen_address_keeps_every_address() -> None:
    config = parse_args(["--web.listen-address=127.0.0.1:9001", "--web.listen-address=[::1]:9002",
                         "--web.listen-address=127.0.0.1:9001"], environ={})
    assert config.listen_addresses == [("127.0.0.1", 9001), ("::1", 9002)]
    assert parse_args([], environ={"GPUIO_WEB_LISTEN_ADDRESS": ":9003"}).listen_addresses == [("", 9003)]
    with pytest.raises(ConfigError, match="port 99999"):
        parse_args(["--web.listen-address=:9001", "--web.listen-address=:99999"], environ={})


def test_collector_switches_and_their_environment_twins() -> None:
    assert parse_args(["--no-collector.pressure"], environ={}).enabled["pressure"] is False
    assert parse_args([], environ={"GPUIO_COLLECTOR_PRESSURE": "false"}).enabled["pressure"] is False
    config = parse_args(["--collector.disable-defaults", "--collector.diskstats"], environ={})
    assert {name for name, on in config.enabled.items() if on} == {"diskstats"}


def test_collector_options_are_flags() -> None:
    config = parse_args(["--collector.diskstats.device-include=^nvme"], environ={})
    assert config.collector_options["diskstats"]["device-include"].pattern == "^nvme"
    assert env_name("collector.diskstats.device-include") == "GPUIO_COLLECTOR_DISKSTATS_DEVICE_INCLUDE"


@pytest.mark.parametrize(("argv", "environ", "expected"), [
    (["--web.listen-address=localhost"], {}, r"'localhost' for --web\.listen-address: .*accepted: \[host\]:port"),
    (["--web.listen-address=:99999"], {}, r"port 99999 is outside 1-65535"),
    ([], {"GPUIO_LOG_LEVEL": "loud"},
     r"'loud' for --log\.level \(from environment variable GPUIO_LOG_LEVEL\).*accepted: debug, info, warn, error"),
    (["--log.format=xml"], {}, r"accepted: logfmt, json"),
    (["--path.procfs=/no/such/dir"], {}, r"'/no/such/dir' for --path\.procfs: no such directory"),
    (["--collector.timeout=0s"], {}, r"must be above zero"),
    (["--collector.timeout=soon"], {}, r"accepted: a duration"),
    (["--web.telemetry-path=metrics"], {}, r"accepted: an absolute path"),
    (["--collector.diskstats.device-include=("], {}, r"bad regular expression"),
    ([], {"GPUIO_COLLECTOR_DISKSTATS": "maybe"}, r"GPUIO_COLLECTOR_DISKSTATS.*accepted: true or false"),
])
def test_bad_values_name_flag_value_and_what_is_accepted(argv, environ, expected) -> None:
    with pytest.raises(ConfigError, match=expected):
        parse_args(argv, environ=environ)


def test_include_and_exclude_together_are_refused() -> None:
    config = parse_args(["--collector.diskstats.device-include=a", "--collector.diskstats.device-exclude=b"],
                        environ={})
    with pytest.raises(ConfigError, match="mutually exclusive"):
        build_scraper(config)


def test_listen_address_forms() -> None:
    assert parse_listen_address(":9817") == ("", 9817)
    assert parse_listen_address("0.0.0.0:1") == ("0.0.0.0", 1)
    assert parse_listen_address("[::]:9817") == ("::", 9817)
    assert parse_seconds("500ms") == 0.5 and parse_seconds("5m") == 300.0


def help_text(capsys) -> str:
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--help"], environ={})
    assert stopped.value.code == 0
    return capsys.readouterr().out


def test_help_shows_defaults_choices_and_a_one_line_usage(capsys) -> None:
    text = help_text(capsys)
    assert text.startswith("usage: gpuio-exporter [flags]\n\n")
    assert '--web.listen-address=":9817"' in text and '--collector.timeout="2s"' in text
    assert "VALUE" not in text and "default )" not in text and "default None" not in text
    flat = " ".join(text.split())
    assert "--log.level=\"info\" Only log at this level or above. One of: debug, info, warn, error." in flat
    assert "One of: logfmt, json." in flat
    assert "One of: never, sleep, standby, idle." in flat
    assert "--web.config.file=FILE" in text  # unset by default: a placeholder, no empty default


@pytest.mark.parametrize(("argv", "expected"), [
    (["--web.listen-adress=:9000"], r"^unknown flag '--web\.listen-adress'; did you mean --web\.listen-address\?$"),
    (["--collector.diskstat"], r"did you mean --collector\.diskstats\?$"),
    (["--zzzz"], r"^unknown flag '--zzzz' \(--help lists the flags\)$"),
    (["--web.listen-address"], r"expected one argument \(--help lists the flags\)$"),
])
def test_a_wrong_flag_is_one_line_with_the_closest_right_one(argv, expected, capsys) -> None:
    with pytest.raises(ConfigError, match=expected):
        parse_args(argv, environ={})
    assert capsys.readouterr() == ("", "")  # no usage block printed


def test_a_misspelt_environment_twin_is_warned_about_with_the_closest_right_one() -> None:
    config = parse_args([], environ={"GPUIO_WEB_LISTEN_ADRESS": ":9000", "GPUIO_LOG_LEVEL": "debug",
                                     "GPUIO_SPOOL_DIR": "/run/gpuio/spool", "GPUIO_COLLECTOR_PRESURE": "false",
                                     "HOME": "/root"})
    assert config.warnings == [
        "environment variable GPUIO_COLLECTOR_PRESURE is not read by gpuio-exporter; "
        "did you mean GPUIO_COLLECTOR_PRESSURE?",
        "environment variable GPUIO_WEB_LISTEN_ADRESS is not read by gpuio-exporter; "
        "did you mean GPUIO_WEB_LISTEN_ADDRESS?",
    ]
    assert (config.listen_port, config.enabled["pressure"]) == (9817, True)  # what the warning is about
    assert parse_args([], environ={"GPUIO_WEB_LISTEN_ADDRESS": ":9000"}).warnings == []


@pytest.mark.parametrize("flag", ["--web.listen-address=:9999", "--web.config.file", "--web.max-requests=3",
                                  "--web.telemetry-path=/m"])
def test_the_tools_refuse_the_servers_flags_with_a_line_saying_why(flag: str) -> None:
    with pytest.raises(ConfigError, match=r"is a flag of the server \(gpuio-exporter\); gpuio scrape runs"):
        parse_args([flag], environ={}, prog="gpuio scrape", server=False)


def test_the_tools_leave_the_servers_environment_to_the_server() -> None:
    # A node-wide GPUIO_WEB_LISTEN_ADDRESS (even one only the server could parse) is not the tool's business.
    config = parse_args([], environ={"GPUIO_WEB_LISTEN_ADDRESS": "not an address"}, prog="gpuio top", server=False)
    assert config.listen_addresses == [("", 9817)] and config.warnings == []
    with pytest.raises(ConfigError, match="GPUIO_WEB_LISTEN_ADDRESS"):
        parse_args([], environ={"GPUIO_WEB_LISTEN_ADDRESS": "not an address"})


def test_one_spool_variable_for_the_library_the_exporter_and_its_tools(tmp_path) -> None:
    """The library reads GPUIO_SPOOL_DIR; a node that sets it once has the exporter look there too (its own
    twin, if set, wins), and two variables naming different directories are warned about."""
    library_dir, twin_dir = str(tmp_path / "library"), str(tmp_path / "twin")
    spool_dir = parse_args([], {"GPUIO_SPOOL_DIR": library_dir}).collector_options["engines"]["spool-dir"]
    assert spool_dir == library_dir
    both = parse_args([], {"GPUIO_SPOOL_DIR": library_dir, "GPUIO_COLLECTOR_ENGINES_SPOOL_DIR": twin_dir})
    assert both.collector_options["engines"]["spool-dir"] == twin_dir
    assert [w for w in both.warnings if "differ" in w] == [
        f"GPUIO_COLLECTOR_ENGINES_SPOOL_DIR={twin_dir!r} and GPUIO_SPOOL_DIR={library_dir!r} differ: the exporter "
        "reads the first, the instrumentation library writes to the second; set one of them"]
    same = parse_args([], {"GPUIO_SPOOL_DIR": library_dir, "GPUIO_COLLECTOR_ENGINES_SPOOL_DIR": library_dir})
    assert not [w for w in same.warnings if "differ" in w]
    flag = parse_args([f"--collector.engines.spool-dir={twin_dir}"], {"GPUIO_SPOOL_DIR": library_dir})
    assert flag.collector_options["engines"]["spool-dir"] == twin_dir  # the command line first, as ever


def test_a_collector_built_without_flags_has_the_settings_of_an_exporter_given_none() -> None:
    """The Option is the one place a default is written: what the flag layer parses when no flag is given
    and what a collector fills in when built directly (a test, a bench, `gpuio engines`) are the same."""
    from exporter.options import with_defaults

    parsed = parse_args([], environ={}, server=False).collector_options
    for name, collector in REGISTRY.items():
        assert with_defaults(collector.options, {}) == parsed[name], name
    smart = REGISTRY["smart"]
    assert with_defaults(smart.options, {"timeout": 5.0, "interval": None})["interval"] == 300.0  # None: unset
