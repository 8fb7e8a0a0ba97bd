"""device_ids and output_device read as DDP reads them (torch's _get_device_index): a device without an index is
the current one of its type. The current device is set by hand: these need no GPU."""

import pytest
import torch

from hsync.compat import check_device_ids

ON_CUDA_1 = torch.device("cuda", 1)  # where the module's parameters are


@pytest.mark.parametrize("given", ["cuda", torch.device("cuda"), "cuda:1", torch.device("cuda", 1), 1])
def test_a_device_without_an_index_is_the_current_one(monkeypatch, given):
    # upstream test_DistributedDataParallel passes output_device=torch.device("cuda") on every rank.
    monkeypatch.setattr(torch._utils, "_get_current_device_index", lambda: 1)
    assert check_device_ids([given], given, ON_CUDA_1) == ([1], 1)


def test_a_device_without_an_index_is_refused_when_the_current_one_is_not_the_modules(monkeypatch):
    monkeypatch.setattr(torch._utils, "_get_current_device_index", lambda: 0)
    with pytest.raises(ValueError, match=r"device_ids \['cuda'\] name another device than the module's parameters"):
        check_device_ids(["cuda"], None, ON_CUDA_1)
