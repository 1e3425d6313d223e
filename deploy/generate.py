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
(never into the repository), all from the same config, so a panel's threshold and its runbook say what the
alert fires on: the rules in DIR, the same rules in node_exporter mode in DIR/rules-node-exporter, the
boards in DIR/dashboards, the runbooks in DIR/runbooks, and with --image the Kubernetes objects in
DIR/kubernetes.  An installed gpuio-exporter does the same with `gpuio generate` (INSTALLED_HELP):

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

from . import fleet_view
from .generated import DASHBOARDS_DIR, REPO, report_stale, stale_files, write
from .kubernetes import generate as kubernetes
from .kubernetes import render
from .kubernetes import variant as kubernetes_variant
from .prometheus import generate as prometheus
from .prometheus import runbooks
from .prometheus.config import DEFAULT, GRAFANA_URL_ENV, KNOBS, RUNBOOK_URL_ENV, Config
from .prometheus.sources import rule_files
from .victoriametrics import vmalert

INSTALLED_HELP = """\
gpuio's rules, boards, runbooks and Kubernetes objects under your own config, from the installed package:

    gpuio generate --set IO_PRESSURE_FULL=0.2 --set STORM_PAGE_FOR=3m --out DIR \\
        [--runbook-url 'https://wiki.example.com/gpuio/{alert}'] [--grafana-url https://grafana.example.com] \\
        [--image registry.example/gpuio-exporter:0.1.0 [--component discovery] [--without-operator]] \\
        [--vmalert-shards 4]

DIR gets:
  *.yml                       the Prometheus rules (gpuio's own disk collector); load DIR/*.yml
  rules-node-exporter/*.yml   the same rules reading node_exporter's disk series, for an exporter run with
                              --no-collector.diskstats beside a node_exporter; load these instead
  vmalert/                    the same rules as vmalert evaluates them best (each group's chain folded), and
                              vmalert/rules-node-exporter/; with --vmalert-shards N one copy per shard of the
                              nodes (vmalert/shard-K/) and vmalert/scrape.yml, which labels each node's shard
  dashboards/*.json           the Grafana boards, their thresholds the alerts' (import, or provision)
  cells/fleet-keep.yml        the series the Fleet board reads, as a keep relabeling: what each cell of a
                              large fleet forwards to the central store (vmagent's -remoteWrite.urlRelabelConfig,
                              or a Prometheus remote_write's write_relabel_configs)
  runbooks/*.md               the runbooks, quoting your numbers (publish them; --runbook-url links them)
  kubernetes/                 with --image: a kustomization with your image, rules and boards
                              (kubectl apply -k DIR/kubernetes)

--knobs lists every knob with its default (what each does: docs/deploy.md, "Your own thresholds").  A knob
is a number, a Prometheus duration (30s, 2m, 1h), text or true/false; a misspelt one is refused with the
closest name.
"""


def boards(config: Config, directory: str | None = None) -> dict[str, str]:
    """Path of each dashboard's JSON -> its text under ``config`` (in dashboards/, or ``directory``).
    Imported here: only the boards need the Grafana SDK (Python 3.11+)."""
    from .grafana import boards

    return boards.rendered(config, directory or DASHBOARDS_DIR)


def rendered(config: Config = DEFAULT) -> dict[str, str]:
    """Every generated file of the repository -> its text, from one config."""
    files = prometheus.rendered(config)
    files.update(prometheus.rendered_node_exporter_mode(config))
    files.update(vmalert.rendered(config))
    files.update(runbooks.rendered(config))
    json_files = boards(config)
    files.update(json_files)
    files.update(fleet_view.rendered(json_files))
    files.update(kubernetes.rendered(rule_files(config), [os.path.basename(path) for path in json_files],
                                     rule_files(prometheus.node_exporter_mode(config))))
    return files


def stray(files: Mapping[str, str]) -> list[str]:
    """Generated-looking files nobody generates any more (a removed rule file or board)."""
    present = [os.path.join(directory, name)
               for directory in (prometheus.RULES_DIR, prometheus.NODE_EXPORTER_RULES_DIR, vmalert.RULES_DIR,
                                 vmalert.NODE_EXPORTER_RULES_DIR) if os.path.isdir(directory)
               for name in os.listdir(directory) if name.endswith(".yml")]
    present += [os.path.join(DASHBOARDS_DIR, name) for name in os.listdir(DASHBOARDS_DIR) if name.endswith(".json")]
    present += glob.glob(os.path.join(kubernetes.NODE_EXPORTER_COMPONENT, "prometheusrule-*.yaml"))
    present += glob.glob(os.path.join(runbooks.RUNBOOKS_DIR, "*.md"))
    return [path for path in present if path not in files]


def stale(config: Config = DEFAULT) -> list[str]:
    files = rendered(config)
    return stale_files(files, stray(files))


# DIR/rules-node-exporter: the rules in node_exporter mode (the repository's deploy/prometheus/rules-node-exporter).
NODE_EXPORTER_RULES = os.path.basename(prometheus.NODE_EXPORTER_RULES_DIR)

# Where --out must never point: the checked-in rules, and the repository (whose dashboards/ it would overwrite).
REPOSITORY_OUTPUTS = (prometheus.RULES_DIR, prometheus.NODE_EXPORTER_RULES_DIR, vmalert.RULES_DIR,
                      vmalert.NODE_EXPORTER_RULES_DIR, REPO)
# DIR/vmalert: the rules as vmalert evaluates them best (deploy/victoriametrics/vmalert.py).
VMALERT = "vmalert"
# DIR/cells: what a cell forwards to the central store (a folder of its own: DIR/*.yml are rule files).
CELLS = "cells"


@dataclasses.dataclass(frozen=True)
class KubernetesOut:
    """What ``--image`` asks for: DIR/kubernetes with this image and these components."""

    image: str
    components: tuple[str, ...] = ()
    without_operator: bool = False


def variant_files(config: Config, out: str, note: str, with_boards: bool = True,
                  objects: KubernetesOut | None = None, vmalert_shards: int = 0) -> dict[str, str]:
    """What ``--out DIR`` writes, all from one config: the rules in DIR, the same in node_exporter mode in
    DIR/rules-node-exporter, vmalert's copies of both in DIR/vmalert (one per shard with ``vmalert_shards``),
    the boards in DIR/dashboards, the runbooks in DIR/runbooks, and with ``objects`` the Kubernetes
    kustomization in DIR/kubernetes."""
    files = prometheus.rendered(config, out, note)
    node_exporter_mode = prometheus.node_exporter_mode(config)
    node_exporter_note = "; ".join(filter(None, (prometheus.NODE_EXPORTER_NOTE, note)))
    files.update(prometheus.rendered(node_exporter_mode, os.path.join(out, NODE_EXPORTER_RULES), node_exporter_note))
    files.update(vmalert.rendered(config, os.path.join(out, VMALERT), os.path.join(out, VMALERT, NODE_EXPORTER_RULES),
                                  vmalert_shards, note))
    boards_dir = os.path.join(out, "dashboards")
    json_files = boards(config, boards_dir) if with_boards else {}
    files.update(json_files)
    if json_files:
        files.update(fleet_view.rendered(json_files, os.path.join(out, CELLS, fleet_view.FILE)))
    files.update(runbooks.rendered(config, os.path.join(out, "runbooks")))
    if objects is not None:
        files.update(kubernetes_variant.rendered(
            os.path.join(out, "kubernetes"), objects.image, objects.components, objects.without_operator,
            rule_files(config), rule_files(node_exporter_mode), json_files, boards_dir))
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


def knob_list(config: Config = DEFAULT) -> str:
    """``NAME=default`` for every knob ``--set`` can replace (lists and mappings are not replaceable)."""
    lines = []
    for name in sorted(KNOBS):
        value = getattr(config, name)
        if isinstance(value, bool):
            lines.append(f"{name}={'true' if value else 'false'}")
        elif isinstance(value, int | float | str):
            lines.append(f"{name}={value}")
    return "\n".join(lines) + "\n"


def parser_for(prog: str, installed: bool) -> argparse.ArgumentParser:
    """The flags of ``python -m deploy.generate`` (a checkout: the repository's files, or --out) and of
    ``gpuio generate`` (an install: no repository, so --out is required and --check is not offered)."""
    parser = argparse.ArgumentParser(prog=prog, description=INSTALLED_HELP if installed else __doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if not installed:
        parser.add_argument("--check", action="store_true", help="report stale files instead of writing them")
    parser.add_argument("--runbook-url", metavar="TEMPLATE",
                        help=f"runbook_url of every alert, {{alert}} replaced by its name (env {RUNBOOK_URL_ENV}; "
                             f"default {DEFAULT.RUNBOOK_URL})")
    parser.add_argument("--grafana-url", metavar="URL",
                        help=f"your Grafana, the base of every dashboard_url (env {GRAFANA_URL_ENV}; "
                             f"default: none, the link is a path on your Grafana)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="replace a knob of the rules' config (deploy/prometheus/config.py; repeatable; needs "
                             "--out): a number, a Prometheus duration, text or true/false")
    parser.add_argument("--out", metavar="DIR", required=installed,
                        help="write the rules into DIR, node_exporter mode's into DIR/rules-node-exporter, the "
                             "boards into DIR/dashboards, the runbooks into DIR/runbooks (not the repository's)")
    parser.add_argument("--vmalert-shards", type=int, default=0, metavar="N",
                        help="write DIR/vmalert as N copies, one per vmalert shard of the nodes (DIR/vmalert/shard-K),"
                             " and DIR/vmalert/scrape.yml, the scrape configuration that labels each node's shard "
                             "(deploy/victoriametrics/README.md, \"Sharding vmalert\")")
    parser.add_argument("--knobs", action="store_true", help="list every knob --set takes, with its default")
    parser.add_argument("--no-boards", action="store_true",
                        help="leave the boards out (they need Python 3.11+, for Grafana's SDK)")
    parser.add_argument("--image", metavar="REF",
                        help="also write DIR/kubernetes, a kustomization with this exporter image (kubectl apply -k "
                             "DIR/kubernetes), e.g. registry.example/gpuio-exporter:0.1.0")
    parser.add_argument("--component", action="append", default=[], metavar="NAME",
                        help="with --image: an opt-in component (repeatable, or comma-separated): "
                             + ", ".join(render.COMPONENTS))
    parser.add_argument("--without-operator", action="store_true",
                        help="with --image: no ServiceMonitor or PrometheusRule (no Prometheus Operator CRDs)")
    return parser


def kubernetes_out(args: argparse.Namespace) -> KubernetesOut | None:
    """--image and its companions, checked as `make kubernetes` checks them; ValueError names what is wrong."""
    if args.image is None:
        if args.component or args.without_operator:
            raise ValueError("--component and --without-operator shape the Kubernetes objects: give --image too")
        return None
    render.check_image(args.image)
    return KubernetesOut(args.image, tuple(render.chosen_components(args.component)), args.without_operator)


def main(argv: list[str] | None = None, environ: Mapping[str, str] = os.environ,
         prog: str = "python -m deploy.generate", installed: bool = False) -> int:
    parser = parser_for(prog, installed)
    if "--knobs" in (sys.argv[1:] if argv is None else argv):
        print(knob_list(), end="")  # before parsing: --out is not needed to read the list
        return 0
    args = parser.parse_args(argv)
    try:
        config = configured(args.runbook_url, args.grafana_url, environ)
        for text in args.set:
            check_knob_name(text)
        overrides = dict(prometheus.parse_override(text, config) for text in args.set)
        objects = kubernetes_out(args)
    except ValueError as error:
        parser.error(str(error))
    out = os.path.abspath(args.out) if args.out else None
    check = getattr(args, "check", False)
    if args.vmalert_shards < 0 or args.vmalert_shards == 1:
        parser.error(f"--vmalert-shards {args.vmalert_shards}: give 2 or more (one vmalert needs no shards)")
    variant_only = overrides or objects or args.no_boards or args.vmalert_shards
    if (variant_only or out) and (check or out in (None, *REPOSITORY_OUTPUTS)):
        parser.error("--set, --image, --vmalert-shards and --no-boards write your own variant: give --out DIR "
                     "(never rules/ or the repository itself), and no --check")
    if not out:
        return report_stale(stale(config), "make generate") if check else write(rendered(config))
    if overrides and config.RUNBOOK_URL == DEFAULT.RUNBOOK_URL:
        # The alerts would link the repository's runbooks, which quote the default numbers.
        print(f"note: the alerts' runbook_url is {DEFAULT.RUNBOOK_URL}, the pages of the default config; "
              f"publish {os.path.join(args.out, 'runbooks')} and give --runbook-url", file=sys.stderr)
    note = prometheus.variant_note(overrides) if overrides else ""
    try:
        files = variant_files(prometheus.variant(overrides, config), out, note, not args.no_boards, objects,
                              args.vmalert_shards)
    except ModuleNotFoundError as error:
        if error.name is None or not error.name.startswith("grafana_foundation_sdk"):
            raise
        parser.error(f"the boards need Grafana's SDK (grafana-foundation-sdk, Python 3.11 or later; this is "
                     f"Python {sys.version_info.major}.{sys.version_info.minor}): run it with Python 3.11+, "
                     f"or give --no-boards for the rules, runbooks and Kubernetes objects alone")
    return write(files)


if __name__ == "__main__":
    sys.exit(main())
