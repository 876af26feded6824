"""Suite-wide settings: one intra-op thread (tiny models run faster without thread hand-off,
and the CI machine has two cores shared by subprocess tests)."""

import os

import pytest
import torch

# The Ray instances the tests start (here, in forked children and in subprocesses) prestart no
# idle workers: every tunesmith actor has a runtime_env of its own, so Ray never hands it one
# of those; they only took CPU from the run that was starting (about 3 s per instance here).
os.environ.setdefault("RAY_enable_worker_prestart", "0")
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")


@pytest.fixture(autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
