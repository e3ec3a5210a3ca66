"""Formulas of in-kernel activations (gate and beta), as sympy expressions.

Specs write formulas as text, e.g. ``-exp(A_log) * softplus(a + dt_bias)``. They are parsed into
sympy with a closed vocabulary of functions so that the same expression can be
 - printed as Triton (lrdsl.codegen.printer),
 - evaluated in float64 by the oracle (lrdsl.reference),
 - differentiated for the backward (sympy.diff, using the `fdiff` rules below).
"""
from __future__ import annotations

import ast
import io
import tokenize

import sympy
from sympy.core.evalf import prec_to_dps
from sympy.core.function import AppliedUndef
from sympy.parsing.sympy_parser import convert_xor, parse_expr, standard_transformations


class softplus(sympy.Function):
    """log(1 + exp(x)), printed in an overflow-safe form. Positive for real x."""

    def fdiff(self, argindex=1):
        return sigmoid(self.args[0])

    def _eval_evalf(self, prec):  # numbers: softplus(1) folds to a constant like exp(1)
        return _evalf(self, prec, lambda x: sympy.log(1 + sympy.exp(x)))

    def _eval_is_real(self):
        return self.args[0].is_real

    def _eval_is_positive(self):
        return self.args[0].is_real


class sigmoid(sympy.Function):
    """1 / (1 + exp(-x)). Positive for real x."""

    def fdiff(self, argindex=1):
        # sigmoid(x) sigmoid(-x), not s (1 - s): 1 - s cancels to 0 in float32 from x ~ 17 on,
        # where sigmoid(-x) still carries exp(-x)
        return sigmoid(self.args[0]) * sigmoid(-self.args[0])

    def _eval_evalf(self, prec):
        return _evalf(self, prec, lambda x: 1 / (1 + sympy.exp(-x)))

    def _eval_is_real(self):
        return self.args[0].is_real

    def _eval_is_positive(self):
        return self.args[0].is_real


class logsigmoid(sympy.Function):
    """log(sigmoid(x)) = -softplus(-x). Negative for real x."""

    def fdiff(self, argindex=1):
        return sigmoid(-self.args[0])

    def _eval_evalf(self, prec):
        return _evalf(self, prec, lambda x: -sympy.log(1 + sympy.exp(-x)))

    def _eval_is_real(self):
        return self.args[0].is_real

    def _eval_is_negative(self):
        return self.args[0].is_real


class tanh(sympy.tanh):
    """sympy's tanh, with a derivative that survives saturation."""

    def fdiff(self, argindex=1):
        # 4 sigmoid(2x) sigmoid(-2x), not 1 - tanh(x)^2: the latter cancels in float32 (6 % off
        # at x = 8, exactly 0 from x ~ 9 on), where sigmoid(-2x) still carries exp(-2x)
        return 4 * sigmoid(2 * self.args[0]) * sigmoid(-2 * self.args[0])


class selected(sympy.Function):
    """selected(s, x): x where s != 0, else 0. Internal (no spec calls it): lower_steps confines a
    log-decay to a token's first sub-step with it. Not s * x: a hard reset's x = -inf times s = 0 is
    NaN, where the sub-step must decay by exactly nothing. Its derivative in x is selected(s, 1),
    so the gradient of an unselected row is 0 whatever x's derivative there; s is a 0/1 mask with
    no gradient."""

    def fdiff(self, argindex=1):
        if argindex == 1:
            return sympy.Integer(0)
        return selected(self.args[0], sympy.Integer(1))

    def _eval_is_real(self):
        return self.args[1].is_real


def _evalf(fn: sympy.Function, prec: int, elementary):
    """evalf of one of the functions above: a number at a number (through its elementary form),
    else the function of its argument's evalf (constants inside fold, the function stays)."""
    (arg,) = fn.args
    if arg.is_number:
        return elementary(arg)._eval_evalf(prec)
    return fn.func(arg.evalf(prec_to_dps(prec)))


# The functions a spec may call. Anything else is an error at parse time.
FUNCTIONS: dict[str, type] = {
    "exp": sympy.exp,
    "log": sympy.log,
    "sqrt": sympy.sqrt,
    "tanh": tanh,
    "softplus": softplus,
    "sigmoid": sigmoid,
    "logsigmoid": logsigmoid,
}

# Symbols every formula may use without declaring them.
HEAD_INDEX = sympy.Symbol("h")  # the value-head index, 0 .. HV-1 (for constant per-head decays)
RESERVED = {"h": HEAD_INDEX}


# The largest finite fp32 value: the kernels' arithmetic type for every input dtype but fp64.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_SMALLEST_NORMAL = 1.1754943508222875e-38  # GPU kernels flush smaller numbers to 0


class FormulaSyntaxError(ValueError):
    """The text is not a formula lrdsl understands; the message says why in one line."""


def parse_formula(text: str, allowed: set[str]) -> sympy.Expr:
    """Parse `text` into a sympy expression over the symbols in `allowed` (plus the reserved ones)."""
    if not isinstance(text, str) or not text.strip():
        raise FormulaSyntaxError("expected a non-empty formula string")
    names = {name: sympy.Symbol(name) for name in allowed}
    local = {**FUNCTIONS, **RESERVED, **names}
    namespace = {
        "__builtins__": {},
        "Symbol": sympy.Symbol,
        "Integer": sympy.Integer,
        "Float": sympy.Float,
        "Rational": sympy.Rational,
        "Function": sympy.Function,
    }
    try:
        aliased, aliases = _aliased_names(text, {**RESERVED, **names}, namespace)
        expr = parse_expr(
            aliased,
            local_dict={**FUNCTIONS, **aliases},
            global_dict=namespace,
            transformations=standard_transformations + (convert_xor,),
        )
    except FormulaSyntaxError:
        raise
    except Exception as exc:  # sympy raises SyntaxError, TokenError, TypeError, NameError ...
        raise FormulaSyntaxError(f"cannot parse formula {text!r}: {type(exc).__name__}") from None
    if not isinstance(expr, sympy.Expr):
        raise FormulaSyntaxError(f"formula {text!r} is not an arithmetic expression")
    unknown_functions = sorted({type(f).__name__ for f in expr.atoms(AppliedUndef)})
    if unknown_functions:
        known = ", ".join(sorted(FUNCTIONS))
        raise FormulaSyntaxError(
            f"formula {text!r} calls unknown function {unknown_functions[0]!r} (known: {known})"
        )
    unknown_symbols = sorted(str(s) for s in expr.free_symbols if str(s) not in local)
    if unknown_symbols:
        declared = ", ".join(sorted(allowed)) or "none"
        raise FormulaSyntaxError(
            f"formula {text!r} uses undeclared name {unknown_symbols[0]!r} "
            f"(declared inputs: {declared}; reserved: h)"
        )
    if expr.has(sympy.I, sympy.zoo, sympy.nan, sympy.oo):
        raise FormulaSyntaxError(f"formula {text!r} is not a finite real expression")
    # a number written beyond fp32's range (sympy keeps 1e400 exactly) is inf in the kernels
    beyond = [n for n in written_numbers(text) if abs(ast.literal_eval(n)) > FLOAT32_MAX]  # 0x10, 1_000 too
    if beyond:
        raise FormulaSyntaxError(
            f"formula {text!r} writes the number {beyond[0]}, beyond fp32's range (|x| <= 3.4e38): "
            "the kernels would compute inf"
        )
    return whole_exponents_as_integers(expr)


def _aliased_names(text: str, symbols: dict[str, sympy.Symbol], namespace: dict) -> tuple[str, dict]:
    """(text with each name of `symbols` written as an alias, {alias: its symbol}).

    sympy's parser writes each number as a call (`Integer(2)`, `Float('0.5')`) and evaluates it
    with the formula's names in scope: an input named Float or Integer would be called in its
    place. Aliases (names starting with '_', which no input may have) keep the inputs out of
    the parser's way, whatever they are called. A name the formula does not declare that is one
    of the parser's own is refused as undeclared here (sympy would call it)."""
    aliases: dict[str, sympy.Symbol] = {}
    alias_of: dict[str, str] = {}
    tokens = []
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        kind, string = token.type, token.string
        if kind == tokenize.NAME and string in symbols:
            if string not in alias_of:
                alias_of[string] = f"_formula_name_{len(alias_of)}"
                aliases[alias_of[string]] = symbols[string]
            string = alias_of[string]
        elif kind == tokenize.NAME and string in namespace:
            raise FormulaSyntaxError(f"formula {text!r} uses undeclared name {string!r}")
        tokens.append((kind, string))
    return tokenize.untokenize(tokens), aliases


def whole_exponents_as_integers(expr: sympy.Expr) -> sympy.Expr:
    """x**2.0 as x**2: sympy treats a Float exponent as possibly fractional, so it cannot tell
    that x**2.0 is real and non-negative, and softplus(x**2.0) would not count as positive."""
    return expr.replace(
        lambda e: e.is_Pow and e.exp.is_Float and float(e.exp).is_integer(),
        lambda e: sympy.Pow(e.base, int(e.exp)),
    )


def written_numbers(text: str) -> list[str]:
    """The numeric literals of a formula's text as written (the text has parsed already)."""
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return [token.string for token in tokens if token.type == tokenize.NUMBER]


def as_real(expr: sympy.Expr) -> sympy.Expr:
    """`expr` with what lrdsl knows about its symbols: inputs are real, h a non-negative integer."""
    known = {
        s: sympy.Symbol(s.name, integer=True, nonnegative=True) if s == HEAD_INDEX else sympy.Symbol(s.name, real=True)
        for s in expr.free_symbols
    }
    return expr.xreplace(known)


def derivative(expr: sympy.Expr, symbol: sympy.Symbol) -> sympy.Expr:
    """d expr / d symbol, over the same (plain) symbols as `expr`.

    Differentiated with the inputs known real: on plain symbols sympy's simplifications ask
    whether each tanh or exp argument is real, and for some nested powers that question does
    not finish (d/dx of tanh(y + (tanh(x)**2 + 1)**(-12)) ran for hours inside Mod and gcd);
    on real symbols it is answered at once."""
    plain = {as_real(s): s for s in expr.free_symbols}
    return sympy.diff(as_real(expr), as_real(symbol)).xreplace(plain)


def is_nonnegative(expr: sympy.Expr) -> bool:
    """Whether `expr` is >= 0 for every value of its (real) inputs, as far as sympy can tell."""
    return as_real(expr).is_nonnegative is True


def integer_exponent(exponent: sympy.Expr) -> int | None:
    """The exponent as an int when it is an integer (2 or 2.0), else None."""
    if exponent.is_Integer:
        return int(exponent)
    if exponent.is_Float and float(exponent).is_integer():
        return int(exponent)
    return None


def constant_beyond_float32(expr: sympy.Expr) -> float | None:
    """The value of a formula without inputs when float32 cannot hold it (nonzero but below its
    smallest normal number, or above its largest: the kernels would compute 0 or inf), else None."""
    if expr.free_symbols:
        return None
    value = abs(float(expr.evalf(30)))
    if value == 0 or FLOAT32_SMALLEST_NORMAL <= value <= FLOAT32_MAX:
        return None
    return float(expr.evalf(30))


def non_real_powers(expr: sympy.Expr) -> list[sympy.Pow]:
    """The powers in `expr` with no real value for some real inputs: a non-integer exponent of a
    base that may be negative (x**0.5, x**(1/3), x**y), or of a negative number."""
    return [
        p
        for p in sorted(expr.atoms(sympy.Pow), key=sympy.default_sort_key)
        if integer_exponent(p.exp) is None and not is_nonnegative(p.base)
    ]


def symbols_of(expr: sympy.Expr) -> frozenset[str]:
    return frozenset(str(s) for s in expr.free_symbols)


def fold_constants(expr: sympy.Expr) -> sympy.Expr:
    """Every constant subexpression as one float (20 digits): evalf alone leaves the constants
    inside functions of symbols, log(x + tanh(2)), which torch functions cannot take."""
    if expr.is_Atom:  # symbols and numbers (integer exponents stay integers)
        return expr
    if expr.is_number:
        return sympy.Float(expr.evalf(20), 20)
    return expr.func(*(fold_constants(arg) for arg in expr.args))


def torch_function(expr: sympy.Expr):
    """(symbols, fn): `fn(*tensors)` evaluates `expr` with torch ops, float64 constants folded.

    Used by the float64 oracle and the chunk-program evaluator, never by generated code.
    """
    import torch
    import torch.nn.functional as F

    functions = {
        "exp": torch.exp,
        "log": torch.log,
        "sqrt": torch.sqrt,
        "tanh": torch.tanh,
        "softplus": F.softplus,
        "sigmoid": torch.sigmoid,
        "logsigmoid": F.logsigmoid,
        "selected": lambda s, x: torch.where(torch.as_tensor(s) != 0, x, torch.zeros_like(torch.as_tensor(x))),
    }
    symbols = sorted(expr.free_symbols, key=str)
    fn = sympy.lambdify(symbols, fold_constants(expr), modules=[functions, "math"])

    def evaluate(*values):
        out = fn(*values)
        return out if isinstance(out, torch.Tensor) else torch.tensor(float(out), dtype=torch.float64)

    return symbols, evaluate
