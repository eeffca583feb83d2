import threading

import pytest

from tests.rewards.plugins import bad


@pytest.fixture(autouse=True)
def release_hung_plugins():
    """Free any plugin thread a test left hanging, and re-arm for the next test."""
    yield
    bad.release.set()
    bad.release = threading.Event()
