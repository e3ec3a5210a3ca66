"""chunk(..., cp_context=ctx): a generated module's chunk() on one rank's slice of a packed batch.

Every recurrence lrdsl compiles updates its state affinely in the state it enters with, column
by column of V: over a run of tokens X_out = M X_in + B (M [K, K] per value head, from the keys
and gates alone; B [K, V]). So a rank's pieces need only the state its first piece enters with,
and that is the earlier ranks' maps chained (docs/design.md §9):

1. A rank whose last piece continues on a later rank runs chunk() once on that piece's tokens:
   where the rank holds only the
   sequence's middle, with v widened by K zero columns and the initial state [0 | I] (the
   widened columns start at I and get no v, so they end at M; the state columns end at B: the
   piece's final state is [B | M], exactly, for every spec, with no per-spec code); where the
   piece starts on this rank, plainly from its own initial state ([X | 0]), and that call's
   output is the piece's output (nothing before the piece reaches it).
2. One all_gather of that [HV, K, V + K] map per rank (zeros from the others) on the group,
   started without waiting.
3. While the maps travel, each rank runs chunk() on the pieces whose entry states it holds (the
   sequences starting on it, but a last piece step 1 ran): on GPUs that work overlaps the
   exchange. Then a rank whose first piece continues chains the maps of the ranks before it, in
   the accumulation dtype, from the sequence's first rank: X = B_r + M_r X, and runs that piece
   alone from X. No token runs twice, and a rank holding only the start of one sequence runs
   nothing after step 1. A rank holding only the middle runs no second call: the output is
   linear in the state, so step 1's o is its output from a zero entry state beside the read of
   M, and o = that + (read of M) X.
The backward is autograd through these steps: the all_gather's backward is an all_reduce of the
gradients of the gathered maps, which hands every rank the gradient of its own map, and with it
the gradient of the state its last piece leaves (d(initial state) of the next rank's first
piece). Two markers keep every rank's backward calling that all_reduce, once, in the same order
as the others: the gathered maps are tied to o (so the backward reaches them on every rank), and
the rank's own map is tied to the call's inputs (so the backward of an earlier layer waits for
this one's exchange).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import InputError

# options of chunk() that context parallelism cannot honour, with why
_REFUSED = {
    "state_pool": "a state pool (serving) is not split across ranks",
    "state_indices": "a state pool (serving) is not split across ranks",
}


def _fail(spec: str, message: str):
    raise InputError(f"{spec}.chunk: cp_context: {message}")


class _Exchanged(torch.autograd.Function):
    """The gathered maps [W, ...], gathered outside (while the rank's other work ran), as a
    function of this rank's own map x: the backward all_reduces their gradient and keeps this
    rank's row."""

    @staticmethod
    def forward(ctx, x, gathered, group, rank):
        ctx.group, ctx.rank = group, rank
        return gathered

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[ctx.rank], None, None, None


# Both run eagerly under torch.compile (a graph break): traced, the gathered maps' backward (an
# all_reduce) would land in a compiled graph, where the ranks' collectives lose the order autograd
# keeps them in (measured: two chained calls under torch.compile then wait on each other forever).
def _start_all_gather(x, ctx):
    """Starts the all_gather of every rank's x (ctx: the CPContext) and returns finish(): it waits
    and gives them, [W, ...], differentiable (_Exchanged). Work queued between the two runs while
    the data travels."""
    rows = [torch.empty_like(x) for _ in range(ctx.world_size)]
    pending = dist.all_gather(rows, x.detach().contiguous(), group=ctx.group, async_op=True)

    def finish():
        pending.wait()
        return _Exchanged.apply(x, torch.stack(rows), ctx.group, ctx.rank)

    return finish


@torch.compiler.disable
def _all_gather(x, ctx):
    """[W, ...] of every rank's x, waited for at once."""
    return _start_all_gather(x, ctx)()


class _Tie(torch.autograd.Function):
    """x, unchanged, made to depend on `others` (no gradient to them): the backward of whatever
    produced them then runs only after x's own backward (the collective) has run."""

    @staticmethod
    def forward(ctx, x, *others):
        ctx.count = len(others)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + (None,) * ctx.count


class _Anchor(torch.autograd.Function):
    """o, unchanged, made to depend on x with a zero gradient: on the gathered maps, so that every
    rank's backward from o reaches the all_gather (the collective must run on all ranks), even
    where o does not read them; on an initial_state of no sequences, which then gets its (empty)
    gradient."""

    @staticmethod
    def forward(ctx, o, x):
        ctx.shape, ctx.dtype = x.shape, x.dtype
        return o.view_as(o)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.zeros(ctx.shape, dtype=ctx.dtype, device=grad.device)


def _pieces(tensors, inputs, start, stop, T):
    """q, k, v and the spec's inputs on tokens [start, stop): each per-token tensor's rows from
    start to stop x its rows per token (several with steps_per_token), the per-head inputs whole.
    inputs: the module's INPUTS, (name, role) of each input after q, k, v."""
    roles = ["token", "token", "token"] + [role for _, role in inputs]
    return [t[:, start * (t.shape[1] // T):stop * (t.shape[1] // T)] if role.startswith("token") else t
            for t, role in zip(tensors, roles)]


@torch.compiler.disable
def context_parallel_chunk(ctx, chunk, tensors, options):
    """(o, final states of the sequences ending on this rank) for this rank's slice `tensors`
    (q, k, v and the spec's inputs); `chunk` is the generated module's own chunk()."""
    spec = chunk.__globals__.get("SPEC_NAME", "module")
    q, k, v, *extras = tensors
    for name, why in _REFUSED.items():
        if options.get(name) is not None:
            _fail(spec, f"{name} is not supported: {why}")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or q.dim() != 4 or v.dim() != 4:
        _fail(spec, "q, k, v must be 4-D tensors [1, T, heads, dim]")
    if q.shape[0] != 1:
        _fail(spec, f"B must be 1 (one packed row per rank, sequences in cu_seqlens), got B={q.shape[0]}")
    if q.shape[1] != ctx.num_tokens:
        _fail(spec, f"q has T={q.shape[1]} tokens but this rank's slice holds {ctx.num_tokens} "
                    f"(the global cu_seqlens' {ctx.num_tokens * ctx.world_size} over {ctx.world_size} ranks)")
    cu = options.get("cu_seqlens")
    if cu is not None and cu is not ctx.cu_seqlens and not (
            isinstance(cu, torch.Tensor) and cu.shape == ctx.cu_seqlens.shape
            and torch.equal(cu.detach().cpu().long(), ctx.cu_seqlens_cpu.long())):
        _fail(spec, "cu_seqlens disagrees with the context: pass cu_seqlens=None or cp_context.cu_seqlens "
                    "(this rank's pieces, not the global cu_seqlens)")
    v_first = bool(options.get("state_v_first"))
    h0 = options.get("initial_state")
    starting = len(ctx.initial_state_ids)
    if h0 is not None:
        if not isinstance(h0, torch.Tensor) or h0.dim() != 4 or h0.shape[0] != starting:
            got = list(h0.shape) if isinstance(h0, torch.Tensor) else type(h0).__name__
            _fail(spec, f"initial_state must hold the {starting} sequences starting on this rank "
                        f"(cp_context.initial_state_ids), got {got}")
        if v_first:
            h0 = h0.transpose(-1, -2)  # K-first inside: the maps act on the key axis
    local = dict(options, cu_seqlens=ctx.cu_seqlens, state_v_first=False, state_pool=None, state_indices=None)
    K, n = k.shape[-1], len(ctx.sequence_ids)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    HV, V = v.shape[2], v.shape[3]
    inputs = [t for t in (*tensors, h0) if isinstance(t, torch.Tensor)]
    training = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)

    # 1. this rank's map: the final state of its last piece, [B | M], where that piece continues
    middle_only = bool(ctx.pre_num_ranks and ctx.post_num_ranks and n == 1)
    want_final = bool(options.get("output_final_state"))
    widened_o = last_o = None
    declared, T = chunk.__globals__["INPUTS"], q.shape[1]
    last_start = int(ctx.cu_seqlens_cpu[-2])  # the last piece's first token in the slice
    if ctx.post_num_ranks:
        # on the last piece's tokens only, as one sequence
        piece = _pieces(tensors, declared, last_start, T, T)
        alone = dict(local, cu_seqlens=None, chunk_indices=None, output_final_state=True)
        if middle_only:  # only the middle of a sequence: its map from any entry
            last = torch.cat([torch.zeros(HV, K, V, dtype=acc, device=q.device),
                              torch.eye(K, dtype=acc, device=q.device).expand(HV, K, K)], dim=-1)
            # v and the inputs per value channel (a written value's w) widened by K columns: the
            # state's columns evolve apart, and a zero v column writes nothing whatever w is there
            value_roles = [False, False, True] + [role == "token_value" for _, role in declared]
            widened = [torch.cat([t, t.new_zeros(*t.shape[:-1], K)], dim=-1) if per_value else t
                       for t, per_value in zip(piece, value_roles)]
            # the slice is this one piece: o of that call is its output from a zero entry state
            # beside the read of M (the output is linear in the state), so it is the rank's
            # output once the entry state is known (step 3), with no second call
            widened_o, state = chunk(*widened, **dict(alone, initial_state=last[None]))
            mine = state[0].reshape(-1)
        else:  # the sequence starts here, from its own initial state: M is not needed (M = 0),
            # and nothing before it changes its output: step 3 leaves the piece out
            start = h0[-1:] if h0 is not None else None
            last_o, state = chunk(*piece, **dict(alone, initial_state=start))
            mine = torch.cat([state[0].to(acc), torch.zeros(HV, K, K, dtype=acc, device=q.device)], dim=-1).reshape(-1)
    else:
        mine = torch.zeros(HV * K * (V + K), dtype=acc, device=q.device, requires_grad=training)
    if training:
        mine = _Tie.apply(mine, *[t for t in inputs if t.requires_grad])
    # 2. every rank's map, to every rank, started here and waited for only once the work that
    # does not need it is under way. The flag travels with them: the ranks must agree on whether
    # there is a backward
    flag = torch.full((1,), float(training), dtype=acc, device=q.device)
    finish_gather = _start_all_gather(torch.cat([mine, flag]), ctx)

    # 3. while the maps travel: the pieces whose entry state this rank holds (those starting here,
    # but a last piece step 1 ran), in one call; a first piece that continues waits for the maps
    ran_last = last_o is not None
    first_waits = bool(ctx.pre_num_ranks) and not middle_only
    lo, hi = int(first_waits), n - ran_last
    outputs, finals = [], []
    if not middle_only and hi > lo:
        own = h0[: hi - lo] if h0 is not None else None  # h0's rows are the pieces starting here, in order
        if lo == 0 and hi == n:  # the whole slice, as the caller gave it
            o_own, ht_own = chunk(*tensors, **dict(local, initial_state=own, output_final_state=want_final))
        else:
            o_own, ht_own = chunk(*_pieces(tensors, declared, int(ctx.cu_seqlens_cpu[lo]), int(ctx.cu_seqlens_cpu[hi]), T),
                                  **dict(local, **_some_pieces(ctx, chunk, local.get("chunk_indices"), lo, hi),
                                         initial_state=own, output_final_state=want_final))
        outputs.append(o_own)
        finals.append(ht_own)
    if ran_last:
        outputs.append(last_o)

    gathered = finish_gather()
    maps = gathered[:, :-1].reshape(ctx.world_size, HV, K, V + K)
    # the state this rank's first piece enters with: the earlier ranks' maps chained
    entry = None
    if ctx.pre_num_ranks:
        first = ctx.rank - ctx.pre_num_ranks  # the sequence's first rank: its map holds no M
        entry = maps[first, ..., :V]
        for r in range(first + 1, ctx.rank):  # ranks holding only its middle
            entry = maps[r, ..., :V] + torch.matmul(maps[r, ..., V:], entry)
    if middle_only:
        # o_t = scale S_t^T q_t with S_t = [B_t | M_t] applied to [X ; I]: the zero-entry output
        # plus the read of M_t times X, in the accumulation dtype
        zero_entry, read_m = widened_o[..., :V].to(acc), widened_o[..., V:].to(acc)
        o = (zero_entry + torch.einsum("bthj,hjv->bthv", read_m, entry)).to(v.dtype)
        # its one sequence ends on a later rank: no final state here
        ht = torch.empty((0, HV, V, K) if v_first else (0, HV, K, V), dtype=acc, device=q.device) if want_final else None
    else:
        if first_waits:  # one sequence, from the chained entry state
            o_first, ht_first = chunk(*_pieces(tensors, declared, 0, int(ctx.cu_seqlens_cpu[1]), T),
                                      **dict(local, cu_seqlens=None, chunk_indices=None, initial_state=entry[None],
                                             output_final_state=want_final))
            outputs.insert(0, o_first)
            finals.insert(0, ht_first)
        o = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        ht = None
        if want_final:  # the sequences ending here, in order (a continuing last piece's is a map, not one)
            ht = torch.cat(finals) if finals else o.new_zeros((0, HV, K, V), dtype=acc)
            ht = ht.transpose(-1, -2).contiguous() if v_first else ht
    if training:
        o = _Anchor.apply(o, gathered)
        if h0 is not None and h0.shape[0] == 0:  # no sequence starts here: its (empty) gradient all the same
            o = _Anchor.apply(o, h0)
    # read back last, once every kernel of the call is queued: it is the call's one host synchronisation
    flags = gathered[:, -1].detach()
    if bool((flags != flags[0]).any()):
        _fail(spec, f"ranks disagree on gradients (inputs needing them on ranks {flags.nonzero().flatten().tolist()} "
                    f"only): every rank of the group must run the backward, or none")
    return o, ht


def _some_pieces(ctx, chunk, given, lo, hi):
    """cu_seqlens (and chunk_indices, where the caller gave them for the whole slice) of a call on
    the slice's pieces lo .. hi - 1. The chunks are counted on the context's host copy of
    cu_seqlens: no synchronisation, as with the caller's. Without the caller's, chunk() counts
    them, as any call without chunk_indices does."""
    cu = ctx.cu_seqlens[lo:hi + 1] - ctx.cu_seqlens[lo] if lo else ctx.cu_seqlens[:hi + 1]
    if given is None:
        return dict(cu_seqlens=cu, chunk_indices=None)
    cu_cpu = ctx.cu_seqlens_cpu[lo:hi + 1] - ctx.cu_seqlens_cpu[lo]
    return dict(cu_seqlens=cu, chunk_indices=chunk.__globals__["prepare_varlen"](cu, given.chunk_size, cu_cpu))
