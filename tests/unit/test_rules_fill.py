"""fill(): the rule sources write PromQL and alert templates as they read, with ``${name}`` placeholders."""

from __future__ import annotations

import pytest

from deploy.prometheus.sources.base import fill


def test_only_braced_names_are_placeholders() -> None:
    template = 'label_replace(${info}{${node}=\'%s\'}, "uuid", "$1", "gpu_uuid", "(.+)") {{ $labels.device }}'
    assert fill(template, info="gpuio_engine_info", node="instance") == (
        "label_replace(gpuio_engine_info{instance='%s'}, \"uuid\", \"$1\", \"gpu_uuid\", \"(.+)\") "
        "{{ $labels.device }}")


@pytest.mark.parametrize("values", [{}, {"metric": "up", "window": "1m"}], ids=["missing", "unused"])
def test_a_placeholder_and_its_value_go_together(values: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="differ"):
        fill("rate(${metric}[5m])", **values)
