"""One InputError: every bad argument lrdsl's functions, its generated modules, the layer and
lrdsl.ops refuse is an lrdsl.InputError, which is an LrdslError (the CLI's one-line errors) and a
ValueError (as Python's own argument checks raise)."""
from __future__ import annotations

import pytest
import torch

import lrdsl
from lrdsl.errors import InputError, LrdslError
from lrdsl.verification.workloads import Shape, make_inputs

from helpers import recurrence


def test_input_error_is_a_value_error_and_lrdsl_error():
    assert lrdsl.InputError is InputError
    assert issubclass(InputError, ValueError) and issubclass(InputError, LrdslError)


def test_generated_modules_raise_lrdsls_input_error(generator):
    """`except lrdsl.InputError` catches a generated module's: before, each module defined its own class."""
    mod = lrdsl.load("gdn")
    assert mod.InputError is lrdsl.InputError
    q, k, v, g, beta = make_inputs(recurrence("gdn"), Shape(1, 8, 1, 2, 16, 24), generator=generator)
    with pytest.raises(lrdsl.InputError, match=r"gdn\.chunk: .*g must be"):
        mod.chunk(q, k, v, g[..., :1, None], beta)


def test_layer_kernels_raise_lrdsls_input_error():
    from lrdsl.layers.kernels import layer_kernels

    assert layer_kernels().InputError is lrdsl.InputError


def test_layer_shape_errors_are_value_errors():
    """Before, the layer raised a bare LrdslError, which `except ValueError` missed."""
    from test_layer import tiny_config

    layer = lrdsl.layers.GatedDeltaNet(tiny_config(), layer_idx=0)
    with pytest.raises(ValueError, match=r"hidden_states must be \[B, T, 32\], got \[2, 5, 31\]") as error:
        layer(torch.randn(2, 5, 31))
    assert isinstance(error.value, lrdsl.InputError)


def test_ops_option_errors_are_input_errors():
    from lrdsl.ops import OptionError, chunk_gated_delta_rule

    assert issubclass(OptionError, lrdsl.InputError)
    with pytest.raises(lrdsl.InputError, match="cp_context"):
        chunk_gated_delta_rule(*[torch.zeros(1)] * 5, cp_context=object())


def test_load_takes_no_options():
    """lrdsl.load(spec) took **options and refused every one: the kernels' options are per call."""
    with pytest.raises(TypeError, match="chunk_size"):
        lrdsl.load("gdn", chunk_size=16)
