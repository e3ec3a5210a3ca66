"""Tree verify (speculative decoding with several candidates per position): verify(...,
parents=) runs each draft token along its own path from its sequence's pool row, and
commit(draft, accepted_node=) writes the state after one path. Every spec, against the float64
oracle run on each path's tokens, and against the kernels' own token-by-token functions: a path
of a tree is a line of tokens, and a tree that is a line is what verify() without parents runs."""
from __future__ import annotations

import pytest
import torch

from lrdsl import reference
from lrdsl.errors import InputError
from lrdsl.verification.workloads import TOLERANCE, Shape, make_inputs, relative_error

from helpers import ALL_SPECS, module, recurrence, rows_per_token

LIMIT = TOLERANCE[torch.float32]
H, HV, K, V = 1, 2, 12, 10  # not powers of two: the kernels' masks are on
# per sequence: a tree (two children of the root's child, a grandchild), one whose first token
# sits beside the pool row's other children, and a line (each token the child of the one before)
PARENTS = [[-1, 0, 0, 1, 2], [-1, -1, 1, 1, 3], [-1, 0, 1, 2, 3]]


def path(parents, node):
    """The tokens from the root to `node`, in order."""
    tokens = []
    while node >= 0:
        tokens.append(node)
        node = parents[node]
    return tokens[::-1]


def path_inputs(rec, tensors, n, tokens, start=0):
    """Sequence n's inputs at `tokens` (token indices after `start`, its first token when packed):
    each token's rows of the per-token tensors, the per-head ones whole."""
    picked = []
    for rows, x in zip(rows_per_token(rec), tensors):
        if not rows:
            picked.append(x)
            continue
        index = torch.tensor([(start + t) * rows + j for t in tokens for j in range(rows)])
        picked.append(x[n:n + 1, index] if start == 0 else x[:, index])
    return picked


def oracle(rec, tensors, n, tokens, state, start=0):
    """The float64 oracle on a path: (the output of its last token [HV, V], the state after it)."""
    o, final = reference.run(rec, *path_inputs(rec, tensors, n, tokens, start), initial_state=state[None].double(),
                             output_final_state=True)
    return o[0, -1], final[0]


def draw(name, generator, B, T, P=6):
    rec = recurrence(name)
    tensors = make_inputs(rec, Shape(B, T, H, HV, K, V), generator=generator)
    pool = torch.randn(P, HV, K, V, generator=generator) * 0.5
    return rec, module(name), tensors, pool


def on(device, tensors):
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("name", ALL_SPECS)
def test_every_node_and_every_committed_path_match_the_oracle(name, generator, device):
    """Three sequences of five draft tokens and a padding slot: each token's output is the
    oracle's at the end of its path from the pool row; verify leaves the pool as it was; commit
    of a leaf, an inner node and nothing writes the oracle's state after that path."""
    rec, mod, tensors, pool = draw(name, generator, B=4, T=5)
    parents = torch.tensor(PARENTS + [[-1, 0, 1, 2, 3]])
    slots = [4, 1, 3, -1]
    before = pool.clone()
    pool = pool.to(device)
    o, draft = mod.verify(*on(device, tensors), state_pool=pool, state_indices=torch.tensor(slots, device=device),
                          parents=parents.to(device))
    assert torch.equal(pool.cpu(), before), "verify only reads the pool"
    assert torch.equal(o[3].cpu(), torch.zeros(5, HV, V)), "a padding slot's outputs are zeros"
    errors = [relative_error(o[n, t], oracle(rec, tensors, n, path(PARENTS[n], t), before[slots[n]])[0])
              for n in range(3) for t in range(5)]
    assert max(errors) <= LIMIT, errors

    leaves = [4, 1, -1, 2]  # a leaf of the tree; an inner node; nothing accepted; a padding slot
    mod.commit(draft, accepted_node=torch.tensor(leaves, device=device))
    pool = pool.cpu()
    for n in range(2):
        _, expected = oracle(rec, tensors, n, path(PARENTS[n], leaves[n]), before[slots[n]])
        assert relative_error(pool[slots[n]], expected) <= LIMIT, f"sequence {n}: the path to draft token {leaves[n]}"
    untouched = [r for r in range(pool.shape[0]) if r not in (slots[0], slots[1])]
    assert torch.equal(pool[untouched], before[untouched]), "no other pool row changes"


@pytest.mark.parametrize("name", ["gdn", "rwkv7", "kda", "gated_deltaproduct"])
def test_a_path_is_a_line_of_tokens_bit_for_bit(name, generator, device):
    """A tree whose every token follows the one before it is what verify() without parents runs,
    and every path of a tree gives, at its last token, recurrent()'s output on the path's tokens
    from the pool row: the same arithmetic in the same order, to the bit. So does the commit of
    that path against recurrent() writing the row."""
    rec, mod, tensors, pool = draw(name, generator, B=3, T=5)
    slots = torch.tensor([2, 0, 5], device=device)
    pool = pool.to(device)
    tensors = on(device, tensors)
    line = torch.tensor([PARENTS[2]] * 3, device=device)
    assert torch.equal(mod.verify(*tensors, state_pool=pool, state_indices=slots, parents=line)[0],
                       mod.verify(*tensors, state_pool=pool, state_indices=slots)[0])

    o, draft = mod.verify(*tensors, state_pool=pool, state_indices=slots, parents=torch.tensor(PARENTS, device=device))
    committed = pool.clone()
    draft.state_pool = committed
    mod.commit(draft, accepted_node=torch.tensor([3, 4, 2], device=device))
    for n, leaf in enumerate([3, 4, 2]):
        for node in range(5):
            tokens = path(PARENTS[n], node)
            row = pool[slots[n]:slots[n] + 1].clone()
            alone, _ = mod.recurrent(*path_inputs(rec, tensors, n, tokens), state_pool=row,
                                     state_indices=torch.tensor([0], device=device))
            assert torch.equal(o[n, node], alone[0, -1]), f"sequence {n}, draft token {node}"
            if node == leaf:
                assert torch.equal(committed[slots[n]], row[0]), f"sequence {n}: commit of draft token {leaf}"


@pytest.mark.parametrize("name", ["gdn", "linear_attn", "rwkv7", "gated_deltaproduct"])
def test_packed_trees_state_v_first(name, generator, device):
    """Trees packed with cu_seqlens (4, 0 and 3 draft tokens; parents index each sequence's own
    tokens), states [P, HV, V, K], commit of one path per sequence (with two steps per token too)."""
    rec, mod, tensors, pool = draw(name, generator, B=1, T=7)
    bounds, slots = [0, 4, 4, 7], [3, 0, 5]
    trees = [[-1, 0, -1, 2], [], [-1, 0, 0]]
    parents = torch.tensor([sum(trees, [])], device=device)
    before = pool.clone()
    pool_v_first = pool.transpose(-1, -2).contiguous().to(device)
    o, draft = mod.verify(*on(device, tensors), state_pool=pool_v_first, state_indices=torch.tensor(slots, device=device),
                          cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device), state_v_first=True,
                          parents=parents)
    for n, tree in enumerate(trees):
        for t in range(len(tree)):
            expected, _ = oracle(rec, tensors, 0, path(tree, t), before[slots[n]], start=bounds[n])
            assert relative_error(o[0, bounds[n] + t], expected) <= LIMIT, f"sequence {n}, draft token {t}"
    leaves = [3, -1, 2]
    mod.commit(draft, accepted_node=torch.tensor(leaves, device=device))
    for n in (0, 2):
        _, expected = oracle(rec, tensors, 0, path(trees[n], leaves[n]), before[slots[n]], start=bounds[n])
        assert relative_error(pool_v_first[slots[n]].transpose(-1, -2), expected) <= LIMIT, f"sequence {n}"
    assert torch.equal(pool_v_first[0].cpu(), before[0].transpose(-1, -2)), "an empty sequence's row stays"


def test_without_validation_a_parent_out_of_order_is_the_pool_rows_child(generator, device):
    """validate=False (a CUDA-graph capture) checks nothing on the host; a parent that is not an
    earlier token of the sequence then counts as -1, and no walk up the tree can loop."""
    rec, mod, tensors, pool = draw("gdn", generator, B=1, T=4)
    pool, tensors, slots = pool.to(device), on(device, tensors), torch.tensor([1], device=device)
    bad = torch.tensor([[-1, 0, 5, 2]], device=device)  # token 2's parent: itself and later tokens
    rooted = torch.tensor([[-1, 0, -1, 2]], device=device)
    got = mod.verify(*tensors, state_pool=pool, state_indices=slots, parents=bad, validate=False)[0]
    assert torch.equal(got, mod.verify(*tensors, state_pool=pool, state_indices=slots, parents=rooted)[0])
    for cycle in ([[-1, 3, 1, 2]], [[0, 0, 0, 0]], [[-7, -1, 1, 1]]):
        mod.verify(*tensors, state_pool=pool, state_indices=slots, parents=torch.tensor(cycle, device=device),
                   validate=False)


def test_one_line_errors(generator, device):
    rec, mod, tensors, pool = draw("gdn", generator, B=2, T=3)
    tensors, pool, slots = on(device, tensors), pool.to(device), torch.tensor([0, 1], device=device)

    def verify(parents, **options):
        return mod.verify(*tensors, state_pool=pool, state_indices=slots, parents=parents, **options)

    cases = [
        (torch.zeros(2, 4, dtype=torch.long), r"gdn\.verify: parents must be a tensor \[B, T\] = \[2, 3\] .*got a torch\.int64 tensor \[2, 4\]"),
        (torch.zeros(2, 3), r"gdn\.verify: parents must be int32 or int64, got torch\.float32"),
        ([[-1, 0, 1]] * 2, r"gdn\.verify: parents must be a tensor \[B, T\] = \[2, 3\] .*got \[\[-1, 0, 1\], \[-1, 0, 1\]\]"),
        (torch.tensor([[-1, 0, 1], [-1, 1, 0]]), r"gdn\.verify: parents\[1, 1\] = 1: a draft token's parent is an "
                                                 r"earlier draft token of its sequence, -1 \.\. 0 here"),
        (torch.tensor([[-1, -2, 1], [-1, 0, 0]]), r"gdn\.verify: parents\[0, 1\] = -2: .* -1 \.\. 0 here"),
    ]
    for parents, message in cases:
        if isinstance(parents, torch.Tensor):
            parents = parents.to(device)
        with pytest.raises(InputError, match=message) as error:
            verify(parents)
        assert "\n" not in str(error.value)

    _, tree = verify(torch.tensor([[-1, 0, 0], [-1, -1, 1]], device=device))
    _, line = mod.verify(*tensors, state_pool=pool, state_indices=slots)
    refusals = [
        (lambda: mod.commit(tree, torch.tensor([1, 1], device=device)),
         r"gdn\.commit: this draft is a tree \(verify\(\.\.\., parents=\)\): pass accepted_node="),
        (lambda: mod.commit(line, accepted_node=torch.tensor([1, 1], device=device)),
         r"gdn\.commit: this draft's tokens are in a line: pass num_accepted"),
        (lambda: mod.commit(tree, accepted_node=torch.tensor([3, 0], device=device)),
         r"gdn\.commit: accepted_node\[0\] = 3 is outside -1 \.\. 2, sequence 0's draft tokens"),
        (lambda: mod.commit(tree, accepted_node=torch.tensor([1], device=device)),
         r"gdn\.commit: accepted_node must be a tensor \[N\] = \[2\] \(the last accepted draft token per sequence\)"),
    ]
    for call, message in refusals:
        with pytest.raises(InputError, match=message) as error:
            call()
        assert "\n" not in str(error.value)


def test_steps_per_token_trees_are_checked_in_tokens(generator, device):
    """With two steps per token, parents and accepted_node count tokens, as q does."""
    rec, mod, tensors, pool = draw("gated_deltaproduct", generator, B=1, T=3)
    tensors, pool, slots = on(device, tensors), pool.to(device), torch.tensor([0], device=device)
    with pytest.raises(InputError, match=r"gated_deltaproduct\.verify: parents must be a tensor \[B, T\] = \[1, 3\]"):
        mod.verify(*tensors, state_pool=pool, state_indices=slots, parents=torch.tensor([[-1, 0, 1, 2, 3, 4]], device=device))
    _, draft = mod.verify(*tensors, state_pool=pool, state_indices=slots, parents=torch.tensor([[-1, 0, 0]], device=device))
    with pytest.raises(InputError, match=r"accepted_node\[0\] = 3 is outside -1 \.\. 2"):
        mod.commit(draft, accepted_node=torch.tensor([3], device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gdn", "kda", "rwkv7", "gated_deltaproduct"])
def test_gpu_tree_verify_bf16_in_a_cuda_graph(name, generator):
    """bf16 inputs at K = V = 128 on a bf16 pool: tree verify + commit captured once in a CUDA
    graph (validate=False) and replayed with new inputs; every node's output and the committed
    rows against the oracle at bf16's tolerance, and equal to the eager calls'."""
    rec, mod = recurrence(name), module(name)
    shape = Shape(4, 5, 2, 4, 128, 128)
    pool = (torch.randn(6, 4, 128, 128, generator=generator) * 0.5).to("cuda", torch.bfloat16)
    slots = torch.tensor([5, 0, -1, 2], device="cuda")
    parents = torch.tensor(PARENTS + [[-1, 0, 1, 2, 3]], device="cuda")
    leaves = torch.tensor([4, 1, 0, 3], device="cuda")

    def draw_inputs():
        return [t.cuda() for t in make_inputs(rec, shape, dtype=torch.bfloat16, generator=generator)]

    static = draw_inputs()
    out = torch.empty(4, 5, 4, 128, dtype=torch.bfloat16, device="cuda")
    working = pool.clone()
    _, draft = mod.verify(*static, state_pool=working, state_indices=slots, parents=parents)

    def step():
        mod.verify(*static, state_pool=working, state_indices=slots, parents=parents, validate=False, out=out,
                   draft=draft)
        mod.commit(draft, accepted_node=leaves, validate=False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        step()
    fresh = draw_inputs()
    for x, y in zip(static, fresh):
        x.copy_(y)
    working.copy_(pool)
    graph.replay()
    torch.cuda.synchronize()
    eager_pool = pool.clone()
    with torch.no_grad():
        o, eager_draft = mod.verify(*fresh, state_pool=eager_pool, state_indices=slots, parents=parents)
        mod.commit(eager_draft, accepted_node=leaves)
    assert torch.equal(out, o) and torch.equal(working, eager_pool)
    tensors = [t.cpu() for t in fresh]
    limit = TOLERANCE[torch.bfloat16]
    for n, row in enumerate(slots.tolist()):
        if row < 0:
            continue
        for node in range(5):
            expected, _ = oracle(rec, tensors, n, path(parents[n].tolist(), node), pool[row].cpu().float())
            assert relative_error(o[n, node], expected) <= limit, f"sequence {n}, draft token {node}"
        _, final = oracle(rec, tensors, n, path(parents[n].tolist(), int(leaves[n])), pool[row].cpu().float())
        assert relative_error(working[row], final) <= limit, f"sequence {n}: committed row"
