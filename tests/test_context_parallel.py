"""Context parallelism (lrdsl.distributed): a packed batch split over 2 and 3 gloo ranks (spawned
processes, the Triton interpreter) through every spec's chunk(..., cp_context=), against ONE
process running the whole batch through the same module's chunk() and against the float64
oracle: outputs, final states and every gradient (inputs and initial states), at the fp32
tolerance.

Each world size is one spawn running every case, so the processes start (import torch, load the
modules) once; the ranks write their results to files and this process compares them.
"""
from __future__ import annotations

import datetime
import functools
import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lrdsl
from lrdsl import reference
from lrdsl.distributed import build_cp_context
from lrdsl.verification.workloads import TOLERANCE, Shape, make_inputs, relative_error

from helpers import ALL_SPECS, module, recurrence, rows_per_token

K = V = 16
SEED = 7

T = 48  # tokens of the packed batch: 24 per rank on 2 ranks, 16 on 3
# global cu_seqlens, each meaning something on 2 and on 3 ranks
LAYOUTS = {
    # 2 and 3 ranks: one sequence over all ranks; on 3 the middle rank holds only its middle
    "one_sequence": [0, 48],
    # short sequences, rank boundaries exactly at sequence starts (16 on 3 ranks, 24 on 2)
    "short_sequences": [0, 5, 16, 24, 30, 48],
    # a long sequence across ranks between short ones; on 3 ranks the middle one holds only its middle
    "crossing": [0, 7, 45, 48],
}
# a collective that never completes (a rank skipping one) fails the test instead of hanging it
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
CORE = ("gdn", "kda", "simple_gla", "rwkv7", "deltanet", "linear_attn")


def _cases(world):
    """(spec, layout, with initial / final states): on 2 ranks every spec once, on 3 the core
    update / gate kinds, the layouts and the state options rotating over them, and gdn (the one
    run with value heads sharing a key head) on every layout with states, so that each layout
    meets several update kinds at little cost (each case is two chunk() calls per rank)."""
    layouts = list(LAYOUTS)
    specs = list(CORE) + ([s for s in ALL_SPECS if s not in CORE] if world == 2 else [])
    cases = [(name, layouts[i % len(layouts)], i % 2 == 0) for i, name in enumerate(specs)]
    return cases + [("gdn", layout, True) for layout in layouts if ("gdn", layout, True) not in cases]


def _heads(name):
    """(H, HV): gdn's value heads share a key head; the others take one head (the interpreter's
    time grows with the heads)."""
    return (1, 2) if name == "gdn" else (1, 1)


def _inputs(name, cu, states):
    rec = recurrence(name)
    g = torch.Generator().manual_seed(SEED)
    H, HV = _heads(name)
    tensors = make_inputs(rec, Shape(1, T, H, HV, K, V), generator=g)
    N = len(cu) - 1
    h0 = torch.randn(N, HV, K, V, generator=g) if states else None
    d_o = torch.randn(1, T, HV, V, generator=g)
    d_ht = torch.randn(N, HV, K, V, generator=g) if states else None
    return rec, tensors, h0, d_o, d_ht


def _token_slice(t, rows, lo, hi):
    return t if rows == 0 else t[:, lo * rows: hi * rows]


class _CountedChunk:
    """A module's chunk() that records, in `events`, the value columns and tokens of every call
    (what context parallelism runs on a rank: plain calls at V, the map's at V + K)."""

    def __init__(self, chunk, events):
        self.chunk, self.events, self.__globals__ = chunk, events, chunk.__globals__

    def __call__(self, q, k, v, *args, **options):
        self.events.append((v.shape[-1], q.shape[1]))
        return self.chunk(q, k, v, *args, **options)


class _RecordedWait:
    """An async collective's handle that records, in `events`, when the rank waited for it."""

    def __init__(self, work, events):
        self.work, self.events = work, events

    def wait(self):
        self.events.append("wait")
        return self.work.wait()


C = 16  # the chunk size of the cases that pass chunk_indices


def _rank_main(rank, world, init, out_dir, cases):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    import lrdsl.distributed.chunk as cp

    events, run_rank, gather = [], cp.context_parallel_chunk, dist.all_gather
    cp.context_parallel_chunk = lambda ctx, chunk, tensors, options: run_rank(ctx, _CountedChunk(chunk, events), tensors, options)
    cp.dist.all_gather = lambda *a, async_op=False, **kw: (
        _RecordedWait(gather(*a, async_op=True, **kw), events) if async_op else gather(*a, **kw))
    try:
        for name, layout, states in cases:
            events.clear()
            local, cu = T // world, LAYOUTS[layout]
            rec, tensors, h0, d_o, d_ht = _inputs(name, cu, states)
            mod = module(name)
            ctx = build_cp_context(torch.tensor(cu, dtype=torch.int32), group=None)
            lo, hi = rank * local, (rank + 1) * local
            leaves = [_token_slice(t, r, lo, hi).clone().requires_grad_() for t, r in
                      zip(tensors, rows_per_token(rec))]
            mine = h0[list(ctx.initial_state_ids)].clone().requires_grad_() if states else None
            # the cases with states also pass chunk_indices counted on the host, as a caller who
            # avoids synchronisations does: every count inside is then made on a host copy
            counted_on, prepare = [], mod.prepare_varlen
            mod.prepare_varlen = lambda cu_, size=64, cu_cpu=None: counted_on.append(cu_cpu is not None) or prepare(cu_, size, cu_cpu)
            given = dict(chunk_size=C, chunk_indices=prepare(ctx.cu_seqlens, C, ctx.cu_seqlens_cpu)) if states else {}
            try:
                o, ht = mod.chunk(*leaves, initial_state=mine, output_final_state=states, cp_context=ctx, **given)
            finally:
                mod.prepare_varlen = prepare
            loss = (o * d_o[:, lo:hi]).sum()
            if states:
                loss = loss + (ht * d_ht[list(ctx.final_state_ids)]).sum()
            loss.backward()
            torch.save(dict(o=o.detach(), ht=None if ht is None else ht.detach(),
                            grads=[t.grad for t in leaves], d_h0=None if mine is None else mine.grad,
                            initial_ids=ctx.initial_state_ids, final_ids=ctx.final_state_ids, events=list(events),
                            counted_on_host=counted_on,
                            where=(ctx.pre_num_ranks > 0, ctx.post_num_ranks > 0, len(ctx.sequence_ids))),
                       os.path.join(out_dir, f"{name}.{layout}.{states}.{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_world(world):
    """Every case on `world` spawned ranks; returns {case: [per-rank results]}."""
    cases = _cases(world)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_main, args=(world, f"tcp://127.0.0.1:{_free_port()}", out_dir, cases),
                           nprocs=world, start_method="spawn")
        return {case: [torch.load(os.path.join(out_dir, f"{case[0]}.{case[1]}.{case[2]}.{r}.pt")) for r in range(world)]
                for case in cases}


def _gathered(results, rec, cu, states):
    """The ranks' results put back into the whole batch's shapes (a per-head input's gradient is
    the sum of the ranks' parts)."""
    o = torch.cat([r["o"] for r in results], dim=1)
    grads = []
    for i, rows in enumerate(rows_per_token(rec)):
        parts = [r["grads"][i] for r in results]
        grads.append(sum(parts) if rows == 0 else torch.cat(parts, dim=1))
    N, HV = len(cu) - 1, _heads(rec.name)[1]
    ht = d_h0 = None
    if states:
        ht = torch.zeros(N, HV, K, V)
        d_h0 = torch.zeros(N, HV, K, V)
        finals = [n for r in results for n in r["final_ids"]]
        initials = [n for r in results for n in r["initial_ids"]]
        assert sorted(finals) == list(range(N)) and sorted(initials) == list(range(N)), "each state once"
        for r in results:
            ht[list(r["final_ids"])] = r["ht"]
            d_h0[list(r["initial_ids"])] = r["d_h0"]
    return o, ht, grads, d_h0


@functools.lru_cache(maxsize=None)  # shared by the world sizes
def _single_and_oracle(name, layout, states):
    """The whole batch through one chunk() call and through the float64 oracle: (o, ht, grads, d_h0) each."""
    cu = LAYOUTS[layout]
    rec, tensors, h0, d_o, d_ht = _inputs(name, cu, states)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    out = []
    for run, dtype in ((module(name).chunk, torch.float32), (lambda *a, **kw: reference.run(rec, *a, **kw), torch.float64)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in tensors]
        h = h0.detach().to(dtype).requires_grad_() if states else None
        o, ht = run(*leaves, initial_state=h, output_final_state=states, cu_seqlens=cu_t)
        loss = (o * d_o.to(dtype)).sum()
        if states:
            loss = loss + (ht * d_ht.to(dtype)).sum()
        loss.backward()
        out.append((o.detach(), ht.detach() if states else None, [t.grad for t in leaves], h.grad if states else None))
    return rec, out


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_matches_one_process_and_oracle(world):
    limit = TOLERANCE[torch.float32]
    worst = {}
    for (name, layout, states), results in _run_world(world).items():
        cu = LAYOUTS[layout]
        for r in results:  # the chunk() calls each rank made, and when it waited for the maps
            continues_from, continues_to, pieces = r["where"]
            if continues_from and continues_to and pieces == 1:
                # only a sequence's middle: one call, its o corrected by the chained maps
                expected = [V + K, "wait"]
            else:
                # its last piece when that continues (the map); then, while the maps travel, the
                # pieces starting here; after them, a first piece that continues
                own = pieces - continues_from - continues_to > 0
                expected = [V] * continues_to + [V] * own + ["wait"] + [V] * continues_from
            got = [e if e == "wait" else e[0] for e in r["events"]]
            assert got == expected, (name, layout, r["where"], r["events"])
            # every token of the slice runs once (the old code ran a continuing last piece twice)
            tokens = sum(e[1] for e in r["events"] if e != "wait")
            assert tokens == T // world, (name, layout, r["where"], r["events"])
            # with chunk_indices counted on the host (the cases with states), no call counts chunks
            # on the device (a synchronisation on a GPU)
            assert not states or all(r["counted_on_host"]), (name, layout, r["where"], r["counted_on_host"])
        rec, references = _single_and_oracle(name, layout, states)
        mine = _gathered(results, rec, cu, states)
        names = ["q", "k", "v"] + [i.name for i in rec.inputs]
        for against, ref in zip(("one process", "oracle"), references):
            errors = {"o": relative_error(mine[0], ref[0])}
            if states:
                errors["ht"] = relative_error(mine[1], ref[1])
                errors["d_h0"] = relative_error(mine[3], ref[3])
            errors.update({f"d_{n}": relative_error(a, b) for n, a, b in zip(names, mine[2], ref[2])})
            bad = {k: e for k, e in errors.items() if not e <= limit}
            assert not bad, f"{world} ranks, {name}, {layout}, states={states}, against {against}: {bad}"
            worst[against] = max(worst.get(against, 0.0), *errors.values())
    print(f"{world} ranks: largest relative errors {worst}")



def _ops_inputs(fn):
    """FLA's inputs of lrdsl.ops' chunk_gated_delta_rule / chunk_kda on the "crossing" layout, with
    FLA's state layout [N, HV, V, K] (state_v_first=True): q, k, v, g, beta, h0, d_o, d_ht."""
    g = torch.Generator().manual_seed(SEED)
    N = len(LAYOUTS["crossing"]) - 1
    q, k = torch.randn(1, T, 1, K, generator=g), torch.nn.functional.normalize(torch.randn(1, T, 1, K, generator=g), dim=-1)
    v = torch.randn(1, T, 1, V, generator=g)
    gate = -0.5 * torch.rand((1, T, 1, K) if fn == "chunk_kda" else (1, T, 1), generator=g)
    beta = torch.rand(1, T, 1, generator=g)
    return (q, k, v, gate, beta, torch.randn(N, 1, V, K, generator=g), torch.randn(1, T, 1, V, generator=g),
            torch.randn(N, 1, V, K, generator=g))


def _ops_call(fn, tensors, h0, **options):
    from lrdsl import ops

    return getattr(ops, fn)(*tensors, initial_state=h0, output_final_state=True, state_v_first=True, **options)


def _layer(seed=SEED):
    """Qwen3.5's Gated DeltaNet layer, tiny (1 key head read by 2 value heads, K = V = 16, a
    convolution 4 wide), the same random weights in every process."""
    from types import SimpleNamespace

    from lrdsl.layers import GatedDeltaNet

    config = SimpleNamespace(hidden_size=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=K,
                             linear_value_head_dim=V, linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6)
    layer = GatedDeltaNet(config, layer_idx=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(layer.named_parameters()):
            fan_in = parameter.shape[-1] if parameter.dim() > 1 else 1
            parameter.copy_(torch.rand(parameter.shape, generator=g) * 2 - 1 if name.endswith("A_log")
                            else torch.randn(parameter.shape, generator=g) / fan_in**0.5)
    x, d_out = torch.randn(1, T, 16, generator=g), torch.randn(1, T, 16, generator=g)
    return layer, x, d_out


def _extras_rank_main(rank, world, init, out_dir, fns, layouts):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    try:
        for fn in fns:
            *tensors, h0, d_o, d_ht = _ops_inputs(fn)
            ctx = build_cp_context(torch.tensor(LAYOUTS["crossing"]), group=None)
            lo, hi = rank * ctx.num_tokens, (rank + 1) * ctx.num_tokens
            leaves = [t[:, lo:hi].clone().requires_grad_() for t in tensors]
            mine = h0[list(ctx.initial_state_ids)].clone().requires_grad_()
            o, ht = _ops_call(fn, leaves, mine, cu_seqlens=ctx.cu_seqlens, cp_context=ctx)
            ((o * d_o[:, lo:hi]).sum() + (ht * d_ht[list(ctx.final_state_ids)]).sum()).backward()
            torch.save(dict(o=o.detach(), ht=ht.detach(), grads=[t.grad for t in leaves], d_h0=mine.grad,
                            initial_ids=ctx.initial_state_ids, final_ids=ctx.final_state_ids),
                       os.path.join(out_dir, f"{fn}.{rank}.pt"))
        # two calls, the second reading the first's output, on "crossing": the backward's collectives
        # (one per call) must run in the same order on every rank, also where a call's maps are zeros
        rec, tensors, h0, d_o, d_ht = _inputs("gdn", LAYOUTS["crossing"], False)
        ctx = build_cp_context(torch.tensor(LAYOUTS["crossing"]), group=None)
        lo, hi = rank * ctx.num_tokens, (rank + 1) * ctx.num_tokens
        leaves = [t[:, lo:hi].clone().requires_grad_() for t in tensors]
        o, _ = module("gdn").chunk(*leaves, cp_context=ctx)
        o, _ = module("gdn").chunk(leaves[0], leaves[1], o, *leaves[3:], cp_context=ctx)
        (o * d_o[:, lo:hi]).sum().backward()
        torch.save(dict(o=o.detach(), grads=[t.grad for t in leaves]), os.path.join(out_dir, f"chained.{rank}.pt"))
        # the same two calls under torch.compile (the context's collectives are outside the graph)
        leaves = [t[:, lo:hi].clone().requires_grad_() for t in tensors]

        def two_calls(q, k, v, *extras):
            o, _ = module("gdn").chunk(q, k, v, *extras, cp_context=ctx)
            return module("gdn").chunk(q, k, o, *extras, cp_context=ctx)[0]

        torch._dynamo.reset()
        o = torch.compile(two_calls, backend="aot_eager")(*leaves)
        (o * d_o[:, lo:hi]).sum().backward()
        torch.save(dict(o=o.detach(), grads=[t.grad for t in leaves]), os.path.join(out_dir, f"compiled.{rank}.pt"))
        # ranks that disagree on gradients (rank 0's inputs need them, the others' do not): every
        # rank refuses in one line, after the exchange that tells it so
        leaves = [t[:, lo:hi].clone().requires_grad_(rank == 0) for t in tensors]
        try:
            module("gdn").chunk(*leaves, cp_context=ctx)
            refusal = None
        except lrdsl.InputError as error:
            refusal = str(error)
        torch.save(dict(refusal=refusal), os.path.join(out_dir, f"disagree.{rank}.pt"))
        for layout in layouts:  # the layer: its convolution's halo, then the recurrence
            layer, x, d_out = _layer()
            ctx = build_cp_context(torch.tensor(LAYOUTS[layout]), group=None, conv1d_kernel_size=4)
            lo, hi = rank * ctx.num_tokens, (rank + 1) * ctx.num_tokens
            mine = x[:, lo:hi].clone().requires_grad_()
            out = layer(mine, cp_context=ctx)
            (out * d_out[:, lo:hi]).sum().backward()
            torch.save(dict(out=out.detach(), dx=mine.grad, params={n: p.grad for n, p in layer.named_parameters()}),
                       os.path.join(out_dir, f"layer.{layout}.{rank}.pt"))
    finally:
        dist.destroy_process_group()


EXTRAS_FNS, EXTRAS_LAYOUTS, EXTRAS_WORLD = ("chunk_gated_delta_rule", "chunk_kda"), ("crossing", "short_sequences"), 2


@functools.lru_cache(maxsize=None)
def _extras_results():
    """The ops and layer cases, run by one spawn of EXTRAS_WORLD ranks: {name: [per-rank results]}."""
    names = list(EXTRAS_FNS) + ["chained", "compiled", "disagree"] + [f"layer.{layout}" for layout in EXTRAS_LAYOUTS]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_extras_rank_main, args=(EXTRAS_WORLD, f"tcp://127.0.0.1:{_free_port()}", out_dir,
                                                    EXTRAS_FNS, EXTRAS_LAYOUTS),
                           nprocs=EXTRAS_WORLD, start_method="spawn")
        return {name: [torch.load(os.path.join(out_dir, f"{name}.{r}.pt")) for r in range(EXTRAS_WORLD)] for name in names}


def test_ops_entry_points_take_cp_context():
    """lrdsl.ops' FLA-compatible chunk_gated_delta_rule and chunk_kda with cp_context (and FLA's
    state layout, [N, HV, V, K]) on 2 ranks, against the same call in one process."""
    results = _extras_results()
    for fn in EXTRAS_FNS:
        *tensors, h0, d_o, d_ht = _ops_inputs(fn)
        leaves = [t.clone().requires_grad_() for t in tensors]
        h = h0.clone().requires_grad_()
        o, ht = _ops_call(fn, leaves, h, cu_seqlens=torch.tensor(LAYOUTS["crossing"]))
        ((o * d_o).sum() + (ht * d_ht).sum()).backward()
        mine_ht, mine_d_h0 = torch.zeros_like(ht), torch.zeros_like(h0)
        for r in results[fn]:
            mine_ht[list(r["final_ids"])] = r["ht"]
            mine_d_h0[list(r["initial_ids"])] = r["d_h0"]
        errors = {"o": relative_error(torch.cat([r["o"] for r in results[fn]], dim=1), o.detach()),
                  "ht": relative_error(mine_ht, ht.detach()), "d_h0": relative_error(mine_d_h0, h.grad)}
        for name, leaf, i in zip("qkvgb", leaves, range(5)):
            errors[f"d_{name}"] = relative_error(torch.cat([r["grads"][i] for r in results[fn]], dim=1), leaf.grad)
        bad = {k: e for k, e in errors.items() if not e <= TOLERANCE[torch.float32]}
        assert not bad, f"{fn} on {EXTRAS_WORLD} ranks: {bad}"


@pytest.mark.parametrize("case", ["chained", "compiled"])
def test_chained_calls(case):
    """Two calls, the second's v the first's o, on 2 ranks against the same in one process; eager,
    and the two calls in one torch.compile'd function (aot_eager on the CPU)."""
    ranks = _extras_results()[case]
    rec, tensors, h0, d_o, d_ht = _inputs("gdn", LAYOUTS["crossing"], False)
    cu = torch.tensor(LAYOUTS["crossing"], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in tensors]
    o, _ = module("gdn").chunk(*leaves, cu_seqlens=cu)
    o, _ = module("gdn").chunk(leaves[0], leaves[1], o, *leaves[3:], cu_seqlens=cu)
    (o * d_o).sum().backward()
    errors = {"o": relative_error(torch.cat([r["o"] for r in ranks], dim=1), o.detach())}
    for i, leaf in enumerate(leaves):
        errors[f"d_{i}"] = relative_error(torch.cat([r["grads"][i] for r in ranks], dim=1), leaf.grad)
    bad = {k: e for k, e in errors.items() if not e <= TOLERANCE[torch.float32]}
    assert not bad, f"two chained calls ({case}) on {EXTRAS_WORLD} ranks: {bad}"


def test_ranks_that_disagree_on_gradients_all_refuse():
    """A call whose inputs need gradients on one rank only would leave the others' backward
    without its collective (a hang): every rank refuses it, in one line naming the ranks."""
    for r in _extras_results()["disagree"]:
        assert r["refusal"] is not None and "ranks disagree on gradients" in r["refusal"], r
        assert "on ranks [0] only" in r["refusal"] and "\n" not in r["refusal"], r["refusal"]


def test_layer_takes_cp_context():
    """Qwen3.5's layer with cp_context (the convolution's halo from the earlier rank, the
    recurrence's entry state) on 2 ranks, against the layer on the whole packed batch in one
    process: the output, the input's gradient and every parameter's (summed over the ranks)."""
    results = _extras_results()
    for layout in EXTRAS_LAYOUTS:
        layer, x, d_out = _layer()
        x = x.clone().requires_grad_()
        out = layer(x, cu_seq_lens_q=torch.tensor(LAYOUTS[layout], dtype=torch.int32))
        (out * d_out).sum().backward()
        ranks = results[f"layer.{layout}"]
        errors = {"out": relative_error(torch.cat([r["out"] for r in ranks], dim=1), out.detach()),
                  "dx": relative_error(torch.cat([r["dx"] for r in ranks], dim=1), x.grad)}
        for name, parameter in layer.named_parameters():
            errors[f"d_{name}"] = relative_error(sum(r["params"][name] for r in ranks), parameter.grad)
        bad = {k: e for k, e in errors.items() if not e <= TOLERANCE[torch.float32]}
        assert not bad, f"the layer on {EXTRAS_WORLD} ranks, {layout}: {bad}"

def test_one_line_errors():
    """What context parallelism refuses, each in one line (a group of one rank, in this process)."""
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    with pytest.raises(lrdsl.InputError, match="init_process_group"):
        build_cp_context(cu)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        mod, rec = module("gdn"), recurrence("gdn")
        tensors = make_inputs(rec, Shape(1, 16, 1, 1, K, V), generator=torch.Generator().manual_seed(SEED))
        ctx = build_cp_context(cu)
        assert (ctx.sequence_ids, ctx.initial_state_ids, ctx.final_state_ids) == ((0, 1), (0, 1), (0, 1))
        refusals = {
            "empty": lambda: build_cp_context(torch.tensor([0, 5, 5, 16])),
            "int32 or int64": lambda: build_cp_context(cu.float()),
            "B must be 1": lambda: mod.chunk(*[torch.cat([t, t]) for t in tensors], cp_context=ctx),
            "this rank's slice holds 16": lambda: mod.chunk(*[t[:, :8] for t in tensors], cp_context=ctx),
            "cu_seqlens disagrees": lambda: mod.chunk(*tensors, cu_seqlens=torch.tensor([0, 16], dtype=torch.int32),
                                                     cp_context=ctx),
            "initial_state must hold the 2 sequences": lambda: mod.chunk(*tensors, initial_state=torch.zeros(1, 1, K, V),
                                                                         cp_context=ctx),
            "state_pool is not supported": lambda: mod.chunk(*tensors, state_pool=torch.zeros(2, 1, K, V),
                                                             state_indices=torch.tensor([0, 1]), cp_context=ctx),
        }
        layer, x, _ = _layer()
        from lrdsl.distributed import causal_conv_with_halo
        from lrdsl.layers import GatedDeltaNetCache

        refusals.update({
            "no conv1d_kernel_size": lambda: causal_conv_with_halo(None, x[:, :16], ctx),
            "built with conv1d_kernel_size=None": lambda: layer(x[:, :16], cp_context=ctx),
            "with a cache is not supported": lambda: layer(x[:, :16], GatedDeltaNetCache(),
                                                           cp_context=build_cp_context(cu, conv1d_kernel_size=4)),
        })
        for message, call in refusals.items():
            with pytest.raises(lrdsl.InputError, match=message) as error:
                call()
            assert "\n" not in str(error.value), message
        # the context's own cu_seqlens is accepted, and one rank is the plain call
        o, ht = mod.chunk(*tensors, cu_seqlens=ctx.cu_seqlens, output_final_state=True, cp_context=ctx)
        ref_o, ref_ht = mod.chunk(*tensors, cu_seqlens=cu, output_final_state=True)
        assert torch.equal(o, ref_o) and torch.equal(ht, ref_ht)
    finally:
        dist.destroy_process_group()


def test_the_one_gpu_script_runs_as_documented_on_the_cpu(tmp_path):
    """scripts/cp_one_gpu.py (the single-card tier: ranks sharing one device over gloo), its
    documented CPU command as a user runs it: every error against one process within fp32's
    tolerance, on 2 and 4 ranks (its default) over its default sequence layout."""
    import json
    import subprocess
    import sys

    from conftest import ROOT
    from test_cli import user_environment

    command = "--device cpu --tokens 96 --heads 1,2 --dims 16 --dtype float32 --repeat 1".split()  # its docstring's
    environment = dict(user_environment(), OUT=str(tmp_path))
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "cp_one_gpu.py"), *command], cwd=tmp_path,
                            env=environment, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads((tmp_path / "cp_one_gpu.json").read_text())
    assert [r["world"] for r in rows] == [2, 4]
    for row in rows:
        assert len(row["cu_seqlens"]) == 6 and row["errors"]
        assert max(row["errors"].values()) <= TOLERANCE[torch.float32], row
        times = [row[k] for k in ("forward_ms", "forward_backward_ms", "one_process_forward_ms",
                                  "one_process_forward_backward_ms")]
        assert all(isinstance(t, float) and t > 0 for t in times), row
