"""Values a config reads with ``${oc.env:...}`` are remembered when resolved and redacted from
every log line we write: shown as ``${oc.env:NAME}``, never as the value."""

from __future__ import annotations

import io

from omegaconf import OmegaConf

from tunesmith.config import plain_config
from tunesmith.config.secrets import SECRET_NAMES_ENV, redact, secret_names, secret_values

TOKEN = "hf_0123456789abcdefTOKEN"


def test_a_resolved_env_value_is_redacted(monkeypatch):
    monkeypatch.setenv("TS_UNIT_TOKEN", TOKEN)
    cfg = OmegaConf.create({"token": "${oc.env:TS_UNIT_TOKEN}", "other": "${oc.env:TS_NONE,x}"})
    assert cfg.token == TOKEN  # the run still gets the value
    assert cfg.other == "x"  # a default is not a secret
    assert redact(f"401 for {TOKEN}!") == "401 for ${oc.env:TS_UNIT_TOKEN}!"
    assert "TS_UNIT_TOKEN" in secret_names() and "TS_NONE" not in secret_names()
    assert plain_config(cfg)["token"] == "${oc.env:TS_UNIT_TOKEN}"  # and it is still recorded
    assert redact(TOKEN) == "${oc.env:TS_UNIT_TOKEN}"


def test_short_values_are_not_redacted(monkeypatch):
    monkeypatch.setenv("TS_UNIT_SHORT", "gloo")
    assert OmegaConf.create({"b": "${oc.env:TS_UNIT_SHORT}"}).b == "gloo"
    assert redact("backend gloo") == "backend gloo"


def test_a_process_that_never_resolves_learns_the_names(monkeypatch):
    monkeypatch.setenv("TS_UNIT_INHERITED", "sk-inherited-0123456789")
    monkeypatch.setenv(SECRET_NAMES_ENV, "TS_UNIT_INHERITED,TS_UNIT_UNSET")
    assert secret_values()["sk-inherited-0123456789"] == "TS_UNIT_INHERITED"
    assert redact("key sk-inherited-0123456789") == "key ${oc.env:TS_UNIT_INHERITED}"


def test_the_torchrun_log_and_the_rank_lines_are_redacted(monkeypatch):
    from tunesmith.cli.launch import _Prefixed
    from tunesmith.cli.torchrun import _RedactingLog

    monkeypatch.setenv("TS_UNIT_RANK", "rank-secret-value-42")
    monkeypatch.setenv(SECRET_NAMES_ENV, "TS_UNIT_RANK")
    file = io.StringIO()
    _RedactingLog(file).write("error: rank-secret-value-42\n")
    _Prefixed(file, "[rank1]: ").write("Traceback: rank-secret-value-42\n")
    assert file.getvalue() == (
        "error: ${oc.env:TS_UNIT_RANK}\n[rank1]: Traceback: ${oc.env:TS_UNIT_RANK}\n"
    )
