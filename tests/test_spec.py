"""Spec validation: every kind of mistake gets one line naming the file, line and key."""
from __future__ import annotations

import pytest

from lrdsl.errors import SpecError
from lrdsl.ir.recurrence import GateKind, InputRole, UpdateRule
from lrdsl.passes.canonicalize import canonicalize
from lrdsl.spec import load_spec, parse_spec

from helpers import ALL_SPECS, spec_path

GOOD = """\
name = "mixer"
summary = "a test mixer"

[recurrence]
update = "delta"
gate = "scalar"

[inputs]
g = "token"
beta = "token"

[formulas]
log_decay = "g"
beta = "beta"
"""


def compile_text(text: str):
    return canonicalize(parse_spec(text, "mixer.toml"))


def error_of(text: str) -> str:
    with pytest.raises(SpecError) as info:
        compile_text(text)
    message = str(info.value)
    assert "\n" not in message, "errors are one line"
    return message


def test_good_spec_compiles():
    rec = compile_text(GOOD)
    assert rec.update is UpdateRule.DELTA and rec.gate is GateKind.SCALAR
    assert [(i.name, i.role) for i in rec.inputs] == [("g", InputRole.TOKEN), ("beta", InputRole.TOKEN)]


@pytest.mark.parametrize("name", ALL_SPECS)
def test_shipped_specs_load(name):
    rec = canonicalize(load_spec(spec_path(name)))
    assert rec.name == name


def test_forgiving_spellings():
    text = GOOD.replace('update = "delta"', 'update = "Delta-Rule"').replace('gate = "scalar"', 'gate = " Scalar "')
    rec = compile_text(text)
    assert rec.update is UpdateRule.DELTA and rec.gate is GateKind.SCALAR


def test_toml_syntax_error_names_line():
    message = error_of(GOOD.replace('gate = "scalar"', 'gate = "scalar'))
    assert message.startswith("mixer.toml:6:") and "invalid TOML" in message


def test_missing_file():
    with pytest.raises(SpecError, match=r"nope\.toml: no such spec file"):
        load_spec("nope.toml")


def test_directory_is_not_a_spec(tmp_path):
    with pytest.raises(SpecError, match="is a directory"):
        load_spec(tmp_path)


def test_unknown_top_level_key():
    message = error_of(GOOD + 'colour = "blue"\n')
    assert message.startswith("mixer.toml:15:") and "colour: unknown key" in message


def test_unknown_recurrence_key():
    message = error_of(GOOD.replace('gate = "scalar"', 'gate = "scalar"\nchunk = 64'))
    assert "mixer.toml:7:" in message and "recurrence.chunk: unknown key" in message


def test_unknown_formula_key():
    message = error_of(GOOD.replace('beta = "beta"\n', 'beta = "beta"\nalpha = "g"\n'))
    assert "formulas.alpha: unknown key" in message and "mixer.toml:15:" in message


def test_wrong_type():
    message = error_of(GOOD.replace('update = "delta"', "update = 3"))
    assert "mixer.toml:5:" in message and "recurrence.update: expected a string" in message and "an integer" in message


def test_unknown_value():
    message = error_of(GOOD.replace('gate = "scalar"', 'gate = "diagonal"'))
    assert "recurrence.gate: unknown value 'diagonal'" in message and "'key_channel'" in message


def test_missing_name():
    message = error_of(GOOD.replace('name = "mixer"\n', ""))
    assert "name: missing required key" in message


def test_bad_name():
    message = error_of(GOOD.replace('name = "mixer"', 'name = "my mixer"'))
    assert "mixer.toml:1:" in message and "name: expected an identifier" in message


def test_missing_recurrence_table():
    text = 'name = "x"\n'
    message = error_of(text)
    assert "recurrence: missing required table [recurrence]" in message


def test_missing_gate():
    message = error_of(GOOD.replace('gate = "scalar"\n', ""))
    assert "recurrence.gate: missing required key" in message


def test_unknown_role():
    message = error_of(GOOD.replace('g = "token"', 'g = "per_token"'))
    assert "mixer.toml:9:" in message and "inputs.g: unknown role 'per_token'" in message


def test_role_wrong_type():
    message = error_of(GOOD.replace('g = "token"', "g = 1.5"))
    assert "inputs.g: expected a role string" in message and "a float" in message


def test_reserved_input_name():
    text = GOOD.replace('g = "token"', 'scale = "token"').replace('log_decay = "g"', 'log_decay = "scale"')
    message = error_of(text)
    assert "inputs.scale: the name 'scale' is reserved" in message


def test_formula_wrong_type():
    message = error_of(GOOD.replace('log_decay = "g"', "log_decay = 0.5"))
    assert "mixer.toml:13:" in message and "formulas.log_decay: expected a formula string" in message


def test_formula_syntax_error():
    message = error_of(GOOD.replace('log_decay = "g"', 'log_decay = "-(g"'))
    assert "mixer.toml:13:" in message and "formulas.log_decay: cannot parse formula" in message


def test_formula_undeclared_name():
    message = error_of(GOOD.replace('log_decay = "g"', 'log_decay = "g * alpha"'))
    assert "formulas.log_decay" in message and "undeclared name 'alpha'" in message


@pytest.mark.parametrize("constant", ["1e400", "-4e38", "0x1" + "0" * 40])
def test_formula_constant_beyond_fp32(constant):
    message = error_of(GOOD.replace('log_decay = "g"', f'log_decay = "g * {constant}"'))
    assert "mixer.toml:13:" in message and "formulas.log_decay" in message and "beyond fp32's range" in message


def test_formula_unknown_function():
    message = error_of(GOOD.replace('log_decay = "g"', 'log_decay = "relu(g)"'))
    assert "formulas.log_decay" in message and "unknown function 'relu'" in message


def test_gate_none_with_decay():
    message = error_of(GOOD.replace('gate = "scalar"', 'gate = "none"'))
    assert "mixer.toml:13:" in message and "formulas.log_decay: given, but recurrence.gate = 'none'" in message


def test_gated_without_decay():
    text = GOOD.replace('g = "token"\n', "").replace('log_decay = "g"\n', "")
    message = error_of(text)
    assert "mixer.toml:6:" in message and "recurrence.gate: gate = 'scalar' needs formulas.log_decay" in message


def test_key_channel_gate_with_constant_decay():
    text = GOOD.replace('gate = "scalar"', 'gate = "key_channel"').replace('g = "token"', 'c = "head_key"')
    text = text.replace('log_decay = "g"', 'log_decay = "c"')
    message = error_of(text)
    assert "formulas.log_decay" in message and "needs a decay per token" in message and "constant" in message


def test_constant_gate_reading_token_input():
    message = error_of(GOOD.replace('gate = "scalar"', 'gate = "constant"'))
    assert "formulas.log_decay: gate = 'constant'" in message and "per-token input 'g'" in message


def test_scalar_gate_reading_key_channel_input():
    message = error_of(GOOD.replace('g = "token"', 'g = "token_key"'))
    assert "formulas.log_decay: gate = 'scalar'" in message and "key_channel" in message


def test_key_channel_gate_without_key_channel_input():
    message = error_of(GOOD.replace('gate = "scalar"', 'gate = "key_channel"'))
    assert "formulas.log_decay: gate = 'key_channel' needs a decay per key channel" in message


def test_head_index_outside_constant_gate():
    message = error_of(GOOD.replace('log_decay = "g"', 'log_decay = "g * h"'))
    assert "formulas.log_decay: the head index h" in message


def test_beta_per_key_channel():
    text = GOOD.replace('beta = "token"', 'beta = "token_key"')
    message = error_of(text)
    assert "formulas.beta: beta is one number per token and head" in message


def test_unused_input():
    message = error_of(GOOD.replace('beta = "token"', 'beta = "token"\nextra = "head"'))
    assert "mixer.toml:11:" in message and "inputs.extra: declared but no formula reads it" in message


def test_inputs_keep_declaration_order(tmp_path):
    rec = canonicalize(load_spec(spec_path("gdn_qwen35")))
    assert [i.name for i in rec.inputs] == ["a", "b", "A_log", "dt_bias"]


DPLR = """\
name = "mixer"

[recurrence]
update = "dplr"
gate = "key_channel"

[inputs]
w = "token_key"
a = "token_key"
b = "token_key"

[formulas]
log_decay = "w"
low_rank_read = "a"
low_rank_write = "b"
"""


def test_dplr_spec_compiles():
    rec = compile_text(DPLR)
    assert rec.update is UpdateRule.DPLR and rec.has_low_rank and not rec.is_delta
    assert (str(rec.low_rank_read), str(rec.low_rank_write)) == ("a", "b")


def test_dplr_without_a_low_rank_vector():
    message = error_of(DPLR.replace('low_rank_write = "b"\n', "").replace('b = "token_key"\n', ""))
    assert "mixer.toml:4:" in message and "recurrence.update: update = 'dplr' needs formulas.low_rank_write" in message


def test_low_rank_vector_without_dplr():
    message = error_of(DPLR.replace('update = "dplr"', 'update = "plain"'))
    assert "mixer.toml:14:" in message
    assert "formulas.low_rank_read: given, but update = 'plain' has no low-rank term (that is update = 'dplr')" in message


def test_dplr_low_rank_vector_must_be_per_key_channel():
    message = error_of(DPLR.replace('b = "token_key"', 'b = "token"'))
    assert "formulas.low_rank_write: is a vector per key channel, but the formula reads no token_key/head_key input" in message


def test_dplr_needs_a_key_channel_gate():
    text = DPLR.replace('gate = "key_channel"', 'gate = "scalar"').replace('w = "token_key"', 'w = "token"')
    message = error_of(text)
    assert "mixer.toml:5:" in message and "recurrence.gate: update = 'dplr' takes gate = 'key_channel'" in message


# -- the delta rule's read vector and written value -------------------------------------------------

DELTA_VECTORS = """\
name = "mixer"

[recurrence]
update = "delta"
gate = "key_channel"

[inputs]
g = "token_key"
b = "token_key"
w = "token_value"

[formulas]
log_decay = "g"
delta_read = "b * k"
write_value = "w * v"
"""


def test_delta_read_and_write_value_compile():
    rec = compile_text(DELTA_VECTORS)
    assert str(rec.delta_read) == "b*k" and str(rec.write_value) == "v*w"
    assert rec.input("w").role is InputRole.TOKEN_VALUE and InputRole.TOKEN_VALUE.shape == ("B", "T", "HV", "V")
    assert rec.is_per_key_channel(rec.delta_read) and rec.is_per_value_channel(rec.write_value)


@pytest.mark.parametrize("update", ["plain", "dplr"])
def test_delta_vectors_without_the_delta_rule(update):
    message = error_of(DELTA_VECTORS.replace('update = "delta"', f'update = "{update}"')
                       .replace('log_decay = "g"', 'log_decay = "g"\nlow_rank_read = "0.1 * b"\nlow_rank_write = "0.1 * g"'
                                if update == "dplr" else 'log_decay = "g"'))
    line = 16 if update == "dplr" else 14
    assert message.startswith(f"mixer.toml:{line}: formulas.delta_read: given, but update = '{update}' has no delta "
                              "residual (that is update = 'delta')"), message


def test_write_value_must_read_v():
    message = error_of(DELTA_VECTORS.replace('write_value = "w * v"', 'write_value = "w"'))
    assert message == "mixer.toml:15: formulas.write_value: is the value written per value channel; it must read v"


def test_write_value_is_per_value_channel():
    message = error_of(DELTA_VECTORS.replace('write_value = "w * v"', 'write_value = "w * v * sigmoid(b)"'))
    assert message.startswith("mixer.toml:15: formulas.write_value: is a vector per value channel, but it reads "
                              "per-key-channel input 'b'")


def test_delta_read_is_per_key_channel():
    text = GOOD.replace('[inputs]', '[inputs]\nr = "token"').replace('beta = "beta"', 'beta = "beta"\ndelta_read = "r"')
    message = error_of(text)
    assert message.startswith("mixer.toml:16: formulas.delta_read: is a vector per key channel, but the formula reads "
                              "neither k nor a token_key/head_key input")


@pytest.mark.parametrize("key, formula, vector", [("log_decay", "g * sigmoid(k)", "k"), ("beta", "sigmoid(v)", "v"),
                                                  ("delta_read", "b * k * v", "v"), ("write_value", "v * k", "k")])
def test_k_and_v_only_where_the_delta_vectors_read_them(key, formula, vector):
    line = {"log_decay": 13, "beta": 14, "delta_read": 14, "write_value": 15}[key]
    text = DELTA_VECTORS.replace('log_decay = "g"', 'log_decay = "g"\nbeta = "0.5"') if key == "beta" else DELTA_VECTORS
    text = text.replace(f'{key} = "{dict(log_decay="g", beta="0.5", delta_read="b * k", write_value="w * v")[key]}"',
                        f'{key} = "{formula}"')
    message = error_of(text)
    assert message.startswith(f"mixer.toml:{line}: formulas.{key}: reads {vector}, which only formulas."), message


def test_token_value_input_only_in_the_written_value():
    text = GOOD.replace('[inputs]', '[inputs]\nx = "token_value"').replace('beta = "beta"', 'beta = "beta * sigmoid(x)"')
    message = error_of(text)
    assert message.startswith("mixer.toml:15: formulas.beta: reads token_value input 'x' (a V-vector per token), "
                              "which only formulas.write_value may read")


def test_delta_vectors_take_no_head_index():
    message = error_of(DELTA_VECTORS.replace('write_value = "w * v"', 'write_value = "w * v * h"'))
    assert message.startswith("mixer.toml:15: formulas.write_value: the head index h may only appear")


def test_token_value_shape_is_checked_at_the_call(generator):
    """A generated module refuses a token_value input of the wrong shape in one line."""
    import torch

    import lrdsl
    from lrdsl.errors import InputError

    mod = lrdsl.load(spec_path("gdn2"))
    q = k = torch.randn(1, 4, 1, 8)
    v = torch.randn(1, 4, 2, 6)
    g, b = -torch.rand(1, 4, 2, 8), torch.rand(1, 4, 2, 8)
    with pytest.raises(InputError, match=r"w must be \[B, T, HV, V\] = \[1, 4, 2, 6\], got \[1, 4, 2, 8\]"):
        mod.recurrent(q, k, v, g, b, torch.rand(1, 4, 2, 8))
