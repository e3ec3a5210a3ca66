"""Host code kept as real Python modules (lrdsl/codegen/host/): imported here like any module,
and copied verbatim into the generated modules, which import torch and triton only."""
from __future__ import annotations

import ast
import builtins

import pytest

from lrdsl.codegen.host.launch_rule import SMALLEST_DOT_TILE, resolve_launch
from lrdsl.codegen.templating import HOST_DIR, host_code
from lrdsl.runtime.loader import generate

from helpers import spec_path

# module_names declares what a generated module defines itself; it is never copied
HOST_MODULES = sorted(p.stem for p in HOST_DIR.glob("*.py") if p.stem not in ("__init__", "module_names"))


def _names_used_but_not_bound(tree: ast.Module) -> set[str]:
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


@pytest.mark.parametrize("name", HOST_MODULES + ["module_names"])
def test_host_modules_import_only_what_a_generated_module_has_and_bind_every_name(name):
    """torch, triton and each other (sibling imports are dropped when copied: one namespace),
    and every name they read is bound by them or imported: a slip fails here, not at emit time."""
    tree = ast.parse((HOST_DIR / f"{name}.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert all(a.name.split(".")[0] in ("torch", "triton") for a in node.names), ast.unparse(node)
        elif isinstance(node, ast.ImportFrom):
            sibling = node.level == 1 and node.module in HOST_MODULES + ["module_names"]
            assert sibling or (node.level == 0 and node.module.split(".")[0] in ("torch", "triton")), ast.unparse(node)
    assert not _names_used_but_not_bound(tree)


@pytest.mark.parametrize("spec", ["gdn", "linear_attn"])
def test_generated_modules_carry_the_host_code_verbatim(spec):
    source, _ = generate(spec_path(spec))
    for name in HOST_MODULES:
        code = host_code(name)
        assert code in source and "import" not in code.split("\n", 1)[0], name


def test_host_code_is_importable_and_runs_as_written():
    """The checks and state helpers, imported from their real module (the names a generated
    module defines itself from module_names): a state row's dims, and a refusal in one line."""
    from lrdsl.codegen.host import checks, module_names

    assert checks._state_dims(4, 8, 16, state_v_first=False) == (4, 8, 16)
    assert checks._state_dims(4, 8, 16, state_v_first=True) == (4, 16, 8)
    with pytest.raises(module_names.InputError, match=r"^host\.chunk: state_v_first must be True or False, got 1$"):
        checks._check_layout("chunk", 1)


TABLES = {
    "launch": {"scan": {"BV": 64, "num_warps": 4, "num_stages": 2}, "output": {"BV": 64, "num_warps": 4, "num_stages": 3}},
    "launch_fp32": {"output": {"BV": 32}},
    "launch_wide": {"output": {"BV": 16, "num_warps": 8}},
    "launch_wide_inputs": {"output": {"num_stages": 1}},
    "launch_small_chunk": {"output": {"BV": 128, "num_warps": 2}, "scan": {"num_stages": 3}},
    "launch_grouped_small_chunk": {"output": {"num_warps": 16}},
    "launch_few_programs": {"scan": {"BV": 32, "num_stages": 4}},
    "launch_fewer_programs": {"scan": {"BV": 16}},
}
PLAIN = dict(precision="input", wide_k=False, wide_inputs=False, small_chunk=False, grouped=False, V=128)


def launch(role, **facts):
    return resolve_launch(TABLES, role, **{**PLAIN, **facts})


def test_the_launch_rule_overlays_its_tables_in_order():
    assert launch("output") == {"BV": 64, "num_warps": 4, "num_stages": 3}
    # fp32 operands first, then wide keys, then wide inputs: one of them, never two
    assert launch("output", precision="tf32", wide_k=True, small_chunk=True)["BV"] == 32
    assert launch("output", wide_k=True, wide_inputs=True) == {"BV": 16, "num_warps": 8, "num_stages": 3}
    assert launch("output", wide_inputs=True, small_chunk=True) == {"BV": 64, "num_warps": 4, "num_stages": 1}
    # the small-chunk settings, and the grouped ones over them
    assert launch("output", small_chunk=True) == {"BV": 128, "num_warps": 2, "num_stages": 3}
    assert launch("output", small_chunk=True, grouped=True)["num_warps"] == 16
    assert launch("output", grouped=True) == launch("output")
    # a scan's programs decide, at the value block the tables before gave it
    programs = lambda BV: 4 * 128 // BV  # noqa: E731
    assert launch("scan", scan_programs=programs, multiprocessors=8) == {"BV": 64, "num_warps": 4, "num_stages": 2}
    assert launch("scan", scan_programs=programs, multiprocessors=9, small_chunk=True) == {"BV": 32, "num_warps": 4, "num_stages": 4}
    assert launch("scan", scan_programs=programs, multiprocessors=40)["BV"] == 16
    assert launch("scan", scan_programs=None, multiprocessors=40)["BV"] == 64  # in segments: many programs
    # a caller's settings last, then the value block clamped to the tile sizes a matmul takes
    assert launch("output", small_chunk=True, replaced={"num_warps": 1}) == {"BV": 128, "num_warps": 1, "num_stages": 3}
    assert launch("output", small_chunk=True, V=40)["BV"] == 64
    assert launch("output", wide_k=True, V=8)["BV"] == SMALLEST_DOT_TILE


def test_every_template_varies_per_spec():
    """A template without a single tag is host code kept as text: it belongs in lrdsl/codegen/host/."""
    from lrdsl.codegen.templating import TEMPLATE_DIR

    for template in TEMPLATE_DIR.glob("*.jinja"):
        text = template.read_text()
        assert "{{" in text or "{%" in text, f"{template.name} has no tag: make it a host module"
