"""What the generated files share (rules, dashboards, Kubernetes manifests): checked-in output that
must equal what ``python -m deploy.generate`` writes (CI fails on drift), and one YAML style."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

# The repository, and its folder of the boards' JSON (what Grafana loads, what the ConfigMaps are made of).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DASHBOARDS_DIR = os.path.join(REPO, "dashboards")


class _Dumper(yaml.SafeDumper):
    """Block literals for multi-line strings (PromQL reads as written), folded long lines, keys in order."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    if "\n" in value:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    if len(value) > 100:  # annotations: folded, so a line break never lands inside quotes
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=">")
    return dumper.represent_scalar("tag:yaml.org,2002:str", value)


_Dumper.add_representer(str, _str)


def yaml_text(content: Any) -> str:
    """``content`` as the generated YAML files write it."""
    return yaml.dump(content, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)


def stale_files(files: Mapping[str, str], present: Iterable[str] = ()) -> list[str]:
    """Paths whose checked-in text differs from ``files`` (or is missing), plus ``present`` files
    that the generator no longer writes."""
    out = []
    for path, text in files.items():
        try:
            with open(path, encoding="utf-8") as handle:
                if handle.read() == text:
                    continue
        except FileNotFoundError:
            pass
        out.append(path)
    return sorted(out + sorted(set(present) - set(files)))


def report_stale(paths: list[str], remedy: str) -> int:
    """``--check``: name each stale file and how to fix it; the exit status."""
    for path in paths:
        print(f"stale: {os.path.relpath(path)} (run {remedy})", file=sys.stderr)
    return 1 if paths else 0


def write(files: Mapping[str, str]) -> int:
    for path, text in files.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
        print(f"wrote {os.path.relpath(path)}")
    return 0
