"""One natural order for names, shared by gpuio top (GPU rows) and the smart collector (NVMe namespaces)."""

from exporter.sorting import natural_key


def test_numbers_inside_names_compare_as_numbers() -> None:
    assert sorted(["nvme10n1", "nvme2n1", "nvme1n10", "nvme1n2"], key=natural_key) == [
        "nvme1n2", "nvme1n10", "nvme2n1", "nvme10n1"]


def test_gpu_indexes_sort_as_numbers_before_uuids_and_never_compare_a_number_with_text() -> None:
    keys = ["10", "GPU-9f0e", "2", "GPU-10ab", "0"]
    assert sorted(keys, key=natural_key) == ["0", "2", "10", "GPU-9f0e", "GPU-10ab"]
