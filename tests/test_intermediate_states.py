"""chunk(..., return_intermediate_states=True): the state at the start of every chunk (a prefix
cache's checkpoints), against the float64 oracle run on each prefix, and prefills resumed from
each of those states, which must reproduce the rest of the sequence."""
from __future__ import annotations

import pytest
import torch
from helpers import force_segments, module, recurrence, rows_per_token, sample

import lrdsl.ops
from lrdsl import reference
from lrdsl.errors import InputError
from lrdsl.verification.workloads import TOLERANCE, Shape, relative_error

SPECS = ("gdn", "kda", "rwkv7", "simple_gla", "gated_deltaproduct")
LIMIT = TOLERANCE[torch.float32]


def _tokens(rec, tensors, start, end):
    """The tensors of tokens [start, end) (k, v and step inputs: their rows); per-head inputs whole."""
    return [x[:, start * n:end * n] if n else x for x, n in zip(tensors, rows_per_token(rec))]


def _close(out, ref, what, errors):
    err = relative_error(out, ref)
    errors.append(err)
    assert err <= LIMIT, f"{what}: relative error {err:.3e} > {LIMIT:.0e}"


def _check_sequence(mod, rec, tensors, h0, h, C, chunk_size, errors, v_first=False):
    """One sequence (B = 1): h [NT, HV, ...] against the oracle's state after each chunk's
    preceding tokens, and chunk() resumed from each entry on the remaining tokens."""
    T = tensors[0].shape[1]
    assert h.shape[0] == -(-T // C), f"{h.shape[0]} states for T={T} at C={C}"
    full_o, full_ht = reference.run(rec, *tensors, initial_state=h0, output_final_state=True)
    start = torch.zeros_like(full_ht) if h0 is None else h0.double()
    for j in range(h.shape[0]):
        state = h[j:j + 1].transpose(-1, -2) if v_first else h[j:j + 1]
        if j == 0:
            expected = start
        else:
            _, expected = reference.run(rec, *_tokens(rec, tensors, 0, j * C), initial_state=h0, output_final_state=True)
        _close(state, expected, f"{rec.name} entry state of chunk {j}", errors)
        # the prefill resumed from chunk j's entry state, in the layout the call returned it in
        rest = _tokens(rec, tensors, j * C, T)
        o, ht = mod.chunk(*rest, initial_state=h[j:j + 1], output_final_state=True, chunk_size=chunk_size,
                          state_v_first=v_first)
        _close(o, full_o[:, j * C:], f"{rec.name} o resumed at chunk {j}", errors)
        _close(ht.transpose(-1, -2) if v_first else ht, full_ht, f"{rec.name} final state resumed at chunk {j}", errors)


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("chunk_size, T", [(16, 37), (None, 70)])
def test_dense_states_match_prefixes_and_resume(name, chunk_size, T, monkeypatch):
    mod, rec = module(name), recurrence(name)
    g = torch.Generator().manual_seed(48)
    shape = Shape(2, T, 1, 2, 16, 8)
    tensors = sample(rec, shape, torch.float32, g)
    h0 = torch.randn(2, 2, 16, 8, generator=g)
    halved = []
    at_half = mod._at_scan_chunk_size
    monkeypatch.setattr(mod, "_at_scan_chunk_size", lambda *a: halved.append(a[2]) or at_half(*a))
    with torch.no_grad():
        o, ht, h = mod.chunk(*tensors, initial_state=h0, output_final_state=True, chunk_size=chunk_size,
                             return_intermediate_states=True)
    monkeypatch.undo()
    C = mod.intermediate_chunk_tokens(tensors[0], chunk_size, v=tensors[2])
    # without chunk_size the scan may run at half the output's chunk size (one state kept per two
    # chunks); chunk sizes count the kernels' rows
    rows = C * rec.steps_per_token
    plan_halves = chunk_size is None and mod.SMALLER_SCAN_CHUNKS[mod.DEFAULT_CHUNK_PLAN] and rows // 2 >= 32
    assert halved == ([rows // 2] if plan_halves else [])
    assert C == (chunk_size or mod.FORWARD_CHUNK_SIZE[mod.DEFAULT_CHUNK_PLAN, "input"]) // rec.steps_per_token
    assert h.shape == (2, -(-T // C), 2, 16, 8) and h.dtype == torch.float32 and not h.requires_grad
    ref_o, ref_ht = reference.run(rec, *tensors, initial_state=h0, output_final_state=True)
    errors = []
    _close(o, ref_o, f"{name} o", errors)
    _close(ht, ref_ht, f"{name} final state", errors)
    for b in range(2):
        _check_sequence(mod, rec, [x[b:b + 1] if n else x for x, n in zip(tensors, rows_per_token(rec))],
                        h0[b:b + 1], h[b], C, chunk_size, errors)
    print(f"{name} C={C}: max relative error {max(errors):.2e}")


@pytest.mark.parametrize("name", SPECS)
def test_varlen_states_per_sequence_in_order(name):
    """Packed sequences (an empty one and a one-token one among them): each sequence's
    ceil(length / C) entry states, the sequences in order, [1, total chunks, ...]."""
    mod, rec = module(name), recurrence(name)
    g = torch.Generator().manual_seed(49)
    bounds = [0, 0, 1, 20, 20, 53]
    tensors = sample(rec, Shape(1, bounds[-1], 2, 2, 8, 16), torch.float32, g)
    h0 = torch.randn(len(bounds) - 1, 2, 8, 16, generator=g)
    cu = torch.tensor(bounds, dtype=torch.int32)
    with torch.inference_mode():
        o, ht, h = mod.chunk(*tensors, initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=16,
                             return_intermediate_states=True)
    C = 16 // rec.steps_per_token
    counts = [-(-(end - start) // C) for start, end in zip(bounds, bounds[1:])]
    assert h.shape == (1, sum(counts), 2, 8, 16)
    errors, first = [], 0
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        if end > start:
            with torch.inference_mode():
                _check_sequence(mod, rec, _tokens(rec, tensors, start, end), h0[n:n + 1], h[0, first:first + counts[n]],
                                C, 16, errors)
        first += counts[n]
    print(f"{name} varlen: max relative error {max(errors):.2e}")


@pytest.mark.parametrize("name", ("gdn", "gated_deltaproduct"))
def test_state_v_first(name):
    """state_v_first: h [.., V, K], the same states transposed, and a resume takes them as they come."""
    mod, rec = module(name), recurrence(name)
    g = torch.Generator().manual_seed(50)
    tensors = sample(rec, Shape(1, 35, 1, 1, 8, 16), torch.float32, g)
    h0 = torch.randn(1, 1, 16, 8, generator=g)  # V-first
    with torch.no_grad():
        _, ht, h = mod.chunk(*tensors, initial_state=h0, output_final_state=True, chunk_size=16, state_v_first=True,
                             return_intermediate_states=True)
        _, _, h_kv = mod.chunk(*tensors, initial_state=h0.transpose(-1, -2).contiguous(), chunk_size=16,
                               return_intermediate_states=True)
        assert h.shape[-2:] == (16, 8) and ht.shape[-2:] == (16, 8)
        assert torch.allclose(h, h_kv.transpose(-1, -2))
        errors = []
        _check_sequence(mod, rec, tensors, h0.transpose(-1, -2), h[0], 16 // rec.steps_per_token, 16, errors,
                        v_first=True)


def test_segmented_scan(monkeypatch):
    """A scan run in segments (long sequences, few programs) stores every chunk's entry state too."""
    mod, rec = module("gdn"), recurrence("gdn")
    g = torch.Generator().manual_seed(56)
    tensors = sample(rec, Shape(1, 70, 1, 1, 8, 8), torch.float32, g)
    chosen = force_segments(monkeypatch, mod)
    with torch.no_grad():
        _, _, h = mod.chunk(*tensors, chunk_size=16, return_intermediate_states=True)
    assert any(chosen), "the scan ran in segments"
    monkeypatch.undo()
    errors = []
    with torch.no_grad():
        _check_sequence(mod, rec, tensors, None, h[0], 16, 16, errors)


def test_no_tokens_and_no_final_state():
    mod, rec = module("gdn"), recurrence("gdn")
    tensors = sample(rec, Shape(2, 0, 1, 1, 8, 8), torch.float32, torch.Generator().manual_seed(51))
    o, ht, h = mod.chunk(*tensors, return_intermediate_states=True)
    assert o.shape == (2, 0, 1, 8) and ht is None and h.shape == (2, 0, 1, 8, 8)
    cu = torch.tensor([0, 0], dtype=torch.int32)
    o, ht, h = mod.chunk(*sample(rec, Shape(1, 0, 1, 1, 8, 8), torch.float32, torch.Generator().manual_seed(52)),
                         cu_seqlens=cu, output_final_state=True, return_intermediate_states=True)
    assert ht.shape == (1, 1, 8, 8) and h.shape == (1, 0, 1, 8, 8)


def test_refusals(monkeypatch):
    mod, rec = module("gdn"), recurrence("gdn")
    tensors = sample(rec, Shape(1, 20, 1, 1, 8, 8), torch.float32, torch.Generator().manual_seed(53))
    leaf = [x.clone().requires_grad_() for x in tensors]
    with pytest.raises(InputError, match=r"^gdn\.chunk: return_intermediate_states=True is a forward without gradients"):
        mod.chunk(*leaf, return_intermediate_states=True)
    with pytest.raises(InputError, match=r"^gdn\.chunk: return_intermediate_states=True with cp_context is not supported"):
        mod.chunk(*tensors, return_intermediate_states=True, cp_context=object())
    pool, indices = torch.zeros(2, 1, 8, 8), torch.tensor([0])
    with pytest.raises(InputError, match=r"^gdn\.chunk: return_intermediate_states=True with state_pool is not supported"):
        mod.chunk(*tensors, return_intermediate_states=True, state_pool=pool, state_indices=indices)
    with pytest.raises(InputError, match=r"^gdn\.chunk: return_intermediate_states must be True or False"):
        mod.chunk(*tensors, return_intermediate_states=1)
    # with several steps per token a chunk must hold whole tokens (no shipped spec's count breaks that)
    mod, rec = module("gated_deltaproduct"), recurrence("gated_deltaproduct")
    rows = rows_per_token(rec)
    tensors = sample(rec, Shape(1, 6, 1, 1, 8, 8), torch.float32, torch.Generator().manual_seed(55))
    # 6 tokens of 2 steps read as 4 of 3: q and the gate's inputs of 4 tokens, the steps' 12 rows
    tensors = [x[:, :4] if n == 1 else x for x, n in zip(tensors, rows)]
    monkeypatch.setattr(mod, "STEPS_PER_TOKEN", 3)
    monkeypatch.setattr(mod, "_ROWS_PER_TOKEN", tuple(3 if n > 1 else n for n in mod._ROWS_PER_TOKEN))
    with pytest.raises(InputError, match=r"^gated_deltaproduct\.chunk: return_intermediate_states=True needs a chunk "
                                         r"size of whole tokens: chunk_size=16 rows is not a multiple of STEPS_PER_TOKEN=3$"):
        mod.chunk(*tensors, chunk_size=16, return_intermediate_states=True)


def _kda_inputs(g, B=1, T=40, H=2, K=16, V=8):
    q, k = torch.randn(B, T, H, K, generator=g), torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, V, generator=g)
    return q, k, v, torch.rand(B, T, H, generator=g)


@pytest.mark.parametrize("fn", ["chunk_kda", "chunk_gated_delta_rule"])
def test_ops_as_fla(fn):
    """lrdsl.ops as a user calls them: (o, final state, h), resumed from h on the rest."""
    g = torch.Generator().manual_seed(54)
    q, k, v, beta = _kda_inputs(g)
    gate = -torch.rand(*(q.shape if fn == "chunk_kda" else q.shape[:3]), generator=g) * 0.3
    call = getattr(lrdsl.ops, fn)
    cu = torch.tensor([0, 9, 40])
    with torch.inference_mode():
        o, ht, h = call(q, k, v, gate, beta, output_final_state=True, cu_seqlens=cu, chunk_size=16,
                        return_intermediate_states=True)
        assert h.shape == (1, 1 + 2, 2, 16, 8)
        # sequence 1's second chunk starts at token 9 + 16
        rest = [x[:, 25:] for x in (q, k, v, gate, beta)]
        o2, ht2 = call(*rest, initial_state=h[:, 2], output_final_state=True, chunk_size=16)
        assert relative_error(o2, o[:, 25:]) < 1e-5 and relative_error(ht2, ht[1:]) < 1e-5
        o3, ht3 = call(q, k, v, gate, beta, output_final_state=True, cu_seqlens=cu, chunk_size=16)
        assert torch.equal(o3, o) and torch.equal(ht3, ht)
    with pytest.raises(InputError, match=r"\.chunk: return_intermediate_states=True is a forward without gradients"):
        call(q.requires_grad_(), k, v, gate, beta, return_intermediate_states=True)


# -- a pool prefill's checkpoints: checkpoint_every=, checkpoint_indices= ----------------------------

@pytest.mark.parametrize("name", ("gdn", "kda", "gated_deltaproduct"))
@pytest.mark.parametrize("v_first", (False, True))
def test_pool_checkpoints_match_prefixes(name, v_first):
    """Packed sequences into a pool: sequence n's state after every 16 tokens in the rows it names
    (-1 and slots past its end untouched), its final state in its own row, o as without them; a
    padding slot (-1) gets nothing."""
    mod, rec = module(name), recurrence(name)
    g = torch.Generator().manual_seed(57)
    bounds = [0, 0, 1, 33, 40, 57]
    tensors = sample(rec, Shape(1, bounds[-1], 1, 2, 8, 16), torch.float32, g)
    every = 16  # tokens: two chunks of 8 tokens where a token takes 2 steps
    dims = (2, 16, 8) if v_first else (2, 8, 16)
    pool = torch.randn(20, *dims, generator=g)
    before = pool.clone()
    state_indices = torch.tensor([0, 1, 2, -1, 3])
    checkpoints = torch.tensor([[4, 5], [6, 7], [8, 9], [10, 11], [12, -1]])
    with torch.no_grad():
        o, out = mod.chunk(*tensors, cu_seqlens=torch.tensor(bounds, dtype=torch.int32), chunk_size=16,
                           state_pool=pool, state_indices=state_indices, state_v_first=v_first,
                           checkpoint_every=every, checkpoint_indices=checkpoints)
    assert out is pool
    as_kv = (lambda x: x.transpose(-1, -2)) if v_first else (lambda x: x)
    written, errors = {0, 1, 2, 3}, []
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        row = int(state_indices[n])
        if row < 0:
            assert torch.equal(o[0, start:end], torch.zeros_like(o[0, start:end]))
            continue
        h0 = as_kv(before[row:row + 1])
        seq = _tokens(rec, tensors, start, end)
        if end > start:
            ref_o, ref_ht = reference.run(rec, *seq, initial_state=h0, output_final_state=True)
            _close(o[:, start:end], ref_o, f"{name} o of sequence {n}", errors)
            _close(as_kv(pool[row:row + 1]), ref_ht, f"{name} final state of sequence {n}", errors)
        for m, target in enumerate(checkpoints[n].tolist()):
            after = (m + 1) * every
            if target < 0:
                continue
            if after >= end - start:
                continue  # not inside the sequence: the row stays as it was (checked below)
            _, expected = reference.run(rec, *_tokens(rec, tensors, start, start + after), initial_state=h0,
                                        output_final_state=True)
            _close(as_kv(pool[target:target + 1]), expected, f"{name} checkpoint {m} of sequence {n}", errors)
            written.add(target)
    untouched = [r for r in range(20) if r not in written]
    assert torch.equal(pool[untouched], before[untouched])
    print(f"{name} pool checkpoints: max relative error {max(errors):.2e}")


def test_pool_checkpoints_dense_resume():
    """Dense batch: resuming from a checkpoint row reproduces the rest of the sequence."""
    mod, rec = module("gdn"), recurrence("gdn")
    g = torch.Generator().manual_seed(58)
    tensors = sample(rec, Shape(2, 50, 1, 1, 8, 8), torch.float32, g)
    pool = torch.zeros(8, 1, 8, 8)
    with torch.no_grad():
        o, _ = mod.chunk(*tensors, chunk_size=16, state_pool=pool, state_indices=torch.tensor([0, 1]),
                         checkpoint_every=32, checkpoint_indices=torch.tensor([[2, 3], [4, 5]]))
        rest = [x[:, 32:] for x in tensors]
        o2, ht2 = mod.chunk(*rest, chunk_size=16, initial_state=pool[[2, 4]], output_final_state=True)
    assert relative_error(o2, o[:, 32:]) < 1e-5 and relative_error(ht2, pool[[0, 1]]) < 1e-5
    assert torch.equal(pool[[3, 5]], torch.zeros(2, 1, 8, 8))  # 64 tokens: past the end


def test_pool_checkpoint_refusals():
    mod, rec = module("gdn"), recurrence("gdn")
    tensors = sample(rec, Shape(2, 20, 1, 1, 8, 8), torch.float32, torch.Generator().manual_seed(59))
    pool, state_indices, rows = torch.zeros(6, 1, 8, 8), torch.tensor([0, 1]), torch.tensor([[2], [3]])
    pooled = dict(state_pool=pool, state_indices=state_indices, chunk_size=16)
    cases = [
        (dict(checkpoint_every=16), "checkpoint_every and checkpoint_indices go together"),
        (dict(checkpoint_every=24, checkpoint_indices=rows, **pooled),
         r"checkpoint_every must be a positive multiple of the chunk size \(16 tokens"),
        (dict(checkpoint_every=16, checkpoint_indices=rows), "checkpoint_every needs state_pool and state_indices"),
        (dict(checkpoint_every=16, checkpoint_indices=rows[0], **pooled), r"checkpoint_indices must be a tensor \[N, M\] = \[2, M\]"),
        (dict(checkpoint_every=16, checkpoint_indices=torch.tensor([[2], [1]]), **pooled),
         r"checkpoint_indices\[1, 0\] and state_indices\[1\] are both row 1"),
        (dict(checkpoint_every=16, checkpoint_indices=torch.tensor([[2], [6]]), **pooled),
         r"checkpoint_indices\[1, 0\] = 6 is outside the pool's 6 rows"),
        (dict(checkpoint_every=16, checkpoint_indices=rows, return_intermediate_states=True, **pooled),
         "checkpoint_every with return_intermediate_states is not supported"),
        (dict(checkpoint_every=16, checkpoint_indices=rows, cp_context=object(), **pooled),
         "checkpoint_every with cp_context is not supported"),
    ]
    for options, message in cases:
        with pytest.raises(InputError, match=r"^gdn\.chunk: " + message) as caught:
            mod.chunk(*tensors, **options)
        assert "\n" not in str(caught.value)
    with pytest.raises(InputError, match=r"^gdn\.chunk: state_pool is updated in place, without gradients"):
        mod.chunk(*[x.clone().requires_grad_() for x in tensors], checkpoint_every=16, checkpoint_indices=rows, **pooled)
