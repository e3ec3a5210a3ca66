"""The shapes `lrdsl bench` times, the modes it runs them in, and how much of each the oracle checks."""
from __future__ import annotations

import torch

from ...errors import LrdslError
from ...verification.workloads import Shape


TRAINING_SHAPES = (
    Shape(4, 4096, 16, 32, 128, 128),
    Shape(1, 32768, 16, 32, 128, 128),
    Shape(1, 65536, 2, 8, 128, 128),
)
DECODE_SHAPES = tuple(Shape(B, 1, 16, 32, 128, 128) for B in (1, 64, 256, 1024))
# the family's comparison shape (every spec with an FLA counterpart against it): no GVA
FAMILY_SHAPES = (Shape(4, 4096, 16, 16, 128, 128),)
SHAPE_GROUPS = {"training": TRAINING_SHAPES, "family": FAMILY_SHAPES, "decode": DECODE_SHAPES}

FORWARD, FORWARD_BACKWARD, DECODE, DECODE_GRAPH = "fwd", "fwd+bwd", "decode", "decode graph"
MODES = (FORWARD, FORWARD_BACKWARD, DECODE, DECODE_GRAPH)
# --serving rows (lrdsl only): what runs, its state dtype, and state rows read / written per call
POOL, POOL_BF16, POOL_INT8, VERIFY, VERIFY_COMMIT = "pool", "pool bf16", "pool int8", "verify", "verify+commit"
GRAPH = " graph"  # the same call as a CUDA-graph replay
SERVING_CALLS = {POOL: (torch.float32, 2), POOL_BF16: (torch.bfloat16, 2), POOL_INT8: (torch.int8, 2),
                 VERIFY: (torch.float32, 1),
                 VERIFY_COMMIT: (torch.float32, 3)}
DRAFT_TOKENS = 4

# The oracle is a float64 Python loop over tokens (about ten kernel launches per token on a GPU;
# for gradients autograd keeps about 8.4 MiB per token at 32 heads of 128 x 128). So it runs on
# a prefix: the first sequences' first ORACLE_TOKENS tokens, all heads (slicing heads would give
# FLA a new autotuning key, minutes of tuning; slicing B and T does not). At the training shapes
# that is about a second and 9 GiB. Each implementation is re-run on the same prefix for the
# final state and the gradients (which depend on every token), and its full-shape o is checked
# on the prefix too; the full-shape outputs are cross-checked against the other
# implementation's. Decode (T = 1) checks every sequence: one step each.
ORACLE_TOKENS = 1024

LRDSL = "lrdsl"


def shape_label(shape: Shape) -> str:
    """BxTxHxHV (xKxV when not 128): the form `--shapes` takes back."""
    label = f"{shape.B}x{shape.T}x{shape.H}x{shape.HV}"
    return label if (shape.K, shape.V) == (128, 128) else f"{label}x{shape.K}x{shape.V}"


def parse_shapes(text: str) -> list[Shape]:
    """Comma-separated: a group (training, family, decode), a known shape by BxT (4x4096, 256x1;
    the first group that has one names it), or any shape as BxTxHxHV or BxTxHxHVxKxV (K = V = 128
    unless given). T = 1 is a decode shape."""
    known: dict[str, Shape] = {}
    for group in SHAPE_GROUPS.values():
        for s in group:
            known.setdefault(f"{s.B}x{s.T}", s)
    shapes: list[Shape] = []
    for token in (t.strip() for t in text.split(",")):
        if token in SHAPE_GROUPS:
            shapes += SHAPE_GROUPS[token]
        elif token in known:
            shapes.append(known[token])
        else:
            shapes.append(_parse_shape_token(token, known))
    return list(dict.fromkeys(shapes))  # in order, each once


def _parse_shape_token(token: str, known: dict) -> Shape:
    usage = (f"--shapes: {token!r} is not a shape; give {', '.join(SHAPE_GROUPS)}, one of {', '.join(known)}, "
             "or BxTxHxHV[xKxV]")
    try:
        values = [int(x) for x in token.split("x")]
    except ValueError:
        raise LrdslError(usage) from None
    if len(values) not in (4, 6) or min(values) < 1:
        raise LrdslError(usage)
    B, T, H, HV, K, V = values if len(values) == 6 else values + [128, 128]
    if HV % H:
        raise LrdslError(f"--shapes: {token!r}: HV = {HV} is not a multiple of H = {H}")
    return Shape(B, T, H, HV, K, V)


def is_decode(shape: Shape) -> bool:
    return shape.T == 1


def modes_for(shape: Shape, backward: bool, device: str) -> tuple[str, ...]:
    """Decode shapes: eager, and as a CUDA-graph replay (GPU only); training shapes: forward, and
    forward + backward when asked."""
    if is_decode(shape):
        return (DECODE, DECODE_GRAPH) if device == "cuda" else (DECODE,)
    return (FORWARD, FORWARD_BACKWARD) if backward else (FORWARD,)


def oracle_prefix(shape: Shape, tokens: int = ORACLE_TOKENS) -> tuple[int, int]:
    """(sequences, tokens) of the prefix the oracle checks (see ORACLE_TOKENS)."""
    if is_decode(shape):
        return shape.B, 1
    T = min(shape.T, tokens)
    return max(1, min(shape.B, tokens // T)), T
