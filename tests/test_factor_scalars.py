"""The factor_scalars pass (IR in -> IR out): scalar factors of tiles that are only summed move
onto the sums. Its numerics (the factored backward is still the VJP of the forward, and sympy
proves it) are in test_backward.py, parametrized over both backward stages."""
from __future__ import annotations

import pytest
import sympy

from lrdsl.ir.chunk import Formula, MatMul, ReduceSum
from lrdsl.passes.factor_scalars import factor_scalars, split_scalar_factors
from lrdsl.passes.pipeline import run_pipeline
from lrdsl.passes.verify import verify
from lrdsl.spec import load_spec

from helpers import spec_path


def _stages(name):
    return run_pipeline(load_spec(spec_path(name)), until="backward_factored", check=True)


def _ops(prog):
    return {op.out: op for op in prog.ops}


def test_split_scalar_factors():
    H, dH, G_last, scale = sympy.symbols("H d_H_next G_last scale")
    rank0 = {"G_last", "scale"}
    scalar, rest = split_scalar_factors(2 ** G_last * H * dH * sympy.log(2), rank0)
    assert (scalar, rest) == (2 ** G_last * sympy.log(2), H * dH)
    assert split_scalar_factors(-H, rank0) == (-1, H)
    assert split_scalar_factors(H + scale, rank0) == (1, H + scale)  # a sum is not a product
    assert split_scalar_factors(scale * G_last, rank0) == (scale * G_last, 1)  # nothing of a tile left


def test_gdn_backward_factors():
    """gdn: the output gradient's scale and the -1 of d_WH leave the matmuls contracting V; the
    decay's factors leave the state-gradient sum; matmuls contracting C keep their operands."""
    st = _stages("gdn")
    before, after = _ops(st["backward"]), _ops(st["backward_factored"])
    d_O, scale, G_last = sympy.symbols("d_O scale G_last")
    # (d_O*scale) @ Vn^T and @ H^T  ->  scale * (d_O @ .)
    for value, b in (("d_QKt_decayed_via_QKtVn", "Vn"), ("d_q_decayed_via_QH", "H")):
        assert before[value] == MatMul(value, before[value].shape, before[value].a, b, transpose_b=True)
        unscaled = after[f"{value}_unscaled"]
        assert isinstance(unscaled, MatMul) and (unscaled.a, unscaled.b, unscaled.transpose_b) == ("d_O", b, True)
        assert after[value] == Formula(value, before[value].shape, scale * sympy.Symbol(f"{value}_unscaled"))
    # (-d_Vn) @ H^T  ->  -(d_Vn @ H^T)
    assert (after["d_W_via_WH_unscaled"].a, after["d_W_via_WH"].expr) == ("d_Vn", -sympy.Symbol("d_W_via_WH_unscaled"))
    # sum(2**G_last*H*d_H_next*log(2))  ->  2**G_last*log(2) * sum(H*d_H_next)
    assert after["d_G_last_via_H_next_tile_unscaled"].expr == sympy.Symbol("H") * sympy.Symbol("d_H_next")
    assert isinstance(after["d_G_last_via_H_next_unscaled"], ReduceSum)
    assert after["d_G_last_via_H_next"].expr == 2 ** G_last * sympy.log(2) * sympy.Symbol("d_G_last_via_H_next_unscaled")
    assert "d_G_last_via_H_next_tile" not in after  # its only reader was the sum
    # the backward scan's d_H = q_decayed^T @ (d_O*scale) contracts C: its operand stays scaled
    assert after["d_H_via_QH"] == before["d_H_via_QH"] and after["d_QH_via_O"] == before["d_QH_via_O"]
    assert after["d_H_via_WH"].b == "d_WH_via_Vn"
    assert st["backward_factored"].outputs == st["backward"].outputs


@pytest.mark.parametrize("name", ["gdn", "kda", "rwkv7", "linear_attn", "retnet"])
def test_factored_programs_verify_and_are_fixed_points(name):
    st = _stages(name)
    factored = st["backward_factored"]
    verify(factored)
    assert factor_scalars(factored) == factored
    assert len(factored.ops) > len(st["backward"].ops)  # every spec's output gradient is scaled
    # no value reads a scaled operand that was dropped
    names = {op.out for op in factored.ops}
    assert all(arg in names for op in factored.ops for arg in op.args())


def test_forward_and_chunk_stages_are_untouched():
    st = _stages("gdn")
    assert "backward_factored" in st and all("_unscaled" not in op.out for op in st["chunk"].ops)
