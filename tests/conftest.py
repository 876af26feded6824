"""Suite-wide settings: one intra-op thread (tiny models run faster without thread hand-off,
and the CI machine has two cores shared by subprocess tests)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
