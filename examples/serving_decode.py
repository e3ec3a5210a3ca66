"""A serving loop on lrdsl's generated kernels: a state pool, continuous batching and speculative
decoding, checked against the float64 oracle.

    python examples/serving_decode.py                          # tiny shapes: CPU (Triton's interpreter) or GPU
    python examples/serving_decode.py --spec kda               # any spec
    python examples/serving_decode.py --state-dtype bfloat16   # a bf16 state pool (GPU; CPU: --state-dtype float16)
    python examples/serving_decode.py --state-dtype int8       # an 8-bit state pool (CPU or GPU)

Requests of different lengths are prefilled into rows of a state pool (one packed chunk() call;
recurrent() for a spec without a chunk form), then decoded in a batch of fixed slots, one token
per request per step: one request leaves and another joins its slot. Every other step is
speculative: 3 draft tokens per request are verified at once (their outputs come back, the pool
is only read), a random number of them is accepted, and commit() writes each row's state after
its accepted tokens. The last step drafts a tree per request (two candidates for the next token,
a continuation of each, and a third token after the first): verify(..., parents=) gives every
candidate's output along its own path, and commit(draft, accepted_node=) writes the state after
the path that was accepted. Then a prefix cache: request P's prefill also writes its state after
every PREFIX_BLOCK tokens into pool rows of their own (checkpoint_every=, checkpoint_indices=),
and request Q, whose prompt repeats P's first two blocks, starts from the copy of the second
checkpoint's row and prefills only its own tokens. On a GPU the decode step and the verify + commit steps are CUDA graphs,
captured once and replayed with new inputs. Random tensors stand in for the model's projections.
Every step's outputs and, at the end, every request's pool row are compared with the oracle run
over that request's tokens, within the tolerance of the dtypes (fp32 2e-3, 16-bit inputs or pool
8e-3, an 8-bit pool sqrt(K) / 254: the most one store's rounding of a column can move it, which
the decay keeps from growing); the last line is "ok", or "FAILED:" with each check that failed,
and the exit status 1. An 8-bit pool's rows are [HV, K + 4, V] (each state column's scale in the
row: copying a row for the prefix cache copies it); the checks read them with unpack_states.

A bf16 pool needs a GPU. The pool rounds each row to bf16 after every call, as a GPU does, to
nearest; Triton's CPU interpreter rounds fp32 to bf16 toward zero instead, a bias that
accumulates over the steps: here the final rows' error was 8.1e-3 (over 8e-3) under the
interpreter and 2.4e-3 with the same kernels' stores rounded to nearest. The error the
interpreter adds is its own, so on a CPU --state-dtype bfloat16 is refused in one line; an fp16
pool (which the interpreter rounds to nearest) runs there.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

from lrdsl import config

config.use_interpreter_without_gpu()  # before anything imports triton

import torch  # noqa: E402

import lrdsl  # noqa: E402
from lrdsl import reference  # noqa: E402
from lrdsl.passes.pipeline import run_pipeline  # noqa: E402
from lrdsl.spec import load_spec_by_name  # noqa: E402
from lrdsl.verification.workloads import TOLERANCE, Shape, make_inputs, relative_error  # noqa: E402

SLOTS, POOL_ROWS, DRAFTS = 4, 8, 3
# the prefix cache: P's prompt is 2.5 blocks, Q's repeats P's first 2 blocks and adds its own tokens
PREFIX_BLOCK, P_TOKENS, Q_OWN_TOKENS = 16, 40, 6
# the draft tree of the last step: each draft token's parent (-1: the request's state)
#   token 0, token 1: two candidates for the next token; 2 follows 0, 3 follows 1, 4 follows 2
TREE = [-1, -1, 0, 1, 2]


def path(node):
    """The draft tokens from the root of TREE to `node`, in order (none for -1)."""
    tokens = []
    while node >= 0:
        tokens.append(node)
        node = TREE[node]
    return tokens[::-1]


@dataclass
class Request:
    name: str
    row: int
    state: torch.Tensor  # the oracle's state of this request, float64 [HV, K, V]


@dataclass
class Engine:
    mod: object
    rec: object
    shape: Shape  # H, HV, K, V of the model (B and T unused)
    dtype: torch.dtype
    device: str
    generator: torch.Generator
    pool: torch.Tensor
    free_rows: list
    params: list = field(default_factory=list)  # the spec's per-head inputs: the model's, fixed
    step: str = ""  # where the loop is ("step 3: "), for the checks that fail
    failed: list = field(default_factory=list)  # "what error > limit" of each check that failed

    def tokens(self, B, T):
        """Inputs of B x T tokens (per-token tensors fresh, per-head ones the model's)."""
        s = self.shape
        tensors = make_inputs(self.rec, Shape(B, T, s.H, s.HV, s.K, s.V), dtype=self.dtype, generator=self.generator)
        if not self.params:
            self.params = [None] * 3 + [None if i.role.per_token else t for i, t in zip(self.rec.inputs, tensors[3:])]
        return [(p if p is not None else t).to(self.device) for p, t in zip(self.params, tensors)]

    def rows_per_token(self):
        """Rows per token of q, k, v and each input (0: a per-head input). A spec with
        steps_per_token = n (Gated DeltaProduct) gives k, v and its steps' inputs n rows a token."""
        n = self.rec.steps_per_token
        return [1, n, n] + [self.rec.rows_per_token(i) if i.role.per_token else 0 for i in self.rec.inputs]

    def oracle(self, request, tensors, n, first, count, tokens=None):
        """The oracle over tokens first .. first+count of sequence n (or over the token indices
        `tokens`: a path of a draft tree): its o; advances the request."""
        index = list(range(first, first + count)) if tokens is None else tokens
        picked = [t[n:n + 1, [i * r + j for i in index for j in range(r)]] if r else t
                  for t, r in zip(tensors, self.rows_per_token())]
        o, final = reference.run(self.rec, *picked, initial_state=request.state[None], output_final_state=True,
                                 use_qk_l2norm_in_kernel=True)
        request.state = final[0]
        return o[0]

    def new_state(self):
        """The oracle's zero state [HV, K, V]."""
        return torch.zeros(self.shape.HV, self.shape.K, self.shape.V, dtype=torch.float64, device=self.device)

    def rows(self, rows):
        """Pool rows as the kernels read them (an 8-bit pool's unpacked), in float64."""
        got = self.pool[rows]
        return (self.mod.unpack_states(got) if got.dtype == torch.int8 else got).double()

    def check(self, what, got, expected):
        if self.pool.dtype == torch.int8:
            limit = self.shape.K ** 0.5 / 254
        else:
            limit = TOLERANCE[torch.float32 if self.dtype == torch.float32 and self.pool.dtype == torch.float32
                              else torch.bfloat16]
        error = relative_error(got, expected)
        print(f"  {what}: relative error vs the oracle {error:.1e}")
        if not error <= limit:  # NaN fails too
            self.failed.append(f"{self.step}{what} {error:.1e} > {limit:.0e}")

    def prefix_cache(self):
        """P's prompt prefilled with a checkpoint after each whole block (rows of their own); Q's
        prompt = P's first 2 blocks + its own tokens, prefilled from a copy of the second checkpoint:
        only Q's own tokens run."""
        if not hasattr(self.mod, "chunk"):
            print("prefix cache: this spec has no chunk form (its prefill is recurrent(), which writes no checkpoints)")
            return
        p_row, q_row, *cache_rows = (self.free_rows.pop(0) for _ in range(4))
        prompt = self.tokens(1, P_TOKENS)
        for row in (p_row, q_row):
            self.pool[row] = 0
        p_request = Request("P", p_row, self.new_state())
        checkpoints = torch.tensor([cache_rows], device=self.device)  # P's state after 16 and after 32 tokens
        with torch.no_grad():
            self.mod.chunk(*prompt, state_pool=self.pool, state_indices=torch.tensor([p_row], device=self.device),
                           chunk_size=PREFIX_BLOCK, checkpoint_every=PREFIX_BLOCK, checkpoint_indices=checkpoints,
                           use_qk_l2norm_in_kernel=True)
        cached = []
        for block in (1, 2):  # the oracle's state after each checkpoint's tokens
            self.oracle(p_request, prompt, 0, (block - 1) * PREFIX_BLOCK, PREFIX_BLOCK)
            cached.append(p_request.state)
        print(f"prefix cache: P's prefill ({P_TOKENS} tokens, row {p_row}) wrote its state after {PREFIX_BLOCK} and "
              f"{2 * PREFIX_BLOCK} tokens into rows {cache_rows[0]} and {cache_rows[1]}")
        self.check("checkpoint rows", self.rows(cache_rows), torch.stack(cached))

        # Q: P's first 2 blocks (cached) then its own tokens; only those run, from the cached state
        own = self.tokens(1, Q_OWN_TOKENS)
        cut = 2 * PREFIX_BLOCK
        q_prompt = [torch.cat([p[:, :cut * r], o], dim=1) if r else p
                    for p, o, r in zip(prompt, own, self.rows_per_token())]
        self.pool[q_row] = self.pool[cache_rows[1]]
        with torch.no_grad():
            o, _ = self.mod.chunk(*own, state_pool=self.pool, state_indices=torch.tensor([q_row], device=self.device),
                                  use_qk_l2norm_in_kernel=True)
        q_request = Request("Q", q_row, self.new_state())
        expected = self.oracle(q_request, q_prompt, 0, 0, cut + Q_OWN_TOKENS)[cut:]  # Q's whole prompt, from zero
        print(f"prefix cache: Q repeats P's first {cut} tokens: row {q_row} := row {cache_rows[1]}, then a prefill "
              f"of Q's own {Q_OWN_TOKENS} tokens")
        self.check("Q's o (its own tokens, against its whole prompt from zero)", o[0], expected)
        self.check("Q's pool row", self.rows([q_row])[0], q_request.state)

    def prefill(self, names_and_lengths):
        """New requests' prompts, packed into one call, each into a fresh pool row."""
        requests = []
        for name, _ in names_and_lengths:
            row = self.free_rows.pop(0)
            self.pool[row] = 0  # a new request starts from the zero state
            requests.append(Request(name, row, self.new_state()))
        lengths = [length for _, length in names_and_lengths]
        tensors = self.tokens(1, sum(lengths))
        bounds = [0]
        for length in lengths:
            bounds.append(bounds[-1] + length)
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=self.device)
        rows = torch.tensor([r.row for r in requests], device=self.device)
        prefill = self.mod.chunk if hasattr(self.mod, "chunk") else self.mod.recurrent
        with torch.no_grad():
            o, _ = prefill(*tensors, cu_seqlens=cu_seqlens, state_pool=self.pool, state_indices=rows,
                           use_qk_l2norm_in_kernel=True)
        expected = torch.cat([self.oracle(r, tensors, 0, bounds[i], lengths[i]) for i, r in enumerate(requests)])
        print("prefill " + ", ".join(f"{r.name} ({n} tokens) -> row {r.row}" for r, n in zip(requests, lengths)))
        self.check("prefill o", o[0], expected)
        return requests


def capture_or_call(fn, on_gpu):
    """On a GPU: fn captured once in a CUDA graph (after a warm-up call), replayed per step."""
    if not on_gpu:
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles the kernels
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="gdn", help="a shipped spec's name or a spec file (default gdn)")
    parser.add_argument("--state-dtype", default="float32", choices=("float32", "bfloat16", "float16", "int8"))
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    if args.state_dtype == "bfloat16" and not on_gpu:
        print("serving_decode.py: --state-dtype bfloat16 needs a GPU: Triton's CPU interpreter rounds fp32 to bf16 "
              "toward zero (a GPU rounds to nearest), a drift of its own; use --state-dtype float16 on a CPU",
              file=sys.stderr)
        return 2
    rec = run_pipeline(load_spec_by_name(args.spec), until="recurrence")["recurrence"]
    mod = lrdsl.load(args.spec)
    shape = Shape(SLOTS, 1, 4, 8, 128, 128) if on_gpu else Shape(SLOTS, 1, 1, 2, 16, 16)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    generator = torch.Generator().manual_seed(0)
    # an 8-bit pool: each state column's fp32 scale (4 bytes) beside its K values; zeros are the zero state
    key_rows = shape.K + 4 if args.state_dtype == "int8" else shape.K
    pool = torch.zeros(POOL_ROWS, shape.HV, key_rows, shape.V, dtype=getattr(torch, args.state_dtype), device=device)
    free = torch.randperm(POOL_ROWS, generator=generator).tolist()  # rows in no particular order
    engine = Engine(mod, rec, shape, dtype, device, generator, pool, free)
    print(f"{args.spec} on {'the GPU, steps as CUDA-graph replays' if on_gpu else 'the CPU'}: {SLOTS} slots, "
          f"a pool of {POOL_ROWS} {args.state_dtype} rows [HV={shape.HV}, K={shape.K}, V={shape.V}]")

    # the batch: static buffers that the captured steps read and write
    slots = engine.prefill([("A", 5), ("B", 11), ("C", 3)]) + [None]
    indices = torch.tensor([r.row if r else -1 for r in slots], dtype=torch.int32, device=device)
    decode_in, draft_in = engine.tokens(SLOTS, 1), engine.tokens(SLOTS, DRAFTS)
    accepted = torch.zeros(SLOTS, dtype=torch.int32, device=device)
    decode_out = torch.empty(SLOTS, 1, shape.HV, shape.V, dtype=dtype, device=device)
    verify_out = torch.empty(SLOTS, DRAFTS, shape.HV, shape.V, dtype=dtype, device=device)
    _, draft = mod.verify(*draft_in, state_pool=pool, state_indices=indices, use_qk_l2norm_in_kernel=True)

    def decode():
        mod.recurrent(*decode_in, state_pool=pool, state_indices=indices, validate=False, out=decode_out,
                      use_qk_l2norm_in_kernel=True)

    def verify_and_commit():
        mod.verify(*draft_in, state_pool=pool, state_indices=indices, validate=False, out=verify_out, draft=draft,
                   use_qk_l2norm_in_kernel=True)
        mod.commit(draft, accepted, validate=False)

    # the tree step's static buffers: its tokens, the tree, each request's accepted node (-1: none)
    tree_in, parents = engine.tokens(SLOTS, len(TREE)), torch.tensor([TREE] * SLOTS, device=device)
    accepted_node = torch.full((SLOTS,), -1, dtype=torch.int32, device=device)
    tree_out = torch.empty(SLOTS, len(TREE), shape.HV, shape.V, dtype=dtype, device=device)
    _, tree_draft = mod.verify(*tree_in, state_pool=pool, state_indices=indices, parents=parents,
                               use_qk_l2norm_in_kernel=True)

    def tree_verify_and_commit():
        mod.verify(*tree_in, state_pool=pool, state_indices=indices, parents=parents, validate=False, out=tree_out,
                   draft=tree_draft, use_qk_l2norm_in_kernel=True)
        mod.commit(tree_draft, accepted_node=accepted_node, validate=False)

    with torch.no_grad():
        step_decode, step_verify = capture_or_call(decode, on_gpu), capture_or_call(verify_and_commit, on_gpu)
        step_tree = capture_or_call(tree_verify_and_commit, on_gpu)
    for step in range(6):
        if step == 3:  # B is done: its slot goes to D, prefilled into a fresh row
            leaving = slots[1]
            engine.free_rows.append(leaving.row)
            slots[1] = engine.prefill([("D", 7)])[0]
            indices.copy_(torch.tensor([r.row if r else -1 for r in slots]))
            print(f"{leaving.name} leaves (row {leaving.row} freed), D joins slot 1")
        live = [(n, r) for n, r in enumerate(slots) if r]
        engine.step = f"step {step}: "
        if step % 2 == 0:
            for static, fresh in zip(decode_in, engine.tokens(SLOTS, 1)):
                static.copy_(fresh)
            step_decode()
            print(f"step {step}: decode, slots {' '.join(r.name if r else '-' for r in slots)}")
            expected = torch.stack([engine.oracle(r, decode_in, n, 0, 1) for n, r in live])
            engine.check("o", decode_out[[n for n, _ in live]], expected)
        else:
            counts = torch.randint(0, DRAFTS + 1, (SLOTS,), generator=generator)
            for static, fresh in zip(draft_in, engine.tokens(SLOTS, DRAFTS)):
                static.copy_(fresh)
            accepted.copy_(counts)
            step_verify()
            print(f"step {step}: verify {DRAFTS} drafts each, accepted " +
                  " ".join(f"{r.name} {int(counts[n])}" for n, r in live))
            expected = []
            for n, r in live:
                start = r.state.clone()
                expected.append(engine.oracle(r, draft_in, n, 0, DRAFTS))  # every draft position's output
                r.state = start
                engine.oracle(r, draft_in, n, 0, int(counts[n]))  # then only the accepted tokens advance it
            engine.check("o of every draft", verify_out[[n for n, _ in live]], torch.stack(expected))

    engine.step = "step 6: "
    nodes = torch.randint(-1, len(TREE), (SLOTS,), generator=generator)
    for static, fresh in zip(tree_in, engine.tokens(SLOTS, len(TREE))):
        static.copy_(fresh)
    accepted_node.copy_(nodes)
    step_tree()
    live = [(n, r) for n, r in enumerate(slots) if r]
    print(f"step 6: verify a tree of {len(TREE)} drafts each (parents {TREE}), accepted paths " +
          " ".join(f"{r.name} {path(int(nodes[n]))}" for n, r in live))
    expected = []
    for n, r in live:
        start = r.state.clone()
        for node in range(len(TREE)):  # each draft token's output along its own path
            expected.append(engine.oracle(r, tree_in, n, 0, 0, tokens=path(node))[-1])
            r.state = start.clone()
        engine.oracle(r, tree_in, n, 0, 0, tokens=path(int(nodes[n])))  # the accepted path advances it
    engine.check("o of every node of the tree", tree_out[[n for n, _ in live]].reshape(-1, shape.HV, shape.V),
                 torch.stack(expected))
    engine.step = "step 7: "
    engine.prefix_cache()
    rows = [r.row for r in slots if r]
    engine.step = ""
    engine.check("final pool rows of the requests in the batch", engine.rows(rows),
                 torch.stack([r.state for r in slots if r]))
    print("FAILED: " + "; ".join(engine.failed) if engine.failed else "ok")
    return 1 if engine.failed else 0


if __name__ == "__main__":
    sys.exit(main())
