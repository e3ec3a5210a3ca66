"""How a spec's names reach generated code, and which names a spec may not take.

A spec names its inputs freely, so generated code keeps them in namespaces of their own rather
than beside its own names:

- an input `x` is the pointer (kernel parameter, launcher local) `in_x`, its register in the
  recurrent kernel `b_in_x` and its gradient `d_in_x`; no name the templates define starts with
  `in_`, `b_in_` or `d_in_`;
- a chunk-program value `x` (inputs keep their names there, the passes give the others fresh
  ones) is the register `b_x`, its buffer `buf_x`, a saved forward buffer `saved_x`; no name the
  templates or emitters define starts with `b_`, `buf_` or `saved_` in the chunk kernels;
- the public functions take the inputs under the spec's names as parameters and hand them at
  once, as one tuple, to a private function: their bodies read no other name, so a parameter
  can shadow nothing. The module's own names all start with `_` except the public ones.

What a spec cannot take, then, is exactly: q, k, v (the positional tensors before the inputs),
the keyword options of the public functions, `h` (the head index in formulas), the functions of
the formula language, Python keywords, and names starting with `_` (the module's private ones).
`reserved_input_name` derives that from the lists below, which the templates render.
"""
from __future__ import annotations

import keyword

from ..ir.formula import FUNCTIONS, RESERVED

INPUT_PREFIX = "in_"
POSITIONAL = ("q", "k", "v")

# The keyword options of the public functions (name, default as source text), in order.
_CALL_OPTIONS = (
    ("scale", "None"),
    ("initial_state", "None"),
    ("output_final_state", "False"),
    ("cu_seqlens", "None"),
    ("use_qk_l2norm_in_kernel", "False"),
)
# Where states live: their layout (state_v_first: [.., HV, V, K]), and a pool of them read and
# written in place (state_pool [P, HV, K, V], state_indices [N]; validate: check the indices on
# the host, which a CUDA-graph capture cannot do).
STATE_OPTIONS = (
    ("state_v_first", "False"),
    ("state_pool", "None"),
    ("state_indices", "None"),
    ("validate", "True"),
)
RECURRENT_OPTIONS = _CALL_OPTIONS + STATE_OPTIONS + (("out", "None"),)  # out: a caller's buffer for o
CHUNK_OPTIONS = _CALL_OPTIONS + (
    ("chunk_size", "None"),  # the largest that fits a GPU block: largest_chunk_size(K, precision, dtype, V)
    ("plan", "None"),
    ("chunk_indices", "None"),
    ("save_policy", "None"),
    ("precision", '"input"'),
) + STATE_OPTIONS
# verify(): draft tokens against pool rows, which it only reads; draft: the buffers of an earlier
# verify() to fill again (a CUDA graph replays into the same memory)
VERIFY_OPTIONS = (
    ("state_pool", "None"),
    ("state_indices", "None"),
    ("scale", "None"),
    ("cu_seqlens", "None"),
    ("use_qk_l2norm_in_kernel", "False"),
    ("state_v_first", "False"),
    ("validate", "True"),
    ("out", "None"),
    ("draft", "None"),
    ("parents", "None"),
)
# chunk() only: the state at the start of every chunk returned too (FLA's option of that name), a
# forward without gradients that chunk() runs itself rather than passing it on to _chunk
STATES_OPTIONS = (("return_intermediate_states", "False"),)
# ... and a pool prefill's checkpoints: the state after every checkpoint_every tokens of sequence n
# written into pool row checkpoint_indices[n, m] (chunk() also runs this call itself)
CHECKPOINT_OPTIONS = (("checkpoint_every", "None"), ("checkpoint_indices", "None"))
# chunk() only: context parallelism (lrdsl.distributed.build_cp_context), which runs chunk() itself
# on the rank's slice, so it is not among the options passed on to the private functions
CP_OPTIONS = (("cp_context", "None"),)
ALL_OPTIONS = RECURRENT_OPTIONS + CHUNK_OPTIONS + STATES_OPTIONS + CHECKPOINT_OPTIONS + CP_OPTIONS + VERIFY_OPTIONS


def input_pointer(name: str) -> str:
    """The pointer (kernel parameter, launcher local) of spec input `name`; q, k, v keep theirs."""
    return name if name in POSITIONAL else INPUT_PREFIX + name


def gradient_pointer(name: str) -> str:
    """Where the gradient of q, k, v or a spec input is written: d_q, d_k, d_v, d_in_<name>."""
    return "d_" + input_pointer(name)


def signature(positional: list[str], options) -> str:
    """`q, k, v, g, beta, scale=None, ...`: a public function's parameters."""
    return ", ".join(list(positional) + [f"{name}={default}" for name, default in options])


def forward_options(options) -> str:
    """`scale=scale, ...`: the options passed on by keyword."""
    return ", ".join(f"{name}={name}" for name, _ in options)


def reserved_input_name(name: str) -> str | None:
    """Why `name` cannot be a spec input (a phrase), or None when it can."""
    if keyword.iskeyword(name):
        return "it is a Python keyword"
    if name.startswith("_"):
        return "names starting with '_' belong to the generated module"
    if name in POSITIONAL:
        return f"{name} is the positional tensor every recurrence takes"
    options = {n for n, _ in ALL_OPTIONS}
    if name in options:
        return f"{name!r} is a keyword option of recurrent()/chunk()/verify()"
    if name in RESERVED:
        return f"{name!r} is the value-head index in formulas"
    if name in FUNCTIONS:
        return f"{name!r} is a function of the formula language"
    return None
