"""The `calculator` tool: arithmetic on numbers, evaluated from Python's `ast` without `eval`.

What it takes: int and float literals, `+ - * / // % **`, parentheses, unary `-` and `+`. No
names, no calls, no attributes, no strings: anything else is refused before a thing is computed.
Sizes are bounded so that a hostile expression cannot hang or exhaust the explorer: the text is at
most `MAX_CHARS` long and nests at most `MAX_DEPTH` deep, an integer result may have at most
`MAX_BITS` bits (`9**9**9` is refused before it is computed: its size is estimated from the operands'
bit lengths first), and float overflow is an error.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

from .tool_calls import ToolError

__all__ = ["calculator", "evaluate", "CalculatorError", "MAX_CHARS", "MAX_BITS", "MAX_DEPTH"]

MAX_CHARS = 256
MAX_DEPTH = 32
MAX_BITS = 4096  # about 1,233 decimal digits: every integer result is at most this large

Number = int | float


class CalculatorError(ToolError, ValueError):
    """An expression the calculator does not take, or one it cannot compute; the message says which."""


_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _bits(value: Number) -> float:
    """An upper bound on log2(|value|) (0 for |value| <= 1)."""
    if isinstance(value, int):
        return float(abs(value).bit_length())
    return max(0.0, math.log2(abs(value))) if value and math.isfinite(value) else 0.0


def _check_size(op: type[ast.operator], left: Number, right: Number) -> None:
    """Refuse an operation whose integer result would pass MAX_BITS, before computing it."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return  # floats overflow to an OverflowError (or inf, refused after)
    if op is ast.Pow and right > 0 and abs(left) > 1 and _bits(left - (1 if left > 0 else -1)) * right > MAX_BITS:
        raise CalculatorError(f"the result of {left} ** {right} would have more than {MAX_BITS} bits")
    if op is ast.Mult and _bits(left) + _bits(right) > MAX_BITS + 1:
        raise CalculatorError(f"the product would have more than {MAX_BITS} bits")


def _evaluate(node: ast.AST, depth: int) -> Number:
    if depth > MAX_DEPTH:
        raise CalculatorError(f"the expression nests deeper than {MAX_DEPTH} levels")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value  # type: ignore[no-any-return]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, depth + 1), _evaluate(node.right, depth + 1)
        _check_size(type(node.op), left, right)
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large for a float") from None
        if isinstance(value, complex):  # a negative number to a fractional power
            raise CalculatorError("the result is not a real number")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("the result is too large for a float")
        if isinstance(value, int) and value.bit_length() > MAX_BITS:
            raise CalculatorError(f"the result has more than {MAX_BITS} bits")
        return value
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise CalculatorError(f"not arithmetic: {what} (numbers, + - * / // % **, parentheses only)")


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression; `CalculatorError` says what is wrong with a bad one."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be text, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression is {len(expression)} characters long, more than {MAX_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise CalculatorError(f"not an arithmetic expression: {getattr(exc, 'msg', exc)}") from None
    return _evaluate(tree.body, 0)


def _format(value: Number) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))  # "82", not "82.0": the answer as a person writes it
    return repr(value) if isinstance(value, float) else str(value)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: The arithmetic expression, for example `37 + 45` or `(2 ** 10 - 1) / 3`.
    """
    return _format(evaluate(expression))
