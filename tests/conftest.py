"""Suite-wide settings: one intra-op thread (tiny models run faster without thread hand-off,
and the CI machine has two cores shared by subprocess tests); and the units of work of
``make test``'s two workers (``--dist loadgroup``): a test file is one unit (its module
fixtures are built once), and the files that start a Ray instance (``pytestmark =
pytest.mark.xdist_group(RAY)``) are one unit together, so one Ray instance runs at a time.
"""

import pytest
import torch

RAY = "ray"
"""The ``xdist_group`` of the test files that start Ray."""


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
