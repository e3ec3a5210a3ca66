"""Goldens: every stage of each core kind of spec, and a hash of every shipped spec's module.

A refactor that claims "generated modules byte-identical" proves it here; a speed change shows
exactly which stages and modules it changed. Refresh with `pytest --update-golden`, then review
the diff of tests/golden/.

The kinds: gdn (delta rule, scalar gate), kda (key-channel gate), rwkv7 (the low-rank dplr
update), simple_gla (plain update) and retnet (constant gate) take different branches of
derive_chunk, autodiff and the planner; gated_deltaproduct (two steps per token) shows the
lower_steps pass's sub-step rows.
"""
from __future__ import annotations

import hashlib

import pytest

from lrdsl.codegen.module import emit_module
from lrdsl.passes.pipeline import STAGES, run_pipeline
from lrdsl.spec import load_spec
from lrdsl.spec import shipped_spec_names

from helpers import spec_path

GOLDEN_SPECS = ("gdn", "kda", "rwkv7", "simple_gla", "retnet", "gated_deltaproduct")
IR_STAGES = STAGES[1:]  # "spec" is the parsed TOML, not IR


@pytest.fixture(scope="module")
def pipelines():
    cache: dict[str, dict] = {}

    def stages(name: str) -> dict:
        if name not in cache:
            cache[name] = run_pipeline(load_spec(spec_path(name)))
        return cache[name]

    return stages


@pytest.mark.parametrize("stage", IR_STAGES)
@pytest.mark.parametrize("name", GOLDEN_SPECS)
def test_stage_golden(name, stage, pipelines, golden):
    golden(f"{name}.{stage}.txt", pipelines(name)[stage].describe() + "\n")


def module_hash(name: str) -> str:
    """sha256 of the module `lrdsl.load(name)` generates for a shipped spec (its text names the
    spec as it was given, so the hash is taken with the bare name)."""
    source = emit_module(run_pipeline(load_spec(spec_path(name))), spec_path=name)
    return hashlib.sha256(source.encode()).hexdigest()


def test_module_hashes(golden):
    """Every shipped spec's generated module, and the layer kernels' module (its default
    activations), byte for byte (`sha256sum` format: hash, two spaces, name)."""
    from lrdsl.codegen.layer_kernels import emit_layer_kernels

    layer = hashlib.sha256(emit_layer_kernels().encode()).hexdigest()
    text = "".join(f"{module_hash(n)}  {n}\n" for n in shipped_spec_names()) + f"{layer}  layer_kernels\n"
    golden("module_hashes.txt", text)
