"""Doctest settings: each docstring example of ``tunesmith/`` runs in an empty temporary
folder (so ``runs/exp1`` or ``out/`` in an example land there, never in the repository), on
one intra-op thread, with torch's and Python's random state put back after it; it fails if
it leaves ``os.environ`` or torch's default dtype changed (both are put back first, so the
next test starts clean).
"""

import os
import random

import pytest
import torch

# Set by pytest itself, and by torch the first time it looks up its compile cache folder.
NOT_STATE = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}


@pytest.fixture(autouse=True)
def _doctest_sandbox(request):
    if not isinstance(request.node, pytest.DoctestItem):
        yield
        return
    request.getfixturevalue("monkeypatch").chdir(request.getfixturevalue("tmp_path"))
    environ, dtype, threads = dict(os.environ), torch.get_default_dtype(), torch.get_num_threads()
    rng, py_rng = torch.random.get_rng_state(), random.getstate()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.random.set_rng_state(rng)
    random.setstate(py_rng)
    changed = _restore_environ(environ)
    left_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    assert not changed, f"{request.node.name}: the example left os.environ changed: {changed}"
    assert left_dtype == dtype, f"{request.node.name}: the example left default dtype {left_dtype}"


def _restore_environ(saved: dict[str, str]) -> list[str]:
    """Put ``os.environ`` back to ``saved``; return the names that differed."""
    changed = sorted(
        k
        for k in saved.keys() | os.environ.keys()
        if saved.get(k) != os.environ.get(k) and k not in NOT_STATE
    )
    for key in changed:
        if key in saved:
            os.environ[key] = saved[key]
        else:
            del os.environ[key]
    return changed
