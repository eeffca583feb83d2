"""Session fixtures: one live server with a PEFT adapter loaded, and its in-process twin."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.server.config import ServeConfig
from rollout.server.loading import Served
from tests.server.common import ADAPTER, config, serve, twin, write_adapter


@pytest.fixture(scope="session")
def adapter_dir(tmp_path_factory) -> Path:
    return write_adapter(tmp_path_factory.mktemp("adapter") / ADAPTER)


@pytest.fixture(scope="session")
def served_cfg(adapter_dir) -> ServeConfig:
    return config(adapters=((ADAPTER, str(adapter_dir)),))


@pytest.fixture(scope="session")
def server(served_cfg):
    s = serve(served_cfg)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def reference(served_cfg) -> Served:
    return twin(served_cfg)
