"""Write every generated file of gpuio in one pass: the Prometheus rules, the Grafana boards and the
Kubernetes objects built from them (``make generate``).

    python -m deploy.generate          # rewrite deploy/prometheus/rules/*.yml, dashboards/*.json,
                                       # dashboards/kustomization.yaml, deploy/kubernetes/prometheusrule.yaml
    python -m deploy.generate --check  # exit 1 if a checked-in file is stale (CI)

Links in alerts (runbook_url, dashboard_url): by default the runbook's path in this repository
(docs/runbooks/<Alert>.md) and the board's path on your Grafana (/d/<uid>/...).  Make them clickable:

    python -m deploy.generate --runbook-url 'https://wiki.example.com/gpuio/{alert}' \\
                              --grafana-url https://grafana.example.com
    GPUIO_RUNBOOK_URL=... GPUIO_GRAFANA_URL=... python -m deploy.generate   # the same, from the environment

A rule variant for tests, written elsewhere (never into the repository; nothing else is written):

    python -m deploy.generate --set STORM_FOR=10s --set BASELINE_WINDOW=2m --out /tmp/rules
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import sys
from collections.abc import Mapping

from deploy.generated import report_stale, stale_files, write
from deploy.kubernetes import generate as kubernetes
from deploy.prometheus import generate as prometheus
from deploy.prometheus.config import DEFAULT, GRAFANA_URL_ENV, RUNBOOK_URL_ENV, Config
from deploy.prometheus.sources import rule_files


def boards() -> dict[str, str]:
    """Path of each dashboard's JSON -> its text.  Imported here: only the boards need the Grafana SDK."""
    import dashboards

    return dashboards.rendered()


def rendered(config: Config = DEFAULT) -> dict[str, str]:
    """Every generated file of the repository -> its text, from one config."""
    files = prometheus.rendered(config)
    files.update(prometheus.rendered_node_exporter_mode(config))
    json_files = boards()
    files.update(json_files)
    files.update(kubernetes.rendered(rule_files(config), [os.path.basename(path) for path in json_files],
                                     rule_files(prometheus.node_exporter_mode(config))))
    return files


def stray(files: Mapping[str, str]) -> list[str]:
    """Generated-looking files nobody generates any more (a removed rule file or board)."""
    present = [os.path.join(directory, name)
               for directory in (prometheus.RULES_DIR, prometheus.NODE_EXPORTER_RULES_DIR) if os.path.isdir(directory)
               for name in os.listdir(directory) if name.endswith(".yml")]
    present += [os.path.join(kubernetes.DASHBOARDS_DIR, name) for name in os.listdir(kubernetes.DASHBOARDS_DIR)
                if name.endswith(".json")]
    present += glob.glob(os.path.join(kubernetes.NODE_EXPORTER_COMPONENT, "prometheusrule-*.yaml"))
    return [path for path in present if path not in files]


def stale(config: Config = DEFAULT) -> list[str]:
    files = rendered(config)
    return stale_files(files, stray(files))


def configured(runbook_url: str | None, grafana_url: str | None, environ: Mapping[str, str]) -> Config:
    """DEFAULT with the links a flag or, failing that, the environment sets."""
    runbook = runbook_url if runbook_url is not None else environ.get(RUNBOOK_URL_ENV)
    grafana = grafana_url if grafana_url is not None else environ.get(GRAFANA_URL_ENV)
    return dataclasses.replace(DEFAULT, RUNBOOK_URL=DEFAULT.RUNBOOK_URL if runbook is None else runbook,
                               GRAFANA_URL=DEFAULT.GRAFANA_URL if grafana is None else grafana)


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
                        help="replace a knob of deploy/prometheus/config.py (a rule variant: needs --out)")
    parser.add_argument("--out", metavar="DIR", help="write the rule files only, into DIR (a variant)")
    args = parser.parse_args(argv)
    try:
        config = configured(args.runbook_url, args.grafana_url, environ)
        overrides = dict(prometheus.parse_override(text, config) for text in args.set)
    except ValueError as error:
        parser.error(str(error))
    out = os.path.abspath(args.out) if args.out else None
    if (overrides or out) and (args.check or out in (None, prometheus.RULES_DIR, prometheus.NODE_EXPORTER_RULES_DIR)):
        parser.error("--set and --out write a variant: give --out DIR (never rules/), and no --check")
    if out:
        os.makedirs(out, exist_ok=True)
        note = prometheus.variant_note(overrides) if overrides else ""
        return write(prometheus.rendered(prometheus.variant(overrides, config), out, note))
    if args.check:
        return report_stale(stale(config), "make generate")
    return write(rendered(config))


if __name__ == "__main__":
    sys.exit(main())
