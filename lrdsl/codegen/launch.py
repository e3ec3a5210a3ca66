"""Launch settings and chunk sizes the generated module carries: per kernel role (value columns
per block, warps, pipeline stages) with the shape- and dtype-dependent overrides measured on the
H200, the largest chunk size whose kernels fit a block's shared memory, and the chunk sizes the
register-pressure estimate picks for the forward and the backward.

Launch settings are typed (`Launch`, and `Overlay` for a table's partial overrides) and rendered
to plain dicts only for the module. Which tables apply to a call, in which order, is one rule:
`resolve_launch` (codegen/host/launch_rule.py), which the module carries and `launch_for` below
calls for the chunk-size estimate.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Mapping

from ..errors import CompileError
from ..ir.chunk import ChunkProgram
from ..ir.plan import BackwardPlan, ChunkPlans, Plan
from .context import KernelContext
from .emitters import KEY_CHANNEL_OPS
from .host.launch_rule import resolve_launch
from .pressure import peak_tile_bytes

# the module's names of the settings, in the order its tables write them
_SETTING_NAMES = {"columns": "BV", "warps": "num_warps", "stages": "num_stages", "registers": "maxnreg"}


def _render(settings) -> dict[str, int]:
    return {_SETTING_NAMES[f.name]: getattr(settings, f.name) for f in fields(settings)
            if getattr(settings, f.name) is not None}


@dataclass(frozen=True)
class Launch:
    """One kernel role's launch: value columns per program (BV), warps, pipeline stages, and an
    optional cap on each thread's registers (maxnreg; none of the tables sets one)."""

    columns: int
    warps: int
    stages: int
    registers: int | None = None

    def render(self) -> dict[str, int]:
        return _render(self)

    def as_overlay(self) -> Overlay:
        """This whole setting as an overlay (every setting replaced)."""
        return Overlay(self.columns, self.warps, self.stages, self.registers)


@dataclass(frozen=True)
class Overlay:
    """A table's partial override of a role's Launch: the settings it names replace the base's."""

    columns: int | None = None
    warps: int | None = None
    stages: int | None = None
    registers: int | None = None

    def render(self) -> dict[str, int]:
        return _render(self)


@dataclass(frozen=True)
class LaunchTables:
    """A module's launch tables: the base setting per role and the overlays resolve_launch applies
    (in its order). Rendered, they are the module's CHUNK_LAUNCH* dicts, by template name."""

    launch: Mapping[str, Launch]
    launch_fp32: Mapping[str, Overlay]
    launch_wide: Mapping[str, Overlay]
    launch_wide_inputs: Mapping[str, Overlay]
    launch_small_chunk: Mapping[str, Overlay]
    launch_grouped_small_chunk: Mapping[str, Overlay]
    launch_few_programs: Mapping[str, Overlay]
    launch_fewer_programs: Mapping[str, Overlay]

    def render(self) -> dict[str, dict[str, dict[str, int]]]:
        return {f.name: {role: s.render() for role, s in getattr(self, f.name).items()} for f in fields(self)}


# Launch settings per kernel role (value columns per block, warps, pipeline stages); the module
# carries them. Backward roles are the backward program's kernel names with "bwd_" in front.
CHUNK_LAUNCH = {
    "prepare": Launch(columns=64, warps=4, stages=2),
    "system": Launch(columns=64, warps=4, stages=2),
    # one warp: the solve's tiles are 16 x 16 blocks, and within a warp its row reductions are
    # register shuffles, with no shared memory or barrier between warps (H200, 4 x 4096: the
    # forward 1.337 -> 1.167 ms against 4 warps)
    "solve": Launch(columns=64, warps=1, stages=2),
    # apply: every value column in one block (one U = T @ (V * beta) product per chunk instead of
    # two, the solved system's tile reused): H200, gdn forward 1.057 -> 1.020 ms at 4 x 4096 and
    # 2.294 -> 2.225 ms at 1 x 32768 against 64 columns in 3 stages (C = 64; at C = 32, below, 64
    # columns stay: the backward's re-run gained nothing from 128)
    "apply": Launch(columns=128, warps=4, stages=2),
    # the scans: 64 value columns per program where that still gives every multiprocessor a
    # program (CHUNK_LAUNCH_FEW_PROGRAMS below otherwise): each chunk's keys and W are read once
    # for twice the columns (gdn forward at 4 x 4096: 1.214 -> 1.147 ms; forward + backward with
    # the backward scan so: 6.127 -> 5.651 ms)
    "scan": Launch(columns=64, warps=4, stages=2),
    # output: a third stage hides its tile loads (H200, gdn forward 1.214 -> 1.192 ms at 4 x 4096,
    # 2.140 -> 2.109 ms at 1 x 65536)
    "output": Launch(columns=64, warps=4, stages=3),
    "bwd_prepare": Launch(columns=64, warps=4, stages=2),
    "bwd_scan": Launch(columns=64, warps=4, stages=3),
    "bwd_output": Launch(columns=64, warps=8, stages=1),
}
# apply's setting before the one above (64 value columns, a third stage hiding their tile loads):
# kept below the largest chunk size, and by programs with per-key-channel decayed products (their
# C x K operand tiles on top of apply's), the cases it was measured in.
_APPLY_BY_64_COLUMNS = Launch(columns=64, warps=4, stages=3)
CHUNK_LAUNCH_KEY_CHANNEL = {**CHUNK_LAUNCH, "apply": _APPLY_BY_64_COLUMNS}
# Smaller settings where the backward's output kernel holds larger tiles, else it runs out of
# shared memory: K > 128 key channels (bf16 operands), or fp32 operands (precision="tf32").
# The forward output kernel keeps 32 columns and 2 stages: with BK = 256, BV = 32 and one stage it
# computed wrong results on the H200 (triton 3.6.0), while these were checked there.
# The scans, apply and output keep there the settings they were checked with (32 value columns,
# 2 stages): the wider or deeper ones above were measured at K = 128 with 16-bit operands only.
_CHECKED_WIDE = {"scan": Overlay(columns=32, stages=2), "bwd_scan": Overlay(columns=32, stages=2),
                 "apply": Overlay(columns=64, stages=2), "output": Overlay(stages=2)}
# The backward output kernel at K > 128 takes 64 value columns: at 32, ptxas gives up on it (32
# registers per thread, 13.8-22.6 KB of spills; at 64 it keeps 255 and spills 1.3-2.2 KB), and it ran
# ten times slower. H200, forward + backward at 2 x 4096, K = V = 256, 16 heads: gdn 45.17 -> 3.86
# ms (87.21 -> 8.54 on 32 value heads), deltanet 40.67 -> 3.16, simple_gla 32.81 -> 2.29.
# Programs with per-key-channel decayed products hold more C x K tiles, and which setting ptxas
# starves differs among them: with at most WIDE_K_FEW_PRODUCTS of them (gla: 3) the kernel starves
# at 32 columns on 8 warps (39,060 B of spills) and keeps 128 registers on 16 warps at 64 columns
# (2,932 B): gla 49.96 -> 12.08 ms (same shape, 16 value heads). With more (the kda specs: 5) 32
# columns on 8 warps keep 255 registers, and 64 on 16 starve kda_fused_gate's kernel (kda's not:
# 14.59 -> 13.36 ms there), so they keep it; so does rwkv7 (10), which starves at every setting
# tried at K = 256.
def _checked_wide(columns: int, warps: int) -> dict[str, Overlay]:
    """_CHECKED_WIDE with the backward output kernel on `columns` value columns, `warps` warps, one stage."""
    return {**_CHECKED_WIDE, "bwd_output": Overlay(columns=columns, warps=warps, stages=1)}


CHUNK_LAUNCH_WIDE_K = _checked_wide(64, 8)
WIDE_K_FEW_PRODUCTS = 3
CHUNK_LAUNCH_WIDE_K_FEW_PRODUCTS = _checked_wide(64, 16)
CHUNK_LAUNCH_WIDE_K_KEY_CHANNEL = _checked_wide(32, 8)
CHUNK_LAUNCH_FP32 = _checked_wide(32, 4)
# fp32 and fp64 inputs multiply in their own width whatever the precision: their tiles take twice
# (four times) the shared memory of 16-bit ones, so none of the wider settings for 16-bit inputs
# apply (128 value columns for the backward output kernel would need 304,640 bytes at C = 32).
CHUNK_LAUNCH_WIDE_INPUTS = {**_CHECKED_WIDE}
# The largest chunk size whose kernels fit an sm_90 block's shared memory (232,448 bytes), by
# (precision, K > 128), after how many per-key-channel decayed products (DecayedGram,
# DecayedMatMul: each holds C x K operand tiles) the backward's output kernel, the largest
# kernel, computes. Measured with `lrdsl resources SPEC --chunk-size C --kernels
# bwd_output` on that kernel at its launch settings (bytes; the sizes chunk() refuses, marked
# over, were compiled with the module's LARGEST_CHUNK_SIZE lifted in the measuring process):
#   0 (gdn, scalar gates)   C = 64: 73,728 (K = 128), 139,264 (K = 256); fp32 operands ("tf32")
#                           at C = 64, K = 128: 237,568, over, so tf32 takes C <= 32 everywhere
#                           (73,728 at C = 32)
#   3 (gla)                 C = 64, K = 256: 98,304
#   5 (kda and variants)    C = 64: 155,648 at K = 128, 303,104 at K = 256 (over; 36,864 at C = 32);
#                           tf32 C = 32: 69,632 / 118,784
#   10 (rwkv7, dplr)        C = 64, K = 128: 417,792 (over; 126,976 at C = 32, 212,992 at K = 256);
#                           tf32 C = 32, K = 128: 282,624 (over; 120,832 at C = 16); tf32 at K = 256
#                           233,472 even at C = 16: no chunk size fits (None), chunk() refuses it
# These were measured with decayed_matmul's levels unrolled, as they still are at C = 16 and at
# K > 128. From C = 32 on at K <= 128 they run as a loop (each level's operand tiles reusing the last
# one's shared memory) with a second 16-bit dot, bf16: kda C = 64: 57,344; rwkv7 C = 32: 45,056; kda
# tf32 C = 32: 36,864. Larger chunk sizes may fit there now; the sizes below stay until the GPU has
# measured them.
# A program with more decayed products than measured here is refused at compile time.
LARGEST_CHUNK_SIZES = (  # (at most this many decayed products, {(precision, K > 128): chunk size or None})
    (3, {("input", False): 64, ("input", True): 64, ("tf32", False): 32, ("tf32", True): 32}),
    (5, {("input", False): 64, ("input", True): 32, ("tf32", False): 32, ("tf32", True): 32}),
    (10, {("input", False): 32, ("input", True): 32, ("tf32", False): 16, ("tf32", True): None}),
)


def backward_key_channel_products(item: BackwardPlan) -> int:
    """How many per-key-channel decayed products the backward's output kernel computes."""
    prog = item.backward.graph.program
    output = next(k for k in item.backward.plans[0].kernels if k.name == "output")
    return sum(isinstance(prog.op(value), KEY_CHANNEL_OPS) for value in output.computes)


def largest_chunk_sizes(item: BackwardPlan) -> dict:
    """The generated module's LARGEST_CHUNK_SIZE, from what the backward's output kernel computes
    (how many per-key-channel decayed products), never from the spec's name."""
    prog = item.backward.graph.program
    products = backward_key_channel_products(item)
    for most, sizes in LARGEST_CHUNK_SIZES:
        if products <= most:
            return sizes
    raise CompileError(f"{prog.recurrence.name}: the backward's output kernel computes {products} per-key-channel "
                       f"decayed products, more than any chunk size was measured to fit (lrdsl resources)")


# The scan walks a sequence's chunks one after another, so where its programs at 64 value columns
# would leave multiprocessors idle (few sequences x heads) it takes 32 columns (twice the
# programs) and a deeper pipeline, which hides each step's loads behind the previous step's
# matmuls. Measured on the H200, gdn 1 x 65536 with 8 value heads (16 programs at 64 columns):
# forward 2.893 ms at 64 columns, 2.140 at 32 with 3 stages, 1.981 with 4; the backward scan
# 13.27 / 11.49 (3 stages) / 11.52 ms (4) forward + backward; at 1 x 32768 with 32 value heads
# (64 programs at 64 columns) the forward took 2.826 (64 columns), 2.460 (64, 4 stages) and
# 2.395 ms (32, 4 stages), the backward scan 11.97 ms at 64 columns against 11.64 at 32.
CHUNK_LAUNCH_FEW_PROGRAMS = {"scan": Overlay(columns=32, stages=4), "bwd_scan": Overlay(columns=32, stages=3)}
# Where even 32 columns give fewer programs than half the multiprocessors, 16 (the narrowest tile
# a matmul takes): gdn 1 x 65536 with 8 value heads (32 programs at 32 columns) forward 1.902 ->
# 1.867 ms, forward + backward (the backward scan so) 10.328 -> 9.987 ms. At 1 x 32768 with 32
# value heads (128 programs at 32 columns) 16 columns were slower: 2.357 -> 2.808 and 11.44 -> 11.59.
CHUNK_LAUNCH_FEWER_PROGRAMS = {"scan": Overlay(columns=16), "bwd_scan": Overlay(columns=16)}
# Below the largest chunk size (C = 32: the backward's usual case, and kda's and gla's forward)
# tiles are half as tall, and the settings change where that was measured to pay (H200, bf16):
#  - the backward output kernel takes 128 value columns per program (6.127 -> 5.652 ms forward +
#    backward at 4 x 4096, gdn) in one stage: with 128 columns its V loop has one step at V = 128,
#    so a second stage only holds 109 KB more shared memory, and ptxas spilled more (848 -> 636 B
#    per thread). Four interleaved rounds each (H200, one process, BENCHMARKS.md round 16): gdn
#    4.493 -> 4.479 ms at 4 x 4096, 9.973 -> 9.956 at 1 x 32768, 5.539 -> 5.550 at 1 x 65536;
#    deltanet 1.992 -> 1.969 / 4.757 -> 4.742, simple_gla 1.507 -> 1.484 / 3.327 -> 3.320 (4 x 4096
#    / 1 x 32768, 16 heads). In processes that had run FLA's kernels first, the 2-stage kernel
#    took 0.2-0.3 ms longer than in processes without them, the 1-stage one did not (there gdn
#    went 4.702 -> 4.471 and 10.241 -> 9.929 ms);
#    two stages had gained when first measured (7.27 -> 6.88 ms), on the larger kernel of then;
#  - the system and output kernels run 2 warps (32-row tiles give 4 warps little to share):
#    kda's forward 1.90 -> 1.59 ms, gla's 1.02 -> 0.86 ms (4 x 4096, H = HV = 16) together with
#    the scan's 64 columns. Each alone gained 4-13 %.
#    Not where the kernel computes per-key-channel decayed products (their C x K operand tiles
#    come on top): gla's forward + backward took 5.654 ms at 128 columns, 5.353 at 64.
#  - apply keeps 64 value columns in 3 stages (128 columns in 2, the C = 64 setting above, left
#    gdn's forward + backward unchanged: the re-run at C = 32 lost what the forward gained);
#  - the scan takes a third stage, where it has programs enough (CHUNK_LAUNCH_FEW_PROGRAMS, applied
#    after this table, still decides where it has few): gdn forward + backward at 4 x 4096 4.552
#    -> 4.475 ms, from the backward's re-run of the forward scan (at C = 64 no gain: 1.057 vs
#    1.062 ms forward). Not for per-key-channel gates, where it was not measured.
CHUNK_LAUNCH_SMALL_CHUNK = {"bwd_output": Overlay(columns=128, stages=1), "system": Overlay(warps=2),
                            "output": Overlay(warps=2), "apply": _APPLY_BY_64_COLUMNS.as_overlay(),
                            "scan": Overlay(stages=3)}
# With grouped value heads (HV > H) the backward output kernel also sums each key head's q and k
# gradients over its value heads, and for programs with more decayed products than
# GROUPED_STARVED_PRODUCTS (rwkv7: 10) ptxas then gives up at 64 columns and 8 warps below the
# largest chunk size: 32 registers per thread and 8,296 B of spills (`lrdsl resources
# SPEC --shape 1,128,16,32,128,128 --chunk-size default --kernels bwd_output`). 32 columns on 16
# warps keep 128 registers and spill 1,274 B. H200, rwkv7 forward + backward at 2 x 4096 with 16 key
# heads: 30.45 -> 16.05 ms on 32 value heads; on 16 (no groups, where the kernel has its 255
# registers) the same setting was slower (5.92 -> 8.15 ms), so it applies with groups only.
GROUPED_STARVED_PRODUCTS = 5
CHUNK_LAUNCH_GROUPED_SMALL_CHUNK = {"bwd_output": Overlay(columns=32, warps=16, stages=1)}
CHUNK_LAUNCH_SMALL_CHUNK_KEY_CHANNEL = {**{role: s for role, s in CHUNK_LAUNCH_SMALL_CHUNK.items() if role != "scan"},
                                        "bwd_output": Overlay(stages=2)}

# The backward recomputes the forward's buffers, or reads only the solved systems (save policies
# "recompute", "save_solve", "save_states"), and so may use its own chunk size; under the
# policies that keep more ("save", the default, and "save_prepare") a training forward runs at
# that size itself, so the backward runs there too. Its output
# kernel holds many more tiles than any forward kernel (every gradient of a chunk), and past the
# register file it spills in its inner work: at C = 64 the gdn kernel took 6.2 ms at 4 x 4096
# (H200), at C = 32 3.4 ms and forward + backward fell from 9.6 to 7.3 ms, at C = 16 the scans'
# extra steps cost more than the kernel gained (8.7 ms); at C = 32 it then gained again from 128
# value columns in one stage (CHUNK_LAUNCH_SMALL_CHUNK: 6.127 -> 5.652 ms). The estimate is a
# lower bound (Triton's temporaries are not counted), so a kernel may exceed the register file:
# rated at the launches the module runs (launch_for), gdn's kernel is 2.17x its register file at
# C = 64 (64 columns, 8 warps), 1.30x at C = 32 (128 columns) and 0.89x at C = 16. The tolerance
# was 1.25 while the estimate rated 64 columns at C = 32 (0.95x there), which the module does not
# run; 1.30 keeps the measured choice. kda's kernel rates 1.38x at C = 32 (64 columns), rwkv7's
# 1.50x, so both keep C = 16; measured at 32 on the H200 (round 33, fwd+bwd 4 x 4096, H = 16)
# kda took 11.45 ms against 7.78 at 16, rwkv7 18.65 against 13.02.
REGISTER_FILE_BYTES_PER_WARP = 32 * 255 * 4  # 32 threads x 255 registers of 4 bytes
BACKWARD_PRESSURE_TOLERANCE = 1.3
# The forward picks its chunk size by the same estimate, with less slack: its kernels are shorter,
# so the scan's steps (twice as many at half the chunk size) weigh less against a spilling kernel.
# Measured on the H200 (4 x 4096, H = HV = 16, K = V = 128, bf16, forward alone): kda (apply 1.26x
# the register file at C = 64) took 2.91 ms at 64 and 1.90 ms at 32; gla (output 1.13x) 1.20 and
# 1.02 ms; gdn (output 0.88x) is as fast or faster at 64 (1.21 vs 1.24 ms at 4 x 4096 with
# HV = 32, 2.12 vs 2.70 ms at 1 x 65536). At C = 32 the module runs the output kernel on 2 warps
# (CHUNK_LAUNCH_SMALL_CHUNK), where kda's and gla's rate 1.07x, and kda_fused_gate's 1.26x: it
# takes C = 16 (rated at 4 warps, as before the estimate used the module's launch, it took 32).
FORWARD_PRESSURE_TOLERANCE = 1.1
PRESSURE_HEAD_DIM = 128  # the head dimension the estimate assumes (K = V)
CHUNK_SIZE_CHOICES = (64, 32, 16)
PRECISION_OPERAND_BYTES = {"input": 2, "tf32": 4}  # the estimate assumes 16-bit inputs


def backward_chunk_sizes(item: BackwardPlan) -> dict[str, int]:
    """Per precision, the largest chunk size at which every backward kernel's live tiles
    (pressure.peak_tile_bytes) stay within BACKWARD_PRESSURE_TOLERANCE x its program's register
    file at the launch the module runs it with, at most the module's largest (LARGEST_CHUNK_SIZE)."""
    backward, largest, tables = item.backward, largest_chunk_sizes(item), launch_tables(item)
    prog, plan = backward.graph.program, backward.plans[0]
    return {precision: _largest_fitting_registers(prog, plan, tables, largest, precision, BACKWARD_PRESSURE_TOLERANCE)
            for precision in PRECISION_OPERAND_BYTES}


def forward_chunk_sizes(item: BackwardPlan) -> dict[tuple[str, str], int]:
    """Per (plan, precision), the chunk size chunk() runs at where the call gives none: the largest
    at which every kernel of the plan stays within FORWARD_PRESSURE_TOLERANCE x its registers (at
    the module's launch), at most the module's largest."""
    forward, largest, tables = item.forward, largest_chunk_sizes(item), launch_tables(item)
    prog = forward.graph.program
    return {(plan.name, precision): _largest_fitting_registers(prog, plan, tables, largest, precision,
                                                               FORWARD_PRESSURE_TOLERANCE)
            for plan in forward.plans for precision in PRECISION_OPERAND_BYTES}


def _largest_fitting_registers(prog: ChunkProgram, plan: Plan, tables: LaunchTables, largest_sizes: dict,
                               precision: str, tolerance: float) -> int:
    """The largest of CHUNK_SIZE_CHOICES up to the module's largest (at K = PRESSURE_HEAD_DIM, what
    the estimate assumes) whose kernels fit tolerance x their registers; the smallest if none does."""
    largest = largest_sizes[precision, False]
    fits = [c for c in CHUNK_SIZE_CHOICES
            if c <= largest and _fits_registers(prog, plan, tables, c, largest, precision, tolerance)]
    return fits[0] if fits else CHUNK_SIZE_CHOICES[-1]


def estimate_facts(precision: str, chunk: int, largest: int) -> dict:
    """The call the chunk-size estimate rates, as resolve_launch's facts: K = V =
    PRESSURE_HEAD_DIM (not above the module's WIDE_K), 16-bit inputs (so "input" multiplies in
    16 bits, "tf32" in fp32), chunk size `chunk` against the module's largest `largest`, and as
    many value heads as key heads. With grouped value heads the module may run the backward
    output kernel at other settings (launch_grouped_small_chunk, programs with more than
    GROUPED_STARVED_PRODUCTS decayed products): the estimate rates the ungrouped launch, the
    shape the tolerances were measured at. The scans' settings (few programs) are not rated."""
    return dict(precision=precision, wide_k=False, wide_inputs=False, small_chunk=chunk < largest, grouped=False,
                V=PRESSURE_HEAD_DIM)


def launch_for(tables: LaunchTables, role: str, **facts) -> Launch:
    """The launch the module runs `role` with under `facts` (resolve_launch's keyword arguments):
    the module's own rule on its own tables."""
    settings = resolve_launch(tables.render(), role, **facts)
    return Launch(settings["BV"], settings["num_warps"], settings["num_stages"], settings.get("maxnreg"))


def _fits_registers(prog: ChunkProgram, plan: Plan, tables: LaunchTables, chunk: int, largest: int, precision: str,
                    tolerance: float) -> bool:
    for kernel in plan.kernels:
        if kernel.kind == "scan":  # its tiles do not grow with the chunk size: the state is K x BV
            continue
        role = ("bwd_" if prog.direction == "backward" else "") + kernel.name
        launch = launch_for(tables, role, **estimate_facts(precision, chunk, largest))
        peak = peak_tile_bytes(KernelContext(prog, plan, kernel), chunk, PRESSURE_HEAD_DIM, launch.columns,
                               PRECISION_OPERAND_BYTES[precision])
        if peak > tolerance * launch.warps * REGISTER_FILE_BYTES_PER_WARP:
            return False
    return True


def launch_tables(item: BackwardPlan) -> LaunchTables:
    """The launch tables the generated module carries, chosen by how many per-key-channel decayed
    products the backward's output kernel computes, never by the spec's name."""
    products = backward_key_channel_products(item)
    if not products:
        wide = CHUNK_LAUNCH_WIDE_K
    else:
        wide = CHUNK_LAUNCH_WIDE_K_FEW_PRODUCTS if products <= WIDE_K_FEW_PRODUCTS else CHUNK_LAUNCH_WIDE_K_KEY_CHANNEL
    return LaunchTables(
        launch=CHUNK_LAUNCH_KEY_CHANNEL if products else CHUNK_LAUNCH,
        launch_fp32=CHUNK_LAUNCH_FP32,
        launch_wide=wide,
        launch_wide_inputs=CHUNK_LAUNCH_WIDE_INPUTS,
        launch_small_chunk=CHUNK_LAUNCH_SMALL_CHUNK_KEY_CHANNEL if products else CHUNK_LAUNCH_SMALL_CHUNK,
        launch_grouped_small_chunk=CHUNK_LAUNCH_GROUPED_SMALL_CHUNK if products > GROUPED_STARVED_PRODUCTS else {},
        launch_few_programs=CHUNK_LAUNCH_FEW_PROGRAMS,
        launch_fewer_programs=CHUNK_LAUNCH_FEWER_PROGRAMS,
    )
