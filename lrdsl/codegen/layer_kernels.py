"""Emitter of the layer kernels around the recurrence: the depthwise causal short convolution and
the gated RMSNorm of a Gated DeltaNet layer.

Both are generated from templates like the recurrence kernels: the activations are sympy formulas
of one variable, differentiated by sympy and printed through the one Triton printer, so a layer
with another activation needs a new formula here, not new kernel code.
"""
from __future__ import annotations

import sympy

from ..version import __version__
from ..errors import CompileError
from ..ir.formula import sigmoid
from .printer import HELPERS, to_triton
from .templating import host_code, render

_x = sympy.Symbol("x")

# Activation formulas by the names transformers' configs use (hidden_act).
ACTIVATIONS: dict[str, sympy.Expr] = {
    "silu": _x * sigmoid(_x),
    "swish": _x * sigmoid(_x),
    "sigmoid": sigmoid(_x),
    "identity": _x,
}


def _printed(activation: str, variable: str) -> tuple[str, str]:
    """(activation, its derivative) of `variable`, as Triton expressions."""
    if activation not in ACTIVATIONS:
        known = ", ".join(sorted(ACTIVATIONS))
        raise CompileError(f"unknown activation {activation!r}; known: {known}")
    formula = ACTIVATIONS[activation]
    names = {"x": variable}
    return to_triton(formula, names), to_triton(sympy.diff(formula, _x), names)


def emit_layer_kernels(conv_activation: str = "silu", gate_activation: str = "silu") -> str:
    """The source of one module with the short-convolution and gated-norm kernels and their autograd."""
    conv_act, conv_act_grad = _printed(conv_activation, "pre")
    gate_act, gate_act_grad = _printed(gate_activation, "gate")
    short_conv = render(
        "short_conv.py.jinja",
        activation_name=conv_activation,
        act=conv_act,
        act_grad=conv_act_grad,
    )
    gated_norm = render(
        "gated_norm.py.jinja",
        activation_name=gate_activation,
        gate_act=gate_act,
        gate_act_grad=gate_act_grad,
    )
    return render(
        "layer_kernels.py.jinja",
        version=__version__,
        conv_activation=conv_activation,
        gate_activation=gate_activation,
        helpers=HELPERS,
        host_helpers=host_code("helpers"),
        sections=[short_conv, gated_norm],
    )
