"""The one sympy -> Triton printer. Every formula reaches generated code through `to_triton`.

Numbers print as float literals (so integer-looking constants never turn into integer arithmetic),
2**x prints as tl.exp2(x), and the activation functions print as the overflow-safe helpers that
every generated module defines (see HELPERS).
"""
from __future__ import annotations

import sympy
from sympy.printing.precedence import PRECEDENCE
from sympy.printing.str import StrPrinter

from ..ir.formula import logsigmoid, sigmoid, softplus

# Triton helpers the printed code may call; the module emitter writes them into every module.
HELPERS = '''\
@triton.jit
def softplus(x):
    """log(1 + exp(x)) without overflow: max(x, 0) + log(1 + exp(-|x|))."""
    return tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def logsigmoid(x):
    """log(sigmoid(x)) = min(x, 0) - log(1 + exp(-|x|))."""
    return tl.minimum(x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x)))
'''


class TritonPrinter(StrPrinter):
    def __init__(self, names: dict[str, str]):
        super().__init__()
        self._names = names

    def _print_Symbol(self, expr):
        name = str(expr)
        if name not in self._names:
            raise KeyError(f"formula symbol {name!r} has no Triton variable")
        return self._names[name]

    def _print_Integer(self, expr):
        return f"{float(expr.p)!r}"

    def _print_Rational(self, expr):
        return f"{float(expr.p) / float(expr.q)!r}"

    def _print_Float(self, expr):
        return repr(float(expr))

    def _print_Half(self, expr):
        return "0.5"

    def _print_NegativeOne(self, expr):
        return "-1.0"

    def _print_One(self, expr):
        return "1.0"

    def _print_Zero(self, expr):
        return "0.0"

    def _print_Exp1(self, expr):
        return repr(float(sympy.E))

    def _print_Pi(self, expr):
        return repr(float(sympy.pi))

    def _print(self, expr, **kwargs):
        # Constant subexpressions (log(2), exp(-1), sqrt(3)) become one float literal.
        if isinstance(expr, sympy.Expr) and expr.is_number and not expr.is_Rational:
            return repr(float(expr))
        return super()._print(expr, **kwargs)

    def _print_exp(self, expr):
        return f"tl.exp({self._print(expr.args[0])})"

    def _print_log(self, expr):
        return f"tl.log({self._print(expr.args[0])})"

    def _print_tanh(self, expr):
        return f"(2.0 * tl.sigmoid(2.0 * {self.parenthesize(expr.args[0], PRECEDENCE['Mul'])}) - 1.0)"

    def _print_Function(self, expr):
        if isinstance(expr, softplus):
            return f"softplus({self._print(expr.args[0])})"
        if isinstance(expr, sigmoid):
            return f"tl.sigmoid({self._print(expr.args[0])})"
        if isinstance(expr, logsigmoid):
            return f"logsigmoid({self._print(expr.args[0])})"
        raise KeyError(f"no Triton form for function {type(expr).__name__}")

    def _print_Pow(self, expr, rational=False):
        base, exponent = expr.args
        if base == 2:
            return f"tl.exp2({self._print(exponent)})"
        if exponent == sympy.Rational(1, 2):
            return f"tl.sqrt({self._print(base)})"
        if exponent == -sympy.Rational(1, 2):
            return f"(1.0 / tl.sqrt({self._print(base)}))"
        if exponent == -1:
            return f"(1.0 / {self.parenthesize(base, PRECEDENCE['Pow'])})"
        if exponent.is_Integer and 2 <= int(exponent) <= 4:
            factor = self.parenthesize(base, PRECEDENCE["Mul"])
            return "(" + " * ".join([factor] * int(exponent)) + ")"
        if exponent.is_Integer and -4 <= int(exponent) <= -2:
            factor = self.parenthesize(base, PRECEDENCE["Mul"])
            return "(1.0 / (" + " * ".join([factor] * -int(exponent)) + "))"
        # general power of a positive base
        return f"tl.exp2({self.parenthesize(exponent, PRECEDENCE['Mul'])} * tl.log2({self._print(base)}))"


def to_triton(expr: sympy.Expr, names: dict[str, str]) -> str:
    """Print `expr` as a Triton expression, with formula symbols renamed through `names`."""
    return TritonPrinter(names).doprint(sympy.sympify(expr))
