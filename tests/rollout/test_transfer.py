"""rollout/transfer.py: `host_tensor` is `torch.tensor` (values, dtype and shape) for every list the engine
hands it, the typed-buffer fast path for flat and rectangular int / float lists included, and torch's own
rules (and errors) for the rest."""

import pytest
import torch

from rollout.transfer import host_tensor, to_device

CASES = [
    [1, 2, 3],
    [[1, 2], [3, 4]],
    [1.5, 2],
    [1, 2.5],
    [True, False],
    [True, 1],
    [1.0, True],
    [[1, 2], [3]],
    [],
    [[]],
    [2**70],
    [[1, 2], [3, True]],
    [[1.0, 2], [3, 4]],
    [[1, 2], [3, 4.5]],
    [-(2**63)],
]


@pytest.mark.parametrize("values", CASES, ids=range(len(CASES)))
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.float64, torch.long, torch.int32, torch.bool])
def test_host_tensor_is_torch_tensor(values, dtype):
    try:
        want = torch.tensor(values, dtype=dtype)
    except (TypeError, ValueError, RuntimeError) as e:
        with pytest.raises(type(e)):
            host_tensor(values, dtype)
        return
    got = host_tensor(values, dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_to_device_keeps_its_values_after_the_list_is_gone():
    values = list(range(1000))
    t = to_device(values, "cpu")
    values[:] = [0] * 1000
    del values
    assert t.tolist() == list(range(1000))
