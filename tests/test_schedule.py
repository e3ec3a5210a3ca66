"""The chunk kernels' schedule (lrdsl.codegen.schedule): sinking and eager sums keep tiles
short-lived. Checked on the generated source; numerics are covered by the oracle tests."""
from __future__ import annotations

import re

from lrdsl.runtime.loader import generate

from helpers import spec_path


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


def test_q_and_k_are_loaded_after_the_backward_v_loop():
    lines = _kernel(_generate("gdn"), "gdn_chunk_bwd_output_kernel")
    loop = next(i for i, line in enumerate(lines) if "for i_v in range" in line)
    for name in ("q_in", "k_in"):
        load = next(i for i, line in enumerate(lines) if line.strip().startswith(f"b_{name} = tl.load("))
        assert load > loop, f"{name} is loaded before the V loop and held across it"


def test_matmul_only_operands_load_in_the_matmul_dtype():
    lines = _kernel(_generate("gdn"), "gdn_chunk_scan_kernel")
    w_load = next(line for line in lines if line.strip().startswith("b_W = tl.load("))
    assert w_load.rstrip().endswith(".to(DOT_DTYPE)"), w_load
