"""The one sympy -> Triton printer. Every formula reaches generated code through `to_triton`.

Numbers print as float literals (so integer-looking constants never turn into integer arithmetic),
2**x prints as tl.exp2(x), and tanh and the activation functions print as the overflow-safe helpers that
every generated module defines (see HELPERS). Integer powers (2.0 counts as one) print as products,
exact for any base; other powers need a base that cannot be negative (the canonicalize pass
refuses the rest) and print as exp2(y * log2(x)).

log(1 + u) prints as log1p(u), and (1 + u)**y as exp(y * log1p(u)): in fp32, 1 + u drops the
digits of a small u (u = 5e-7 keeps one of them), and the derivative sympy takes of a power
carries log(base) as a term of its own (d/dt (1 + t**2)**t holds log(1 + t**2)), where that loss
became a 3 % error in a gradient (a fuzz-drawn spec).
"""
from __future__ import annotations

import sympy
from sympy.printing.precedence import PRECEDENCE
from sympy.printing.str import StrPrinter

from ..errors import CompileError
from ..ir.formula import integer_exponent, is_nonnegative, logsigmoid, selected, sigmoid, softplus

# x**n with |n| up to this prints as n factors; larger powers by repeated squaring
SHORT_POWER = 4

# Triton helpers the printed code may call; the module emitter writes them into every module.
HELPERS = '''\
@triton.jit
def log1p(x):
    """log(1 + x), accurate for small x: log(u) * x / (u - 1) with u = 1 + x rounded (the rounding
    error of u cancels in the ratio), and x itself where u rounds to 1."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))


@triton.jit
def tanh(x):
    """tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|), without overflow. Where e > 1/2
    (|x| < 0.35), 1 - e cancels: it is taken as (1 - e) y / log(e) (the rounding of e cancels in
    the ratio; -y where e rounds to 1), which keeps tanh's relative precision for small |x|
    (2 sigmoid(2x) - 1 came out 1 % off at x = 1e-5 in fp32)."""
    y = -2.0 * tl.abs(x)
    e = tl.exp(y)
    one_minus_e = tl.where(e == 1.0, -y, tl.where(e > 0.5, (1.0 - e) * (y / tl.log(e)), 1.0 - e))
    t = one_minus_e / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def softplus(x):
    """log(1 + exp(x)) without overflow: max(x, 0) + log1p(exp(-|x|))."""
    return tl.maximum(x, 0.0) + log1p(tl.exp(-tl.abs(x)))


@triton.jit
def logsigmoid(x):
    """log(sigmoid(x)) = min(x, 0) - log1p(exp(-|x|))."""
    return tl.minimum(x, 0.0) - log1p(tl.exp(-tl.abs(x)))


@triton.jit
def square(x):
    """x * x: integer powers print as products of repeated squares, e.g. x**5 = square(square(x)) * x."""
    return x * x
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
        rest = _one_plus(expr.args[0])
        if rest is not None:
            return f"log1p({self._print(rest)})"
        return f"tl.log({self._print(expr.args[0])})"

    def _print_tanh(self, expr):
        return f"tanh({self._print(expr.args[0])})"

    def _print_Function(self, expr):
        if isinstance(expr, softplus):
            return f"softplus({self._print(expr.args[0])})"
        if isinstance(expr, sigmoid):
            return f"tl.sigmoid({self._print(expr.args[0])})"
        if isinstance(expr, logsigmoid):
            return f"logsigmoid({self._print(expr.args[0])})"
        if isinstance(expr, selected):
            mask, x = expr.args
            return f"tl.where({self._print(mask)} != 0, {self._print(x)}, 0.0)"
        raise KeyError(f"no Triton form for function {type(expr).__name__}")

    def _print_Pow(self, expr, rational=False):
        base, exponent = expr.args
        n = integer_exponent(exponent)
        if n is not None:
            return self._integer_power(base, n)
        if base == 2:
            return f"tl.exp2({self._print(exponent)})"
        if not is_nonnegative(base):
            raise CompileError(f"{expr}: a non-integer power of a base that may be negative has no real value")
        if exponent == sympy.Rational(1, 2):
            return f"tl.sqrt({self._print(base)})"
        if exponent == -sympy.Rational(1, 2):
            return f"(1.0 / tl.sqrt({self._print(base)}))"
        rest = _one_plus(base)
        if rest is not None:
            return f"tl.exp({self.parenthesize(exponent, PRECEDENCE['Mul'])} * log1p({self._print(rest)}))"
        return f"tl.exp2({self.parenthesize(exponent, PRECEDENCE['Mul'])} * tl.log2({self._print(base)}))"

    def _integer_power(self, base, n: int) -> str:
        """base**n by multiplication (exact for negative bases, unlike exp2(n log2 x)); 1 / that for n < 0."""
        if n == 0:
            return "1.0"
        factor = self.parenthesize(base, PRECEDENCE["Mul"])
        if abs(n) <= SHORT_POWER:
            product = " * ".join([factor] * abs(n))
        else:
            # x**n = product of x**(2**i) over the bits i of n, each a chain of squares
            squares = []
            for bit in range(abs(n).bit_length()):
                if abs(n) >> bit & 1:
                    squares.append(factor if bit == 0 else "square(" * bit + self._print(base) + ")" * bit)
            product = " * ".join(squares)
        return f"({product})" if n > 0 else f"(1.0 / ({product}))"


def _one_plus(expr):
    """u where `expr` is 1 + u (a sum with the constant term 1), else None."""
    if not isinstance(expr, sympy.Add):
        return None
    constant, rest = expr.as_coeff_Add()
    return rest if constant == 1 else None


def to_triton(expr: sympy.Expr, names: dict[str, str]) -> str:
    """Print `expr` as a Triton expression, with formula symbols renamed through `names`."""
    return TritonPrinter(names).doprint(sympy.sympify(expr))
