"""Golden runs: sft, dpo, kd and reward_model (see :data:`tests.golden.runs.RUNS`) on fixed seeds
give the per-step losses (and every other per-step metric recorded) and the final weights that
were recorded in ``tests/golden/<run>.json`` from an earlier commit (see its ``recorded``).

- On a machine with the recorded fingerprint (torch version, CPU capability, architecture,
  CPU model and instruction-set flags):
  bitwise. Every recorded float is the same double, every int the same, and the final
  weights have the same sha256.
- Elsewhere (another torch or CPU kernel set cannot reproduce the bits): every float metric
  within rel 1e-5 (metrics other than losses also within abs 1e-6), and the final weights
  within 1e-5 as far as the recorded per-tensor digests tell (sums, sums of squares, largest
  value, first values).

The assertion message names the comparison that ran. A behaviour-preserving refactor passes
the bitwise comparison unchanged; a deliberate change of numerics re-records the goldens
(``python -m tests.golden.record``, see its docstring) and says why in the commit.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from tests.golden.runs import GOLDEN_DIR, RUNS, build_world, execute, fingerprint, summarize

TOL = 1e-5
"""Approximate comparison: relative tolerance of metrics, absolute tolerance of weights."""
METRIC_ABS_TOL = 1e-6
"""Approximate comparison: absolute floor for metrics other than losses (rewards, margins)."""
FINGERPRINT_KEYS = ("torch", "cpu_capability", "machine", "cpu", "cpu_isa")


def load_golden(name: str) -> dict:
    return json.loads((GOLDEN_DIR / f"{name}.json").read_text())


def _show(value) -> str:
    return f"{value!r} ({value.hex()})" if isinstance(value, float) else repr(value)


def _metric_problems(section: str, recorded: dict, got: dict, bitwise: bool) -> list[str]:
    if recorded.keys() != got.keys():
        return [
            f"{section}: logged steps {sorted(got, key=int)}, recorded {sorted(recorded, key=int)}"
        ]
    problems = []
    for step, want_record in recorded.items():
        got_record = got[step]
        for key, want in want_record.items():
            where = f"{section} step {step} {key}"
            if key not in got_record:
                problems.append(f"{where}: not logged (recorded {_show(want)})")
                continue
            value = got_record[key]
            if isinstance(want, int):
                ok = isinstance(value, int) and value == want
            elif not isinstance(value, (int, float)) or isinstance(value, bool):
                ok = False
            elif bitwise:
                ok = float(value).hex() == want.hex()
            else:
                abs_tol = 0.0 if "loss" in key else METRIC_ABS_TOL
                ok = math.isclose(value, want, rel_tol=TOL, abs_tol=abs_tol)
            if not ok:
                problems.append(f"{where}: got {_show(value)}, recorded {_show(want)}")
    return problems


def _h(x: str) -> float:
    return float.fromhex(x)


def _tensor_problems(name: str, want: dict, got: dict) -> list[str]:
    """Necessary conditions for every element of ``got`` being within :data:`TOL` of
    ``want``'s, from the two digests."""
    if (want["dtype"], want["shape"]) != (got["dtype"], got["shape"]):
        return [f"{name}: {got['dtype']} {got['shape']}, recorded {want['dtype']} {want['shape']}"]
    numel = math.prod(want["shape"])
    slack = 1e-12 * max(numel, 1)  # float64 summation rounding
    bounds = {
        "sum": TOL * numel,
        "abs_sum": TOL * numel,
        "sq_sum": 2 * TOL * _h(want["abs_sum"]) + numel * TOL**2,
        "max_abs": TOL,
    }
    problems = []
    for stat, bound in bounds.items():
        diff = abs(_h(got[stat]) - _h(want[stat]))
        if diff > bound + slack:
            problems.append(
                f"{name} {stat}: got {_h(got[stat])!r}, recorded {_h(want[stat])!r} "
                f"(differ by {diff:.3g} > {bound:.3g})"
            )
    for i, (g, w) in enumerate(zip(got["first"], want["first"])):
        if abs(_h(g) - _h(w)) > TOL:
            problems.append(f"{name}[{i}]: got {_h(g)!r}, recorded {_h(w)!r}")
    return problems


def _weight_problems(label: str, recorded: dict, got: dict, bitwise: bool) -> list[str]:
    want_t, got_t = recorded["tensors"], got["tensors"]
    if want_t.keys() != got_t.keys():
        return [f"{label}: tensors differ: {sorted(want_t.keys() ^ got_t.keys())}"]
    if bitwise:
        if got["sha256"] == recorded["sha256"]:
            return []
        changed = [n for n in want_t if want_t[n] != got_t[n]]
        return [
            f"{label}: sha256 {got['sha256']}, recorded {recorded['sha256']} "
            f"({len(changed)} tensors' digests differ, e.g. {changed[:4]})"
        ]
    return [f"{label}: {p}" for n in want_t for p in _tensor_problems(n, want_t[n], got_t[n])]


def compare(golden: dict, got: dict, bitwise: bool) -> list[str]:
    """What of ``got`` (a :func:`~tests.golden.runs.summarize`) differs from ``golden``:
    bit for bit, or within the tolerances of the approximate comparison; empty if nothing."""
    problems = []
    for key in ("recipe", "config", "overrides"):
        if golden[key] != got[key]:
            problems.append(
                f"the run changed since it was recorded ({key}: {got[key]!r}, recorded "
                f"{golden[key]!r}): record the goldens again from the commit they stand for"
            )
    for section in ("train", "eval"):
        problems += _metric_problems(section, golden[section], got[section], bitwise)
    problems += _weight_problems(
        "final weights", golden["final_weights"], got["final_weights"], bitwise
    )
    return problems


def input_differences(golden: dict, got: dict, bitwise: bool) -> list[str]:
    """Differences of the generated world (data, tokenizer and config files, initial
    weights) from the recorded one: context for a failure (a change of the world, not of
    the training, may explain it)."""
    want, have = golden["inputs"], got["inputs"]
    out = [
        f"input file {f}: sha256 {have['files'].get(f)}, recorded {want['files'].get(f)}"
        for f in sorted(want["files"].keys() | have["files"].keys())
        if want["files"].get(f) != have["files"].get(f)
    ]
    for key, digest in want["initial_weights"].items():
        out += _weight_problems(
            f"initial {key} weights", digest, have["initial_weights"][key], bitwise
        )
    return out


def comparison_mode(golden: dict) -> tuple[bool, str]:
    """(bitwise?, a sentence saying which comparison runs and why)."""
    here = fingerprint()
    recorded = {k: golden["recorded"].get(k) for k in FINGERPRINT_KEYS}
    if recorded == here:
        return True, f"bitwise comparison (this machine's fingerprint {here} is the recorded one)"
    return False, (
        f"approximate comparison: metrics within rel {TOL}, weights within {TOL} (recorded on "
        f"{recorded}, running on {here}: not expected to reproduce the bits)"
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    return build_world(tmp_path_factory.mktemp("golden-world"))


def test_every_run_has_a_golden():
    assert sorted(p.stem for p in GOLDEN_DIR.glob("*.json")) == sorted(RUNS)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_run_equals_golden(name, world, tmp_path):
    golden = load_golden(name)
    bitwise, mode = comparison_mode(golden)
    print(f"{name}: {mode}")
    got = summarize(RUNS[name], world, execute(RUNS[name], world, tmp_path / name))
    problems = compare(golden, got, bitwise)
    if problems:
        context = input_differences(golden, got, bitwise)
        message = [f"{name} differs from its golden; {mode}; recorded from commit "
                   f"{golden['recorded'].get('commit')}:", *problems[:40]]  # fmt: skip
        if len(problems) > 40:
            message.append(f"... and {len(problems) - 40} more")
        if context:
            message += ["the generated world differs too (may explain it):", *context[:10]]
        pytest.fail("\n  ".join(message), pytrace=False)


# -- the comparison can fail --------------------------------------------------------------------


def test_comparison_catches_perturbations():
    """One ulp off a loss fails the bitwise comparison (not the approximate one); 1e-4
    relative off a loss, a metric not logged, a missing step, a weight 2e-5 off (first
    value, or spread over a whole tensor) fail the approximate one; a changed weight hash
    fails the bitwise one."""
    golden = load_golden("sft")
    assert not compare(golden, copy.deepcopy(golden), bitwise=True)
    assert not compare(golden, copy.deepcopy(golden), bitwise=False)

    def perturbed(change) -> dict:
        got = copy.deepcopy(golden)
        change(got)
        return got

    loss = golden["train"]["3"]["loss"]
    one_ulp = perturbed(lambda g: g["train"]["3"].update(loss=math.nextafter(loss, math.inf)))
    assert compare(golden, one_ulp, bitwise=True)
    assert not compare(golden, one_ulp, bitwise=False)
    off = perturbed(lambda g: g["train"]["3"].update(loss=loss * (1 + 1e-4)))
    assert any("train step 3 loss" in p for p in compare(golden, off, bitwise=False))
    assert compare(golden, perturbed(lambda g: g["eval"]["6"].pop("val_loss")), bitwise=False)
    assert compare(golden, perturbed(lambda g: g["train"].pop("6")), bitwise=False)

    name = sorted(golden["final_weights"]["tensors"])[0]

    def nudge_first(g):
        t = g["final_weights"]["tensors"][name]
        t["first"][0] = (_h(t["first"][0]) + 2e-5).hex()

    def shift_all(g):  # every element +2e-5: the sum moves by 2e-5 * numel
        t = g["final_weights"]["tensors"][name]
        t["sum"] = (_h(t["sum"]) + 2e-5 * math.prod(t["shape"])).hex()

    for change in (nudge_first, shift_all):
        assert any(name in p for p in compare(golden, perturbed(change), bitwise=False))
    rehashed = perturbed(lambda g: g["final_weights"].update(sha256="0" * 64))
    assert compare(golden, rehashed, bitwise=True)
