"""Argument checks and state addressing: the checks every public function of a generated module
runs before launching anything, and the helpers that size, check, read and write state rows.

Host code (lrdsl/codegen/host/__init__.py): copied verbatim into every generated module.
"""
import torch
import triton
import triton.language as tl

from .helpers import _cdiv
from .module_names import INPUTS, SPEC_NAME, InputError

# ---------------------------------------------------------------------------------------------
# Argument checks: every public function runs these before launching anything.
# ---------------------------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_ROLE_SHAPES = {"token": "[B, T, HV]", "token_key": "[B, T, HV, K]", "head": "[HV]", "head_key": "[HV, K]", "token_value": "[B, T, HV, V]"}
MAX_HEAD_DIM = 256
# CUDA caps a grid's first axis at 2**31 - 1 programs and the other two at 65,535: every launch
# puts all its programs on the first axis, and a call that would need more is refused.
MAX_PROGRAMS = 2**31 - 1


def _fail(fn, message):
    raise InputError(f"{SPEC_NAME}.{fn}: {message}")


def _shape(x):
    return "[" + ", ".join(str(d) for d in x.shape) + "]"


def _acc(q):
    """Triton dtype of tiles in registers and of accumulation: fp32, fp64 for fp64 inputs."""
    return tl.float64 if q.dtype == torch.float64 else tl.float32


def _acc_dtype(q):
    """torch dtype of states and fp32 buffers: fp32, fp64 for fp64 inputs."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _is_interpreted(kernel):
    return type(kernel).__name__ == "InterpretedFunction"


def _on_input_device(launcher):
    """`launcher` run with its inputs' CUDA device current. Triton launches on the current
    device, which need not be theirs (tensors on cuda:1 while cuda:0 is current): a kernel would
    then run on the wrong GPU with the other one's addresses. The first argument is q, or the dict
    of a chunked call holding it."""

    def on_input_device(first, *args, **kwargs):
        q = first["q"] if isinstance(first, dict) else first
        with torch.cuda.device(q.device if q.is_cuda else -1):  # -1 selects nothing (CPU tensors)
            return launcher(first, *args, **kwargs)

    on_input_device.__name__, on_input_device.__doc__ = launcher.__name__, launcher.__doc__
    return on_input_device


def _check_programs(fn, programs, what):
    """Refuses a launch of more programs than a grid's first axis holds (see MAX_PROGRAMS)."""
    if programs > MAX_PROGRAMS:
        _fail(fn, f"{what} make {programs} GPU programs, more than one launch can have ({MAX_PROGRAMS}): split the batch")


def _describe(x):
    """A short description of an argument, never a whole tensor."""
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor {_shape(x)}"
    text = repr(x)
    return text if len(text) <= 40 else f"a {type(x).__name__}"


def _scale(fn, scale, K, named):
    """The scale as a Python float: None means K ** -0.5; Python and NumPy numbers and 0-d tensors
    are taken (a 0-d tensor on a GPU costs one synchronisation)."""
    if scale is None:
        return K ** -0.5
    if isinstance(scale, torch.Tensor) and scale.dim() > 0:
        given = ", ".join(f"{name} {_shape(x)}" for name, x in named)
        _fail(fn, f"scale must be a number, got a tensor {_shape(scale)}: one tensor too many? {SPEC_NAME}.{fn} takes "
                  f"{len(named)} tensors ({', '.join(name for name, _ in named)}), given {given}")
    boolean = isinstance(scale, bool) or type(scale).__name__ == "bool_" or (
        isinstance(scale, torch.Tensor) and (scale.dtype == torch.bool or scale.dtype.is_complex))
    numeric = isinstance(scale, (int, float)) or (hasattr(scale, "__float__") and getattr(scale, "shape", None) == ())
    try:
        value = float(scale) if numeric and not boolean else None
    except (TypeError, ValueError):
        value = None
    if value is None or not abs(value) < float("inf"):
        _fail(fn, f"scale must be a finite number, got {_describe(scale)}")
    return value


def _check_call(fn, kernel, q, k, v, extras, scale, initial_state, cu_seqlens, state_v_first=False, values=True):
    """Validate one call; returns (B, T, H, K, HV, V, N, scale as a float). values=False: shapes,
    dtypes and devices only (a custom op's fake implementation sees no values)."""
    named = [("q", q), ("k", k), ("v", v)] + [(name, x) for (name, _), x in zip(INPUTS, extras)]
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            _fail(fn, f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if q.dim() != 4:
        _fail(fn, f"q must be [B, T, H, K], got {_shape(q)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        _fail(fn, f"k must be [B, T, H, K] = {_shape(q)} like q, got {_shape(k)}")
    if v.dim() != 4 or v.shape[0] != B or v.shape[1] != T:
        _fail(fn, f"v must be [B, T, HV, V] with B={B}, T={T} as in q, got {_shape(v)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV == 0 or HV % H != 0:
        _fail(fn, f"the value heads HV={HV} must be a positive multiple of the key heads H={H}")
    if not (0 < K <= MAX_HEAD_DIM and 0 < V <= MAX_HEAD_DIM):
        _fail(fn, f"head dims K={K}, V={V} must lie in 1..{MAX_HEAD_DIM}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in _FLOAT_DTYPES:
            _fail(fn, f"{name} must be float32, float16, bfloat16 or float64, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        _fail(fn, f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    device = q.device
    for name, x in named:
        if x.device != device:
            _fail(fn, f"{name} is on {x.device} but q is on {device}; all tensors must share one device")
    sizes = {"B": B, "T": T, "HV": HV, "K": K, "V": V}
    for (name, role), x in zip(INPUTS, extras):
        expected = tuple(sizes[d] for d in _ROLE_SHAPES[role][1:-1].split(", "))
        if tuple(x.shape) != expected:
            _fail(fn, f"{name} must be {_ROLE_SHAPES[role]} = [{', '.join(map(str, expected))}], got {_shape(x)}")
        if not x.dtype.is_floating_point:
            _fail(fn, f"{name} must be a floating-point tensor, got {x.dtype}")
    scale = _scale(fn, scale, K, named)
    N = B
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            _fail(fn, "cu_seqlens must be a 1-D tensor [N + 1] of sequence boundaries")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            _fail(fn, f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
        if cu_seqlens.device != device:
            _fail(fn, f"cu_seqlens is on {cu_seqlens.device} but q is on {device}")
        if B != 1:
            _fail(fn, f"with cu_seqlens the batch must be 1 (sequences packed along T), got B={B}")
        N = cu_seqlens.numel() - 1
        if device.type == "cpu" and values:  # values are checked where that costs no device synchronisation
            bounds = cu_seqlens.tolist()
            if bounds[0] != 0 or bounds[-1] != T or any(b > a for b, a in zip(bounds, bounds[1:])):
                _fail(fn, f"cu_seqlens must rise from 0 to T={T} without decreasing, got {bounds}")
    # the recurrent kernel and the scans: one program per (sequence, value head, block of >= 16 columns)
    _check_programs(fn, N * HV * _cdiv(V, 16), f"N={N} sequences x HV={HV} value heads x V={V} columns")
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            _fail(fn, f"initial_state must be a torch.Tensor, got {type(initial_state).__name__}")
        dims = _state_dims(HV, K, V, state_v_first)
        if tuple(initial_state.shape) != (N, *dims):
            _fail(fn, f"initial_state must be [N, {_state_dims_text(state_v_first)[1:-1]}] = [{N}, {', '.join(map(str, dims))}], "
                      f"got {_shape(initial_state)}")
        if initial_state.dtype not in _FLOAT_DTYPES:
            _fail(fn, f"initial_state must be float32, float16, bfloat16 or float64, got {initial_state.dtype}")
        if initial_state.device != device:
            _fail(fn, f"initial_state is on {initial_state.device} but q is on {device}")
    if device.type == "cpu" and not _is_interpreted(kernel):
        _fail(fn, "tensors are on the CPU: set TRITON_INTERPRET=1 before importing this module, or use a GPU")
    if device.type not in ("cpu", "cuda"):
        _fail(fn, f"tensors must be on a CUDA device (or the CPU under TRITON_INTERPRET=1), got {device}")
    return B, T, H, K, HV, V, N, scale


# ---------------------------------------------------------------------------------------------
# State addressing. Every kernel that reads or writes a state row (the recurrent kernel, the
# chunk scans forward and backward, commit) goes through the helpers below, and every Python
# function sizes and checks state tensors with the ones after them: which row (a sequence's own,
# or its row of a pool), the layout ([rows, HV, K, V], or [rows, HV, V, K] with state_v_first,
# the layout serving engines keep) and the dtype (ACC in registers, any float in memory) are
# decided here and nowhere else.
# ---------------------------------------------------------------------------------------------

@triton.jit
def _sequence_rows(cu_seqlens, i_n, T):
    """(bos, eos): the rows of packed sequence i_n, int64, clamped into the call's T rows (0 <= bos
    <= eos <= T). Every tile a kernel loads or stores lies in rows bos .. eos - 1, so whatever
    cu_seqlens holds on the device (checked on the host only where that costs no synchronisation)
    and whatever the chunk table says, no kernel reads or writes outside its tensors: a wrong
    table gives a wrong result, never a corrupted process (docs/design.md, "Bounds")."""
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    bos = tl.minimum(tl.maximum(bos, 0), T)
    eos = tl.minimum(tl.maximum(eos, bos), T)
    return bos, eos


@triton.jit
def _state_row(i_n, state_indices, P, USE_POOL: tl.constexpr):
    """(row, live) of sequence i_n: its own row i_n of the state tensors, or with USE_POOL row
    state_indices[i_n] of a pool of P rows. live is false for a padding slot (index -1) and for an
    index outside the pool (which validation refuses; without it such a row is skipped, never
    read or written out of bounds): its output is zeros and no state row is touched."""
    if USE_POOL:
        row = tl.load(state_indices + i_n).to(tl.int64)
        live = (row >= 0) & (row < P)
    else:
        row = i_n.to(tl.int64)
        live = row >= 0
    return row, live


@triton.jit
def _state_offsets(row, i_hv, o_k, o_v, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   STATE_V_FIRST: tl.constexpr):
    """Offsets of value head i_hv's K x BV state tile (key channels o_k, value columns o_v) in
    state row `row` (int64: a pool can hold more than 2^31 elements)."""
    base = (row * HV + i_hv) * (K * V)
    if STATE_V_FIRST:
        offsets = base + o_v[None, :] * K + o_k[:, None]
    else:
        offsets = base + o_k[:, None] * V + o_v[None, :]
    return offsets


# An 8-bit pool (int8) holds each state column as K int8 values and, beside them, the column's
# fp32 scale (its largest |value| / 127): a row is [HV, K + 4, V] (rows K .. K + 3 of a head hold
# its V scales as fp32) or, with state_v_first, [HV, V, K + 4] (each column's K values, then its
# scale). A column is one program's (K is never split), so a store finds its scale alone, and a
# copy of a pool row carries its scales. Why per column and int8, not e4m3: docs/design.md, section 5.
POOL_8BIT_DTYPE = torch.int8
POOL_8BIT_EXTRA = 4  # the bytes of a column's fp32 scale, beside its K values
POOL_8BIT_LEVELS = 127.0  # int8's largest magnitude used: values round to -127 .. 127
POOL_8BIT_FLOOR = 2.0**-120  # the smallest divisor of a column's scaling: 127 / it stays finite
# the same three as the kernels read them (pack_states must give the kernels' bytes)
_EXTRA, _LEVELS, _FLOOR = tl.constexpr(POOL_8BIT_EXTRA), tl.constexpr(POOL_8BIT_LEVELS), tl.constexpr(POOL_8BIT_FLOOR)


@triton.jit
def _columns(mask):
    """The value columns a K x BV tile's mask touches."""
    return tl.max(mask.to(tl.int32), axis=0) > 0


@triton.jit
def _column_scales(states, row, i_hv, o_v, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   STATE_V_FIRST: tl.constexpr):
    """Pointers to the fp32 scales of value columns o_v of head i_hv in an 8-bit pool's row."""
    base = (row * HV + i_hv) * ((K + _EXTRA) * V)
    if STATE_V_FIRST:
        at = states + base + o_v * (K + _EXTRA) + K
    else:
        at = states + base + K * V + o_v * _EXTRA
    return at.to(tl.pointer_type(tl.float32))


@triton.jit
def _load_state(states, row, i_hv, o_k, o_v, mask, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                STATE_V_FIRST: tl.constexpr, ACC: tl.constexpr):
    """A state tile in ACC (fp32, fp64 for fp64 inputs), whatever dtype `states` stores (an 8-bit
    pool: its values times their column's scale)."""
    if states.dtype.element_ty == tl.int8:
        offsets = _state_offsets(row, i_hv, o_k, o_v, HV, K + _EXTRA, V, STATE_V_FIRST)
        scales = tl.load(_column_scales(states, row, i_hv, o_v, HV, K, V, STATE_V_FIRST), mask=_columns(mask), other=0.0)
        return tl.load(states + offsets, mask=mask, other=0).to(ACC) * scales.to(ACC)[None, :]
    offsets = _state_offsets(row, i_hv, o_k, o_v, HV, K, V, STATE_V_FIRST)
    return tl.load(states + offsets, mask=mask, other=0.0).to(ACC)


@triton.jit
def _state_at_boundary(tile, states, at_boundary, i_n, i_hv, o_k, o_v, mask, USE_STATES: tl.constexpr,
                       HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, STATE_V_FIRST: tl.constexpr,
                       ACC: tl.constexpr):
    """A stored state tile (given in ACC) as a formula reads it: at a sequence boundary (its first
    chunk for the initial state, its last for the final state's gradient) from the caller's `states`
    at full precision (USE_STATES: the call passed them), elsewhere the tile itself."""
    exact = tile
    if USE_STATES:
        boundary = _load_state(states, i_n.to(tl.int64), i_hv, o_k, o_v, mask & at_boundary, HV, K, V, STATE_V_FIRST, ACC)
        exact = tl.where(at_boundary, boundary, exact)
    return exact


@triton.jit
def _store_state(states, row, i_hv, o_k, o_v, mask, tile, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 STATE_V_FIRST: tl.constexpr):
    """Stores a state tile, rounded to the dtype `states` stores (a bf16 pool rounds once per
    call: the tokens of one call carry the state in ACC). An 8-bit pool stores each column as
    round(value * 127 / m) with its scale m / 127 (m: the column's largest |value|; a zero
    column stores zeros and scale 0), in fp32 with correctly rounded divisions, so that
    pack_states() on the host gives the same bytes."""
    if states.dtype.element_ty == tl.int8:
        magnitude = tl.max(tl.where(mask, tl.abs(tile.to(tl.float32)), 0.0), axis=0)
        # the divisor floored (a column whose values all lie below the floor stores zeros)
        levels_per_unit = tl.full(magnitude.shape, _LEVELS, tl.float32)
        inverse = tl.where(magnitude > 0, tl.math.div_rn(levels_per_unit, tl.maximum(magnitude, _FLOOR)), 0.0)
        levels = tl.floor(tile.to(tl.float32) * inverse[None, :] + 0.5)
        levels = tl.minimum(tl.maximum(levels, -_LEVELS), _LEVELS)
        offsets = _state_offsets(row, i_hv, o_k, o_v, HV, K + _EXTRA, V, STATE_V_FIRST)
        tl.store(states + offsets, levels.to(tl.int8), mask=mask)
        scale = tl.math.div_rn(magnitude, levels_per_unit)
        tl.store(_column_scales(states, row, i_hv, o_v, HV, K, V, STATE_V_FIRST), scale, mask=_columns(mask))
    else:
        offsets = _state_offsets(row, i_hv, o_k, o_v, HV, K, V, STATE_V_FIRST)
        tl.store(states + offsets, tile.to(states.dtype.element_ty), mask=mask)


_POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, POOL_8BIT_DTYPE)


def _pool_dims(HV, K, V, state_v_first, dtype):
    """The dims of one pool row: a state row's, with K + 4 for an 8-bit pool (its scales)."""
    rows = K + POOL_8BIT_EXTRA if dtype == POOL_8BIT_DTYPE else K
    return _state_dims(HV, rows, V, state_v_first)


def pack_states(states, state_v_first=False):
    """States [N, HV, K, V] (or [N, HV, V, K] with state_v_first) as 8-bit pool rows [N, HV, K + 4, V]
    ([N, HV, V, K + 4]): each value column rounded to int8 against its largest |value|, the
    column's fp32 scale beside it; the bytes a kernel stores for the same state. For putting a
    state into an 8-bit pool: pool[rows] = pack_states(states)."""
    if not isinstance(states, torch.Tensor) or states.dim() != 4 or not states.is_floating_point():
        _fail("pack_states", f"states must be a float tensor [N, HV, K, V] (or [N, HV, V, K] with state_v_first), got {_describe(states)}")
    k_axis = -1 if state_v_first else -2
    if states.shape[k_axis] % 4:
        _fail("pack_states", f"an 8-bit pool needs K divisible by 4 (each column's fp32 scale sits after its K bytes), got K={states.shape[k_axis]}")
    x = states.float()
    magnitude = x.abs().amax(dim=k_axis, keepdim=True)
    floored = magnitude.clamp(min=POOL_8BIT_FLOOR)  # as the kernels divide: 127 / it stays finite
    # divisions of two tensors, correctly rounded as the kernels' div_rn: torch computes a number
    # over a tensor as the number times the tensor's reciprocal (two roundings: 1 ulp off for a
    # quarter of the divisors), and a tensor over a number on a GPU likewise
    levels_per_unit = torch.full_like(magnitude, POOL_8BIT_LEVELS)
    inverse = torch.where(magnitude > 0, levels_per_unit / floored, torch.zeros_like(magnitude))
    levels = torch.floor(x * inverse + 0.5).clamp(-POOL_8BIT_LEVELS, POOL_8BIT_LEVELS).to(POOL_8BIT_DTYPE)
    scale = (magnitude / levels_per_unit).contiguous()  # [N, HV, 1, V] or [N, HV, V, 1]
    if state_v_first:
        scale_bytes = scale.view(POOL_8BIT_DTYPE)  # [N, HV, V, 4]
    else:  # the V scales' bytes as 4 more rows of V bytes
        scale_bytes = scale.view(POOL_8BIT_DTYPE).reshape(*scale.shape[:2], POOL_8BIT_EXTRA, scale.shape[-1])
    return torch.cat([levels, scale_bytes], dim=k_axis).contiguous()


def unpack_states(rows, state_v_first=False):
    """8-bit pool rows [N, HV, K + 4, V] ([N, HV, V, K + 4] with state_v_first) as fp32 states [N, HV, K, V]
    ([N, HV, V, K]): what the kernels read from them."""
    if not isinstance(rows, torch.Tensor) or rows.dim() != 4 or rows.dtype != POOL_8BIT_DTYPE:
        _fail("unpack_states", f"rows must be an 8-bit pool's rows, int8 [N, HV, K + 4, V] (or [N, HV, V, K + 4] with state_v_first), got {_describe(rows)}")
    k_axis = -1 if state_v_first else -2
    K = rows.shape[k_axis] - POOL_8BIT_EXTRA
    if K <= 0 or K % 4:
        _fail("unpack_states", f"rows must hold K + 4 entries on the key axis with K divisible by 4, got {rows.shape[k_axis]}")
    levels, scale_bytes = rows.split([K, POOL_8BIT_EXTRA], dim=k_axis)
    if state_v_first:
        scale = scale_bytes.contiguous().view(torch.float32)  # [N, HV, V, 1]
    else:
        scale = scale_bytes.contiguous().reshape(*rows.shape[:2], 1, POOL_8BIT_EXTRA * rows.shape[-1]).view(torch.float32)
    return levels.float() * scale


def _state_dims(HV, K, V, state_v_first):
    """The dims of one state row: (HV, K, V), or (HV, V, K) with state_v_first."""
    return (HV, V, K) if state_v_first else (HV, K, V)


def _state_dims_text(state_v_first):
    return "[HV, V, K]" if state_v_first else "[HV, K, V]"


def _check_layout(fn, state_v_first):
    if not isinstance(state_v_first, bool):
        _fail(fn, f"state_v_first must be True or False, got {_describe(state_v_first)}")
    return state_v_first


def _check_out(fn, out, shape, v):
    """`out`, a caller's buffer for o (shape `shape`, v's dtype and device, contiguous), or None."""
    if out is None:
        return None
    if not isinstance(out, torch.Tensor):
        _fail(fn, f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != v.dtype or out.device != v.device or not out.is_contiguous():
        _fail(fn, f"out must be a contiguous {v.dtype} tensor [{', '.join(map(str, shape))}] on {v.device} (o's shape), "
                  f"got {_describe(out)}{'' if out.is_contiguous() else ', not contiguous'}")
    return out


def _check_pool(fn, state_pool, state_indices, N, HV, K, V, q, state_v_first, validate):
    """Checks a pool call's state_pool and state_indices; returns the pool's row count P. With
    validate, the indices' values too (one host synchronisation): each in -1 .. P-1, no row twice."""
    if state_pool is None or state_indices is None:
        given, missing = ("state_pool", "state_indices") if state_indices is None else ("state_indices", "state_pool")
        _fail(fn, f"{given} needs {missing}: sequence n reads and writes row state_indices[n] of state_pool")
    for name, x in (("state_pool", state_pool), ("state_indices", state_indices)):
        if not isinstance(x, torch.Tensor):
            _fail(fn, f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != q.device:
            _fail(fn, f"{name} is on {x.device} but q is on {q.device}")
    if state_pool.dtype not in _POOL_DTYPES:
        _fail(fn, f"state_pool must be float32, bfloat16, float16, float64 or int8 (8-bit), got {state_pool.dtype}")
    eight_bit = state_pool.dtype == POOL_8BIT_DTYPE
    if eight_bit and K % 4:
        _fail(fn, f"an 8-bit (int8) state_pool needs K divisible by 4 (each column's fp32 scale sits after its K bytes), got K={K}")
    dims = _pool_dims(HV, K, V, state_v_first, state_pool.dtype)
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != dims:
        layout = _state_dims_text(state_v_first)[1:-1].replace("K", "K + 4" if eight_bit else "K")
        _fail(fn, f"{'an 8-bit ' if eight_bit else ''}state_pool must be [P, {layout}] = [P, {', '.join(map(str, dims))}], "
                  f"got {_shape(state_pool)}")
    if not state_pool.is_contiguous():
        _fail(fn, "state_pool must be contiguous: its rows are updated in place")
    if state_indices.dim() != 1 or state_indices.shape[0] != N:
        _fail(fn, f"state_indices must be [N] = [{N}] (one pool row per sequence), got {_shape(state_indices)}")
    if state_indices.dtype not in (torch.int32, torch.int64):
        _fail(fn, f"state_indices must be int32 or int64, got {state_indices.dtype}")
    P = state_pool.shape[0]
    if validate:
        _check_index_values(fn, state_indices.tolist(), P)
    return P


def _check_index_values(fn, indices, P):
    seen = {}
    for n, row in enumerate(indices):
        if row == -1:
            continue
        if not 0 <= row < P:
            _fail(fn, f"state_indices[{n}] = {row} is outside the pool's {P} rows (-1 marks a padding slot)")
        if row in seen:
            _fail(fn, f"state_indices[{seen[row]}] and state_indices[{n}] are both row {row}: "
                      "two sequences cannot share a pool row")
        seen[row] = n


def _state_for_pool(fn, initial_state, output_final_state, tensors):
    """A pool call: the pool is both the initial and the final state, and it has no gradient."""
    if initial_state is not None:
        _fail(fn, "pass initial_state or state_pool, not both: with a pool, sequence n starts from row state_indices[n]")
    if output_final_state:
        _fail(fn, "output_final_state must be False with state_pool: the final states are written into the pool")
    if _needs_grad(*tensors):
        _fail(fn, "state_pool is updated in place, without gradients: call it under torch.no_grad() "
                  "(or pass initial_state for a differentiable call)")
