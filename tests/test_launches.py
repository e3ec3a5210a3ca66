"""Kernel launches on the CPU interpreter: every launch runs under its inputs' device guard and
puts its programs on the grid's first axis (CUDA caps the other two at 65,535), the program-id
decomposition that follows is right, launches too large for one grid are refused, and tensors
on different devices are one clear error. tests/test_gpu_reliability.py runs the same on GPUs."""
from __future__ import annotations

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from lrdsl import reference
from lrdsl.layers.kernels import layer_kernels
from lrdsl.verification.workloads import TOLERANCE, Shape, relative_error

from helpers import module, recurrence, sample

LIMIT = TOLERANCE[torch.float32]


class _Launches:
    """Records each interpreted launch (kernel name, grid, the device guards around it) while
    torch.cuda.device is replaced by a recorder of the devices it is asked to select."""

    def __init__(self, monkeypatch):
        self.launches, self.selected, self.depth = [], [], 0
        run, launches = InterpretedFunction.run, self

        class Guard:
            def __init__(self, device):
                launches.selected.append(device)

            def __enter__(self):
                launches.depth += 1

            def __exit__(self, *exc):
                launches.depth -= 1

        def recording_run(fn, *args, grid, **kwargs):
            self.launches.append((fn.__name__, tuple(grid), self.depth))
            return run(fn, *args, grid=grid, **kwargs)

        monkeypatch.setattr(torch.cuda, "device", Guard)
        monkeypatch.setattr(InterpretedFunction, "run", recording_run)


def _leaves(tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def test_recurrence_launches_are_guarded_and_one_dimensional(monkeypatch, generator):
    rec, mod = recurrence("gdn"), module("gdn")
    tensors = sample(rec, Shape(2, 5, 1, 2, 8, 40), torch.float32, generator)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    recorder = _Launches(monkeypatch)
    for plan in mod.CHUNK_PLANS:
        o, ht = mod.chunk(*_leaves(tensors), plan=plan, chunk_size=16, output_final_state=True)
        (o.sum() + ht.sum()).backward()
    o, _ = mod.recurrent(*_leaves(tensors))
    o.sum().backward()
    mod.chunk(*[t[:1] for t in tensors], cu_seqlens=cu, chunk_size=16)
    names = {name for name, _, _ in recorder.launches}
    assert {"gdn_recurrent_fwd_kernel", "gdn_chunk_scan_kernel", "gdn_chunk_bwd_scan_kernel",
            "gdn_chunk_prepare_kernel", "gdn_chunk_bwd_output_kernel"} <= names, names
    for name, grid, depth in recorder.launches:
        assert depth >= 1, f"{name} launched outside its inputs' device guard"
        assert len(grid) == 1, f"{name} launched on grid {grid}: programs belong on the first axis"
    assert recorder.selected and all(device == -1 for device in recorder.selected)  # CPU tensors: no device to select


def test_layer_kernel_launches_are_guarded_and_batch_free_past_the_first_axis(monkeypatch, generator):
    kernels = layer_kernels()
    D, W = 40, 4
    x = torch.randn(3, 9, D, generator=generator, requires_grad=True)
    weight = torch.randn(D, W, generator=generator, requires_grad=True)
    recorder = _Launches(monkeypatch)
    y, window = kernels.short_conv(x, weight, output_final_window=True)
    y.sum().backward()
    kernels.short_conv(x[:1].detach(), weight.detach(), cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32))
    kernels.short_conv_update(x[:, 0].detach(), window, weight.detach())
    gate = torch.randn(3, 9, D, generator=generator)
    kernels.gated_rms_norm(x, gate, torch.randn(D, generator=generator)).sum().backward()
    names = {name for name, _, _ in recorder.launches}
    assert {"short_conv_fwd_kernel", "short_conv_bwd_kernel", "short_conv_window_kernel", "short_conv_update_kernel",
            "gated_norm_fwd_kernel", "gated_norm_bwd_kernel"} <= names, names
    for name, grid, depth in recorder.launches:
        assert depth >= 1, f"{name} launched outside its inputs' device guard"
        # past the first axis only blocks of channels: the same for any batch
        assert len(grid) <= 2 and all(n == 1 for n in grid[1:]), f"{name} launched on grid {grid}"


def _errors(rec, mod, kernel, tensors, d_o, options, **kwargs):
    """Relative errors of o and (d_o given) of every gradient, kernel vs the float64 oracle."""
    leaves = _leaves(tensors) if d_o is not None else tensors
    o, _ = getattr(mod, kernel)(*leaves, **kwargs, **options)
    refs = [t.detach().double().requires_grad_() for t in tensors]
    ref_o, _ = reference.run(rec, *refs, **kwargs)
    errors = {"o": relative_error(o, ref_o)}
    if d_o is not None:
        grads = torch.autograd.grad(o, leaves, d_o)
        ref_grads = torch.autograd.grad(ref_o, refs, d_o.double())
        names = ["q", "k", "v"] + [i.name for i in rec.inputs]
        errors.update({f"d{n}": relative_error(a, b) for n, a, b in zip(names, grads, ref_grads)})
    return errors


@pytest.mark.parametrize("varlen", [False, True])
def test_program_ids_decompose_into_every_index(varlen, generator):
    """Several sequences, chunks per sequence, key heads, value heads per key head and blocks of
    value columns (V = 40: two blocks of the recurrent kernel and the scans), K = 8 (a tile padded
    to 16): each program id of the one grid axis is its own (sequence or chunk, head, value block)."""
    rec, mod = recurrence("gdn"), module("gdn")
    shape = Shape(1, 20, 2, 4, 8, 40) if varlen else Shape(2, 17, 2, 4, 8, 40)
    tensors = sample(rec, shape, torch.float32, generator)
    d_o = torch.randn(shape.B, shape.T, shape.HV, shape.V, generator=generator)
    cu = torch.tensor([0, 17, 17, 20], dtype=torch.int32) if varlen else None
    chunk = _errors(rec, mod, "chunk", tensors, d_o, dict(chunk_size=16), cu_seqlens=cu)
    recurrent = _errors(rec, mod, "recurrent", tensors, None, {}, cu_seqlens=cu)
    assert max(chunk.values()) <= LIMIT and recurrent["o"] <= LIMIT, (chunk, recurrent)


def _expanded(rec, B, T, H, HV, K, V):
    """Inputs of any size without memory: one element each, expanded (the checks read shapes only)."""
    sizes = {"B": B, "T": T, "HV": HV, "K": K}
    q = torch.zeros(1, 1, 1, 1).expand(B, T, H, K)
    v = torch.zeros(1, 1, 1, 1).expand(B, T, HV, V)
    extras = [torch.zeros([1] * len(i.role.shape)).expand(*[sizes[d] for d in i.role.shape]) for i in rec.inputs]
    return [q, q, v, *extras]


def test_more_programs_than_a_grid_holds_are_refused():
    rec, mod = recurrence("gdn"), module("gdn")
    # 2**21 sequences x 1,024 value heads: 2**31 programs of the recurrent kernel and the scans
    with pytest.raises(mod.InputError) as info:
        mod.recurrent(*_expanded(rec, 2**21, 1, 1024, 1024, 1, 1))
    message = str(info.value)
    assert "\n" not in message and "N=2097152 sequences x HV=1024 value heads" in message and "split the batch" in message
    # 2**24 chunks of 16 tokens x 1,024 value heads
    with pytest.raises(mod.InputError, match=r"NC=16777216 chunks x HV=1024 value heads make 17179869184 GPU programs"):
        mod.chunk(*_expanded(rec, 1, 2**28, 1, 1024, 1, 1), chunk_size=16)


def test_tensors_on_different_devices_are_one_clear_error(generator):
    rec, mod = recurrence("gdn"), module("gdn")
    q, k, v, g, beta = sample(rec, Shape(1, 5, 1, 2, 8, 8), torch.float32, generator)
    cases = [
        (dict(v=v.to("meta")), {}, "v is on meta but q is on cpu"),
        ({}, dict(initial_state=torch.zeros(1, 2, 8, 8, device="meta")), "initial_state is on meta but q is on cpu"),
        ({}, dict(cu_seqlens=torch.tensor([0, 5], device="meta")), "cu_seqlens is on meta but q is on cpu"),
    ]
    for replaced, kwargs, expected in cases:
        tensors = dict(dict(q=q, k=k, v=v, g=g, beta=beta), **replaced)
        for kernel in ("chunk", "recurrent"):
            with pytest.raises(mod.InputError) as info:
                getattr(mod, kernel)(*tensors.values(), **kwargs)
            assert str(info.value) == f"gdn.{kernel}: {expected}" + (
                "; all tensors must share one device" if replaced else ""), str(info.value)


def test_layer_kernels_refuse_tensors_on_different_devices(generator):
    kernels = layer_kernels()
    x = torch.randn(1, 4, 8, generator=generator)
    one_device = "; all tensors must share one device$"
    with pytest.raises(kernels.InputError, match=r"^short_conv: weight is on meta but x is on cpu" + one_device):
        kernels.short_conv(x, torch.zeros(8, 4, device="meta"))
    with pytest.raises(kernels.InputError, match=r"^gated_rms_norm: gate is on meta but x is on cpu" + one_device):
        kernels.gated_rms_norm(x, x.to("meta"), torch.ones(8))


def test_chunk_sizes_of_wide_inputs_fit_a_gpu_block():
    """fp32 and fp64 inputs multiply in their own width on a GPU, so their default (and largest)
    chunk size is one whose kernels fit a block's shared memory (as lrdsl.measure.resources measured them,
    the module's LARGEST_CHUNK_SIZE_WIDE_INPUTS); the interpreter has no such limit. A meta tensor
    stands for a GPU's, as in lrdsl.measure.resources."""
    mod = module("gdn")

    def largest(dtype, K, device="meta", precision="input"):
        return mod._largest_chunk_size(torch.empty(0, dtype=dtype, device=device), K, precision, K)

    assert [largest(torch.bfloat16, 256), largest(torch.bfloat16, 256, precision="tf32")] == [64, 32]
    assert [largest(torch.float32, 128), largest(torch.float32, 256), largest(torch.float64, 64)] == [64, 32, 16]
    assert [largest(torch.float32, 256, "cpu"), largest(torch.float64, 256, "cpu")] == [64, 64]


def _launch(monkeypatch, name, role, *, N, HV, BT, dtype=torch.bfloat16, K=128, precision="input", H=None):
    """The launch settings module `name` picks for `role` on a GPU of 132 multiprocessors (an H200);
    H: key heads (default HV: no grouped value heads)."""
    mod = module(name)
    monkeypatch.setattr(mod, "_multiprocessors", lambda q: 132)
    call = dict(precision=precision, K=K, V=128, N=N, H=H or HV, HV=HV, BT=BT, q=torch.empty(0, dtype=dtype))
    return mod._launch(role, call)


@pytest.mark.parametrize("role", ["scan", "bwd_scan"])
def test_scan_value_blocks_narrow_as_programs_become_few(monkeypatch, role):
    """The scans take 64 value columns while that gives every multiprocessor a program, else 32
    with a deeper pipeline, else (fewer programs than half the multiprocessors even so) 16."""
    many = _launch(monkeypatch, "gdn", role, N=4, HV=32, BT=64)  # 256 programs at 64 columns
    few = _launch(monkeypatch, "gdn", role, N=1, HV=32, BT=64)  # 64 at 64, 128 at 32
    fewer = _launch(monkeypatch, "gdn", role, N=1, HV=8, BT=64)  # 16 at 64, 32 at 32
    assert (many["BV"], few["BV"], fewer["BV"]) == (64, 32, 16)
    assert few["num_stages"] > 2 and fewer["num_stages"] == few["num_stages"]


def test_backward_output_widens_its_value_blocks_only_where_that_was_measured_to_pay(monkeypatch):
    """128 value columns below the largest chunk size for 16-bit inputs of a spec without
    per-key-channel decayed products (gdn); 64 at the largest chunk size, for fp32 inputs, and
    for a key-channel spec (gla), whose backward was slower at 128."""
    def columns(name, BT, dtype=torch.bfloat16):
        return _launch(monkeypatch, name, "bwd_output", N=4, HV=32, BT=BT, dtype=dtype)["BV"]

    assert columns("gdn", 32) == 128
    assert columns("gdn", 64) == columns("gdn", 32, torch.float32) == columns("gla", 32) == 64


def test_backward_output_keeps_its_registers_at_wide_keys_and_with_grouped_value_heads(monkeypatch):
    """Settings at which ptxas gives the backward output kernel its registers (at the neighbouring
    ones it fell back to 32 and ran ten times slower on the H200): at K > 128, 64 value columns on
    8 warps, or on 16 with at most WIDE_K_FEW_PRODUCTS per-key-channel decayed products (gla;
    kda keeps 32 on 8); with grouped value heads below the largest chunk size, 32 columns on 16
    warps for programs with more decayed products than GROUPED_STARVED_PRODUCTS (rwkv7), and the
    small-chunk setting without groups."""
    def setting(name, **options):
        launch = _launch(monkeypatch, name, "bwd_output", N=4, **options)
        return launch["BV"], launch["num_warps"], launch["num_stages"]

    assert setting("gdn", HV=16, BT=32, K=256) == setting("deltanet", HV=16, BT=32, K=256) == (64, 8, 1)
    assert setting("gla", HV=16, BT=32, K=256) == (64, 16, 1)
    assert setting("kda", HV=16, BT=16, K=256) == setting("kda_fused_gate", HV=16, BT=16, K=256) == (32, 8, 1)
    assert setting("rwkv7", H=16, HV=32, BT=16) == (32, 16, 1)
    assert setting("rwkv7", HV=16, BT=16) == (64, 8, 2)
    assert setting("kda", H=16, HV=32, BT=16) == setting("kda", HV=16, BT=16) == (64, 8, 2)


def test_apply_takes_every_value_column_only_at_the_largest_chunk_of_a_scalar_gate(monkeypatch):
    """apply runs all 128 value columns in one block at C = 64 for 16-bit inputs (measured on the
    H200 for gdn), 64 below it (the backward's re-run), for wide operands, and for a spec with
    per-key-channel decayed products (kda, rwkv7: not measured there)."""
    def columns(name, BT, **options):
        return _launch(monkeypatch, name, "apply", N=4, HV=32, BT=BT, **options)["BV"]

    assert columns("gdn", 64) == columns("deltanet", 64) == 128
    assert columns("gdn", 32) == columns("gdn", 64, dtype=torch.float32) == columns("gdn", 64, K=256) == 64
    assert columns("kda", 64) == columns("kda", 32) == columns("rwkv7", 32) == 64


def test_scan_at_a_smaller_chunk_takes_a_third_stage_unless_it_has_few_programs(monkeypatch):
    """Below the largest chunk size (the backward's re-run of the forward scan) the scan pipelines
    three stages; with few programs their own setting (32 columns, 4 stages) still applies; a
    key-channel spec's scan keeps its settings."""
    many = _launch(monkeypatch, "gdn", "scan", N=4, HV=32, BT=32)
    few = _launch(monkeypatch, "gdn", "scan", N=1, HV=32, BT=32)
    assert (many["BV"], many["num_stages"]) == (64, 3)
    assert (few["BV"], few["num_stages"]) == (32, 4)
    assert _launch(monkeypatch, "kda", "scan", N=4, HV=32, BT=32)["num_stages"] == 2


def test_wide_operands_keep_the_scan_settings_they_were_checked_with(monkeypatch):
    """fp32 inputs, precision="tf32" and K > 128 take twice the shared memory per tile: the scan
    keeps 32 value columns and 2 stages there, whatever the programs."""
    for options in (dict(dtype=torch.float32), dict(precision="tf32"), dict(K=256)):
        launch = _launch(monkeypatch, "gdn", "scan", N=4, HV=32, BT=32, **options)
        assert (launch["BV"], launch["num_stages"]) == (32, 2), options


@pytest.mark.parametrize("name", ["gdn", "kda", "rwkv7", "linear_attn"])
def test_solve_merges_take_three_tf32_passes_only_for_16_bit_inputs_on_a_gpu(name):
    """The triangular solve's block merges multiply fp32 blocks: in three tf32 passes (about
    fp32's accuracy, on tensor cores) for 16-bit inputs on a GPU, exactly (ieee) for fp32 / fp64
    inputs and on the interpreter. Only kernels that solve take the setting (linear_attn has no
    system to solve)."""
    mod = module(name)

    def precision(dtype, device="meta"):
        return mod._solve_precision(torch.empty(0, dtype=dtype, device=device))

    assert [precision(torch.bfloat16), precision(torch.float16)] == ["tf32x3", "tf32x3"]
    assert [precision(torch.float32), precision(torch.float64), precision(torch.bfloat16, "cpu")] == ["ieee"] * 3
    kernels = open(mod.__file__).read().split("@triton.jit")[1:]
    solving = ["(I + A)^-1" in kernel for kernel in kernels]
    assert any(solving) == (name != "linear_attn")
    for kernel, solves in zip(kernels, solving):
        assert ("SOLVE_PRECISION: tl.constexpr" in kernel) == solves
        assert ("input_precision=SOLVE_PRECISION" in kernel) == solves


def test_the_chunk_size_estimate_rates_the_launches_the_module_runs(monkeypatch):
    """One launch rule: for every shipped spec, plan (forward and backward), precision and chunk
    size, each kernel the chunk-size estimate rates is rated at the value columns the generated
    module's _launch gives it for the call the estimate describes (K = V = 128, bf16, HV = H), and
    launch_for gives the module's every setting. (The estimate used to overlay only the fp32
    table on the base one: gdn's backward output kernel at C = 32, which the module runs on 128
    value columns, was rated at 64.)"""
    from lrdsl.codegen import launch
    from lrdsl.passes.pipeline import run_pipeline
    from lrdsl.spec import load_spec
    from lrdsl.spec import shipped_spec_names

    from helpers import spec_path

    rated = []
    real_peak = launch.peak_tile_bytes

    def recording(ctx, chunk, head_dim, block_v, operand_bytes=2):
        role = ("bwd_" if ctx.prog.direction == "backward" else "") + ctx.kernel.name
        rated.append((role, chunk, operand_bytes, block_v))
        return real_peak(ctx, chunk, head_dim, block_v, operand_bytes)

    monkeypatch.setattr(launch, "peak_tile_bytes", recording)
    precisions = {bytes_: precision for precision, bytes_ in launch.PRECISION_OPERAND_BYTES.items()}
    for name in shipped_spec_names():
        item = run_pipeline(load_spec(spec_path(name)))["save"]
        mod = module(name)

        def module_launch(role, chunk, precision):
            call = dict(precision=precision, K=128, V=128, N=4, H=16, HV=16, BT=chunk, q=torch.empty(0, dtype=torch.bfloat16))
            return mod._launch(role, call)

        rated.clear()
        assert mod.BACKWARD_CHUNK_SIZE == launch.backward_chunk_sizes(item)
        assert mod.FORWARD_CHUNK_SIZE == launch.forward_chunk_sizes(item)
        assert {role for role, *_ in rated} >= {"bwd_output", "output"}
        for role, chunk, operand_bytes, block_v in rated:
            assert block_v == module_launch(role, chunk, precisions[operand_bytes])["BV"], (name, role, chunk)

        tables, largest = launch.launch_tables(item), launch.largest_chunk_sizes(item)
        for role in mod.CHUNK_LAUNCH:
            for precision in mod.PRECISIONS:
                for chunk in mod.CHUNK_SIZES:
                    facts = launch.estimate_facts(precision, chunk, largest[precision, False])
                    expected = module_launch(role, chunk, precision)
                    assert launch.launch_for(tables, role, **facts).render() == expected, (name, role, precision, chunk)
