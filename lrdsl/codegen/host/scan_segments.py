"""Segmented scans: a scan with few programs cut into segments of chunks run side by side.

Host code (lrdsl/codegen/host/__init__.py): copied verbatim into every generated module.
"""
import torch
import triton
import triton.language as tl

from .checks import _acc_dtype, _load_state, _state_row, _store_state
from .helpers import _cdiv, _next_power_of_2
from .launch_rule import SMALLEST_DOT_TILE
from .module_names import WIDE_K, _launch
from .programs import _multiprocessors, _scan_programs

# A scan walks a sequence's chunks one after another; a few long sequences with few heads give it
# far fewer programs than the GPU has multiprocessors, each waiting on its own chain of matmuls. A
# scan whose update is affine in the state (its launcher's segmentable=, checked when this module
# was generated) then cuts each sequence into segments of L chunks run side by side (_scan): each
# segment's map first, the maps chained from the initial state (_combine_segments_kernel), then
# each segment from its entry state. That is about twice the scan's matmuls (the map's K extra
# columns) on many more programs: measured on an H200 (gdn, K = V = 128), 16 programs of 64
# columns took the forward + backward's three scans from 5.4 to 2.2 ms in 33 segments, while 64
# programs (in 9 segments) and 128 (in 5) got slower. So only a scan with at most a quarter as
# many programs as multiprocessors is segmented, into about SCAN_PROGRAMS_PER_MULTIPROCESSOR
# programs per multiprocessor in all, with at least SCAN_SEGMENT_MIN_CHUNKS chunks per segment.
# Packed sequences (cu_seqlens) get their segments counted on the device (_segment_table).
SCAN_SEGMENT_FEW_PROGRAMS = 4  # segmented where programs x this <= multiprocessors
SCAN_PROGRAMS_PER_MULTIPROCESSOR = 4
SCAN_SEGMENT_MIN_CHUNKS = 16
SCAN_COMBINE_BV = 32  # value columns per program of _combine_segments_kernel


def _scan_segments(c, BV):
    """Chunks per segment for a scan with value blocks of BV, or 0 where it walks whole sequences
    (enough programs already, or sequences on average shorter than two segments)."""
    if c["K"] > WIDE_K:
        return 0  # the combine holds a K x K map in registers: measured only up to K = WIDE_K
    programs, multiprocessors = _scan_programs(c, BV), _multiprocessors(c["q"])
    if programs * SCAN_SEGMENT_FEW_PROGRAMS > multiprocessors:
        return 0
    segments = _cdiv(SCAN_PROGRAMS_PER_MULTIPROCESSOR * multiprocessors, programs // c["N"])  # in all
    L = max(SCAN_SEGMENT_MIN_CHUNKS, _cdiv(c["NC"], segments))
    return L if c["NC"] >= 2 * c["N"] * L else 0


def _segment_table(c, L):
    """The segments of packed sequences, L chunks each (a sequence's last one shorter), counted on
    the device without a synchronisation: (table [G, 2] int32 of (sequence, first chunk in it),
    offsets [N + 1] int32 of each sequence's first segment, G). G = NC // L + N bounds the count;
    the slots past the last segment start past every sequence's end, so their programs do nothing."""
    chunks = c["chunk_offsets"].long()
    counts = (chunks[1:] - chunks[:-1] + L - 1) // L
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    G = c["NC"] // L + c["N"]
    slot = torch.arange(G, device=chunks.device)
    sequence = torch.searchsorted(offsets[1:], slot, right=True).clamp(max=c["N"] - 1)
    first = torch.where(slot < offsets[-1], (slot - offsets[sequence]) * L, 2**30)
    return torch.stack([sequence, first], dim=1).to(torch.int32).contiguous(), offsets.to(torch.int32), G


@triton.jit(do_not_specialize=["P", "S"])
def _combine_segments_kernel(
    transitions, entries, segment_offsets, h0, ht, state_indices, P, S,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr, USE_POOL: tl.constexpr, STATE_V_FIRST: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr,
):
    """Chains the segments' maps of a segmented scan. Segment g takes its entry state X to
    M @ X + B, with [B | M] in transitions [G, HV, K, V + K]; a sequence's segments are S in a row
    (fixed length) or segment_offsets[n] .. segment_offsets[n + 1] (packed). From the initial
    state (h0, or 0) this walks a sequence's segments in order (last to first with REVERSE: the
    backward's scan), storing each one's entry state in entries [G, HV, K, V], and the final state
    in ht (h0 itself for a sequence without chunks). One program per (block of BV value columns,
    sequence x value head). The products in about fp32 precision (three tf32 passes on the tensor
    cores; ieee for fp64), the loads of the next map pipelined behind them."""
    i_v = tl.program_id(0) % tl.cdiv(V, BV)
    i_nh = tl.program_id(0) // tl.cdiv(V, BV)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    if IS_VARLEN:
        first = tl.load(segment_offsets + i_n)
        count = tl.load(segment_offsets + i_n + 1) - first
    else:
        first = i_n * S
        count = S
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    row, live = _state_row(i_n, state_indices, P, USE_POOL)
    m_s = m_k[:, None] & m_v[None, :] & live
    b_X = tl.zeros((BK, BV), dtype=ACC)
    if USE_INITIAL_STATE:
        b_X += _load_state(h0, row, i_hv, o_k, o_v, m_s, HV, K, V, STATE_V_FIRST, ACC)
    for i in range(0, count):
        i_g = first + (count - 1 - i if REVERSE else i)
        segment = i_g * HV + i_hv
        tl.store(entries + segment * (K * V) + o_k[:, None] * V + o_v[None, :], b_X, mask=m_k[:, None] & m_v[None, :])
        # X = M @ X + B
        rows = transitions + segment * (K * (V + K)) + o_k[:, None] * (V + K)
        b_M = tl.load(rows + V + o_k[None, :], mask=m_k[:, None] & m_k[None, :], other=0.0)
        b_B = tl.load(rows + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_X = tl.dot(b_M, b_X, input_precision=PRECISION) + b_B
    if STORE_FINAL_STATE:
        _store_state(ht, row, i_hv, o_k, o_v, m_s, b_X, HV, K, V, STATE_V_FIRST)


def _segment_slots(c, L):
    """(S, table, offsets, G) of a scan run in segments of L chunks: S segments per sequence of
    fixed length; for packed sequences the table, the offsets and the slot count of
    _segment_table (S unused)."""
    if c["cu_seqlens"] is None:
        S = _cdiv(_cdiv(c["T"], c["BT"]), L)
        return S, None, None, c["N"] * S
    return (1, *_segment_table(c, L))


def _scan(kernel, buffers, c, role, h0, ht, state_indices, P, segmentable, reverse=False, resume=None):
    """Runs a scan kernel (its buffers first) from h0 to ht: over whole sequences, or where it
    pays (_scan_segments) and the kernel is segmentable, in segments (above); with `resume`, the
    backward's re-run from the forward call's entry states (_scan_resumed)."""
    if resume is not None:
        _scan_resumed(kernel, buffers, c, role, h0, *resume)
        return
    segmented_launch = _launch(role, c, segmented=True)
    L = _scan_segments(c, segmented_launch["BV"]) if segmentable else 0
    launch, meta = segmented_launch if L else _launch(role, c), c["meta"]
    N, HV, K, V, BV, T = c["N"], c["HV"], c["K"], c["V"], launch["BV"], c["T"]
    if not L:
        kernel[(_scan_programs(c, BV),)](
            *buffers, h0, ht, state_indices, c["cu_seqlens"], c["chunk_offsets"], c["state_offsets"], None, None,
            c["scale"], T, P, 1, 0, STATE_EVERY=c["state_every"],
            USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=ht is not None, USE_POOL=state_indices is not None,
            STATE_V_FIRST=c["state_v_first"], SEGMENTED=False, TRANSITION=False, **launch, **meta,
        )
        return
    S, table, offsets, G = _segment_slots(c, L)
    acc_dtype = _acc_dtype(c["q"])
    segmented = dict(USE_INITIAL_STATE=False, STORE_FINAL_STATE=False, USE_POOL=False, STATE_V_FIRST=False,
                     SEGMENTED=True, STATE_EVERY=c["state_every"], **launch, **meta)
    where = (c["cu_seqlens"], c["chunk_offsets"], c["state_offsets"], table)
    transitions = torch.empty((G, HV, K, V + K), dtype=acc_dtype, device=c["q"].device)
    kernel[(G * HV * _cdiv(V + K, BV),)](
        *buffers, None, None, None, *where, transitions, c["scale"], T, 0, S, L, TRANSITION=True, **segmented,
    )
    entries = torch.empty((G, HV, K, V), dtype=acc_dtype, device=c["q"].device)
    combine_bv = max(SMALLEST_DOT_TILE, min(_next_power_of_2(V), SCAN_COMBINE_BV))
    _combine_segments_kernel[(N * HV * _cdiv(V, combine_bv),)](
        transitions, entries, offsets, h0, ht, state_indices, P, S, HV=HV, K=K, V=V, BK=meta["BK"], BV=combine_bv,
        IS_VARLEN=c["cu_seqlens"] is not None, REVERSE=reverse, USE_INITIAL_STATE=h0 is not None,
        STORE_FINAL_STATE=ht is not None, USE_POOL=state_indices is not None, STATE_V_FIRST=c["state_v_first"],
        ACC=meta["ACC"], PRECISION="ieee" if acc_dtype == torch.float64 else "tf32x3", num_warps=4, num_stages=2,
    )
    del transitions
    kernel[(G * HV * _cdiv(V, BV),)](
        *buffers, None, None, None, *where, entries, c["scale"], T, 0, S, L, TRANSITION=False, **segmented,
    )


def _scan_resumed(kernel, buffers, c, role, h0, states, L):
    """The backward's re-run of the forward scan (save_states) from the entry states the forward
    call kept, states [forward chunks, HV, K, V], one per L chunks of this call: every run of L
    chunks a forward chunk covers starts from its state, all of them side by side (a sequence's
    first from h0 itself, at full precision). It needs no map of its state, so any scan resumes
    so; the final state is the forward's."""
    launch, meta = _launch(role, c, segmented=True), c["meta"]
    HV, V, BV, T = c["HV"], c["V"], launch["BV"], c["T"]
    # a run per forward chunk: slots in the forward's chunk order, fixed length or packed
    S, table, _, G = _segment_slots(c, L)
    if G == 0:
        return  # sequences without tokens: nothing to re-run
    kernel[(G * HV * _cdiv(V, BV),)](
        *buffers, h0, None, None, c["cu_seqlens"], c["chunk_offsets"], c["state_offsets"], table, states, c["scale"], T,
        0, S, L, STATE_EVERY=c["state_every"],
        USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=False, USE_POOL=False, STATE_V_FIRST=c["state_v_first"],
        SEGMENTED=True, TRANSITION=False, **launch, **meta,
    )


# save_states keeps the forward scan's entry states for the backward's re-run of that scan. Where
# the re-run walking whole sequences already has programs enough, resuming does not pay (H200,
# gdn, every forward chunk's state kept, forward + backward: 4 x 4096 with 512 programs 4.45 ->
# 4.55 ms; 1 x 32768 with 128 programs 10.37 -> 10.02; 1 x 65536 with 32 programs 6.08 -> 5.60):
# the forward then keeps none, as under save_solve (_resumes). Elsewhere one state per
# RESUME_EVERY forward chunks is kept and the re-run runs the chunks between two of them side by
# side: one state per 1 / 4 / 8 / 16 chunks took 1 x 32768 from 10.38 ms (none kept) to 10.30 /
# 9.94 / 9.89 / 9.87, and 1 x 65536 from 6.11 to 5.73 / 5.58 / 5.55 / 5.53 (BENCHMARKS.md round 14).
RESUME_FEW_PROGRAMS = 2  # resumed where the whole-sequence re-run has fewer programs than this x multiprocessors
RESUME_EVERY = 16  # forward chunks per kept entry state


def _resumes(c, backward_c, role):
    """Whether the backward's re-run of the forward scan (role) resumes from kept entry states:
    decided before the forward call runs, which keeps its states only then (elsewhere the call is
    save_solve's, buffer for buffer)."""
    programs = _scan_programs(backward_c, _launch(role, backward_c, segmented=True)["BV"])
    return c["NC"] > 0 and programs < RESUME_FEW_PROGRAMS * _multiprocessors(c["q"])


def _resume_states(c, backward_c, states):
    """What the forward call keeps for the backward's re-run of its scan, from the entry states it
    stored (states [NC, HV, K, V], one per forward chunk): (one of every RESUME_EVERY of them in
    the slot order of _segment_slots, backward chunks per kept state)."""
    S, table, _, _ = _segment_slots(c, RESUME_EVERY)
    every = RESUME_EVERY * (c["BT"] // backward_c["BT"])
    if table is None:
        # fixed length: sequence n's slot j starts at forward chunk n * chunks + j * RESUME_EVERY; a
        # strided copy of those (index_select of the same rows took 0.035 ms for 17 MB at 4 x 4096
        # on the H200), always a copy, so that the kept states never hold the whole buffer
        chunks, state = _cdiv(c["T"], c["BT"]), states.shape[1:]
        every_slot = states.view(c["N"], chunks, *state)[:, ::RESUME_EVERY]
        return every_slot.clone(memory_format=torch.contiguous_format).view(c["N"] * S, *state), every
    # packed: (sequence, first chunk in it); a slot past every sequence's end reads any row
    table = table.long()
    rows = (c["chunk_offsets"].long()[table[:, 0]] + table[:, 1]).clamp(max=c["NC"] - 1)
    return states.index_select(0, rows), every
