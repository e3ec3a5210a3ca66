"""The float64 oracle: any recurrence, token by token, exactly as docs/design.md §1 writes it
(the dplr update as S_t = D_t S_{t-1} + k_t (beta_t v_t)^T + b_t (a_t^T S_{t-1}); the delta update
as u_t = beta_t (x_t - S'^T r_t), S_t = S' + k_t u_t^T, with r_t = k_t and x_t = v_t unless the
spec gives formulas.delta_read / formulas.write_value).

It is the reference of every numeric test, so it is written to be read, not to be fast: GVA by
repeating q/k, one Python loop over tokens, one einsum per term. It is differentiable (no
in-place updates), so gradient tests take autograd through it.

    import lrdsl.reference
    o, ht = lrdsl.reference.run(rec_or_spec_path, q, k, v, *inputs, scale=None, initial_state=None,
                                output_final_state=False, cu_seqlens=None,
                                use_qk_l2norm_in_kernel=False)

`o` is float64 [B, T, HV, V]; `ht` float64 [N, HV, K, V] or None; both on q's device.

With steps_per_token = n > 1 each token decays once, takes n update steps with its own k, v and
step inputs (rows t*n .. t*n + n - 1 of k [B, T*n, H, K], v and beta's inputs) and is read once;
cu_seqlens count tokens. This loop does exactly that, with no sub-step rows: it is the oracle of the
compiler's lowering (passes/lower_steps.py), not a copy of it.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .ir.formula import HEAD_INDEX, torch_function
from .ir.recurrence import GateKind, InputRole, Recurrence

def _as_recurrence(rec) -> Recurrence:
    if isinstance(rec, Recurrence):
        return rec
    from .passes.pipeline import run_pipeline
    from .spec import load_spec

    return run_pipeline(load_spec(Path(rec)), until="recurrence")["recurrence"]


def evaluate_formula(expr, named: dict[str, torch.Tensor], roles: dict[str, InputRole], HV: int, per_key: bool, device="cpu"):
    """Evaluate a formula in float64, broadcasting every input to [B, T, HV] (or [B, T, HV, K],
    or [B, T, HV, V] for a formula of v and token_value inputs: pass per_key=True for those too,
    it adds the last axis to per-token scalars). `named` may hold k and v ([B, T, HV, *])."""
    symbols, fn = torch_function(expr)
    values = []
    for s in symbols:
        if s == HEAD_INDEX:
            x = torch.arange(HV, dtype=torch.float64, device=device).view(1, 1, HV)
        else:
            x = named[str(s)].to(torch.float64)
            role = roles[str(s)]
            if role is InputRole.HEAD:
                x = x.view(1, 1, HV)
            elif role is InputRole.HEAD_KEY:
                x = x.view(1, 1, HV, -1)
        if per_key and x.dim() == 3:
            x = x.unsqueeze(-1)
        values.append(x)
    return fn(*values)


def run(
    rec,
    q,
    k,
    v,
    *inputs,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel=False,
):
    rec = _as_recurrence(rec)
    if len(inputs) != len(rec.inputs):
        names = ", ".join(i.name for i in rec.inputs)
        raise TypeError(f"{rec.name} takes q, k, v{', ' if names else ''}{names}: got {3 + len(inputs)} tensors")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    steps = rec.steps_per_token  # update steps per token: k, v and the step inputs hold T * steps rows
    scale = K**-0.5 if scale is None else scale

    # GVA: value head h reads key head h // (HV / H). The oracle repeats; kernels index.
    q = q.to(torch.float64).repeat_interleave(HV // H, dim=2)
    k = k.to(torch.float64).repeat_interleave(HV // H, dim=2)
    v = v.to(torch.float64)
    if use_qk_l2norm_in_kernel:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)

    named = {i.name: x for i, x in zip(rec.inputs, inputs)}
    roles = {i.name: i.role for i in rec.inputs}
    named.update(k=k, v=v)  # what delta_read and write_value may read (k after the L2 norm)
    roles.update(k=InputRole.TOKEN_KEY, v=InputRole.TOKEN_VALUE)
    per_key = rec.gate is GateKind.KEY_CHANNEL
    if rec.has_gate:
        g = evaluate_formula(rec.log_decay, named, roles, HV, per_key, q.device).to(q.device)
        g = g.expand(B, T, HV, K) if per_key else g.expand(B, T, HV)
    if rec.has_beta:
        beta = evaluate_formula(rec.beta, named, roles, HV, per_key=False, device=q.device).to(q.device).expand(B, T * steps, HV)
    if rec.has_low_rank:  # a_t, b_t: [B, T * steps, HV, K]
        a = evaluate_formula(rec.low_rank_read, named, roles, HV, True, q.device).to(q.device).expand(B, T * steps, HV, K)
        b_write = evaluate_formula(rec.low_rank_write, named, roles, HV, True, q.device).to(q.device).expand(B, T * steps, HV, K)
    delta_read = k  # r_t: what the delta rule reads the state with (a row per step)
    if rec.delta_read is not None:
        delta_read = evaluate_formula(rec.delta_read, named, roles, HV, True, q.device).to(q.device).expand(B, T * steps, HV, K)
    write_value = v  # x_t: the value the delta rule writes (a row per step)
    if rec.write_value is not None:
        write_value = evaluate_formula(rec.write_value, named, roles, HV, True, q.device).to(q.device).expand(B, T * steps, HV, V)

    if cu_seqlens is None:
        sequences = [(b, 0, T) for b in range(B)]
    else:
        bounds = [int(x) for x in cu_seqlens.tolist()]
        sequences = [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]

    outputs, finals = [], []
    for n, (b, bos, eos) in enumerate(sequences):
        if initial_state is not None:
            S = initial_state[n].to(torch.float64)
        else:
            S = torch.zeros(HV, K, V, dtype=torch.float64, device=q.device)
        for s in range(bos * steps, eos * steps):  # row s is step j of token t (one step: row s is token t)
            t, j = divmod(s, steps)
            S_before = S
            if rec.gate is GateKind.KEY_CHANNEL and j == 0:  # a token decays once, before its first step
                S = torch.exp(g[b, t])[:, :, None] * S  # Diag(exp(g_t)) S
            elif rec.has_gate and j == 0:
                S = torch.exp(g[b, t])[:, None, None] * S  # exp(g_t) S
            if rec.is_delta:
                prediction = torch.einsum("hkv,hk->hv", S, delta_read[b, s])  # S'^T r_t
                u = write_value[b, s] - prediction  # x_t - S'^T r_t
            else:
                u = v[b, s]
            if rec.has_beta:
                u = beta[b, s][:, None] * u
            S = S + torch.einsum("hk,hv->hkv", k[b, s], u)  # S_t = S' + k_t u_t^T
            if rec.has_low_rank:  # + b_t (a_t^T S_{t-1}): the state before this step's decay
                read = torch.einsum("hkv,hk->hv", S_before, a[b, s])
                S = S + torch.einsum("hk,hv->hkv", b_write[b, s], read)
            if j == steps - 1:  # a token is read once, after its last step
                outputs.append(scale * torch.einsum("hkv,hk->hv", S, q[b, t]))  # o_t = scale S_t^T q_t
        finals.append(S)

    if outputs:
        o = torch.stack(outputs).view(len(outputs), HV, V)
    else:
        o = torch.zeros(0, HV, V, dtype=torch.float64, device=q.device)
    o = o.reshape(B, T, HV, V)
    ht = torch.stack(finals) if output_final_state else None
    return o, ht
