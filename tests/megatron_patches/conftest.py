"""Megatron tests run TP=1 in the pytest process: a world of one (gloo) for this package's tests only,
torn down afterwards so other test packages find torch.distributed as they left it."""

import warnings

import pytest

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")


@pytest.fixture(scope="package", autouse=True)
def tp1_world():
    from megatron_patches.parallel import single_process

    with single_process():
        yield
