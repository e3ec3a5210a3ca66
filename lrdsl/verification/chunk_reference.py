"""Whole sequences through a chunk program in float64 (lrdsl.ir.evaluate's torch backend).

This runs the *derived* chunk form, chunk by chunk with the exit state of one chunk entering the
next, exactly as the kernels must; comparing it with the oracle tests the derivation at real
sizes without any Triton in the way. Slow (a Python loop over sequences, heads and chunks).
"""
from __future__ import annotations

import torch

from ..ir.chunk import ChunkProgram, Load
from ..ir.evaluate import evaluate_torch
from ..ir.recurrence import InputRole


def run_chunked(prog: ChunkProgram, q, k, v, *inputs, chunk_size: int, scale=None, initial_state=None,
                output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    rec = prog.recurrence
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    C = chunk_size
    scale = K**-0.5 if scale is None else scale
    named = {"q": q.double(), "k": k.double(), "v": v.double()}
    named.update({i.name: x.double() for i, x in zip(rec.inputs, inputs)})
    roles = {i.name: i.role for i in rec.inputs}
    if cu_seqlens is None:
        sequences = [(b, 0, T) for b in range(B)]
    else:
        bounds = [int(x) for x in cu_seqlens.tolist()]
        sequences = [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]
    o = torch.zeros(B, T, HV, V, dtype=torch.float64)
    finals = []
    sizes = {"C": C, "K": K, "V": V}
    state_name = prog.state_in

    def rows(x, b, start, stop):
        """Rows start..stop of a token tensor, zero-padded to C rows."""
        tile = x[b, start:stop]
        pad = torch.zeros((C - tile.shape[0],) + tuple(tile.shape[1:]), dtype=torch.float64)
        return torch.cat([tile, pad])

    for n, (b, bos, eos) in enumerate(sequences):
        heads = []
        for hv in range(HV):
            h = hv // (HV // H)
            S = initial_state[n, hv].double() if initial_state is not None else torch.zeros(K, V, dtype=torch.float64)
            for start in range(bos, eos, C):
                stop = min(start + C, eos)
                env = {state_name: S}
                for op in prog.ops:
                    if not isinstance(op, Load):
                        continue
                    if op.source in ("q", "k"):
                        env[op.out] = rows(named[op.source][:, :, h], b, start, stop)
                    elif op.source == "v":
                        env[op.out] = rows(named["v"][:, :, hv], b, start, stop)
                    elif op.source == "scale":
                        env[op.out] = torch.tensor(float(scale), dtype=torch.float64)
                    elif op.source == "h":
                        env[op.out] = torch.tensor(float(hv), dtype=torch.float64)
                    elif roles[op.source].per_token:
                        env[op.out] = rows(named[op.source][:, :, hv], b, start, stop)
                    else:
                        env[op.out] = named[op.source][hv]
                out = evaluate_torch(prog, env, sizes, valid_rows=stop - start, l2norm=use_qk_l2norm_in_kernel)
                o[b, start:stop, hv] = out[prog.output("o")][: stop - start]
                S = out[prog.output("state")]
            heads.append(S)
        finals.append(torch.stack(heads))
    return o, (torch.stack(finals) if output_final_state else None)



