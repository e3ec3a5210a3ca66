"""The chunk kernels' schedule (lrdsl.codegen.schedule): sinking and eager sums keep tiles
short-lived. Checked on the generated source; numerics are covered by the oracle tests."""
from __future__ import annotations

import re

import pytest
import torch

from lrdsl import reference
from lrdsl.passes.pipeline import run_pipeline
from lrdsl.codegen import schedule
from lrdsl.runtime.loader import generate
from lrdsl.spec import load_spec
from lrdsl.verification.workloads import TOLERANCE, Shape, make_inputs, relative_error

from helpers import module, recurrence, spec_path


def _generate(name: str) -> str:
    source, _ = generate(spec_path(name))
    return source


def _kernel(source: str, name: str) -> list[str]:
    start = source.index(f"def {name}(")
    end = source.find("\n@triton.jit", start)
    return source[start:end].split("\n")


def test_eager_sum_terms_die_where_they_are_added():
    lines = _kernel(_generate("gdn"), "gdn_chunk_bwd_output_kernel")
    added = [(i, m.group(2)) for i, line in enumerate(lines) if (m := re.search(r"b_(\w+) \+?= b_(\w+)  # running sum", line))]
    assert len(added) >= 10, "expected gdn's gradient sums (d_k, d_q, d_G, d_T, ...) to accumulate eagerly"
    for index, term in added:
        later = "\n".join(lines[index + 1:])
        assert not re.search(rf"\bb_{term}\b", later), f"{term} is read after it was added to its running sum"


@pytest.mark.parametrize("name, issued", [("gdn", {"g", "q_in", "k_in", "G_last"}), ("kda", {"g", "q_in", "k_in"}),
                                           ("gdn_qwen35", {"a", "A_log", "dt_bias", "q_in", "k_in", "G_last"}),
                                           ("rwkv7", {"b"})])
def test_inputs_read_after_a_v_loop_are_loaded_before_it_in_their_storage_dtype(name, issued):
    """The backward output kernel reads q, k and the gate inputs (and a scalar gate's saved
    chunk total, whose factor moved onto a sum) only after its V loop: their loads are issued
    just before that loop, unconverted (16 bits held across it, not an fp32
    tile), and each is converted after the loop, where its value is placed; nothing between the
    load and the loop reads it."""
    source = _generate(name)
    kernel = f"{name}_chunk_bwd_output_kernel"
    lines = _kernel(source, kernel)
    found = set()
    for index, line in enumerate(lines):
        loaded = re.match(r"\s*b_(\w+) = tl\.load\((\w+) \+", line)
        if not loaded or "ahead of the V loop" not in lines[index - 1]:
            continue
        value = loaded.group(1)
        assert not re.search(r"\)\.to\(\w+\)$", line.rstrip()), f"{kernel}: {value} is converted as it is loaded"
        loop = next(i for i in range(index + 1, len(lines)) if "for i_v in range" in lines[i])
        readers = [i for i in range(index + 1, len(lines)) if re.search(rf"\bb_{value}\b", lines[i])]
        assert readers and readers[0] > loop, f"{kernel}: {value} is read before the V loop it was issued ahead of"
        assert lines[readers[0]].strip().startswith(f"b_{value} = b_{value}.to("), lines[readers[0]]
        found.add(value)
    assert found == issued, (kernel, found)


@pytest.mark.parametrize("name", ["gdn", "kda", "rwkv7"])
def test_buffer_tiles_load_just_before_their_first_reader(name):
    """A buffer tile without a V axis is loaded right before the first statement that reads it,
    not at the top of its segment, so it holds no registers while unrelated work runs (the
    apply kernel's solved system T waits for the keys' normalisation). Between the load and
    that reader there are only comments, other loads and the V loop's header. (The scans load at
    the top of their loop body, where Triton pipelines the next chunk's loads.)"""
    source = _generate(name)
    checked = 0
    for kernel in [k for k in re.findall(r"def (\w+_kernel)\(", source) if "_scan_" not in k]:
        lines = _kernel(source, kernel)
        for index, line in enumerate(lines):
            loaded = re.match(r"\s*(b_\w+) = tl\.load\(buf_", line)
            if not loaded or "stored by an earlier kernel" not in lines[index - 1]:  # not a solve's own result
                continue
            reader = next(i for i in range(index + 1, len(lines)) if re.search(rf"\b{loaded.group(1)}\b", lines[i]))
            between = [text.strip() for text in lines[index + 1:reader]]
            # the guard of the kept narrowed copy's store, which reads the tile on its next line
            allowed = ("#", "for i_v in range", "o_v = ", "m_v = ", "if narrowed_")
            stray = [text for text in between if text and not text.startswith(allowed) and "= tl.load(" not in text]
            assert not stray, f"{kernel}: {loaded.group(1)} is loaded {len(stray)} statements before its first reader: {stray[:3]}"
            checked += 1
    assert checked >= 3, f"{name}: expected buffer loads in its chunk kernels"


def test_matmul_only_operands_load_in_the_matmul_dtype():
    lines = _kernel(_generate("gdn"), "gdn_chunk_scan_kernel")
    w_load = next(line for line in lines if line.strip().startswith("b_W = tl.load("))
    assert w_load.rstrip().endswith(".to(DOT_DTYPE)"), w_load


@pytest.mark.parametrize("name", ["gdn", "kda", "gdn_qwen35"])
def test_the_l2_norm_adjoint_reads_the_normalised_rows(name):
    """Where a kernel normalises q or k and also computes that normalisation's adjoint, the
    adjoint reads the normalised rows and their norms, so the raw rows die at the normalisation
    instead of living to the end of the kernel (one C x K tile fewer each)."""
    lines = _kernel(_generate(name), f"{name}_chunk_bwd_output_kernel")
    for raw, normalised in (("q_in", "q"), ("k_in", "k")):
        normalisation = next(i for i, line in enumerate(lines) if line.strip() == f"b_{normalised} = b_{raw} / row_norm_{normalised}[:, None]")
        later = "\n".join(lines[normalisation + 1:])
        assert not re.search(rf"\bb_{raw}\b", later), f"{name}: {raw} is read after its rows were normalised"
        assert f"= 1.0 / row_norm_{normalised}" in later, f"{name}: the adjoint does not reuse the norms of {normalised}"


def _storage_dtype_tiles(lines: list[str]) -> list[str]:
    """The variables a kernel loads without converting them (held in their stored dtype)."""
    return [m.group(1) for line in lines
            if (m := re.match(r"\s*(b_\w+) = tl\.load\(.*\)$", line)) and not re.search(r"\.to\(\w+\)$", line)]


@pytest.mark.parametrize("name", ["gdn", "kda", "rwkv7", "simple_gla"])
def test_tiles_held_in_their_stored_dtype_are_converted_where_read(name):
    """A loaded 16-bit tile that only matmuls and elementwise formulas read stays 16-bit in
    registers (half the registers of fp32: the backward output kernel's K x V state tiles among
    them); every read converts it (to DOT_DTYPE in a matmul, to ACC in a formula: exact, so the
    results are bit for bit those of converting at the load), or copies it under a new name that
    obeys the same rule, or is converted in place once (`b_k_in = b_k_in.to(ACC)`, an input
    loaded ahead of a V loop). The forward's guards of non-finite rows test and zero such a tile
    in its own dtype."""
    source = _generate(name)
    held = 0
    for kernel in [k for k in re.findall(r"def (\w+_kernel)\(", source) if "_chunk_" in k]:
        lines = _kernel(source, kernel)
        pending = _storage_dtype_tiles(lines)
        held += len(pending)
        while pending:
            tile = pending.pop()
            for line in lines:
                code = line.split("#")[0]
                if re.match(rf"\s*{tile} = {tile}\.to\((ACC|DOT_DTYPE)\)$", code):
                    break  # converted in place (an input loaded ahead of a V loop): read converted below
                if re.match(rf"\s*{tile} = ", code):  # its load, the copy that defines it, its guard
                    continue
                if re.match(r"\s*ok_\w+ = ", code):  # a finiteness test (row_guards): any dtype reads
                    continue
                copy = re.match(rf"\s*(b_\w+) = {tile}$", code)
                if copy:
                    pending.append(copy.group(1))
                    continue
                for use in re.finditer(rf"\b{tile}\b(\.to\((ACC|DOT_DTYPE)\))?", code):
                    assert use.group(1), f"{name} {kernel}: {tile} is read unconverted: {code.strip()}"
    if name == "gdn":
        lines = _kernel(source, "gdn_chunk_bwd_output_kernel")
        assert {"b_H", "b_d_H_next", "b_v"} <= set(_storage_dtype_tiles(lines))
        # d_O, its scale moved onto the sums (factor_scalars), feeds only matmuls: operand dtype
        assert any(re.match(r"\s*b_d_O = tl\.load\(.*\)\.to\(DOT_DTYPE\)$", line) for line in lines)
    assert held > 0, f"{name}: no tile is held in its stored dtype"


# -- register pressure (codegen/pressure.py) and the backward's chunk size ------------------------

def _contexts(name):
    from lrdsl.codegen.context import KernelContext

    item = run_pipeline(load_spec(spec_path(name)))["save"]
    plan = item.backward.plans[0]
    backward = {k.name: KernelContext(item.backward.graph.program, plan, k) for k in plan.kernels}
    forward_plan = item.forward.plans[0]
    forward = {k.name: KernelContext(item.forward.graph.program, forward_plan, k) for k in forward_plan.kernels}
    return item, forward, backward


def test_live_tiles_grow_with_the_chunk_and_the_backward_output_holds_most():
    from lrdsl.codegen.pressure import peak_tile_bytes

    _, forward, backward = _contexts("gdn")
    output = [peak_tile_bytes(backward["output"], c, 128, 64) for c in (16, 32, 64)]
    assert output[0] < output[1] < output[2]
    # every gradient of a chunk at once: more than any forward kernel holds
    assert output[2] > 2 * max(peak_tile_bytes(ctx, 64, 128, 64) for ctx in forward.values() if ctx.kernel.kind != "scan")
    # 16-bit matmul operands count half of fp32 ones
    assert peak_tile_bytes(backward["output"], 64, 128, 64, operand_bytes=4) > output[2]


def test_inputs_loaded_ahead_of_a_v_loop_count_through_it(monkeypatch):
    """gdn's backward output kernel holds q, k (16-bit C x K), g and G_last through its V loop: the
    estimate counts them from their early load to their conversion."""
    from lrdsl.codegen import pressure

    _, _, backward = _contexts("gdn")
    ctx = backward["output"]
    place, _ = schedule.place_values(ctx)
    assert set(schedule.loads_issued_early(ctx, place)) == {"g", "q_in", "k_in", "G_last"}
    held = pressure.peak_tile_bytes(ctx, 32, 128, 128)
    monkeypatch.setattr(pressure, "loads_issued_early", lambda ctx, place: {})
    assert held - pressure.peak_tile_bytes(ctx, 32, 128, 128) >= 2 * 32 * 128 * 2  # at least q and k, 16 bits


@pytest.mark.parametrize("name, expected", [("gdn", 32), ("deltanet", 32), ("simple_gla", 32), ("linear_attn", 64), ("rwkv7", 16)])
def test_backward_chunk_size_follows_register_pressure(name, expected):
    """The largest chunk size whose backward kernels fit their registers (within the tolerance):
    the gated and delta specs' output kernel overflows at 64, linear attention's does not."""
    from lrdsl.codegen.launch import backward_chunk_sizes

    item, _, _ = _contexts(name)
    sizes = backward_chunk_sizes(item)
    assert sizes["input"] == expected
    assert sizes["tf32"] <= min(expected, 32)
    assert module(name).BACKWARD_CHUNK_SIZE == sizes


@pytest.mark.parametrize("name, expected", [("gdn", 64), ("deltanet", 64), ("linear_attn", 64), ("kda", 32), ("gla", 32),
                                            ("rwkv7", 32)])
def test_forward_chunk_size_follows_register_pressure(name, expected, monkeypatch):
    """chunk()'s own chunk size is the largest at which the plan's forward kernels fit their
    registers (within the forward's tolerance): kda's apply and gla's output kernels overflow at
    64, the scalar-gated specs' do not; rwkv7 is capped by its largest chunk size (32). chunk()
    without chunk_size runs at it."""
    from lrdsl.codegen.launch import forward_chunk_sizes

    item, _, _ = _contexts(name)
    sizes = forward_chunk_sizes(item)
    mod = module(name)
    assert mod.FORWARD_CHUNK_SIZE == sizes
    assert {sizes[plan, "input"] for plan in mod.CHUNK_PLANS} == {expected}
    assert all(sizes[plan, "tf32"] <= min(expected, 32) for plan in mod.CHUNK_PLANS)
    ran = []
    launch = mod._CHUNK_LAUNCHERS[mod.DEFAULT_CHUNK_PLAN]
    # the output kernel's chunk size (the kernels before it may run at half of it: plan rule 6)
    monkeypatch.setitem(mod._CHUNK_LAUNCHERS, mod.DEFAULT_CHUNK_PLAN,
                        lambda c, *rest, **kw: ran.append((kw.get("output_c") or c)["BT"]) or launch(c, *rest, **kw))
    generator = torch.Generator().manual_seed(int(torch.seed() % 2**31))
    tensors = make_inputs(recurrence(name), Shape(1, 40, 1, 2, 8, 12), generator=generator)
    o, _ = mod.chunk(*tensors)
    assert ran == [expected]
    o_ref, _ = reference.run(recurrence(name), *[t.double() for t in tensors])
    assert relative_error(o, o_ref) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("name, differences, direct", [
    ("gdn", 3, 1), ("simple_gla", 2, 1), ("retnet", 2, 0),  # retnet's constant gate has no gradient
    ("kda", 0, 4), ("rwkv7", 0, 9),
])
def test_scalar_gate_suffix_sums_are_differences_of_the_inclusive_one(name, differences, direct):
    """A kernel that holds a scalar gate's inclusive cumsum s takes the suffix sum from it (the
    chunk's total - s) instead of a C x C masked sum; every other exclusive sum (the adjoint of
    the suffix sum, per-key-channel gates' sums) is still summed directly."""
    source = _generate(name)
    found = summed_directly = 0
    for kernel in re.findall(r"def (\w+_kernel)\(", source):
        lines = _kernel(source, kernel)
        for index, line in enumerate(lines):
            summed = re.match(r"\s*# (\w+) = (reverse_)?exclusive_cumsum\((\w+)\)", line)
            if not summed:
                continue
            out, x, code = summed.group(1), summed.group(3), lines[index + 1]
            inclusive = [m.group(1) for l in lines[:index] if (m := re.match(rf"\s*# (\w+) = cumsum\({x}\)$", l))]
            if "o_c[None, :]" in code or "tl.gather" in code:
                summed_directly += 1
                continue
            assert summed.group(2) and inclusive and code.strip() == (
                f"b_{out} = tl.sum(tl.where(o_c == BT - 1, b_{inclusive[0]}, 0.0), axis=0) - b_{inclusive[0]}"), (kernel, code)
            found += 1
    assert (found, summed_directly) == (differences, direct)


def _every_kernel():
    """(spec, KernelContext with its placement and eager sums) of every chunk kernel of every shipped spec."""
    from lrdsl.codegen.context import KernelContext
    from lrdsl.spec import shipped_spec_names

    for name in shipped_spec_names():
        item = run_pipeline(load_spec(spec_path(name)))["save"]
        for plans in (item.forward, item.backward):
            for plan in plans.plans:
                for kernel in plan.kernels:
                    ctx = KernelContext(plans.graph.program, plan, kernel)
                    place, _ = schedule.place_values(ctx)
                    ctx.eager = schedule.eager_sums(ctx, place)
                    yield name, ctx, place


def test_emitted_args_names_exactly_what_each_emitter_reads():
    """schedule.emitted_args, the one answer to "what does this op's code read", against the code
    each emitter writes: the values (b_) and buffers (buf_) it names, for every op of every
    kernel of every shipped spec. Both of its exceptions occur: an L2-norm adjoint reads the
    normalised rows (not its raw argument), a suffix sum its inclusive sibling."""
    from lrdsl.codegen.emitters import CHUNK_EMITTERS

    exceptions = set()
    for name, ctx, _ in _every_kernel():
        for value in ctx.kernel.computes:
            op = ctx.prog.op(value)
            code = "\n".join(CHUNK_EMITTERS.lookup(op)(op, ctx))
            read = set(re.findall(r"\b(?:b|buf)_(\w+)", code)) - {value}
            assert read == set(schedule.emitted_args(ctx, value)), f"{name} {ctx.kernel.name}: {op.describe()}"
            if set(schedule.emitted_args(ctx, value)) != set(op.args()):
                exceptions.add(type(op).__name__)
    assert exceptions == {"NormalizeGrad", "Cumsum"}


def test_placement_and_pressure_see_the_same_readers():
    """The register-pressure estimate's live ranges come from the schedule's reader lists: every
    value lives at least until each reader the schedule placed reads it, and no longer than its
    last one (or the end of the V loop it is read in)."""
    from lrdsl.codegen import pressure

    for name, ctx, place in _every_kernel():
        ranges = pressure.live_ranges(ctx, place, ctx.eager)
        running_sums = {total for total, _ in ctx.eager.values()}
        for value in ctx.kernel.computes:
            if value in ctx.eager or value in running_sums:  # a term dies into its sum at once
                continue
            first, last = ranges[value]
            for reader in schedule.readers(ctx, value):
                assert ranges[reader][0] <= last or place[reader][0] == "sum", (
                    f"{name} {ctx.kernel.name}: {value} dies before its reader {reader}")
            if not schedule.readers(ctx, value):
                assert last == first, f"{name} {ctx.kernel.name}: {value} has no reader but stays live"
