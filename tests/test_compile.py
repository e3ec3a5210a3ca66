"""torch.compile: the generated functions run as torch.library custom ops under torch.compile,
with fake implementations and autograd, so that code using them compiles with fullgraph=True
(no graph break), forward and backward, and computes what the eager calls and the float64
oracle compute.

On the CPU, torch.compile runs with backend="aot_eager": Dynamo, the fake implementations and
AOTAutograd's forward and backward graphs, all that the custom ops take part in (inductor only
compiles the torch operations around them, and takes minutes on a 2-core box). The inductor
backend runs in the `gpu` test."""
from __future__ import annotations

import pytest
import torch

from lrdsl import reference
from lrdsl.verification.workloads import TOLERANCE, Shape, make_inputs, relative_error

from helpers import module, recurrence, rows_per_token

LIMIT = TOLERANCE[torch.float32]
BACKEND = "aot_eager"


def ops_of(mod):
    return getattr(torch.ops, mod._OP_NAMESPACE)


def small_inputs(name, generator, B=2, T=5, H=1, HV=2, K=8, V=12):
    return make_inputs(recurrence(name), Shape(B, T, H, HV, K, V), generator=generator)


def prefill_then_decode(mod):
    """A model-like function: chunk() over a prompt from an initial state, then recurrent()
    for the next tokens from its final state; one loss of both outputs and the last state."""

    def run(prompt, following, h0):
        o, ht = mod.chunk(*prompt, initial_state=h0, output_final_state=True, chunk_size=16, use_qk_l2norm_in_kernel=True)
        o2, ht2 = mod.recurrent(*following, initial_state=ht, output_final_state=True, use_qk_l2norm_in_kernel=True)
        return (o.float().sin().sum() + o2.float().square().sum() + ht2.square().sum()) / 10

    return run


def split(name, tensors, at):
    """The tensors of the first `at` tokens and of the rest (several steps per token: their rows)."""
    rows = rows_per_token(recurrence(name))
    first = [t[:, :at * r] if r else t for t, r in zip(tensors, rows)]
    rest = [t[:, at * r:] if r else t for t, r in zip(tensors, rows)]
    return first, rest


@pytest.mark.parametrize("name", ["gdn", "linear_attn", "gdn_qwen35", "gated_deltaproduct"])
def test_prefill_and_decode_compile_fullgraph_forward_and_backward(name, generator, device):
    """fullgraph=True compiles chunk() then recurrent(), and the backward through both: the
    loss and every gradient equal the eager calls' and the oracle's."""
    mod, rec = module(name), recurrence(name)
    tensors = [t.to(device).requires_grad_() for t in small_inputs(name, generator, T=7)]
    h0 = (torch.randn(2, 2, 8, 12, generator=generator) * 0.5).to(device).requires_grad_()
    run = prefill_then_decode(mod)
    torch._dynamo.reset()
    compiled = torch.compile(run, fullgraph=True, backend=BACKEND)
    loss = compiled(*split(name, tensors, 5), h0)
    grads = torch.autograd.grad(loss, tensors + [h0])
    eager_loss = run(*split(name, tensors, 5), h0)
    eager_grads = torch.autograd.grad(eager_loss, tensors + [h0])
    assert relative_error(loss, eager_loss) <= 1e-6
    for index, (a, b) in enumerate(zip(grads, eager_grads)):
        assert relative_error(a, b) <= 1e-6, f"gradient {index} differs from eager"

    refs = [t.detach().double().requires_grad_() for t in tensors]
    h0_ref = h0.detach().double().requires_grad_()
    first, rest = split(name, refs, 5)
    o, ht = reference.run(rec, *first, initial_state=h0_ref, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o2, ht2 = reference.run(rec, *rest, initial_state=ht, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_loss = (o.sin().sum() + o2.square().sum() + ht2.square().sum()) / 10
    ref_grads = torch.autograd.grad(ref_loss, refs + [h0_ref])
    assert relative_error(loss, ref_loss) <= LIMIT
    for index, (a, b) in enumerate(zip(grads, ref_grads)):
        assert relative_error(a, b) <= LIMIT, f"gradient {index} vs the oracle"


@pytest.mark.parametrize("chunk_size", [None, 16])
def test_compiled_backward_runs_at_the_chunk_size_eager_chooses(chunk_size, generator, device, monkeypatch):
    """Under torch.compile, as in eager chunk(): with the chunk size left to lrdsl the backward
    recomputes at BACKWARD_CHUNK_SIZE (what its kernels' registers hold), with a caller's at that
    one; the gradients match the oracle either way."""
    mod, rec = module("gdn"), recurrence("gdn")
    tensors = [t.to(device).requires_grad_() for t in small_inputs("gdn", generator, T=40)]
    # patched where the compiled backward's custom op looks it up: the namespace of the last module
    # object of this text that registered the op (a test that loaded the same text again, into a
    # fresh loader cache, leaves the ops calling into its object, not into module("gdn"))
    import torch._library.custom_ops as custom_ops

    namespace = custom_ops.OPDEFS[f"{mod._OP_NAMESPACE}::chunk_backward"]._init_fn.__globals__
    sizes, backward = [], namespace["_chunk_backward"]
    monkeypatch.setitem(namespace, "_chunk_backward", lambda c, *rest: sizes.append(c["BT"]) or backward(c, *rest))
    torch._dynamo.reset()
    compiled = torch.compile(lambda *x: mod.chunk(*x, chunk_size=chunk_size)[0].float().sin().sum(), fullgraph=True,
                             backend=BACKEND)
    grads = torch.autograd.grad(compiled(*tensors), tensors)
    expected = mod.BACKWARD_CHUNK_SIZE["input"] if chunk_size is None else chunk_size
    assert sizes == [expected] and expected < mod.largest_chunk_size(8)
    refs = [t.detach().double().requires_grad_() for t in tensors]
    o, _ = reference.run(rec, *refs)
    for index, (a, b) in enumerate(zip(grads, torch.autograd.grad(o.sin().sum(), refs))):
        assert relative_error(a, b) <= LIMIT, f"gradient {index} vs the oracle"

def serving_step(mod):
    """One engine step: decode one token per request on the pool, verify 3 draft tokens, commit."""

    def step(pool, indices, accepted, decode, drafts, out):
        o, _ = mod.recurrent(*decode, state_pool=pool, state_indices=indices, validate=False, out=out)
        o_draft, draft = mod.verify(*drafts, state_pool=pool, state_indices=indices, validate=False)
        mod.commit(draft, accepted, validate=False)
        return o, o_draft

    return step


@pytest.mark.parametrize("name", ["gdn", "kda", "rwkv7", "gated_deltaproduct"])
def test_serving_step_compiles_fullgraph(name, generator, device):
    """Pool decode, verify and commit (ops that update the pool in place) compile with
    fullgraph=True and leave the pool as the eager calls do; kda has no chunk form (its module
    registers the recurrent ops only); rwkv7's Draft holds its low-rank term's b and r too."""
    tensors = [t.to(device) for t in small_inputs(name, generator, B=3, T=4)]
    decode, drafts = split(name, tensors, 1)
    pool = torch.randn(5, 2, 8, 12, generator=generator).to(device)
    indices = torch.tensor([4, -1, 1], device=device)
    accepted = torch.tensor([2, 0, 3], device=device)
    step = serving_step(module(name))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=BACKEND)
    pools = [pool.clone(), pool.clone()]
    outs = [torch.empty(3, 1, 2, 12, device=device), torch.empty(3, 1, 2, 12, device=device)]
    with torch.no_grad():
        got = compiled(pools[0], indices, accepted, decode, drafts, outs[0])
        expected = step(pools[1], indices, accepted, decode, drafts, outs[1])
    assert torch.equal(pools[0], pools[1]) and not torch.equal(pools[0], pool)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("name", ["gdn", "rwkv7", "gated_deltaproduct"])
def test_tree_verify_and_commit_compile_fullgraph(name, generator, device):
    """verify(..., parents=) of a tree of drafts and commit(draft, accepted_node=) compile with
    fullgraph=True and give the eager calls' outputs and pool, bit for bit."""
    mod = module(name)
    _, drafts = split(name, [t.to(device) for t in small_inputs(name, generator, B=2, T=5)], 1)
    pool = torch.randn(4, 2, 8, 12, generator=generator).to(device)
    indices, leaves = torch.tensor([3, 1], device=device), torch.tensor([3, 2], device=device)
    parents = torch.tensor([[-1, 0, 0, 2], [-1, -1, 1, 0]], device=device)

    def step(pool, drafts):
        o, draft = mod.verify(*drafts, state_pool=pool, state_indices=indices, parents=parents, validate=False)
        mod.commit(draft, accepted_node=leaves, validate=False)
        return o

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=BACKEND)
    pools = [pool.clone(), pool.clone()]
    with torch.no_grad():
        got, expected = compiled(pools[0], drafts), step(pools[1], drafts)
    assert torch.equal(got, expected)
    assert torch.equal(pools[0], pools[1]) and not torch.equal(pools[0], pool)


def test_custom_ops_pass_opcheck(generator, device):
    """torch.library.opcheck on every op of a module: schema (which arguments are mutated),
    autograd registration, fake implementations against the real ones, AOT dispatch."""
    mod = module("gdn")
    ops = ops_of(mod)
    q, k, v, g, beta = [t.to(device) for t in small_inputs("gdn", generator, B=2, T=3)]
    h0 = torch.randn(2, 2, 8, 12, generator=generator).to(device)
    pool = torch.randn(4, 2, 8, 12, generator=generator).to(device)
    indices = torch.tensor([3, 0], device=device)
    lq, lk, lv, lg, lbeta, lh0 = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    scale = 8 ** -0.5
    calls = [  # the spec's inputs travel as one list
        (ops.recurrent, (lq, lk, lv, [lg, lbeta], lh0, None, scale, True, True, False)),
        (ops.chunk, (lq, lk, lv, [lg, lbeta], lh0, None, None, None, scale, True, True, 16, 16, mod.DEFAULT_CHUNK_PLAN,
                     "recompute", "input", False)),
        (ops.recurrent_pool, (q, k, v, [g, beta], pool.clone(), indices, None, scale, True, False, True)),
        (ops.chunk_pool, (q, k, v, [g, beta], pool.clone(), indices, None, None, None, scale, True, 16,
                          mod.DEFAULT_CHUNK_PLAN, "input", False, True)),
    ]
    for op, args in calls:
        results = torch.library.opcheck(op, args)
        assert set(results.values()) == {"SUCCESS"}, (op, results)


@pytest.mark.parametrize("name", ["gdn", "rwkv7"])
def test_verify_and_commit_ops_pass_opcheck(name, generator, device):
    """opcheck on the verify and commit ops: the Draft's buffers travel as k, u, g, b, r (empty
    where the spec has none: gdn has no low-rank term, rwkv7's b and r are what commit replays of
    it); the op-committed rows equal the oracle's state after the accepted tokens."""
    rec, ops = recurrence(name), ops_of(module(name))
    q, k, v, *extras = [t.to(device) for t in small_inputs(name, generator, B=2, T=3)]
    pool = torch.randn(4, 2, 8, 12, generator=generator).to(device)
    indices, accepted = torch.tensor([3, 0], device=device), torch.tensor([1, 3], device=device)
    scale = 8 ** -0.5
    verify_args = (q, k, v, extras, pool, indices, None, scale, True, False, True, None)
    results = torch.library.opcheck(ops.verify, verify_args)
    assert set(results.values()) == {"SUCCESS"}, results
    _, *draft = ops.verify(*verify_args)
    assert [x.numel() > 0 for x in draft[3:]] == [rec.has_low_rank] * 2, "b and r: present exactly for a low-rank term"
    commit_args = (pool.clone(), indices, accepted, *draft, None, False, True, None)
    results = torch.library.opcheck(ops.commit, commit_args)
    assert set(results.values()) == {"SUCCESS"}, results
    committed = pool.clone()
    ops.commit(committed, indices, accepted, *draft, None, False, True, None)
    per_token = [True] * 3 + [i.role.per_token for i in rec.inputs]
    for n, (row, count) in enumerate(zip(indices.tolist(), accepted.tolist())):
        prefix = [(t[n:n + 1, :count] if p else t).double().cpu() for t, p in zip((q, k, v, *extras), per_token)]
        _, expected = reference.run(rec, *prefix, initial_state=pool[row][None].double().cpu(), output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, scale=scale)
        assert relative_error(committed[row][None], expected) <= LIMIT, f"row {row} after {count} accepted"

    # a tree of drafts: token 2 of sequence 0 follows token 0, token 1 of sequence 1 the pool row
    parents = torch.tensor([[-1, 0, 0], [-1, -1, 1]], device=device)
    tree_args = verify_args[:-1] + (parents,)
    results = torch.library.opcheck(ops.verify, tree_args)
    assert set(results.values()) == {"SUCCESS"}, results
    _, *draft = ops.verify(*tree_args)
    leaves = torch.tensor([2, 2], device=device)
    results = torch.library.opcheck(ops.commit, (pool.clone(), indices, leaves, *draft, None, False, True, parents))
    assert set(results.values()) == {"SUCCESS"}, results
    committed = pool.clone()
    ops.commit(committed, indices, leaves, *draft, None, False, True, parents)
    for n, (row, path) in enumerate(zip(indices.tolist(), ([0, 2], [1, 2]))):
        tokens = [(t[n:n + 1, path] if p else t).double().cpu() for t, p in zip((q, k, v, *extras), per_token)]
        _, expected = reference.run(rec, *tokens, initial_state=pool[row][None].double().cpu(), output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, scale=scale)
        assert relative_error(committed[row][None], expected) <= LIMIT, f"row {row} after the path {path}"


def test_a_bad_tensor_under_compile_names_it(generator, device):
    """The fake implementations run the eager checks: torch.compile's error carries the one-line
    message naming the tensor."""
    mod = module("gdn")
    q, k, v, g, beta = [t.to(device) for t in small_inputs("gdn", generator)]
    torch._dynamo.reset()
    compiled = torch.compile(lambda *x: mod.recurrent(*x)[0], fullgraph=True, backend=BACKEND)
    with pytest.raises(Exception, match=r"gdn.recurrent: g must be \[B, T, HV\] = \[2, 5, 2\], got \[2, 5, 3\]"):
        compiled(q, k, v, torch.zeros(2, 5, 3, device=device), beta)



def test_chunk_under_compile_takes_the_eager_default_and_limit_of_chunk_size():
    """chunk() under torch.compile fills in the chunk size eager chunk() would (FORWARD_CHUNK_SIZE,
    capped by largest_chunk_size for the precision, K and, for a GPU's tensors, the dtype: meta
    tensors stand for them), and its op's fake implementation refuses a larger one, in one line."""
    mod = module("kda")
    wide = torch.empty(1, 4, 1, 136, device="meta")  # kda at K > 128: 32
    fp32_wide = module("gdn"), torch.empty(1, 4, 1, 256, dtype=torch.float32, device="meta")  # fp32 on a GPU: 32
    for m, q in ((mod, wide), fp32_wide):
        assert m._largest_chunk_size(q, q.shape[3], "input", q.shape[3]) == 32
        assert m._default_chunk_size("chunk", q, q.shape[3], "input", m.DEFAULT_CHUNK_PLAN, q.shape[3]) == 32
        m._fake_chunk_options(q, q, 32, m.DEFAULT_CHUNK_PLAN, "input")
        with pytest.raises(m.InputError, match=rf"^{m.SPEC_NAME}.chunk: chunk_size must be one of \(16, 32, 64\) and at most 32 "):
            m._fake_chunk_options(q, q, 64, m.DEFAULT_CHUNK_PLAN, "input")
    with pytest.raises(mod.InputError, match=r"precision must be one of \('input', 'tf32'\), got 'fp8'"):
        mod._compiled_chunk((wide, wide, wide), None, None, False, None, False, None, None, None, None, "fp8", False,
                            None, None, True)

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gdn", "gdn_qwen35"])
def test_gpu_inductor_fullgraph_forward_backward_and_serving(name, generator):
    """The default backend (inductor) on the GPU: the prefill/decode model forward and backward,
    and the serving step, equal to eager."""
    mod = module(name)
    tensors = [t.cuda().requires_grad_() for t in small_inputs(name, generator, B=2, T=70, H=2, HV=4, K=128, V=128)]
    h0 = (torch.randn(2, 4, 128, 128, generator=generator) * 0.1).cuda().requires_grad_()
    run = prefill_then_decode(mod)
    torch._dynamo.reset()
    compiled = torch.compile(run, fullgraph=True)
    loss = compiled(*split(name, tensors, 64), h0)
    grads = torch.autograd.grad(loss, tensors + [h0])
    eager_loss = run(*split(name, tensors, 64), h0)
    eager_grads = torch.autograd.grad(eager_loss, tensors + [h0])
    assert relative_error(loss, eager_loss) <= 1e-5
    for a, b in zip(grads, eager_grads):
        assert relative_error(a, b) <= 1e-5

    plain = [t.detach()[:, :4] if t.dim() >= 3 else t.detach() for t in tensors]
    decode, drafts = split(name, plain, 1)
    pool = torch.randn(8, 4, 128, 128, generator=generator).cuda()
    indices, accepted = torch.tensor([5, 2], device="cuda"), torch.tensor([3, 1], device="cuda")
    step = serving_step(mod)
    compiled_step = torch.compile(step, fullgraph=True)
    pools = [pool.clone(), pool.clone()]
    with torch.no_grad():
        got = compiled_step(pools[0], indices, accepted, decode, drafts, None)
        expected = step(pools[1], indices, accepted, decode, drafts, None)
    assert torch.equal(pools[0], pools[1])
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
