"""Write every generated file of gpuio in one pass, from one config: the Prometheus rules, the Grafana
boards, the runbooks and the Kubernetes objects built from them (``make generate``).

    python -m deploy.generate          # rewrite deploy/prometheus/rules/*.yml, dashboards/*.json, docs/runbooks,
                                       # dashboards/kustomization.yaml, deploy/kubernetes/prometheusrule.yaml
    python -m deploy.generate --check  # exit 1 if a checked-in file is stale (CI)

Links in alerts (runbook_url, dashboard_url): by default the runbook's path in this repository
(docs/runbooks/<Alert>.md) and the board's path on your Grafana (/d/<uid>/...).  Make them clickable:

    python -m deploy.generate --runbook-url 'https://wiki.example.com/gpuio/{alert}' \\
                              --grafana-url https://grafana.example.com
    GPUIO_RUNBOOK_URL=... GPUIO_GRAFANA_URL=... python -m deploy.generate   # the same, from the environment

Your own thresholds, windows or selectors (any knob of deploy/prometheus/config.py), written elsewhere
(never into the repository): the rules in DIR, the boards in DIR/dashboards, the runbooks in DIR/runbooks,
all from the same config, so a panel's threshold and its runbook say what the alert fires on:

    python -m deploy.generate --set STORM_FOR=10m --set IO_PRESSURE_FULL=0.2 --out /tmp/gpuio
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import glob
import os
import sys
from collections.abc import Mapping

from deploy.generated import DASHBOARDS_DIR, REPO, report_stale, stale_files, write
from deploy.kubernetes import generate as kubernetes
from deploy.prometheus import generate as prometheus
from deploy.prometheus import runbooks
from deploy.prometheus.config import DEFAULT, GRAFANA_URL_ENV, KNOBS, RUNBOOK_URL_ENV, Config
from deploy.prometheus.sources import rule_files


def boards(config: Config, directory: str | None = None) -> dict[str, str]:
    """Path of each dashboard's JSON -> its text under ``config`` (in dashboards/, or ``directory``).
    Imported here: only the boards need the Grafana SDK (Python 3.11+)."""
    from deploy.grafana import boards

    return boards.rendered(config, directory or DASHBOARDS_DIR)


def rendered(config: Config = DEFAULT) -> dict[str, str]:
    """Every generated file of the repository -> its text, from one config."""
    files = prometheus.rendered(config)
    files.update(prometheus.rendered_node_exporter_mode(config))
    files.update(runbooks.rendered(config))
    json_files = boards(config)
    files.update(json_files)
    files.update(kubernetes.rendered(rule_files(config), [os.path.basename(path) for path in json_files],
                                     rule_files(prometheus.node_exporter_mode(config))))
    return files


def stray(files: Mapping[str, str]) -> list[str]:
    """Generated-looking files nobody generates any more (a removed rule file or board)."""
    present = [os.path.join(directory, name)
               for directory in (prometheus.RULES_DIR, prometheus.NODE_EXPORTER_RULES_DIR) if os.path.isdir(directory)
               for name in os.listdir(directory) if name.endswith(".yml")]
    present += [os.path.join(DASHBOARDS_DIR, name) for name in os.listdir(DASHBOARDS_DIR) if name.endswith(".json")]
    present += glob.glob(os.path.join(kubernetes.NODE_EXPORTER_COMPONENT, "prometheusrule-*.yaml"))
    present += glob.glob(os.path.join(runbooks.RUNBOOKS_DIR, "*.md"))
    return [path for path in present if path not in files]


def stale(config: Config = DEFAULT) -> list[str]:
    files = rendered(config)
    return stale_files(files, stray(files))


# Where --out must never point: the checked-in rules, and the repository (whose dashboards/ it would overwrite).
REPOSITORY_OUTPUTS = (prometheus.RULES_DIR, prometheus.NODE_EXPORTER_RULES_DIR, REPO)


def variant_files(config: Config, out: str, note: str) -> dict[str, str]:
    """What ``--out DIR`` writes: the rules in DIR, the boards in DIR/dashboards, the runbooks in
    DIR/runbooks, from one config."""
    files = prometheus.rendered(config, out, note)
    files.update(boards(config, os.path.join(out, "dashboards")))
    files.update(runbooks.rendered(config, os.path.join(out, "runbooks")))
    return files


def configured(runbook_url: str | None, grafana_url: str | None, environ: Mapping[str, str]) -> Config:
    """DEFAULT with the links a flag or, failing that, the environment sets."""
    runbook = runbook_url if runbook_url is not None else environ.get(RUNBOOK_URL_ENV)
    grafana = grafana_url if grafana_url is not None else environ.get(GRAFANA_URL_ENV)
    return dataclasses.replace(DEFAULT, RUNBOOK_URL=DEFAULT.RUNBOOK_URL if runbook is None else runbook,
                               GRAFANA_URL=DEFAULT.GRAFANA_URL if grafana is None else grafana)


def check_knob_name(text: str) -> None:
    """ValueError, with the closest knob's name, where ``NAME=VALUE`` names no knob: a misspelt knob (STORM_FR)
    would otherwise be told only that it is none, and a lower-case one (storm_for) the same."""
    name, sep, _ = text.partition("=")
    if not sep or name in KNOBS:
        return  # well formed and known, or not NAME=VALUE at all (parse_override says what is expected)
    close = difflib.get_close_matches(name.upper(), sorted(KNOBS), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else " (the knobs are the fields of its Config)"
    raise ValueError(f"--set {text!r}: {name} is not a knob of deploy/prometheus/config.py{hint}")


def main(argv: list[str] | None = None, environ: Mapping[str, str] = os.environ) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="report stale files instead of writing them")
    parser.add_argument("--runbook-url", metavar="TEMPLATE",
                        help=f"runbook_url of every alert, {{alert}} replaced by its name (env {RUNBOOK_URL_ENV}; "
                             f"default {DEFAULT.RUNBOOK_URL})")
    parser.add_argument("--grafana-url", metavar="URL",
                        help=f"your Grafana, the base of every dashboard_url (env {GRAFANA_URL_ENV}; "
                             f"default: none, the link is a path on your Grafana)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="replace a knob of deploy/prometheus/config.py (needs --out)")
    parser.add_argument("--out", metavar="DIR",
                        help="write the rules into DIR, the boards into DIR/dashboards, the runbooks into "
                             "DIR/runbooks (not the repository's)")
    args = parser.parse_args(argv)
    try:
        config = configured(args.runbook_url, args.grafana_url, environ)
        for text in args.set:
            check_knob_name(text)
        overrides = dict(prometheus.parse_override(text, config) for text in args.set)
    except ValueError as error:
        parser.error(str(error))
    out = os.path.abspath(args.out) if args.out else None
    if (overrides or out) and (args.check or out in (None, *REPOSITORY_OUTPUTS)):
        parser.error("--set and --out write your own variant: give --out DIR (never rules/ "
                     "or the repository itself), and no --check")
    if out:
        if overrides and config.RUNBOOK_URL == DEFAULT.RUNBOOK_URL:
            # The alerts would link the repository's runbooks, which quote the default numbers.
            print(f"note: the alerts' runbook_url is {DEFAULT.RUNBOOK_URL}, the pages of the default config; "
                  f"publish {os.path.join(args.out, 'runbooks')} and give --runbook-url", file=sys.stderr)
        return write(variant_files(prometheus.variant(overrides, config), out,
                                   prometheus.variant_note(overrides) if overrides else ""))
    if args.check:
        return report_stale(stale(config), "make generate")
    return write(rendered(config))


if __name__ == "__main__":
    sys.exit(main())
