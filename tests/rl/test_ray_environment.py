"""What the async GRPO pipeline gives its Ray workers and how it joins a cluster, without
starting Ray: the workers' environment (a safe import path, the opt-ins passed on, a
``PYTHONPATH`` without the working folder), the runtime environment refused again where the
actors are made (the Python API skips the config check), and ``ray.address`` checked before
``ray.init`` (the end-to-end cases are in ``tests/faults/test_ray_safety.py``)."""

from __future__ import annotations

import os
import socket
import time

import pytest

from tunesmith.config import ALLOW_ANY_COMPONENT_ENV
from tunesmith.rl.asynchronous.pipeline import (
    ALLOW_RUNTIME_ENV_ENV,
    _worker_env,
    init_ray,
    ray_address_problem,
    require_ray,
    runtime_env,
)


@pytest.fixture
def no_opt_in(monkeypatch) -> None:
    for name in (ALLOW_ANY_COMPONENT_ENV, ALLOW_RUNTIME_ENV_ENV):
        monkeypatch.delenv(name, raising=False)


def test_workers_get_a_safe_path_and_no_working_folder(monkeypatch, tmp_path, no_opt_in):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", f"::mine:{os.sep}opt{os.sep}mods:")
    env = _worker_env()
    assert env["PYTHONSAFEPATH"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [
        str(tmp_path / "mine"),
        f"{os.sep}opt{os.sep}mods",
    ]
    assert ALLOW_ANY_COMPONENT_ENV not in env and ALLOW_RUNTIME_ENV_ENV not in env
    monkeypatch.delenv("PYTHONPATH")
    assert _worker_env()["PYTHONPATH"] == ""  # never the working folder


@pytest.mark.parametrize("name", [ALLOW_ANY_COMPONENT_ENV, ALLOW_RUNTIME_ENV_ENV])
def test_the_opt_ins_reach_the_workers(monkeypatch, name, no_opt_in):
    monkeypatch.setenv(name, "1")
    assert _worker_env()[name] == "1"


def test_a_runtime_env_is_refused_where_the_actors_are_made(monkeypatch, no_opt_in):
    with pytest.raises(ValueError, match=r"^reward_workers\.runtime_env\.pip: a Ray runtime"):
        runtime_env({"runtime_env": {"pip": ["evil"]}}, "reward_workers")
    assert runtime_env({"runtime_env": {}}, "rollout")["env_vars"]["PYTHONSAFEPATH"] == "1"
    monkeypatch.setenv(ALLOW_RUNTIME_ENV_ENV, "1")
    env = runtime_env({"runtime_env": {"pip": ["vllm"], "env_vars": {"A": "b"}}}, "rollout")
    assert env["pip"] == ["vllm"] and env["env_vars"]["A"] == "b"
    assert env["env_vars"]["PYTHONSAFEPATH"] == "1"


@pytest.mark.parametrize(
    ("address", "ok"),
    [
        (None, True),
        ("auto", True),
        ("10.0.0.5:6379", True),
        ("ray://head:10001", True),
        ("[::1]:6379", True),
        ("head-node", False),
        ("head:port", False),
        ("head:0", False),
        (6379, False),
    ],
)
def test_ray_address_forms(address, ok):
    assert (ray_address_problem(address) is None) == ok


def test_a_closed_port_is_refused_before_ray_init(no_opt_in):
    ray = require_ray()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(
        ConnectionError, match=rf"^ray\.address: 127\.0\.0\.1:{port}: cannot connect"
    ):
        init_ray(ray, {"address": f"127.0.0.1:{port}", "connect_timeout_s": 5})
    assert time.monotonic() - start < 5 and not ray.is_initialized()
