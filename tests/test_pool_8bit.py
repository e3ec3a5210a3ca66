"""8-bit state pools (int8 values, an fp32 scale per state column beside them) on every spec's
generated kernels: decode, multi-token recurrent, chunk prefill, verify and commit, tree verify
and a prefill's checkpoint rows, in both state layouts.

Each call runs twice from the same start: on the 8-bit pool, and on an fp32 pool holding the
same values (unpack_states). The 8-bit pool must then hold exactly pack_states() of the fp32
pool's result (bit for bit on the CPU: the kernels round as pack_states does; on a GPU within
one level of each column), the outputs must be those of the fp32 pool, rows no sequence uses
must not change, and the outputs must match the float64 oracle run from the 8-bit rows' values.
What 8 bits cost over many steps: test_8bit_pool_drift (and docs/design.md §5).
"""
from __future__ import annotations

import pytest
import torch

from lrdsl.verification.workloads import TOLERANCE, relative_error

from helpers import ALL_SPECS, module, recurrence
from test_serving import HV, LIMIT, V, K, ReferencePool, has_chunk, inputs, on

P = 6


def new_8bit_pool(mod, generator, state_v_first, device, rows=P):
    states = torch.randn(rows, HV, K, V, generator=generator) * 0.5
    if state_v_first:
        states = states.transpose(-1, -2).contiguous()
    return mod.pack_states(states, state_v_first=state_v_first).to(device)


def twin(mod, pool, state_v_first):
    """The fp32 pool holding an 8-bit pool's values."""
    return mod.unpack_states(pool, state_v_first=state_v_first)


def check_pools(mod, pool, fp32_pool, before, used, state_v_first, what):
    """The 8-bit pool after a call against the fp32 twin's result, packed; unused rows untouched."""
    expected = mod.pack_states(fp32_pool, state_v_first=state_v_first)
    unused = [r for r in range(pool.shape[0]) if r not in used]
    assert torch.equal(pool[unused].cpu(), before[unused].cpu()), f"{what}: rows {unused} were touched"
    if pool.device.type == "cpu":
        assert torch.equal(pool, expected), f"{what}: the 8-bit rows are not pack_states() of the fp32 result"
        return
    # a GPU contracts x * (127 / m) + 0.5 into one rounding: a value may land one level off
    got, want = twin(mod, pool, state_v_first), twin(mod, expected, state_v_first)
    k_axis = -1 if state_v_first else -2
    level = fp32_pool.abs().amax(dim=k_axis, keepdim=True) / 127
    assert ((got - want).abs() <= level * 1.001 + 1e-30).all(), f"{what}: the 8-bit rows are more than a level off"


def check_outputs(o, fp32_o, ref_o, what):
    assert relative_error(o, fp32_o) <= (0.0 if o.device.type == "cpu" else 1e-6), f"{what}: o differs from the fp32 pool's"
    assert relative_error(o, ref_o) <= LIMIT, f"{what}: o against the oracle"


@pytest.mark.parametrize("name", ALL_SPECS)
def test_8bit_pool_decode_and_recurrent(name, generator, device):
    """Two decode steps and a 3-token recurrent call on random rows with a padding slot, both
    layouts."""
    rec, mod = recurrence(name), module(name)
    for state_v_first in (False, True):
        pool = new_8bit_pool(mod, generator, state_v_first, device)
        rows = torch.randperm(P, generator=generator).tolist()
        slots = [rows[0], -1, rows[1], rows[2]]
        for step, T in enumerate((1, 1, 3)):
            tensors = inputs(rec, len(slots), T, generator)
            before, fp32_pool = pool.clone(), twin(mod, pool, state_v_first)
            ref = ReferencePool(fp32_pool.cpu(), state_v_first)
            index = torch.tensor(slots, device=device)
            with torch.no_grad():
                o, returned = mod.recurrent(*on(device, tensors), state_pool=pool, state_indices=index,
                                            state_v_first=state_v_first)
                fp32_o, _ = mod.recurrent(*on(device, tensors), state_pool=fp32_pool, state_indices=index,
                                          state_v_first=state_v_first)
            assert returned is pool and pool.dtype == torch.int8
            what = f"{name} step {step} (T={T}, state_v_first={state_v_first})"
            check_outputs(o, fp32_o, ref.run(rec, tensors, slots), what)
            check_pools(mod, pool, fp32_pool, before, {r for r in slots if r >= 0}, state_v_first, what)


@pytest.mark.parametrize("name", [n for n in ALL_SPECS if has_chunk(n)])
def test_8bit_pool_prefill_and_checkpoints(name, generator, device):
    """Packed prompts of 5, 0 and 33 tokens and a padding slot prefilled into 8-bit rows by
    chunk(), the long one also writing its state after 16 and 32 tokens into two more rows
    (checkpoint_every=16), both layouts."""
    rec, mod = recurrence(name), module(name)
    for state_v_first in (False, True):
        pool = new_8bit_pool(mod, generator, state_v_first, device, rows=P + 2)
        rows = torch.randperm(P, generator=generator).tolist()
        slots = [rows[0], -1, rows[1], rows[2]]
        bounds = [0, 5, 9, 9, 42]
        checkpoints = torch.tensor([[-1, -1], [-1, -1], [-1, -1], [P, P + 1]], device=device)
        tensors = inputs(rec, 1, bounds[-1], generator)
        before, fp32_pool = pool.clone(), twin(mod, pool, state_v_first)
        ref = ReferencePool(fp32_pool.cpu(), state_v_first)
        options = dict(cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device), state_indices=torch.tensor(slots, device=device),
                       state_v_first=state_v_first, chunk_size=16, checkpoint_every=16, checkpoint_indices=checkpoints)
        with torch.no_grad():
            o, _ = mod.chunk(*on(device, tensors), state_pool=pool, **options)
            fp32_o, _ = mod.chunk(*on(device, tensors), state_pool=fp32_pool, **options)
        what = f"{name} prefill (state_v_first={state_v_first})"
        # the chunk form's own rounding differs from the oracle's token by token: the fp32 limit
        assert relative_error(o, fp32_o) <= (0.0 if device == "cpu" else 1e-6), what
        assert relative_error(o, ref.run(rec, tensors, slots, bounds=bounds)) <= LIMIT, what
        check_pools(mod, pool, fp32_pool, before, set(rows[:3]) | {P, P + 1}, state_v_first, what)


@pytest.mark.parametrize("name", ALL_SPECS)
def test_8bit_pool_verify_commit_and_tree(name, generator, device):
    """Verify of 4 draft tokens reads the 8-bit rows (and writes nothing), commit of 0 to 4
    accepted tokens writes them; a tree of drafts (parents=) reads them too."""
    rec, mod = recurrence(name), module(name)
    T = 4
    for state_v_first in (False, True):
        pool = new_8bit_pool(mod, generator, state_v_first, device)
        rows = torch.randperm(P, generator=generator).tolist()
        slots = [rows[0], -1, rows[1], rows[2], rows[3]]
        index = torch.tensor(slots, device=device)
        tensors = inputs(rec, len(slots), T, generator)
        before, fp32_pool = pool.clone(), twin(mod, pool, state_v_first)
        ref = ReferencePool(fp32_pool.cpu(), state_v_first)
        o, draft = mod.verify(*on(device, tensors), state_pool=pool, state_indices=index, state_v_first=state_v_first)
        fp32_o, fp32_draft = mod.verify(*on(device, tensors), state_pool=fp32_pool, state_indices=index,
                                        state_v_first=state_v_first)
        what = f"{name} verify (state_v_first={state_v_first})"
        assert torch.equal(pool, before), f"{what}: verify only reads the pool"
        check_outputs(o, fp32_o, ref.run(rec, tensors, slots), what)
        accepted = torch.tensor([3, 2, 0, 4, 1], device=device)
        mod.commit(draft, accepted)
        mod.commit(fp32_draft, accepted)
        check_pools(mod, pool, fp32_pool, before, {r for r in slots if r >= 0}, state_v_first, f"{name} commit")
        # a tree: tokens 1 and 2 both follow token 0, token 3 follows token 1
        parents = torch.tensor([[-1, 0, 0, 1]] * len(slots), device=device)
        fp32_pool = twin(mod, pool, state_v_first)
        o, _ = mod.verify(*on(device, tensors), state_pool=pool, state_indices=index, state_v_first=state_v_first,
                          parents=parents)
        fp32_o, _ = mod.verify(*on(device, tensors), state_pool=fp32_pool, state_indices=index,
                               state_v_first=state_v_first, parents=parents)
        assert relative_error(o, fp32_o) <= (0.0 if device == "cpu" else 1e-6), f"{name} tree verify"


def drift_8bit(name, steps, generator, device, B=4):
    """Decode `steps` tokens on an 8-bit pool and on an fp32 pool from the same start (the fp32
    start packed, so both begin equal): errors of the 8-bit run against the fp32 one and against
    the float64 oracle, for o (all steps) and the final rows."""
    from lrdsl import reference
    from lrdsl.verification.workloads import Shape, make_inputs

    rec, mod = recurrence(name), module(name)
    pool = mod.pack_states(torch.randn(B, HV, K, V, generator=generator) * 0.5).to(device)
    fp32_pool = twin(mod, pool, False)
    ref, rows = fp32_pool.double(), torch.arange(B, device=device)
    outs, fp32_outs, ref_outs = [], [], []
    for _ in range(steps):
        tensors = on(device, make_inputs(rec, Shape(B, 1, 1, HV, K, V), generator=generator))
        with torch.no_grad():
            outs.append(mod.recurrent(*tensors, state_pool=pool, state_indices=rows, use_qk_l2norm_in_kernel=True)[0])
            fp32_outs.append(mod.recurrent(*tensors, state_pool=fp32_pool, state_indices=rows,
                                           use_qk_l2norm_in_kernel=True)[0])
        o_ref, ref = reference.run(rec, *tensors, initial_state=ref, output_final_state=True, use_qk_l2norm_in_kernel=True)
        ref_outs.append(o_ref)
    low, full, exact = torch.cat(outs, 1), torch.cat(fp32_outs, 1), torch.cat(ref_outs, 1)
    state = twin(mod, pool, False)
    return {
        "o_vs_fp32_state": relative_error(low, full), "state_vs_fp32_state": relative_error(state, fp32_pool),
        "o_vs_oracle": relative_error(low, exact), "state_vs_oracle": relative_error(state, ref),
        "fp32_state_vs_oracle": relative_error(fp32_pool, ref),
    }


@pytest.mark.parametrize("name", ["gdn", "kda", "rwkv7"])
def test_8bit_pool_drift(name, generator, device):
    """48 decode steps on an 8-bit pool beside an fp32 pool from the same start (the errors are
    printed). Each store rounds a column to within 1/254 of its largest value; the decay and the
    delta rule's erasure keep the errors from compounding, so after 48 steps the state stays
    within the 16-bit tolerance of the fp32 pool's."""
    errors = drift_8bit(name, 48, generator, device)
    print(f"{name} 8-bit pool, 48 steps: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    assert errors["fp32_state_vs_oracle"] <= LIMIT
    assert all(e <= TOLERANCE[torch.bfloat16] for e in errors.values()), errors


def test_8bit_pool_errors_are_one_line(generator, device):
    import lrdsl

    rec, mod = recurrence("gdn"), module("gdn")
    tensors = on(device, inputs(rec, 2, 1, generator))
    index = torch.tensor([0, 1], device=device)
    cases = {
        # the rows of a float pool, in int8: the scales have no room
        "an 8-bit state_pool must be \\[P, HV, K \\+ 4, V\\] = \\[P, 2, 16, 10\\]":
            lambda: mod.recurrent(*tensors, state_pool=torch.zeros(3, HV, K, V, dtype=torch.int8, device=device),
                                  state_indices=index),
        "must be \\[P, HV, V, K \\+ 4\\]":
            lambda: mod.recurrent(*tensors, state_pool=torch.zeros(3, HV, K + 4, V, dtype=torch.int8, device=device),
                                  state_indices=index, state_v_first=True),
        "float32, bfloat16, float16, float64 or int8": lambda: mod.recurrent(
            *tensors, state_pool=torch.zeros(3, HV, K, V, dtype=torch.int16, device=device), state_indices=index),
        "pack_states: an 8-bit pool needs K divisible by 4": lambda: mod.pack_states(torch.zeros(1, 1, 6, 4)),
        "pack_states: states must be a float tensor": lambda: mod.pack_states(torch.zeros(1, 1, 8, 4, dtype=torch.int8)),
        "unpack_states: rows must be an 8-bit pool's rows": lambda: mod.unpack_states(torch.zeros(1, 1, 12, 4)),
    }
    for message, call in cases.items():
        with pytest.raises(lrdsl.InputError, match=message) as error:
            with torch.no_grad():
                call()
        assert "\n" not in str(error.value), message


def test_pack_unpack_round_trip(generator):
    """pack_states then unpack_states is within half a level of each column; packing the unpacked
    values again gives the same bytes; a zero column packs to zeros and scale 0."""
    mod = module("gdn")
    for state_v_first in (False, True):
        # [N, HV, K, V] = [3, 2, 8, 6], or [N, HV, V, K] = [3, 2, 6, 8] with state_v_first
        states = torch.randn(3, 2, 6, 8, generator=generator) * 10 if state_v_first else torch.randn(3, 2, 8, 6, generator=generator) * 10
        states[0, 1] = 0.0
        rows = mod.pack_states(states, state_v_first=state_v_first)
        assert rows.dtype == torch.int8
        assert rows.shape == ((3, 2, 6, 12) if state_v_first else (3, 2, 12, 6))
        back = mod.unpack_states(rows, state_v_first=state_v_first)
        k_axis = -1 if state_v_first else -2
        half_level = states.abs().amax(dim=k_axis, keepdim=True) / 254
        assert ((back - states).abs() <= half_level * 1.0001).all()
        assert torch.equal(mod.pack_states(back, state_v_first=state_v_first), rows)
        assert torch.equal(back[0, 1], torch.zeros_like(back[0, 1]))


def test_pack_states_rounds_with_correctly_rounded_divisions(generator):
    """pack_states gives the kernels' bytes: round(x * fl(127 / m)) with 127 / m and m / 127 each
    one correctly rounded fp32 division (the kernels' div_rn), computed here in numpy. torch's
    127.0 / tensor multiplies by a reciprocal instead, 1 ulp off for about a quarter of the
    columns; CI met one such column (gdn2 commit, seed 698121103: m = 1.3420782, x = -1.0197681,
    x * 127 / m = -96.4999..., which the reciprocal took past -96.5 to -97)."""
    import numpy as np

    mod = module("gdn")
    states = torch.randn(64, 4, 32, 64, generator=generator) * torch.rand(64, 4, 1, 64, generator=generator) * 4
    states[0, 0, :, 0] = 0.0
    states[0, 0, :, 1] = 0.5
    states[0, 0, 0, 1], states[0, 0, 1, 1] = 1.3420782089233398, -1.0197681188583374
    x = states.numpy()
    m = np.abs(x).max(axis=-2, keepdims=True)
    inverse = np.where(m > 0, np.float32(127.0) / np.maximum(m, np.float32(2.0**-120)), np.float32(0.0))
    levels = np.clip(np.floor(x * inverse + np.float32(0.5)), -127, 127).astype(np.int8)
    rows = mod.pack_states(states)
    assert torch.equal(rows[:, :, :32], torch.from_numpy(levels))
    assert rows[0, 0, 1, 1] == -96
    scales = rows[:, :, 32:].contiguous().reshape(64, 4, 1, 4 * 64).view(torch.float32)
    assert torch.equal(scales, torch.from_numpy(m / np.float32(127.0)))


USER_PACKS_A_STATE_THE_KERNEL_STORES = """
import lrdsl, torch
mod = lrdsl.load("gdn")
# one decode step from a zero row with g = 0, beta = 1: the kernel stores the state k v^T, whose
# column 0 is k itself: largest |value| m = 1.3420782, and x = -1.0197681 with x * 127 / m on the
# rounding boundary between levels -96 and -97 (CI's column, gdn2 commit, seed 698121103)
k = torch.full((1, 1, 1, 8), 0.5)
k[0, 0, 0, 0], k[0, 0, 0, 1] = 1.3420782089233398, -1.0197681188583374
v = torch.tensor([[[[1.0, 0.25, -2.0, 0.125]]]])
q, g, beta = torch.ones(1, 1, 1, 8), torch.zeros(1, 1, 1), torch.ones(1, 1, 1)
pool = mod.pack_states(torch.zeros(1, 1, 8, 4))
mod.recurrent(q, k, v, g, beta, state_pool=pool, state_indices=torch.tensor([0]))
expected = mod.pack_states(k[0, 0, 0][:, None] * v[0, 0, 0][None, :] * torch.ones(1, 1, 8, 4))
print(pool[0, 0, 1, 0].item(), expected[0, 0, 1, 0].item(), torch.equal(pool, expected))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the bytes are exact on the CPU interpreter; a GPU may contract x * (127 / m) + 0.5")
def test_pack_states_gives_the_bytes_the_kernel_stores_in_a_fresh_interpreter(tmp_path):
    """A user's round trip, in a fresh interpreter through the public API: a state the decode
    kernel stores into an 8-bit pool, and pack_states() of the same state, are the same bytes.
    pack_states used to compute 127 / m as a reciprocal times 127 and packed -97 here (the kernel:
    -96)."""
    import subprocess
    import sys

    from test_cli import user_environment

    script = tmp_path / "pack.py"
    script.write_text(USER_PACKS_A_STATE_THE_KERNEL_STORES)
    result = subprocess.run([sys.executable, str(script)], env=user_environment(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["-96", "-96", "True"], result.stdout


def test_8bit_pool_prefill_through_segmented_scans(generator, device, monkeypatch):
    """A long prefill whose scan runs in segments (the combine kernel reads and writes the pool
    rows), in both layouts: the 8-bit rows are the fp32 twin's result packed."""
    from helpers import force_segments

    rec, mod = recurrence("gdn"), module("gdn")
    chosen = force_segments(monkeypatch, mod)
    for state_v_first in (False, True):
        pool = new_8bit_pool(mod, generator, state_v_first, device, rows=3)
        tensors = inputs(rec, 3, 70, generator)
        index = torch.tensor([2, -1, 0], dtype=torch.int32, device=device)
        before, fp32_pool = pool.clone(), twin(mod, pool, state_v_first)
        ref = ReferencePool(fp32_pool.cpu(), state_v_first)
        with torch.no_grad():
            o, _ = mod.chunk(*on(device, tensors), state_pool=pool, state_indices=index, chunk_size=16,
                             state_v_first=state_v_first)
            fp32_o, _ = mod.chunk(*on(device, tensors), state_pool=fp32_pool, state_indices=index, chunk_size=16,
                                  state_v_first=state_v_first)
        assert chosen and all(chosen), chosen
        what = f"segmented prefill (state_v_first={state_v_first})"
        check_outputs(o, fp32_o, ref.run(rec, tensors, [2, -1, 0]), what)
        check_pools(mod, pool, fp32_pool, before, {0, 2}, state_v_first, what)


def test_8bit_pool_under_torch_compile(generator, device):
    """A decode step on an 8-bit pool inside torch.compile(fullgraph=True) (the module's custom
    op, its fake implementation checking the [P, HV, K + 4, V] rows): the eager call's o and rows."""
    rec, mod = recurrence("gdn"), module("gdn")
    tensors = on(device, inputs(rec, 2, 1, generator))
    pool = new_8bit_pool(mod, generator, False, device, rows=3)
    eager_pool, index = pool.clone(), torch.tensor([2, 0], device=device)

    def step(*tensors):
        return mod.recurrent(*tensors, state_pool=pool, state_indices=index, validate=False)[0]

    with torch.no_grad():
        o = torch.compile(step, backend="aot_eager", fullgraph=True)(*tensors)
        eager_o, _ = mod.recurrent(*tensors, state_pool=eager_pool, state_indices=index)
    assert torch.equal(o, eager_o) and torch.equal(pool, eager_pool)
