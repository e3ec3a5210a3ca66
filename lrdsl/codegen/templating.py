"""The jinja2 environment of all kernel and module templates (StrictUndefined: a missing hook is an error)."""
from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

import jinja2

TEMPLATE_DIR = Path(__file__).parent / "templates"
HOST_DIR = Path(__file__).parent / "host"


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def render(template: str, **hooks) -> str:
    return environment().get_template(template).render(**hooks)


def indent(lines: list[str], spaces: int) -> str:
    pad = " " * spaces
    return "\n".join(pad + line if line else "" for line in lines)


@lru_cache(maxsize=None)
def host_code(module: str) -> str:
    """The code of host module `module` (lrdsl/codegen/host/<module>.py) as a generated module
    carries it: the file after its docstring and its imports (torch and triton, which the
    generated module imports itself, and the sibling host modules, which are its own code there),
    without leading or trailing blank lines. Imports come first in a host module, nowhere else."""
    text = (HOST_DIR / f"{module}.py").read_text(encoding="utf-8")
    tree = ast.parse(text)
    docstring, *body = tree.body
    if not (isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant)):
        raise ValueError(f"host module {module} has no docstring")
    imports = [node for node in body if isinstance(node, (ast.Import, ast.ImportFrom))]
    if body[:len(imports)] != imports:
        raise ValueError(f"host module {module}: imports come first, before any code")
    start = imports[-1].end_lineno if imports else docstring.end_lineno
    return "".join(text.splitlines(keepends=True)[start:]).strip("\n")
