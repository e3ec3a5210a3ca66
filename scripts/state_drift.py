"""How far a decode drifts when its state is stored in fewer bits after every step (CPU, torch).

    python scripts/state_drift.py                        # gdn, kda, rwkv7; 1000 steps; K = V = 128
    python scripts/state_drift.py --specs gdn --steps 200 --heads 2

One decode at a time through the float64 oracle (lrdsl.reference), the state rounded after every
step to a storage format, as a state pool's kernels store it once per call:
    fp32   the pool lrdsl keeps by default
    bf16   round to nearest (a GPU's rounding; Triton's interpreter truncates instead)
    e4m3   float8 e4m3 with one fp32 scale per state column (its largest |value| / 448)
    int8   lrdsl's 8-bit pool: int8 with one fp32 scale per column (largest |value| / 127),
           through the generated module's pack_states / unpack_states (the kernels' exact bytes,
           tests/test_pool_8bit.py)
Printed per format: the relative error (||x - x_exact|| / ||x_exact||) of the outputs so far and
of the state, after 10, 100 and --steps steps, against the same decode kept in float64 throughout.
Inputs: make_inputs' (gates down to about -0.5 a token, unit keys after the in-kernel l2 norm).
JSON to $OUT/state_drift.json (or /tmp).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def formats(mod):
    """name -> the state after one store in that format (float64 in, float64 out; [N, HV, K, V])."""

    def per_column_e4m3(x):
        scale = (x.abs().amax(dim=-2, keepdim=True) / 448.0).clamp(min=2.0**-120)
        return (x / scale).to(torch.float8_e4m3fn).double() * scale

    return {
        "fp32": lambda x: x.float().double(),
        "bf16": lambda x: x.to(torch.bfloat16).double(),
        "e4m3": per_column_e4m3,
        "int8": lambda x: mod.unpack_states(mod.pack_states(x.float())).double(),
    }


def drift(spec, steps, B, H, HV, K, V, seed):
    import lrdsl
    from lrdsl import reference
    from lrdsl.passes.pipeline import run_pipeline
    from lrdsl.spec import load_spec_by_name
    from lrdsl.verification.workloads import Shape, make_inputs, relative_error

    mod = lrdsl.load(spec)
    rec = run_pipeline(load_spec_by_name(spec), until="recurrence")["recurrence"]
    generator = torch.Generator().manual_seed(seed)
    start = torch.randn(B, HV, K, V, generator=generator, dtype=torch.float64) * 0.5
    stores = formats(mod)
    states = {name: store(start) for name, store in stores.items()}
    exact = states["fp32"].clone()  # every format starts from the same (fp32) state
    outs = {name: [] for name in stores}
    exact_outs, rows = [], {}
    for step in range(1, steps + 1):
        tensors = [t.double() for t in make_inputs(rec, Shape(B, 1, H, HV, K, V), generator=generator)]
        o, exact = reference.run(rec, *tensors, initial_state=exact, output_final_state=True, use_qk_l2norm_in_kernel=True)
        exact_outs.append(o)
        for name, store in stores.items():
            o, state = reference.run(rec, *tensors, initial_state=states[name], output_final_state=True,
                                     use_qk_l2norm_in_kernel=True)
            outs[name].append(o)
            states[name] = store(state)
        if step in (10, 100, steps):
            whole = torch.cat(exact_outs, dim=1)
            rows[step] = {name: {"o": relative_error(torch.cat(outs[name], dim=1), whole),
                                 "state": relative_error(states[name], exact)} for name in stores}
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", default="gdn,kda,rwkv7")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2, help="value heads (one key head each)")
    parser.add_argument("--dims", type=int, default=128, help="K = V")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from lrdsl import config

    config.use_interpreter_without_gpu()  # the module loads; nothing here launches a kernel
    results = {}
    for spec in args.specs.split(","):
        rows = drift(spec, args.steps, args.batch, args.heads, args.heads, args.dims, args.dims, args.seed)
        results[spec] = rows
        for step, by_format in rows.items():
            cells = ", ".join(f"{name} o {e['o']:.1e} state {e['state']:.1e}" for name, e in by_format.items())
            print(f"{spec} after {step} steps: {cells}", flush=True)
    path = os.path.join(os.environ.get("OUT", "/tmp"), "state_drift.json")
    with open(path, "w") as handle:
        json.dump(dict(args=vars(args), results=results), handle, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
