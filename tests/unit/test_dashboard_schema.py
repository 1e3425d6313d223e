"""Every generated board validates against Grafana's own dashboard schema, as a Grafana release checks it.

The schemas are Grafana's TypeScript types from the npm package @grafana/schema (generated there from
Grafana's CUE kinds) turned into JSON Schema by ts-json-schema-generator: `make grafana-schema` (part
of `make test`) writes them under dashboards/schema/out/<grafana version>/, one for the oldest Grafana
the boards support and one for the Grafana that docker-compose.yml runs.  Objects are closed: a
misspelt field, a field in the wrong place or a null where Grafana wants an object fails.  Each
panel's options and custom field config are checked against its panel type's own schema too.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk (Python 3.11+) is not installed")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (pip install '.[dev]')")

from deploy.grafana import boards  # noqa: E402
from tests.conftest import REPO  # noqa: E402

SCHEMAS = os.path.join(REPO, "dashboards", "schema", "out")
# The oldest Grafana the boards are built for (the grafana-foundation-sdk build pyproject.toml pins writes
# its schema), and the one docker-compose.yml runs.
VERSIONS = ("10.1", "11.3")
BOARDS = {os.path.basename(path): json.loads(text) for path, text in boards.rendered().items()}


def schema(version: str, name: str) -> dict | None:
    path = os.path.join(SCHEMAS, version, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as file:
        loaded: dict = json.load(file)
    return optional_defaults(loaded)  # type: ignore[return-value]


def optional_defaults(node: object) -> object:
    """The schema with no required fields.  The TypeScript types mark required every field that has a
    default in Grafana's CUE kind, and Grafana fills those in on load; and one version's defaulted field
    is the next one's unknown field (10.1 defaults the dashboard's `style` and a variable's `id`, 11.3
    has neither; 11.3 defaults the stat panel's `wideLayout`, which 10.1 rejects).  So what is checked,
    against both, is what is written: closed objects, types, enums."""
    if isinstance(node, dict):
        return {key: optional_defaults(value) for key, value in node.items() if key != "required"}
    if isinstance(node, list):
        return [optional_defaults(value) for value in node]
    return node


def errors(instance: object, against: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(against)
    found = []
    for error in validator.iter_errors(instance):
        for leaf in error.context or [error]:
            found.append(f"{'/'.join(str(part) for part in leaf.absolute_path)}: {leaf.message[:300]}")
    return found


@pytest.fixture(params=VERSIONS)
def version(request: pytest.FixtureRequest) -> str:
    if schema(request.param, "dashboard") is None:
        pytest.skip(f"Grafana {request.param}'s dashboard schema is not built: run `make grafana-schema` "
                    "(npm ci in dashboards/schema)")
    return str(request.param)


def panels(board: dict) -> list[dict]:
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_board_validates_against_grafanas_dashboard_schema(name: str, version: str) -> None:
    assert errors(BOARDS[name], schema(version, "dashboard") or {}) == []


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_panel_options_validate_against_their_panel_types_schema(name: str, version: str) -> None:
    found = []
    for panel in panels(BOARDS[name]):
        if panel["type"] == "row":
            continue
        options = schema(version, f"{panel['type']}.Options")
        assert options is not None, f"{panel['type']}: no schema built for this panel type (dashboards/schema)"
        found += [f"{panel['title']}: options/{error}" for error in errors(panel.get("options"), options)]
        custom = schema(version, f"{panel['type']}.FieldConfig")
        if custom is not None and "custom" in panel.get("fieldConfig", {}).get("defaults", {}):
            found += [f"{panel['title']}: custom/{error}"
                      for error in errors(panel["fieldConfig"]["defaults"]["custom"], custom)]
    assert found == []
