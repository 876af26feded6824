"""Hostile sizes and hangs (issue #29, section 4): inputs that used to hang a command or grow
its memory until the machine gave out, and the lesser inputs whose refusal did not name the
file. Each must end within a bound with one line naming the input.

Every :class:`Hostile` builds its input inside the case's own folder (a copy of the tiny model
folder with a hostile chat template or config, a prompts file, a dataset, a metrics file) and
returns an :class:`Attempt`: the ``tunesmith`` command line, the words its one-line error (or
its skip report) must hold, the bound in seconds, and whether it must run in a child process
under a memory limit (``isolate``: a regression there would allocate gigabytes).

Kinds (all group ``bad_input``): ``hang`` (used to run forever; ``expect`` states the bound),
``size`` (used to grow memory without end), ``cli-input`` (the lesser ones). The test records
``{"outcome": "refused" | "counted skip", "error": first line, "seconds": measured}``.
Nothing heavy is imported here, so the report script lists the catalogue cheaply.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.faults.kit import GOOD_ROW, Case, World, edit_json, model_copy

__all__ = ["HOSTILE", "HOSTILE_CASES", "Attempt", "Hostile", "run_limited"]

MIB = 2**20
NESTED_RANGES = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@dataclass
class Attempt:
    """How to run a hostile case and what must come of it."""

    argv: list[str]
    words: list[str]
    bound: float = 30.0  # seconds
    isolate: bool = False  # run in a child under a memory limit (RLIMIT_AS)
    stdin: bytes | None = None
    skipped: str | None = None  # a bad-row reason: the run succeeds, counting one skip
    live: Callable[[], str] | None = None  # shows the input is hostile; returns how


@dataclass(frozen=True)
class Hostile:
    id: str
    kind: str
    what: str
    expect: str
    build: Callable[[World], Attempt] = field(repr=False)
    ci: bool = True


def _refused(bound: float, what: str) -> str:
    return f"exit 1 within {bound:g} s with one line 'tunesmith: error: ...' naming {what}"


# ----------------------------------------------------------------------------- commands


def _generate(model: Path, *args: str) -> list[str]:
    return ["generate", str(model), "--device", "cpu", "--max-new-tokens", "2", *args]


def _sft(world: World, *overrides: str) -> list[str]:
    return [
        "run",
        "sft",
        "--config",
        "tiny",
        f"model_dir={world.model_dir}",
        f"dataset.source={world.data}",
        f"output_dir={world.out}",
        "max_steps=2",
        "progress_bar=false",
        *overrides,
    ]


def _template_model(world: World, template: str, where: str = "chat_template.jinja") -> Path:
    """A copy of the model folder whose chat template is ``template`` (in ``where``)."""
    model = model_copy(world)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    if where == "chat_template.jinja":
        (model / where).write_text(template)
    else:
        edit_json(model / "tokenizer_config.json", chat_template=template)
    return model


def _plain_jinja_runs_past(template: str, seconds: float) -> Callable[[], str]:
    """Plain ``jinja2`` (its sandbox, no budget) still rendering ``template`` after
    ``seconds``: the template really hangs."""

    def live() -> str:
        import multiprocessing

        process = multiprocessing.get_context("forkserver").Process(
            target=_plain_render, args=(template,)
        )
        process.start()
        process.join(seconds)
        alive = process.exitcode is None
        process.kill()
        process.join()
        assert alive, "plain jinja2 finished the template: it is not hostile"
        return f"plain jinja2 still rendering after {seconds:g} s"

    return live


def _plain_jinja_over(template: str, limit_gb: float = 1.5) -> Callable[[], str]:
    """Plain ``jinja2`` rendering ``template`` under a ``limit_gb`` memory limit fails with
    MemoryError (or makes more text than the budget allows)."""

    def live() -> str:
        import multiprocessing

        queue = multiprocessing.get_context("forkserver").SimpleQueue()
        process = multiprocessing.get_context("forkserver").Process(
            target=_plain_render, args=(template, limit_gb, queue)
        )
        process.start()
        process.join(60)
        if process.exitcode is None:
            process.kill()
        got = queue.get() if not queue.empty() else f"exit {process.exitcode}"
        over = got.startswith("size ") and int(got.split()[1]) > 2**26  # the budget's limit
        assert over or got.startswith(("MemoryError", "OverflowError")), got
        return f"plain jinja2 under {limit_gb:g} GB: {got}"

    return live


def _plain_render(template: str, limit_gb: float = 0, queue=None) -> None:
    """Child side: render ``template`` with plain ``jinja2`` (no budget); report on ``queue``."""
    import jinja2.sandbox

    if limit_gb:
        _limit_memory(limit_gb)
    env = jinja2.sandbox.ImmutableSandboxedEnvironment()
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent)
    try:
        text = env.from_string(template).render(messages=[GOOD_ROW["messages"][0]])
        got = f"size {len(text)}"
    except Exception as e:
        got = f"{type(e).__name__}: {str(e)[:60]}"
    if queue is not None:
        queue.put(got)


def _limit_memory(extra_gb: float) -> None:
    """RLIMIT_AS: what this process maps now plus ``extra_gb``."""
    import resource

    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = vm + int(extra_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def run_limited(argv: list[str], log: str, extra_gb: float, stdin: str | None) -> None:
    """Child side: ``tunesmith ARGV`` under a memory limit, output in ``log``."""
    import sys

    _limit_memory(extra_gb)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if stdin is not None:
        sys.stdin = open(stdin, encoding="utf-8")  # noqa: SIM115
    from tunesmith.cli.main import main

    sys.exit(main(argv))


# ----------------------------------------------------------------------------- templates


def _template_case(
    template: str,
    live: Callable[[str], Callable[[], str]] | None = None,
    where: str = "chat_template.jinja",
    isolate: bool = False,
    sft: bool = False,
) -> Callable[[World], Attempt]:
    def build(world: World) -> Attempt:
        model = _template_model(world, template, where)
        argv = _sft(world, f"model_dir={model}") if sft else _generate(model, "--prompt", "hi")
        shows = None if live is None else live(template)
        return Attempt(
            argv, [str(model / where), "chat template stopped"], isolate=isolate, live=shows
        )

    return build


def _hangs(template: str) -> Callable[[], str]:
    return _plain_jinja_runs_past(template, 2)


_TEMPLATES = [
    Hostile(
        "template-nested-range-generate",
        "hang",
        "`generate` with a chat_template.jinja of two nested range(100000) loops (10^10 steps)",
        _refused(30, "chat_template.jinja and its 1,000,000-step budget"),
        _template_case(NESTED_RANGES, _hangs),
    ),
    Hostile(
        "template-nested-range-sft",
        "hang",
        "`run sft` with the nested range loops in tokenizer_config.json's chat_template (each "
        "row used to hang; with on_bad_row: skip it must not become per-row skips)",
        _refused(30, "tokenizer_config.json; no row skipped, nothing written"),
        _template_case(NESTED_RANGES, where="tokenizer_config.json", sft=True),
    ),
    Hostile(
        "template-nested-message-loops",
        "hang",
        "nested loops over `messages * 2000` (no range(): 4*10^6 steps over a list)",
        _refused(30, "chat_template.jinja"),
        _template_case(
            "{% for a in messages * 2000 %}{% for b in messages * 2000 %}{% endfor %}{% endfor %}"
        ),
    ),
    Hostile(
        "template-recursive-macro",
        "hang",
        "a macro that calls itself without end",
        _refused(30, "chat_template.jinja and 'recurse too deep'"),
        _template_case("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"),
    ),
    Hostile(
        "template-tojson-indent",
        "size",
        "`messages|tojson(indent=10**8)` (2.6 GB of spaces)",
        _refused(30, "chat_template.jinja and the indent limit 4096") + "; memory-limited child",
        _template_case("{{ messages|tojson(indent=10**8) }}", _plain_jinja_over, isolate=True),
    ),
    Hostile(
        "template-string-doubling",
        "size",
        "a namespace string doubled 40 times with `~` (2^40 characters)",
        _refused(30, "chat_template.jinja and the 64 Mi-character limit") + "; memory-limited",
        _template_case(
            "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
            _plain_jinja_over,
            isolate=True,
        ),
    ),
    Hostile(
        "template-repeat-string",
        "size",
        "`'x' * 10**10` in the template",
        _refused(30, "chat_template.jinja") + "; memory-limited child",
        _template_case("{{ 'x' * 10**10 }}", _plain_jinja_over, isolate=True),
    ),
    Hostile(
        "template-format-width",
        "size",
        "`'%0999999999d' % 1` and `'{:>999999999}'.format(1)` (a 1 GB width)",
        _refused(30, "chat_template.jinja and the width limit") + "; memory-limited child",
        _template_case(
            "{{ '%0999999999d' % 1 }}{{ '{:>999999999}'.format(1) }}",
            _plain_jinja_over,
            isolate=True,
        ),
    ),
]


# ----------------------------------------------------------------------------- config sizes

_CONFIG_SIZES = {  # key -> hostile value (the limits: tunesmith.models.spec.SIZE_LIMITS)
    "num_hidden_layers": 10_000_000,
    "hidden_size": 10_000_000,
    "vocab_size": 2**31,
    "intermediate_size": 10**9,
    "num_attention_heads": 10**6,
    "head_dim": 10**6,
    "max_position_embeddings": 2**40,
    "num_experts": 10**6,
}


def _config_case(key: str, value: int) -> Callable[[World], Attempt]:
    def build(world: World) -> Attempt:
        model = model_copy(world)
        edit_json(model / "config.json", **{key: value})
        return Attempt(
            _generate(model, "--prompt", "hi"),
            [str(model / "config.json"), f"{key} = {value}", "limit"],
            isolate=True,
        )

    return build


_CONFIGS = [
    Hostile(
        f"config-{key.replace('_', '-')}-huge",
        "size" if key != "num_hidden_layers" else "hang",
        f"config.json with `{key}: {value}` given to `generate`"
        + (
            " (memory grew 20 MB/s for minutes before any check)"
            if key == "num_hidden_layers"
            else ""
        ),
        _refused(10, f"config.json, {key} and its limit") + "; nothing built; memory-limited",
        _config_case(key, value),
    )
    for key, value in _CONFIG_SIZES.items()
]


# ----------------------------------------------------------------------------- prompts


def _prompt_file(world: World, line: bytes, name: str = "prompts.jsonl") -> Path:
    path = world.tmp / name
    path.write_bytes(json.dumps("hello").encode() + b"\n" + line + b"\n")
    return path


def _prompt_1mb(world: World) -> Attempt:
    prompt = "add 1 and 2 " * (MIB // 12)
    return Attempt(
        _generate(world.model_dir, "--prompt", prompt),
        ["--prompt", f"{len(prompt)} characters", "positions"],
        live=_tokens_over_positions(world, prompt),
    )


def _tokens_over_positions(world: World, prompt: str) -> Callable[[], str]:
    def live() -> str:
        from tunesmith.data import Tokenizer

        positions = json.loads((world.model_dir / "config.json").read_text())[
            "max_position_embeddings"
        ]
        sample = prompt[: 20 * positions]  # enough to show the whole prompt cannot fit
        tokens = len(Tokenizer.from_pretrained(world.model_dir).encode(sample))
        assert tokens > positions, (tokens, positions)
        return f"{tokens} tokens from its first {len(sample)} characters > {positions} positions"

    return live


def _input_1mb(world: World) -> Attempt:
    path = _prompt_file(world, json.dumps({"prompt": "x " * (MIB // 2)}).encode())
    return Attempt(
        _generate(world.model_dir, "--input", str(path), "--output", str(world.tmp / "out.jsonl")),
        [f"{path}:2", "characters", "positions"],
    )


def _input_50mb(world: World) -> Attempt:
    path = _prompt_file(world, json.dumps({"prompt": "x " * (25 * MIB)}).encode())
    return Attempt(
        _generate(world.model_dir, "--input", str(path), "--output", str(world.tmp / "out.jsonl")),
        [f"{path}:2", "longer than 16777216 bytes"],
        isolate=True,
    )


def _chat_file_50mb(world: World) -> Attempt:
    path = world.tmp / "chat.json"
    path.write_text(json.dumps([{"role": "user", "content": "x " * (25 * MIB)}]))
    return Attempt(
        _generate(world.model_dir, "--chat", str(path)),
        [str(path), "larger than 16777216 bytes"],
        isolate=True,
    )


def _prompt_50mb_in_process(world: World) -> Attempt:
    prompt = "x " * (25 * MIB)
    return Attempt(
        _generate(world.model_dir, "--prompt", prompt),
        ["--prompt", f"{len(prompt)} characters"],
        isolate=True,
    )


def _prompt_over_positions(world: World) -> Attempt:
    prompt = "add 1 and 2 " * 400  # ~2400 tokens, under the character limit of 512 positions
    return Attempt(
        _generate(world.model_dir, "--prompt", prompt),
        ["--prompt", "tokens", "512 positions", "no room to generate"],
        live=_tokens_over_positions(world, prompt),
    )


def _chat_1mb_line(world: World) -> Attempt:
    return Attempt(
        ["chat", str(world.model_dir), "--device", "cpu", "--max-new-tokens", "2"],
        ["the conversation", "characters", "positions"],
        stdin=b"hi\n" + b"x " * (MIB // 2) + b"\n",
    )


_PROMPTS = [
    Hostile(
        "prompt-1mb-generate",
        "hang",
        "`generate --prompt` with a 1 MB prompt (it hung: 262k tokens through a 512-position "
        "model on the CPU)",
        _refused(30, "--prompt, its size and the model's positions")
        + "; refused before tokenising",
        _prompt_1mb,
    ),
    Hostile(
        "prompt-1mb-input",
        "hang",
        "`generate --input` whose line 2 is a 1 MB prompt",
        _refused(30, "the file and line 2"),
        _input_1mb,
    ),
    Hostile(
        "prompt-1mb-chat",
        "hang",
        "`chat` whose second stdin line is 1 MB",
        _refused(30, "the conversation and the model's positions"),
        _chat_1mb_line,
    ),
    Hostile(
        "prompt-50mb-input",
        "size",
        "`generate --input` with a 50 MB line (it aborted at 6 GB)",
        _refused(30, "the file, line 2 and the 16 MiB line limit") + "; memory-limited child",
        _input_50mb,
    ),
    Hostile(
        "prompt-50mb-chat-file",
        "size",
        "`generate --chat` with a 50 MB messages file",
        _refused(30, "the file and the 16 MiB limit") + "; memory-limited child",
        _chat_file_50mb,
    ),
    Hostile(
        "prompt-50mb-argument",
        "size",
        "`generate --prompt` with a 50 MB string (in-process main(): argv cannot hold it)",
        _refused(30, "--prompt and its size") + "; memory-limited child",
        _prompt_50mb_in_process,
    ),
    Hostile(
        "prompt-over-positions",
        "size",
        "`generate --prompt` of ~2400 tokens for a model of 512 positions (was generated "
        "silently at positions the model never saw)",
        _refused(30, "--prompt, its tokens and the model's 512 positions"),
        _prompt_over_positions,
    ),
]


# ----------------------------------------------------------------------------- datasets


def _rows_with(world: World, bad: bytes, name: str = "data.jsonl") -> Path:
    good = (json.dumps(GOOD_ROW) + "\n").encode() * 8
    path = world.tmp / name
    path.write_bytes(good + bad + b"\n" + good)
    return path


def _huge_line() -> bytes:
    row = {
        "messages": [
            {"role": "user", "content": "x" * (20 * MIB)},
            {"role": "assistant", "content": "3"},
        ]
    }
    return json.dumps(row).encode()


def _dataset_line(skip: bool) -> Callable[[World], Attempt]:
    def build(world: World) -> Attempt:
        path = _rows_with(world, _huge_line())
        argv = _sft(
            world, f"dataset.source={path}", *(() if skip else ("dataset.on_bad_row=error",))
        )
        if skip:
            return Attempt(argv, ["row_too_large"], skipped="row_too_large", isolate=True)
        return Attempt(argv, [str(path), "line 9", "row_too_large", "16777216"], isolate=True)

    return build


def _parquet_row(world: World) -> Attempt:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [GOOD_ROW] * 8 + [json.loads(_huge_line())] + [GOOD_ROW] * 8
    path = world.tmp / "data.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return Attempt(
        _sft(world, f"dataset.source={path}"),
        ["row_too_large"],
        skipped="row_too_large",
        isolate=True,
    )


def _deep_json(depth: int = 100_000) -> bytes:
    return b"[" * depth + b"]" * depth


def _dataset_deep_json(world: World) -> Attempt:
    path = _rows_with(world, _deep_json())
    return Attempt(
        _sft(world, f"dataset.source={path}", "dataset.on_bad_row=error"),
        [str(path), "line 9", "nested too deep"],
    )


def _array_with(world: World, bad: dict) -> Path:
    """A JSON array file, one row a line: 8 good rows, ``bad`` (row 8, line 10), 8 good."""
    rows = [GOOD_ROW] * 8 + [bad] + [GOOD_ROW] * 8
    path = world.tmp / "data.json"
    path.write_text("[\n" + ",\n".join(json.dumps(row) for row in rows) + "\n]\n")
    return path


def _json_array_element(skip: bool) -> Callable[[World], Attempt]:
    def build(world: World) -> Attempt:
        path = _array_with(world, json.loads(_huge_line()))
        argv = _sft(
            world, f"dataset.source={path}", *(() if skip else ("dataset.on_bad_row=error",))
        )
        if skip:
            return Attempt(argv, ["row_too_large"], skipped="row_too_large", isolate=True)
        words = [str(path), "bad row at line 10", "row_too_large", "16777216"]
        return Attempt(argv, words, isolate=True)

    return build


def _csv_with(world: World, bad: bytes) -> Path:
    """A prompt/completion CSV file: its header, 8 good rows, ``bad`` (row 8, line 10)."""
    path = world.tmp / "data.csv"
    path.write_bytes(b"prompt,completion\n" + b"add 1 and 2,3\n" * 8 + bad + b"\n")
    return path


def _csv_field(world: World) -> Attempt:
    path = _csv_with(world, b"x" * (20 * MIB) + b",3\nadd 2 and 2,4")
    argv = _sft(world, f"dataset.source={path}", "dataset.format=prompt_completion")
    return Attempt(argv, ["row_too_large"], skipped="row_too_large", isolate=True)


def _csv_unended_quote(world: World) -> Attempt:
    path = _csv_with(world, b'x,"' + b"y" * 20_000)
    argv = _sft(
        world,
        f"dataset.source={path}",
        "dataset.format=prompt_completion",
        "dataset.max_row_bytes=10000",
    )
    return Attempt(argv, [str(path), "line 10", "max_row_bytes", "quoted cell does not end"])


def _max_row_bytes_key(world: World) -> Attempt:
    row = {
        "messages": [{"role": "user", "content": "y" * 5000}, {"role": "assistant", "content": "3"}]
    }
    path = _rows_with(world, json.dumps(row).encode())
    argv = _sft(
        world, f"dataset.source={path}", "dataset.max_row_bytes=2000", "dataset.on_bad_row=error"
    )
    return Attempt(argv, [str(path), "bad row at line 9", "row_too_large", "limit of 2000"])


def _max_row_bytes_invalid(world: World) -> Attempt:
    return Attempt(_sft(world, "dataset.max_row_bytes=0"), ["max_row_bytes", "got 0"])


def _json_object_over_cap(world: World) -> Attempt:
    path = world.tmp / "data.json"
    path.write_text(json.dumps({"rows": [GOOD_ROW] * 300}, indent=2))
    argv = _sft(world, f"dataset.source={path}", "dataset.max_row_bytes=10000")
    return Attempt(argv, [str(path), "max_row_bytes limit of 10000", "not read whole"])


_DATASETS = [
    Hostile(
        "dataset-line-20mb-skip",
        "size",
        "a 20 MB JSONL line (over the 16 MiB row limit; the issue's 300 MB one aborted at "
        "8 GiB and on_bad_row: skip did not help) with on_bad_row: skip",
        "exit 0: the line is skipped unread and counted (row_too_large); memory-limited",
        _dataset_line(skip=True),
    ),
    Hostile(
        "dataset-line-20mb-error",
        "size",
        "the same 20 MB line with on_bad_row: error",
        _refused(30, "the file, line 9, row_too_large and the limit") + "; memory-limited",
        _dataset_line(skip=False),
    ),
    Hostile(
        "dataset-parquet-row-20mb",
        "size",
        "a Parquet dataset whose row 8 holds a 20 MB cell",
        "exit 0: the row is a counted skip (row_too_large); memory-limited child",
        _parquet_row,
        ci=False,  # ~12 s: datasets converts the Parquet file first
    ),
    Hostile(
        "dataset-deep-json",
        "cli-input",
        "a JSONL line nested 100,000 deep (RecursionError) with on_bad_row: error",
        _refused(30, "the file, line 9 and 'nested too deep'"),
        _dataset_deep_json,
    ),
    Hostile(
        "dataset-json-array-element-20mb-skip",
        "size",
        "a JSON-array dataset (read whole before) whose row 8 is a 20 MB element, with "
        "on_bad_row: skip",
        "exit 0: the element is skipped unread and counted (row_too_large); memory-limited",
        _json_array_element(skip=True),
    ),
    Hostile(
        "dataset-json-array-element-20mb-error",
        "size",
        "the same 20 MB JSON-array element with on_bad_row: error",
        _refused(30, "the file, row 8 and its line, row_too_large and the limit")
        + "; memory-limited",
        _json_array_element(skip=False),
    ),
    Hostile(
        "dataset-csv-field-20mb",
        "size",
        "a CSV dataset (read whole before) whose row 8 holds a 20 MB cell",
        "exit 0: the row is skipped unread and counted (row_too_large); memory-limited child",
        _csv_field,
    ),
    Hostile(
        "dataset-csv-quote-never-ends",
        "cli-input",
        "a CSV row over max_row_bytes whose quoted cell never ends (the row's end cannot be found)",
        _refused(30, "the file, line 10, max_row_bytes and the open quote"),
        _csv_unended_quote,
    ),
    Hostile(
        "dataset-max-row-bytes-key",
        "cli-input",
        "`dataset.max_row_bytes=2000` and a 5 KB JSONL row, with on_bad_row: error",
        _refused(30, "the file, row 8 and line 9, row_too_large and the limit 2000"),
        _max_row_bytes_key,
    ),
    Hostile(
        "dataset-max-row-bytes-zero",
        "cli-input",
        "`dataset.max_row_bytes=0`",
        _refused(30, "max_row_bytes and the value"),
        _max_row_bytes_invalid,
    ),
    Hostile(
        "dataset-json-object-over-cap",
        "cli-input",
        "a .json file holding one object over several lines, bigger than max_row_bytes "
        "(used to be read whole to tell)",
        _refused(30, "the file and max_row_bytes"),
        _json_object_over_cap,
    ),
]


# ----------------------------------------------------------------------------- lesser


def _out(world: World) -> str:
    return str(world.tmp / "out.jsonl")


def _hacker_input(world: World) -> Attempt:
    line = json.dumps({"messages": [{"role": "hacker", "content": "hi"}]}).encode()
    path = _prompt_file(world, line)
    return Attempt(
        _generate(world.model_dir, "--input", str(path), "--output", _out(world)),
        [f"{path}:2", "role 'hacker'"],
    )


def _hacker_chat(world: World) -> Attempt:
    path = world.tmp / "chat.json"
    path.write_text(json.dumps([{"role": "hacker", "content": "hi"}]))
    return Attempt(_generate(world.model_dir, "--chat", str(path)), [str(path), "role 'hacker'"])


def _binary_input(world: World) -> Attempt:
    path = _prompt_file(world, b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    return Attempt(
        _generate(world.model_dir, "--input", str(path), "--output", _out(world)),
        [f"{path}:2", "not UTF-8"],
    )


def _binary_chat(world: World) -> Attempt:
    path = world.tmp / "chat.json"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    return Attempt(_generate(world.model_dir, "--chat", str(path)), [str(path), "not UTF-8"])


def _deep_input(world: World) -> Attempt:
    path = _prompt_file(world, _deep_json())
    return Attempt(
        _generate(world.model_dir, "--input", str(path), "--output", _out(world)),
        [f"{path}:2", "nested too deep"],
    )


def _stdin_not_utf8(world: World) -> Attempt:
    return Attempt(
        ["chat", str(world.model_dir), "--device", "cpu", "--max-new-tokens", "2"],
        ["stdin", "line 1", "not valid UTF-8"],
        stdin=b"caf\xe9 \xff\xfe\n",
    )


def _metrics(world: World, data: bytes) -> tuple[Path, list[str]]:
    run = world.tmp / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 2.0}\n' + data + b"\n")
    return run, ["plot", str(run), "--output", str(world.tmp / "loss.png")]


def _plot_binary(world: World) -> Attempt:
    run, argv = _metrics(world, b"\x89PNG\r\n\x1a\n\xff\xfe")
    return Attempt(argv, [f"{run / 'metrics.jsonl'}:2", "not UTF-8"])


def _plot_deep(world: World) -> Attempt:
    run, argv = _metrics(world, _deep_json())
    return Attempt(argv, [f"{run / 'metrics.jsonl'}:2", "nested too deep"])


def _plot_not_record(world: World) -> Attempt:
    run, argv = _metrics(world, b"[1, 2, 3]")
    return Attempt(argv, [f"{run / 'metrics.jsonl'}:2", "not a metrics record"])


_LESSER = [
    Hostile(
        "generate-role-hacker-input",
        "cli-input",
        "`generate --input` whose row has a message of role 'hacker'",
        _refused(30, "the file, line 2 and the role"),
        _hacker_input,
    ),
    Hostile(
        "generate-role-hacker-chat",
        "cli-input",
        "`generate --chat` with a message of role 'hacker'",
        _refused(30, "the file and the role"),
        _hacker_chat,
    ),
    Hostile(
        "generate-input-binary",
        "cli-input",
        "`generate --input` given a binary file",
        _refused(30, "the file and line"),
        _binary_input,
    ),
    Hostile(
        "generate-chat-binary",
        "cli-input",
        "`generate --chat` given a binary file",
        _refused(30, "the file"),
        _binary_chat,
    ),
    Hostile(
        "generate-input-deep-json",
        "cli-input",
        "`generate --input` whose line 2 is JSON nested 100,000 deep",
        _refused(30, "the file, line 2 and 'nested too deep'"),
        _deep_input,
    ),
    Hostile(
        "chat-stdin-not-utf8",
        "cli-input",
        "`chat` whose stdin is not UTF-8 (it said 'TextInputSequence must be str')",
        _refused(30, "stdin and the line"),
        _stdin_not_utf8,
    ),
    Hostile(
        "plot-metrics-binary",
        "cli-input",
        "`plot` on a metrics.jsonl with binary bytes",
        _refused(30, "metrics.jsonl and the line"),
        _plot_binary,
    ),
    Hostile(
        "plot-metrics-deep-json",
        "cli-input",
        "`plot` on a metrics.jsonl whose line is nested 100,000 deep",
        _refused(30, "metrics.jsonl and the line"),
        _plot_deep,
    ),
    Hostile(
        "plot-metrics-not-a-record",
        "cli-input",
        "`plot` on a metrics.jsonl whose line is a JSON list",
        _refused(30, "metrics.jsonl and the line"),
        _plot_not_record,
    ),
]

HOSTILE: list[Hostile] = [*_TEMPLATES, *_CONFIGS, *_PROMPTS, *_DATASETS, *_LESSER]
HOSTILE_CASES: list[Case] = [
    Case(h.id, "bad_input", h.kind, h.what, h.expect, ci=h.ci) for h in HOSTILE
]
