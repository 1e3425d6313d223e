"""Discovery of engines from /proc: the names of the layouts servers use, the model patterns, NVML's
process list as discovery reads it, and the one engine model both sources feed (the processes
themselves: tests/e2e/test_discovery.py)."""

from __future__ import annotations

import copy

import pytest

from exporter.context import GpuProcesses
from exporter.engines import discovery, model
from exporter.engines.discovery import engine_identity
from exporter.pods.attribution import PodAttribution
from gpuio import spool as spool_format


@pytest.mark.parametrize(("path", "identity"), [
    ("/models/resnet50/1/model.plan", ("resnet50", "1")),
    ("/models/bert/12/model.onnx", ("bert", "12")),
    ("/srv/llama-3-8b/model-00001-of-00004.safetensors", ("llama-3-8b", "")),
    ("/srv/llama-3-8b/pytorch_model.bin", ("llama-3-8b", "")),
    ("/engines/gpt-tp2/rank1.engine", ("gpt-tp2", "")),
    ("/models/ranker.engine", ("ranker", "")),
    ("/models/resnet50/1/weights.plan", ("1", "")),  # a generic name in a version directory: its directory
    ("/data/ranker-v2.plan", ("ranker-v2", "")),
])
def test_engine_names_follow_the_layouts_servers_use(path: str, identity: tuple[str, str]) -> None:
    assert engine_identity(path) == identity


def test_patterns_match_file_names_only() -> None:
    assert discovery.parse_patterns(" *.plan, *.onnx ") == ("*.plan", "*.onnx")
    for bad in ("", " , ", "/models/*.plan"):
        with pytest.raises(ValueError):
            discovery.parse_patterns(bad)
    matches = discovery.pattern_matcher(discovery.MODEL_PATTERNS)
    assert matches("model.plan") and matches("x.safetensors") and not matches("config.pbtxt")
    assert not matches("pytorch_model.bin") and not matches("distutils-precedence.pth")  # opt-in: ambiguous
    assert discovery.pattern_matcher(discovery.parse_patterns("*.bin"))("pytorch_model.bin")


def test_a_process_on_several_gpus_is_on_none_of_them() -> None:
    """One Triton server holds a context on every GPU: which GPU a model is for cannot be told from NVML's
    process list, so the process has no single GPU (its engines show gpu_uuid="")."""
    gpus = GpuProcesses()
    gpus.update([((10, 5), "GPU-a"), ((11, 6), "GPU-a"), ((11, 6), "GPU-b"), ((12, 0), "GPU-c")])
    assert gpus.get(10, 5) == "GPU-a" and gpus.get(11, 6) is None
    assert gpus.processes() == {(10, 5), (11, 6)}  # the start time 0 (not read) is no process this exporter names
    gpus.update({(10, 5): "GPU-b"})
    assert gpus.get(10, 5) == "GPU-b" and gpus.processes() == {(10, 5)}


def test_discovered_engines_join_the_spools_without_changing_it() -> None:
    """model.combined adds discovered totals to the spool's; the spool's merge (reused between reads) is
    left as it was, and discovered processes are counted apart."""
    size = spool_format.ENGINE_LAYOUT.size
    spool = model.Totals(engines={"ranker": [1.0] * size}, processes={"ranker": 2},
                      loads={("ranker", "GPU-a", (8, 1)): [1.0, 100.0, 50.0]},
                      abandoned={("ranker", "GPU-a"): 1.0})
    before = copy.deepcopy(spool)
    found = model.Totals(engines={"ranker": [2.0] * size, "resnet50": [0.0] * size},
                      processes={"resnet50": 1, "ranker": 1},
                      loads={("ranker", "GPU-a", (8, 1)): [2.0, 10.0, 40.0]},
                      abandoned={("ranker", "GPU-a"): 3.0, ("resnet50", ""): 1.0},
                      pods={("resnet50", ""): {model.PodIdentity(pod_uid="u-1")}})
    both = model.combined(spool, found)
    assert spool == before
    assert both.engines["ranker"] == [3.0] * size and "resnet50" in both.engines
    assert both.loads[("ranker", "GPU-a", (8, 1))] == [3.0, 110.0, 40.0]  # the oldest start of both
    assert both.abandoned == {("ranker", "GPU-a"): 4.0, ("resnet50", ""): 1.0}
    assert both.processes == {"ranker": 2} and both.discovered_processes == {"resnet50": 1, "ranker": 1}
    assert model.combined(spool, model.Totals()) is spool  # nothing found: the spool's own


def test_pods_that_serve_engines_include_those_discovery_found() -> None:
    pods = PodAttribution()
    pods.update_writer_pods([("u-spool", "ml", "ranker-0")])
    pods.set_discovered_pods(["u-triton", ""])
    assert pods.writer_pod_uids() == {"u-spool", "u-triton"}
