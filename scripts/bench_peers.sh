#!/usr/bin/env bash
# lrdsl beside FLA's Triton kernels, FLA's dispatch (FlashQLA) and FlashQLA itself, on the GPU
# machine (no internet): installs the wheels carried in $WHEELS (default ./.whl, which git
# ignores: pass it in the device call's `carry`), then runs scripts/bench_peers.py PHASE ...
# with its output in $OUT/PHASE.log, .json, .png (3 files a phase: at most 2 phases a call).
#
#   .whl/  fla_core-0.6.0-*.whl einops-*.whl                        (the FLA columns)
#          flash_qla-0.1.3-*.whl tilelang-0.1.15-*.whl apache_tvm_ffi-0.1.12-*.whl
#          torch_c_dlpack_ext-*.whl z3_solver-4.15.4-*.whl + their deps (the FlashQLA columns)
#
# Each call must end within the device's 10 minutes and starts on a bare machine (nothing is
# kept between calls), so FLA's autotuning (minutes) and FlashQLA's compiles (49-110 s a shape)
# are paid in every call: one phase a call, family-a with decode at most. The commands:
#
#   bash scripts/bench_peers.sh training             # gdn, 3 training shapes, fwd and fwd+bwd
#   bash scripts/bench_peers.sh flashqla             # gdn at FlashQLA's shapes: 1x32768 and 4x8192 at 16/64
#   bash scripts/bench_peers.sh family-a decode      # gdn, gdn_qwen35, deltanet, simple_gla; gdn decode
#   bash scripts/bench_peers.sh family-b             # kda, gla, rwkv7
#   bash scripts/bench_peers.sh family-c             # comba, gdn2, gated_deltaproduct
#
# then, on any machine: lrdsl bench --from-json OUT/*.json --json all.json --plot all.png
# BENCH_DEADLINE_S (default 420): no new (spec, shape) starts after that many seconds.
set -uo pipefail

OUT=${OUT:-/tmp/bench_peers}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
log="$OUT/$(IFS=-; echo "$*").log"

{
    echo "== wheels in $WHEELS"
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        ls "$WHEELS"
        # everything carried, its dependencies from the same folder; where one is missing,
        # fla-core alone (its one dependency, einops, carried beside it), then flash-qla without
        # its dependencies: what imports is what gets a column
        python3 -m pip install -q --no-index --find-links "$WHEELS" "$WHEELS"/*.whl ||
            { python3 -m pip install -q --no-index --find-links "$WHEELS" fla-core;
              python3 -m pip install -q --no-index --no-deps "$WHEELS"/flash_qla-*.whl 2>/dev/null; }
    else
        echo "no wheels: FLA and FlashQLA columns only if already installed"
    fi
    python3 -c "import fla; print('fla-core imports')" 2>&1 | tail -1
    python3 -c "import flash_qla; print('flash_qla imports')" 2>&1 | tail -1
    python3 scripts/bench_peers.py "$@" --out "$OUT"
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
