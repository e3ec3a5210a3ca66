"""FLA's own context-parallel tests (fla-org/flash-linear-attention, tests/context_parallel/
test_cp_gdn.py and test_cp_kda.py) re-run against lrdsl over gloo on the CPU.

Every case of those two files, with its world size, heads, sequence lengths, GQA, state layout,
gate options and recompute flag, is run the way their worker runs it: the global inputs drawn as
theirs are (q and k L2-normalised, GDN's g = logsigmoid(randn), KDA's raw gate with
use_gate_in_kernel, safe_gate and lower_bound = -5 and its A_log and dt_bias), a reference call on
the whole packed batch with cu_seqlens in one process, then each rank calling
lrdsl.ops.chunk_gated_delta_rule / chunk_kda on its T / world_size tokens with FLA's exact call
form (cp_context=build_cp_context(cu_seqlens, group=dist.group.WORLD), no cu_seqlens, no states),
backward with a random d_o, and the outputs and every gradient all-gathered. Their check (FLA's
assert_close at ratio 3e-3 against the one-process run) becomes ours: the relative error against
the one-process run AND against the float64 oracle within the fp32 tolerance.

What is scaled for Triton's CPU interpreter: tokens by 1/128 (T = 10240 -> 80, their 65536-token
CP8 case -> 512), each sequence length with them (boundaries rounded, the total kept), head
dims 128 -> 16 and 64 -> 8, KDA's 12 heads -> 3; fp32 instead of their bf16 (the interpreter
rounds to bf16 toward zero, a drift of its own). FLA's cases at full size on a GPU over NCCL wait
for a multi-GPU machine.
"""
from __future__ import annotations

import datetime
import functools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from lrdsl import ops, reference
from lrdsl.distributed import build_cp_context
from lrdsl.verification.workloads import TOLERANCE, relative_error

from helpers import recurrence
from test_context_parallel import _free_port

TOKEN_SCALE = 128
HEAD_DIMS = {128: 16, 64: 8}
KDA_HEADS = {12: 3}
KDA_GATE = dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0)  # every KDA case of theirs
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)

# (their test's name, world size, T, H, D, sequence lengths, options), as in their files
GDN_CASES = [
    ("CP2_SequenceCut", 2, 10240, 4, 64, [3000, 4000, 3240], {}),
    ("CP2_BoundaryAligned", 2, 10240, 4, 128, [5120, 5120], {}),
    ("CP4_Complex", 4, 10240, 4, 128, [7000, 3240], {}),
    ("CP4_SingleSequence", 4, 10240, 4, 128, [10240], {}),
    ("CP8_SingleSequence", 8, 65536, 4, 128, [65536], {}),
    ("CP2_ManyShortSequences", 2, 10240, 4, 128, [1000, 1500, 2000, 2500, 1240, 1000, 1000], {}),
    ("CP2_GQA_SequenceCut", 2, 10240, 4, 64, [3000, 4000, 3240], {"Hq": 2}),
    ("CP2_GQA_SingleSequence", 2, 10240, 8, 64, [10240], {"Hq": 2}),
    ("CP2_TransposeState", 2, 10240, 4, 128, [3000, 4000, 3240], {"state_v_first": True}),
    ("CP4_TransposeState", 4, 10240, 4, 128, [10240], {"state_v_first": True}),
]
KDA_CASES = [
    ("CP2_SequenceCut", 2, 10240, 12, 128, [3000, 4000, 3240], {}),
    ("CP2_BoundaryAligned", 2, 10240, 12, 128, [5120, 5120], {}),
    ("CP4_Complex", 4, 10240, 12, 128, [7000, 3240], {}),
    ("CP4_SingleSequence", 4, 10240, 12, 128, [10240], {}),
    ("CP8_SingleSequence", 8, 65536, 12, 128, [65536], {}),
    ("CP2_ManyShortSequences", 2, 10240, 12, 128, [1000, 1500, 2000, 2500, 1240, 1000, 1000], {}),
    ("CP2_DisableRecompute", 2, 10240, 12, 128, [3000, 4000, 3240], {"disable_recompute": True}),
    ("CP2_TransposeState", 2, 10240, 12, 128, [3000, 4000, 3240], {"state_v_first": True}),
    ("CP4_TransposeState", 4, 10240, 12, 128, [10240], {"state_v_first": True}),
]
CASES = [("chunk_gated_delta_rule", *case) for case in GDN_CASES] + [("chunk_kda", *case) for case in KDA_CASES]
WORLDS = sorted({case[2] for case in CASES})


def scaled(case):
    """(fn, name, world, T, H, Hq, D, cu_seqlens, options) at the CPU's size."""
    fn, name, world, T, H, D, lengths, options = case
    options = dict(options)
    small_T = T // TOKEN_SCALE
    ends = torch.tensor(lengths).cumsum(0).double() * small_T / T
    bounds = [0] + [int(round(float(e))) for e in ends]
    assert bounds[-1] == small_T and all(b > a for a, b in zip(bounds, bounds[1:])), (name, bounds)
    H = KDA_HEADS.get(H, H) if fn == "chunk_kda" else H
    Hq = options.pop("Hq", H)
    return fn, name, world, small_T, H, Hq, HEAD_DIMS[D], bounds, options


def global_inputs(fn, T, H, Hq, D, dtype=torch.float32):
    """Their inputs, drawn on every rank from their seed (42): q, k, v, g, beta, d_o, and KDA's
    A_log [H] and dt_bias [H * D]."""
    torch.manual_seed(42)
    q = F.normalize(torch.randn(1, T, Hq, D), p=2, dim=-1).to(dtype)
    k = F.normalize(torch.randn(1, T, Hq, D), p=2, dim=-1).to(dtype)
    v = torch.randn(1, T, H, D, dtype=dtype)
    if fn == "chunk_kda":
        g = torch.randn(1, T, H, D, dtype=dtype)  # the raw gate: use_gate_in_kernel forms the decay
        extras = dict(A_log=torch.rand(H) * 2 - 1, dt_bias=torch.randn(H * D) * 0.1)
    else:
        g = F.logsigmoid(torch.randn(1, T, H, dtype=dtype))
        extras = {}
    beta = torch.randn(1, T, H).sigmoid()
    d_o = torch.randn(1, T, H, D, dtype=dtype)
    return q, k, v, g, beta, d_o, extras


def _call(fn, tensors, extras, options, **where):
    """lrdsl.ops' function as their test calls FLA's: o only (no states)."""
    kda = dict(use_qk_l2norm_in_kernel=True, **KDA_GATE, **extras) if fn == "chunk_kda" else {}
    o, _ = getattr(ops, fn)(*tensors, **kda, **options, **where)
    return o


def _rank_main(rank, world, init, out_dir, cases):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    try:
        for fn, name, _, T, H, Hq, D, bounds, options in cases:
            q, k, v, g, beta, d_o, extras = global_inputs(fn, T, H, Hq, D)
            cu_seqlens = torch.tensor(bounds, dtype=torch.long)
            context = build_cp_context(cu_seqlens, group=dist.group.WORLD)
            local = T // world
            lo, hi = rank * local, (rank + 1) * local
            leaves = [t[:, lo:hi].clone().detach().requires_grad_(True) for t in (q, k, v, g, beta)]
            head_leaves = {n: t.clone().requires_grad_(True) for n, t in extras.items()}
            o = _call(fn, leaves, head_leaves, options, cp_context=context)
            o.backward(d_o[:, lo:hi])
            parts = [o.detach()] + [t.grad for t in leaves]
            gathered = []
            for part in parts:
                pieces = [torch.zeros_like(part) for _ in range(world)]
                dist.all_gather(pieces, part.contiguous())
                gathered.append(torch.cat(pieces, dim=1))
            for n, t in head_leaves.items():  # a per-head parameter's gradient: the sum of the ranks'
                dist.all_reduce(t.grad)
                gathered.append(t.grad)
            if rank == 0:
                torch.save(gathered, os.path.join(out_dir, f"{fn}.{name}.pt"))
    finally:
        dist.destroy_process_group()


@functools.lru_cache(maxsize=None)
def _run_world(world):
    cases = [scaled(c) for c in CASES if c[2] == world]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_main, args=(world, f"tcp://127.0.0.1:{_free_port()}", out_dir, cases),
                           nprocs=world, start_method="spawn")
        return {(c[0], c[1]): torch.load(os.path.join(out_dir, f"{c[0]}.{c[1]}.pt")) for c in cases}


def one_process(fn, T, H, Hq, D, bounds, options, dtype):
    """The whole packed batch in one call (their reference) at fp32, or the float64 oracle: o and
    the gradients of q, k, v, g, beta (and KDA's A_log, dt_bias)."""
    q, k, v, g, beta, d_o, extras = global_inputs(fn, T, H, Hq, D)
    leaves = [t.to(dtype).requires_grad_(True) for t in (q, k, v, g, beta)]
    head_leaves = {n: t.to(dtype).requires_grad_(True) for n, t in extras.items()}
    cu_seqlens = torch.tensor(bounds, dtype=torch.long)
    if dtype == torch.float32:
        o = _call(fn, leaves, head_leaves, options, cu_seqlens=cu_seqlens)
    else:
        o = _oracle(fn, leaves, head_leaves, cu_seqlens)
    o.backward(d_o.to(dtype))
    return [o.detach()] + [t.grad for t in leaves] + [t.grad for t in head_leaves.values()]


def _oracle(fn, leaves, head_leaves, cu_seqlens):
    """The float64 step-by-step recurrence of gdn or kda; KDA's bounded in-kernel gate
    lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) (FLA's safe_gate form) formed first."""
    q, k, v, g, beta = leaves
    H, D = v.shape[2], v.shape[3]
    if fn == "chunk_kda":
        A_log, dt_bias = head_leaves["A_log"], head_leaves["dt_bias"]
        g = KDA_GATE["lower_bound"] * torch.sigmoid(A_log.exp().view(H, 1) * (g + dt_bias.view(H, D)))
        o, _ = reference.run(recurrence("kda"), q, k, v, g, beta, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
    else:
        o, _ = reference.run(recurrence("gdn"), q, k, v, g, beta, cu_seqlens=cu_seqlens)
    return o


@pytest.mark.parametrize("world", WORLDS)
def test_fla_context_parallel_cases(world):
    limit = TOLERANCE[torch.float32]
    results = _run_world(world)
    worst = 0.0
    for case in [scaled(c) for c in CASES if c[2] == world]:
        fn, name, _, T, H, Hq, D, bounds, options = case
        names = ["o", "dq", "dk", "dv", "dg", "dbeta"] + (["dA_log", "ddt_bias"] if fn == "chunk_kda" else [])
        mine = results[(fn, name)]
        for against, dtype in (("one process", torch.float32), ("oracle", torch.float64)):
            reference_values = one_process(fn, T, H, Hq, D, bounds, options, dtype)
            errors = {n: relative_error(a, b) for n, a, b in zip(names, mine, reference_values)}
            assert len(errors) == len(names) == len(reference_values)
            bad = {n: e for n, e in errors.items() if not e <= limit}
            assert not bad, f"{fn} {name} ({world} ranks, cu_seqlens {bounds}) against {against}: {bad}"
            worst = max(worst, *errors.values())
    print(f"FLA's cases on {world} ranks: largest relative error {worst:.1e}")
