"""exporter/thresholds.py: the judgements `gpuio top` and the rules share (device classes, work waiting)."""

from __future__ import annotations

import pytest

from exporter import thresholds as th


@pytest.mark.parametrize(("device", "rotational", "klass"), [
    ("nvme0n1", "0", th.NVME), ("nvme1n1p2", "0", th.NVME), ("rbd0", "0", th.NETWORK), ("nbd3", "1", th.NETWORK),
    ("sda", "0", th.SOLID_STATE), ("vdb", "0", th.SOLID_STATE), ("sdb", "1", th.ROTATIONAL),
    ("md0", "", th.ROTATIONAL), ("loop0", "1", th.ROTATIONAL), (None, "0", th.SOLID_STATE),
])
def test_disk_class_by_name_then_rotational_flag(device: str | None, rotational: str, klass: str) -> None:
    assert th.disk_class(rotational, device) == klass


def test_nvme_judged_by_its_own_limits() -> None:
    """8 ms with a deep queue: normal load for a SATA SSD (limit 10 ms), saturation on NVMe (5 ms)."""
    args = (100.0, None, 0.008, None, 20.0, False)
    assert th.SATURATED not in th.DEFAULT.disk_flags("0", *args, device="sda")
    assert th.SATURATED in th.DEFAULT.disk_flags("0", *args, device="nvme0n1")


def test_a_request_in_flight_is_not_work_waiting() -> None:
    """A spare replica or light traffic: one or two requests in flight, no pool wait: idle, not starved."""
    assert not th.DEFAULT.engine_starved(0.05, True, in_flight=2, pool_wait=0.0005, contexts=4)
    assert not th.DEFAULT.engine_starved(0.05, True, in_flight=1, pool_wait=None)  # no pool: in flight says nothing
    assert th.DEFAULT.engine_starved(0.05, True, in_flight=4, pool_wait=None, contexts=4)  # every context busy
    assert th.DEFAULT.engine_starved(0.05, True, in_flight=0, pool_wait=0.2)  # requests wait for a context
    assert not th.DEFAULT.engine_starved(0.9, True, in_flight=4, pool_wait=0.2, contexts=4)  # the GPU is busy
    assert not th.DEFAULT.engine_starved(0.05, False, in_flight=4, pool_wait=0.2, contexts=4)  # the disk is fine


def test_sm_activity_decides_idle_where_gpm_measures_it() -> None:
    """NVML busy 100 % with 1 % of the SMs working (one spinning block, weights crossing PCIe): idle."""
    assert th.DEFAULT.gpu_idle(1.0, 0.01) and not th.DEFAULT.gpu_idle(1.0, 0.5)
    assert th.DEFAULT.gpu_idle(0.2, 0.15)  # kernels 20 % of the time: idle by busy, whatever SM activity says
    assert th.DEFAULT.gpu_idle(None, 0.01)  # a GPU in MIG mode has no busy
    assert th.DEFAULT.gpu_idle(0.2, None) and not th.DEFAULT.gpu_idle(1.0, None)  # no GPM: NVML busy decides
    assert th.DEFAULT.engine_starved(1.0, True, in_flight=4, pool_wait=0.2, contexts=4, gpu_sm_active=0.01)
    assert not th.DEFAULT.engine_starved(1.0, True, in_flight=4, pool_wait=0.2, contexts=4)
