"""Side-by-side benchmarks: lrdsl's generated kernels vs its peers (fla-core 0.6.0, FlashQLA 0.1.3),
gated on correctness.

    lrdsl bench SPEC [SPEC ...] | --all  [--shapes LIST] [--plans LIST] [--backward]
                                         [--json FILE] [--plot FILE.png]
    lrdsl bench --from-json FILE [FILE ...] [--json FILE] [--plot FILE.png]   (no GPU: report earlier runs)

Peers, each a column of its own, timed in the same process on the same inputs: "fla-triton",
FLA's public function with every backend its dispatcher would pick for the call switched off
(fla-core 0.6.0 reads each backend's environment switch at every call; the switches are set
around every call of that column, its backward included); the backend FLA's dispatcher picks,
where it picks one ("flashqla": FLA sends chunk_gated_delta_rule to FlashQLA on Hopper when
flash-qla is installed); "flashqla-direct", flash_qla.chunk_gated_delta_rule itself, where it
imports and applies (the plain scalar-gate delta rule with beta, K = V = 128, bf16 or fp16).
Each lrdsl row gets one ratio per peer: peer ms / lrdsl ms.

Protocol: bf16 q, k, v (and beta); fp32 g; use_qk_l2norm_in_kernel=True wherever FLA's function
takes it (else False on both sides); scale = K**-0.5; median of triton.testing.do_bench; peak
memory of one call (its inputs included, whatever else the process holds excluded); kept memory
of forward + backward rows = what the forward leaves allocated for the backward (its outputs
excluded: what a deep model holds once per layer), shown beside the ratios too; cold time =
the first call of that function at that shape in the process (compilation and autotuning
included). TFLOP/s: the recurrent form's 6 * B * T * HV * K * V floating-point operations for
the forward (predict, write, read: 2KV each per token and head), 3x that for forward + backward,
the same count for every implementation. Decode (T = 1): an fp32 initial state in, the final
state out, as a server does; TB/s counts that state read once and written once, also when the
kernels run as a CUDA-graph replay, beside the card's copy bandwidth (one 1 GiB device-to-device
copy, bytes read + written, measured once per run) and the fraction of it.

Correctness gate: every row's outputs (o, the final state, and for forward + backward the
gradient of every input) are compared with the float64 oracle (lrdsl.reference) and with the
other implementations'. A row whose outputs are not finite, or differ from the oracle's beyond
the dtype's tolerance, is FAILED and gets no ratio; so is one that differs from another
implementation unless a third sides with it (see _rows). Peer functions are called by keyword,
each spec input mapped to the peer's parameter by its role (the gate to `g`, beta to `beta`) or,
for an in-kernel form (gdn_qwen35: FLA's use_gate_in_kernel and use_beta_sigmoid_in_kernel),
by matching the spec's formulas with the peer's symbol for symbol; never by position.

Serving (--serving, at decode shapes; lrdsl only, FLA has no state pool): decode on a state
pool of 2B rows in random order (fp32, bf16 and 8-bit state), verify of 4 draft tokens, and verify +
commit of a random number of them, each eager and as a CUDA-graph replay (validate=False, the
caller's buffers). Each row is gated by one run on a fresh pool against the oracle (o, and the
pool rows); TB/s counts the state traffic of the row's kernels (a pool decode reads and writes
each row once, verify reads it once, verify + commit reads it twice and writes it once), and
"x pool" is the row's time over the fp32 pool decode's (eager or graph alike).

The harness runs on any device: on a GPU `lrdsl bench` times it; on the CPU the tests drive the
same row building, gate, keyword mapping and ratios at tiny shapes (timings there mean nothing).
"""
from .shapes import (  # noqa: F401
    DECODE,
    DECODE_GRAPH,
    DECODE_SHAPES,
    DRAFT_TOKENS,
    FAMILY_SHAPES,
    FORWARD,
    FORWARD_BACKWARD,
    GRAPH,
    LRDSL,
    MODES,
    ORACLE_TOKENS,
    POOL,
    POOL_BF16,
    POOL_INT8,
    SERVING_CALLS,
    SHAPE_GROUPS,
    TRAINING_SHAPES,
    VERIFY,
    VERIFY_COMMIT,
    _parse_shape_token,
    is_decode,
    modes_for,
    oracle_prefix,
    parse_shapes,
    shape_label,
)
from .peers import (  # noqa: F401
    DirectPeer,
    FLA,
    FLASHQLA_DIRECT,
    FLASH_QLA,
    FLA_BACKEND_LABELS,
    FLA_BASELINES,
    FLA_TRITON,
    FlaBaseline,
    FlaFunction,
    _GATE_AND_BETA,
    _GDN_IN_KERNEL,
    _MOST_BACKENDS,
    _RWKV7_ROLES,
    _candidate_backends,
    _formula_names,
    _match_in_kernel_form,
    _role_expressions,
    _takes_kwargs,
    allow_fla_gated_backward_on_hopper,
    dispatched_backend,
    environment,
    explicit_parameters,
    fla_baseline,
    fla_dispatch_path,
    fla_keywords,
    input_parameters,
    input_role,
    missing_parameters,
    resolve_fla,
    triton_switches,
)
from .contenders import (  # noqa: F401
    Call,
    Contender,
    direct_contender,
    direct_peers,
    fla_contender,
    fla_peers,
    lrdsl_contenders,
    make_call,
    oracle_outputs,
    run_mode,
)
from .timing import (  # noqa: F401
    Measurement,
    NotCapturable,
    _first_line,
    measure_graph_replay,
    measure_on_gpu,
    measure_once,
    measurers,
)
from .gate import (  # noqa: F401
    BenchRow,
    _Result,
    _difference,
    _rows,
    _state_tbps,
    _tflops,
    broken_outputs,
    relative_error,
    run_group,
    state_bytes,
    with_ratios,
    worst_error,
)
from .run import (  # noqa: F401
    COPY_BYTES,
    SpecUnderTest,
    bench,
    measure_copy_tbps,
    with_copy_bandwidth,
)
from .serving import (  # noqa: F401
    ServingCase,
    make_serving_case,
    serving_call,
    serving_gate,
    serving_rows,
    serving_state_bytes,
)
from .report import (  # noqa: F401
    HEADER,
    _COLUMNS,
    _with_peer_columns,
    format_row,
    format_summary,
    peers_of,
    plot_ratios,
    ratio_summary,
    require_matplotlib,
    rows_from_json,
    to_json,
)
