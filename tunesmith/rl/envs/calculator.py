"""The ``calculator`` tool: exact rational arithmetic on a small grammar parsed here (no
``eval``, no names, no attributes, no calls).

Grammar (``^`` is a synonym of ``**``)::

    expression := term (("+" | "-") term)*
    term       := unary (("*" | "/" | "//" | "%") unary)*
    unary      := ("+" | "-") unary | power
    power      := atom (("**" | "^") unary)?
    atom       := NUMBER | "(" expression ")"
    NUMBER     := digits with an optional decimal point, e.g. 123456, 0.25, .5

Numbers are Python ``int`` and :class:`fractions.Fraction`, so 6-digit products, big powers and
``1/3 + 1/6`` are exact; ``-2**2`` is ``-4`` and ``2**-1`` is ``1/2``, as in Python. The result
is an integer, an exact decimal when the denominator has only the factors 2 and 5 (``0.125``,
up to 100 places), else a fraction (``1/3``). Bounds: :data:`MAX_CHARS` characters, :data:`MAX_DEPTH` nesting,
integer exponents with every result (intermediate ones too) at most :data:`MAX_BITS` bits;
anything else is a :class:`~tunesmith.rl.envs.tool.ToolError` saying why.

Example::

    >>> Calculator()(expression="123456 * 654321")
    '80779853376'
    >>> Calculator()(expression="(1/3 + 1/6) * 2^-1")
    '0.25'
"""

from __future__ import annotations

import re
from fractions import Fraction

from tunesmith.config.registry import component
from tunesmith.rl.envs.tool import ToolError, function_schema

__all__ = ["MAX_BITS", "MAX_CHARS", "MAX_DEPTH", "Calculator", "calculate"]

MAX_CHARS = 1000
MAX_DEPTH = 100
MAX_BITS = 14000  # about 4,200 decimal digits (Python prints ints of up to 4,300)
_MAX_DECIMALS = 100  # a finite decimal with more places is written as a fraction

_TOKEN = re.compile(r"\s*(?:(\d+\.?\d*|\.\d+)|(\*\*|//|[-+*/%^()]))")


def _tokens(expression: str) -> list[str]:
    tokens, position = [], 0
    while position < len(expression):
        if expression[position:].isspace():
            break
        match = _TOKEN.match(expression, position)
        if match is None:
            bad = expression[position:].lstrip()[:12]
            raise ToolError(
                f"calculator: {bad!r} is not part of the grammar (numbers, + - * / // % ** ^ "
                "and parentheses only)"
            )
        tokens.append(match.group(1) or match.group(2))
        position = match.end()
    return tokens


def _bounded(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise ToolError(f"calculator: a result is larger than {MAX_BITS} bits")
    return value


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise ToolError("calculator: exponents must be integers (no roots)")
    size = max(base.numerator.bit_length(), base.denominator.bit_length())
    if (size - 1) * abs(exponent.numerator) + 1 > MAX_BITS:  # a lower bound of its size
        raise ToolError(f"calculator: a result is larger than {MAX_BITS} bits")
    if base == 0 and exponent < 0:
        raise ToolError("calculator: division by zero")
    return _bounded(base**exponent.numerator)


def _divide(operator: str, left: Fraction, right: Fraction) -> Fraction:
    if right == 0:
        raise ToolError("calculator: division by zero")
    if operator == "/":
        return left / right
    return Fraction(left // right) if operator == "//" else left % right


class _Parser:
    """Recursive descent over the tokens (one method per grammar rule)."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.position, self.depth = tokens, 0, 0

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ToolError("calculator: the expression ends too early")
        self.position += 1
        return token

    def nested(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ToolError(f"calculator: nested deeper than {MAX_DEPTH}")

    def expression(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            operator, right = self.take(), self.term()
            value = _bounded(value + right if operator == "+" else value - right)
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/", "//", "%"):
            operator, right = self.take(), self.unary()
            value = _bounded(value * right) if operator == "*" else _divide(operator, value, right)
        return value

    def unary(self) -> Fraction:
        if self.peek() in ("+", "-"):
            self.nested()
            sign = self.take()
            value = self.unary()
            self.depth -= 1
            return -value if sign == "-" else value
        return self.power()

    def power(self) -> Fraction:
        base = self.atom()
        if self.peek() in ("**", "^"):
            self.take()
            self.nested()
            exponent = self.unary()
            self.depth -= 1
            return _power(base, exponent)
        return base

    def atom(self) -> Fraction:
        token = self.take()
        if token == "(":
            self.nested()
            value = self.expression()
            if self.peek() != ")":
                raise ToolError("calculator: a '(' is not closed")
            self.take()
            self.depth -= 1
            return value
        if token[0].isdigit() or token[0] == ".":
            return Fraction(token)
        raise ToolError(f"calculator: expected a number or '(', got {token!r}")


def _format(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    denominator, twos, fives = value.denominator, 0, 0
    while denominator % 2 == 0:
        denominator, twos = denominator // 2, twos + 1
    while denominator % 5 == 0:
        denominator, fives = denominator // 5, fives + 1
    places = max(twos, fives)
    if denominator != 1 or places > _MAX_DECIMALS:
        return f"{value.numerator}/{value.denominator}"
    scaled = abs(value.numerator) * 10**places // value.denominator
    digits = str(scaled).rjust(places + 1, "0")
    sign = "-" if value < 0 else ""
    return f"{sign}{digits[:-places]}.{digits[-places:]}"


def calculate(expression: str) -> str:
    """Evaluate ``expression`` exactly (see the module docs) and format the result.

    Example::

        >>> calculate("2 ** 100"), calculate("7 / 3"), calculate("-7 // 2")
        ('1267650600228229401496703205376', '7/3', '-4')
    """
    if not isinstance(expression, str):
        raise ToolError(
            f"calculator: the expression must be a string, got {type(expression).__name__}"
        )
    if len(expression) > MAX_CHARS:
        raise ToolError(f"calculator: the expression is longer than {MAX_CHARS} characters")
    tokens = _tokens(expression)
    if not tokens:
        raise ToolError("calculator: the expression is empty")
    parser = _Parser(tokens)
    value = parser.expression()
    if parser.peek() is not None:
        raise ToolError(f"calculator: unexpected {parser.peek()!r} after a complete expression")
    return _format(value)


@component
class Calculator:
    """The ``calculator`` tool (see the module docs).

    Example (YAML, in a ``ToolEnv``'s ``tools``)::

        tools:
          - {_component_: tunesmith.rl.envs.Calculator}
    """

    name = "calculator"
    schema = function_schema(
        "calculator",
        "Evaluate an arithmetic expression exactly (integers and fractions; + - * / // % ** "
        "and parentheses).",
        {"expression": {"type": "string", "description": "The expression, e.g. 123 * 456."}},
    )

    def __call__(self, expression: str) -> str:
        return calculate(expression)
