"""Render RELIABILITY.md from the fault suite's catalogue and its recorded outcomes.

    make test-faults                       # runs the suite, records benchmarks/results/reliability.json
    python -m tests.faults.report          # -> RELIABILITY.md
    python -m tests.faults.report --check  # exit 1 if RELIABILITY.md is not what it would render

Every catalogue case is a row (a case without a recorded outcome shows "not run"), and the
summary counts faults injected and survived, checkpoints lost, bad inputs tried and refused.
``test_reliability_report.py`` checks that the committed file is up to date.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.faults.catalogue import CASES, CI_SIGKILL_SEEDS, GROUPS, SIGKILL_SEEDS, Case

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "reliability.json"
OUTPUT = ROOT / "RELIABILITY.md"

TITLES = {
    "fault": "Faults: processes killed, stopped, starved",
    "bad_input": "Bad inputs",
    "safety": "Safe loading: nothing runs code unless the user says so",
    "determinism": "Determinism",
}

# Safety kinds that are not attempts to run code: a component built with the opt-in flag, and
# the scan of the package source. They are counted on a line of their own.
NOT_REFUSALS = ("opt-in", "static")
# Safety kinds counted on lines of their own: model-written code trying to leave the sandbox, and
# files planted to redirect what a run writes (or secrets that would reach its logs).
SANDBOX = ("sandbox-escape",)
FILES = ("symlink", "hardlink", "secret")
# Bad inputs that hung or exhausted memory before: each must end within the bound its case states.
BOUNDED = ("hang", "size")

GPU_DETERMINISM = """\
## Determinism on GPUs

On CPU a fixed `seed` gives bitwise identical runs (checked above; the resume tests also compare
resumed and uninterrupted runs bitwise). tunesmith sets no global determinism switches, so on
GPUs the following make two runs of the same config differ in the last bits (never in
correctness); set the remedies in your launcher when you need bitwise reproducibility:

| setting | what varies | remedy |
|---|---|---|
| PyTorch's default (non-deterministic) CUDA kernels | kernels that accumulate with atomics add in a different order each run: embedding backward, `index_add_`/`scatter_add_` (MoE token routing), some loss backward paths | `torch.use_deterministic_algorithms(True)` and `CUBLAS_WORKSPACE_CONFIG=:4096:8` (slower; ops without a deterministic kernel raise) |
| memory-efficient / flash SDPA backward | the query gradient is reduced in parallel over key blocks | the math SDPA backend, or the switch above (slower) |
| `torch.backends.cudnn.benchmark = True`, `compile: {mode: max-autotune}` | kernels are picked by timing, which changes between runs | benchmark off, the default compile mode |
| more than one GPU: NCCL algorithm, protocol, topology, world size | all-reduce and reduce-scatter sum in another order | the same world size and topology, pinned `NCCL_ALGO` / `NCCL_PROTO` |

Not run-to-run nondeterminism, but different bits from a CPU or fp32 run: TF32 matmuls
(`torch.backends.cuda.matmul.allow_tf32`), `mixed_precision: bf16`, and `compile: true` (fused
kernels round differently from eager ones); each is repeatable on the same machine and setup.
"""


def _code(text: str) -> str:
    """``text`` as an inline code span safe inside a table cell."""
    return "`" + str(text).replace("`", "'").replace("|", "\\|").replace("\n", " ") + "`"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _detail(case: Case, result: Mapping[str, Any]) -> str:
    """What the recorded outcome says, in a few words."""
    try:
        return _known_detail(case, result)
    except KeyError:  # recorded without the usual details
        return _cell(
            ", ".join(f"{k}: {v}" for k, v in result.items() if k not in ("passed", "seconds"))
        )


def _known_detail(case: Case, r: Mapping[str, Any]) -> str:
    if case.kind == "sigkill":
        kept = ", ".join(r["checkpoints_left"]) or "none"
        return (
            f"killed at {_code(r['killed_at'])} ({r['phase']}); checkpoints left: {kept}; "
            f"resumed from {r['resumed_from']}; lost: {r['lost_checkpoints']}"
        )
    if case.kind == "sigterm":
        return f"exit 0, {r['seconds_to_exit']} s after the signal; newest checkpoint {r['checkpoint']}"
    if case.kind == "disk_full":
        return f"{r['mechanism']}: {_code(r['error'])}; lost: {r['lost_checkpoints']}"
    if case.kind == "rank_death":
        after = r.get("seconds_after_fault", r.get("seconds"))
        return f"exit 1 after {after} s: {_code(r['error'])}"
    if "error" in r:
        return _code(r["error"])
    if "report" in r:
        return f"{r['outcome']}: {_code(r['report'])}"
    if case.group == "determinism":
        return (
            f"{r['steps']} steps bitwise equal (loss {r['first_loss']:.6g} -> {r['last_loss']:.6g})"
        )
    return ", ".join(f"{k}: {v}" for k, v in r.items() if k not in ("passed", "seconds"))


def _outcome(case: Case, results: Mapping[str, Mapping[str, Any]]) -> str:
    result = results.get(case.id)
    if result is None:
        return "not run"
    if not result["passed"]:
        return "**FAILED**"
    return "passed: " + _detail(case, result)  # cell-safe already


def _best_effort(result: Mapping[str, Any]) -> str | None:
    """The outcome of a sandbox case in the best-effort mode (None when it did not run)."""
    return result.get("modes", {}).get("best_effort", {}).get("outcome")


def summary(cases: Sequence[Case], results: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """The headline counts."""

    def ran(group: str) -> list[Mapping[str, Any]]:
        return [results[c.id] for c in cases if c.group == group and c.id in results]

    faults, bad = ran("fault"), ran("bad_input")
    safety = [(c.kind, results[c.id]) for c in cases if c.group == "safety" and c.id in results]
    bad_kinds = [
        (c.kind, results[c.id]) for c in cases if c.group == "bad_input" and c.id in results
    ]
    return {
        "faults injected": len(faults),
        "faults survived": sum(r["passed"] for r in faults),
        "checkpoints lost": sum(r.get("lost_checkpoints", 0) for r in faults),
        "bad inputs tried": len(bad),
        "bad inputs refused cleanly": sum(
            r["passed"] and r.get("outcome") == "refused" for r in bad
        ),
        "bad rows skipped and counted (on_bad_row=skip)": sum(
            r["passed"] and r.get("outcome") == "counted skip" for r in bad
        ),
        "bad inputs that hung or exhausted memory before, ended within their bound": sum(
            r["passed"] for kind, r in bad_kinds if kind in BOUNDED
        ),
        "hangs past their bound": sum(not r["passed"] for kind, r in bad_kinds if kind in BOUNDED),
        "code-execution attempts and unsafe loads refused": sum(
            r["passed"] for kind, r in safety if kind not in (*NOT_REFUSALS, *SANDBOX, *FILES)
        ),
        "sandbox escape attempts contained (OS isolation where the machine offers it)": sum(
            r["passed"] and r.get("outcome") == "contained" for kind, r in safety if kind in SANDBOX
        ),
        "sandbox escapes the opt-in best-effort mode lets through (documented gaps)": sum(
            r["passed"] and _best_effort(r) == "documented" for kind, r in safety if kind in SANDBOX
        ),
        "planted links refused, secrets kept out of logs": sum(
            r["passed"] for kind, r in safety if kind in FILES
        ),
        "other safety checks passed (the opt-in build, the source scan)": sum(
            r["passed"] for kind, r in safety if kind in NOT_REFUSALS
        ),
        "determinism checks bitwise equal": sum(r["passed"] for r in ran("determinism")),
        "cases not run": sum(c.id not in results for c in cases),
        "cases failed": sum(not results[c.id]["passed"] for c in cases if c.id in results),
    }


def render(cases: Sequence[Case], results: Mapping[str, Mapping[str, Any]]) -> str:
    """RELIABILITY.md for ``cases`` and their recorded ``results``."""
    lines = [
        "# Reliability",
        "",
        "<!-- Generated by `python -m tests.faults.report` from "
        "benchmarks/results/reliability.json (recorded by `make test-faults`). Do not edit: "
        "tests/faults/test_reliability_report.py fails when this file is out of date. -->",
        "",
        "What tunesmith does when a training process is killed, stopped, starved of disk, "
        "given a damaged checkpoint or a second run in its folder, or fed broken input or code "
        "to run. Every row below is one case of the suite in `tests/faults/` (the list is "
        "`tests/faults/catalogue.py`), each a real `tunesmith run sft` (`grpo_async` for the asynchronous RL cases) on a tiny model: faults "
        "are injected into real processes (signals, a full tmpfs or a file size limit, a dead "
        "gloo peer, same-size corruption, a concurrent run), bad inputs and code-execution "
        "routes go through the command line. `make test-faults` runs them all and regenerates "
        "this file; CI runs the cases marked *CI* on every change (at least one of every kind; "
        f"{len(CI_SIGKILL_SEEDS)} of the {len(SIGKILL_SEEDS)} SIGKILL seeds).",
        "",
        "## Summary",
        "",
        "| | count |",
        "|---|---|",
    ]
    lines += [f"| {name} | {count} |" for name, count in summary(cases, results).items()]
    for group in GROUPS:
        group_cases = [c for c in cases if c.group == group]
        lines += [
            "",
            f"## {TITLES[group]} ({len(group_cases)})",
            "",
            "| case | CI | fault or input | expected | outcome |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| `{c.id}` | {'CI' if c.ci else ''} | {_cell(c.what)} | {_cell(c.expect)} | "
            f"{_outcome(c, results)} |"
            for c in group_cases
        ]
    return "\n".join(lines) + "\n\n" + GPU_DETERMINISM


def load_results(path: Path = RESULTS) -> dict[str, dict[str, Any]]:
    return json.loads(path.read_text()) if path.is_file() else {}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="recorded outcomes (JSON)")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="the Markdown file")
    parser.add_argument("--check", action="store_true", help="only check it is up to date")
    args = parser.parse_args(argv)
    text = render(CASES, load_results(args.results))
    if args.check:
        if not args.output.is_file() or args.output.read_text() != text:
            print(f"{args.output} is out of date: run `python -m tests.faults.report`")
            return 1
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output} ({len(CASES)} cases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
