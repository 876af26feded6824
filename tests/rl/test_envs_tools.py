"""The built-in tools (tunesmith.rl.envs): the calculator is exact and refuses anything
outside its grammar, the python tool runs in the code sandbox (timeouts and exceptions become
ToolErrors), and BM25 ranks a tiny corpus in the order computed by hand."""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction

import pytest

from tunesmith.rl.envs import BM25Index, Calculator, PythonTool, Retrieve, ToolError, calculate
from tunesmith.rl.envs.calculator import MAX_BITS, MAX_CHARS, MAX_DEPTH
from tunesmith.rl.rewards import available_isolation


def test_calculator_six_digit_products_are_exact() -> None:
    rng = random.Random(0)
    for _ in range(200):
        a, b = rng.randrange(100_000, 1_000_000), rng.randrange(100_000, 1_000_000)
        assert calculate(f"{a} * {b}") == str(a * b)
        assert calculate(f"{a}*{b} - {a}") == str(a * b - a)
    assert calculate("999999 * 999999") == "999998000001"


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("-2**2", "-4"),
        ("(-2)**2", "4"),
        ("2**-2", "0.25"),
        ("2^3^2", "512"),  # right-associative, as **
        ("1/3 + 1/6", "0.5"),
        ("1/3 + 1/12", "5/12"),
        ("0.1 + 0.2", "0.3"),
        ("10 / 4", "2.5"),
        ("-1/8", "-0.125"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("-7 % 3", "2"),
        ("2/3 * 3", "2"),
        ("1/7", "1/7"),
        ("  ( 1 + 2 ) * ( 3 + 4 )  ", "21"),
        ("2**200", str(2**200)),
        (".5 * 4", "2"),
    ],
)
def test_calculator_follows_python_arithmetic_exactly(expression: str, expected: str) -> None:
    assert calculate(expression) == expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("x + 1", "not part of the grammar"),
        ("__import__('os')", "not part of the grammar"),
        ("(1).real", "not part of the grammar"),
        ("abs(-1)", "not part of the grammar"),
        ("1e5", "not part of the grammar"),
        ("1 if 1 else 2", "not part of the grammar"),
        ("[1]", "not part of the grammar"),
        ("9**9**9", "larger than"),
        ("(1/3)**-70000", "larger than"),
        ("10**100000", "larger than"),
        ("2**0.5", "exponents must be integers"),
        ("1/0", "division by zero"),
        ("5 % (2-2)", "division by zero"),
        ("0**-1", "division by zero"),
        ("(1 + 2", "not closed"),
        ("1 2", "unexpected '2'"),
        ("1 +", "ends too early"),
        ("", "empty"),
        ("*3", "expected a number"),
        ("-" * (MAX_DEPTH + 1) + "1", "nested deeper"),
        ("(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1), "nested deeper"),
        ("1+" * MAX_CHARS + "1", "longer than"),
    ],
)
def test_calculator_refuses_outside_the_grammar(expression: str, message: str) -> None:
    with pytest.raises(ToolError, match=message):
        calculate(expression)


def test_calculator_bounds_every_intermediate_result() -> None:
    big = f"(2**{MAX_BITS - 1})"
    assert int(calculate(big)) == 2 ** (MAX_BITS - 1)
    with pytest.raises(ToolError, match="larger than"):
        calculate(f"{big} * {big}")
    assert calculate("2**-101") == f"1/{2**101}" and calculate("2**-100").startswith("0.000")
    assert calculate("1 ** (10**1000)") == "1" and calculate("(-1) ** (10**1000 + 1)") == "-1"
    assert Calculator()(expression="123456 * 654321") == str(123456 * 654321)


MODES = available_isolation()


@pytest.mark.parametrize("isolation", MODES)
def test_python_tool_runs_in_the_sandbox(isolation: str) -> None:
    tool = PythonTool(timeout_s=1, memory_mb=256, isolation=isolation, max_output_chars=50)
    assert tool(code="import math\nprint(math.factorial(20))") == f"{math.factorial(20)}\n"
    long = tool(code="print('x' * 100)")
    assert long == "[...51 characters cut]\n" + "x" * 49 + "\n"  # 101 characters, the last 50 kept
    with pytest.raises(ToolError, match=r"ZeroDivisionError: division by zero\Z"):
        tool(code="print('before')\n1 / 0")
    with pytest.raises(ToolError, match="timed out after 1 s"):
        tool(code="while True: pass")
    with pytest.raises(ToolError, match="non-empty string"):
        tool(code="  ")


def test_python_tool_has_no_network() -> None:
    tool = PythonTool(timeout_s=2, isolation=MODES[0])
    code = "import socket\ns = socket.socket()\ns.connect(('1.1.1.1', 80))\nprint('connected')"
    refusal = {
        "namespaces": "Network is unreachable",
        "best_effort": "socket.__new__ is not allowed",
    }
    with pytest.raises(ToolError, match=refusal[MODES[0]]):
        tool(code=code)


CORPUS = ["the cat sat on the mat", "dogs chase the cat", "a dog barks", "cat cat cat"]


def _bm25(query: str, k1: float = 1.5, b: float = 0.75) -> list[float]:
    """BM25 written out with fractions and the textbook sum, independently of the index."""
    docs = [d.split() for d in CORPUS]
    n, avg = len(docs), Fraction(sum(len(d) for d in docs), len(docs))
    scores = []
    for doc in docs:
        total = 0.0
        for term in set(query.split()):
            df = sum(term in d for d in docs)
            f = doc.count(term)
            if f:
                idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
                norm = float(k1 * (1 - b + b * Fraction(len(doc)) / avg))
                total += idf * f * (k1 + 1) / (f + norm)
        scores.append(total)
    return scores


def test_bm25_ranks_a_tiny_corpus_as_computed_by_hand() -> None:
    index = BM25Index(CORPUS)
    # by hand: "cat" is in 3 of 4 documents (idf ln(1 + 1.5/3.5) = 0.3567); lengths 6, 4, 3,
    # 3 (avgdl 4): "cat cat cat" (f=3, short) > "dogs chase the cat" (f=1, avgdl) > "the cat
    # sat on the mat" (f=1, long); "a dog barks" has no "cat" and is left out.
    assert [i for i, _ in index.top("cat", 10)] == [3, 1, 0]
    # "dog" is only in document 2 ("dogs" is another term): it wins alone
    assert index.top("dog", 10) == [(2, pytest.approx(_bm25("dog")[2]))]
    # "the cat": "the" appears in 2 documents, twice in document 0, which now ranks above 3
    assert [i for i, _ in index.top("the cat", 10)] == [0, 1, 3]
    for query in ("cat", "the cat", "dog barks cat"):
        expected = _bm25(query)
        assert [index.score(query, i) for i in range(4)] == pytest.approx(expected, rel=1e-12)
    assert index.top("zebra", 3) == []
    assert index.top("cat", 2) == index.top("cat", 10)[:2]


def test_retrieve_reads_a_jsonl_corpus(tmp_path) -> None:
    path = tmp_path / "corpus.jsonl"
    rows = [{"id": f"d{i}", "text": text} for i, text in enumerate(CORPUS)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    tool = Retrieve(path, top_k=2, max_chars_per_document=12)
    assert tool(query="cat") == "[d3] cat cat cat\n\n[d1] dogs chase t"
    assert tool(query="zebra") == "No document matches."
    with pytest.raises(ToolError, match="at least one word"):
        tool(query="!!")
    path.write_text('{"text": "ok"}\n{"body": "no text"}\n', encoding="utf-8")
    with pytest.raises(
        ValueError, match=r"corpus.jsonl:2: expected an object with a string 'text'"
    ):
        Retrieve(path)
