"""The oracle against independent plain loops, one written out by hand per spec.

These loops index key heads (no repeat), run head by head with matrix-vector products, and
spell each spec's recurrence directly (not from the IR), so they share no code with the oracle.
"""
from __future__ import annotations

import math

import pytest
import torch

from lrdsl import reference
from lrdsl.verification.workloads import Shape

from helpers import recurrence, sample


def plain_loop(name, q, k, v, *extra, scale, h0=None, bounds=None, l2norm=False):
    q, k, v = q.double(), k.double(), v.double()
    extra = [x.double() for x in extra]
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if l2norm:
        q = q / torch.sqrt((q**2).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k**2).sum(-1, keepdim=True) + 1e-6)
    seqs = [(b, 0, T) for b in range(B)] if bounds is None else [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    o = torch.zeros(B, T, HV, V, dtype=torch.float64)
    finals = torch.zeros(len(seqs), HV, K, V, dtype=torch.float64)
    for n, (b, bos, eos) in enumerate(seqs):
        for hv in range(HV):
            h = hv // (HV // H)
            S = h0[n, hv].double().clone() if h0 is not None else torch.zeros(K, V, dtype=torch.float64)
            for t in range(bos, eos):
                qt, kt, vt = q[b, t, h], k[b, t, h], v[b, t, hv]
                if name == "gdn":
                    g, beta = extra[0][b, t, hv], extra[1][b, t, hv]
                    S = math.exp(g) * S
                    S = S + torch.outer(kt, beta * (vt - S.T @ kt))
                elif name == "gdn_qwen35":
                    a, braw, A_log, dt_bias = extra[0][b, t, hv], extra[1][b, t, hv], extra[2][hv], extra[3][hv]
                    g = -math.exp(A_log) * math.log1p(math.exp(a + dt_bias))
                    beta = 1 / (1 + math.exp(-braw))
                    S = math.exp(g) * S
                    S = S + torch.outer(kt, beta * (vt - S.T @ kt))
                elif name == "deltanet":
                    beta = extra[0][b, t, hv]
                    S = S + beta * torch.outer(kt, vt - S.T @ kt)
                elif name == "simple_gla":
                    S = math.exp(extra[0][b, t, hv]) * S + torch.outer(kt, vt)
                elif name == "linear_attn":
                    S = S + torch.outer(kt, vt)
                elif name == "retnet":
                    S = (1 - 2 ** (-5 - hv)) * S + torch.outer(kt, vt)  # exp(log(1 - 2^(-5-h)))
                elif name == "kda":
                    g, beta = extra[0][b, t, hv], extra[1][b, t, hv]
                    S = torch.diag(torch.exp(g)) @ S
                    S = S + beta * torch.outer(kt, vt - S.T @ kt)
                elif name == "gla":
                    S = torch.exp(extra[0][b, t, hv])[:, None] * S + torch.outer(kt, vt)
                elif name == "rwkv7":  # FLA's definition: S_t = (Diag(exp(w_t)) + b_t a_t^T) S_{t-1} + k_t v_t^T
                    w, a, bb = extra[0][b, t, hv], extra[1][b, t, hv], extra[2][b, t, hv]
                    S = (torch.diag(torch.exp(w)) + torch.outer(bb, a)) @ S + torch.outer(kt, vt)
                else:
                    raise AssertionError(name)
                o[b, t, hv] = scale * (S.T @ qt)
            finals[n, hv] = S
    return o, finals


@pytest.mark.parametrize("name", ["gdn", "deltanet", "simple_gla", "linear_attn", "gdn_qwen35", "retnet", "kda", "gla",
                                  "rwkv7"])
@pytest.mark.parametrize("varlen", [False, True])
def test_oracle_matches_plain_loop(name, varlen, generator):
    rec = recurrence(name)
    shape = Shape(1, 9, 2, 6, 5, 3) if varlen else Shape(2, 5, 1, 3, 4, 6)
    tensors = sample(rec, shape, torch.float32, generator)
    bounds = [0, 0, 1, 5, 9] if varlen else None
    N = len(bounds) - 1 if varlen else shape.B
    h0 = torch.randn(N, shape.HV, shape.K, shape.V, generator=generator)
    scale = 0.7
    kwargs = dict(scale=scale, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  cu_seqlens=torch.tensor(bounds) if varlen else None)
    o, ht = reference.run(rec, *tensors, **kwargs)
    o_loop, ht_loop = plain_loop(name, *tensors, scale=scale, h0=h0, bounds=bounds, l2norm=True)
    torch.testing.assert_close(o, o_loop, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, ht_loop, rtol=1e-10, atol=1e-10)


def test_oracle_default_scale_and_no_state(generator):
    rec = recurrence("linear_attn")
    q, k, v = sample(rec, Shape(1, 4, 1, 1, 16, 2), torch.float32, generator)
    o, ht = reference.run(rec, q, k, v)
    assert ht is None
    # linear attention: o_t = K^-1/2 * sum_{s<=t} (q_t . k_s) v_s
    expected = torch.einsum("tk,sk,sv->tsv", q[0, :, 0].double(), k[0, :, 0].double(), v[0, :, 0].double())
    expected = torch.tril(torch.ones(4, 4, dtype=torch.float64))[:, :, None] * expected
    torch.testing.assert_close(o[0, :, 0], expected.sum(1) / 4.0)


def test_oracle_is_differentiable(generator):
    rec = recurrence("gdn_qwen35")
    tensors = [t.double().requires_grad_() for t in sample(rec, Shape(1, 3, 1, 2, 4, 4), torch.float32, generator)]
    o, _ = reference.run(rec, *tensors)
    o.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in tensors)


# The gated delta rule as a dplr update (docs/design.md §1): b_t = k_t, a_t = -beta_t exp(g_t) k_t
# and the write beta_t k_t v_t^T. The key enters as an input of its own (formulas cannot read k).
KDA_AS_DPLR = """\
name = "kda_as_dplr"
[recurrence]
update = "dplr"
gate = "key_channel"
[inputs]
g = "token_key"
beta = "token"
kk = "token_key"
[formulas]
log_decay = "g"
beta = "beta"
low_rank_read = "-beta * exp(g) * kk"
low_rank_write = "kk"
"""


@pytest.mark.parametrize("name", ["kda", "gdn"])
def test_the_delta_rule_is_a_dplr_update(name, tmp_path, generator):
    """kda, and gdn (its one decay per token spread over the key channels), as the dplr update
    b_t = k_t, a_t = -beta_t exp(g_t) k_t: the oracle gives the delta rule's numbers."""
    from lrdsl.passes.pipeline import run_pipeline
    from lrdsl.spec import load_spec

    path = tmp_path / "kda_as_dplr.toml"
    path.write_text(KDA_AS_DPLR)
    dplr = run_pipeline(load_spec(path), until="recurrence")["recurrence"]
    delta = recurrence(name)
    K = 5
    q, k, v, g, beta = sample(delta, Shape(1, 11, 1, 2, K, 3), torch.float32, generator)
    per_channel = g if g.dim() == 4 else g[..., None].expand(-1, -1, -1, K)
    keys = k.repeat_interleave(2, dim=2)  # per value head, as a token_key input
    h0 = torch.randn(1, 2, K, 3, generator=generator)
    kwargs = dict(initial_state=h0, output_final_state=True)
    o, ht = reference.run(dplr, q, k, v, per_channel, beta, keys, **kwargs)
    o_delta, ht_delta = reference.run(delta, q, k, v, g, beta, **kwargs)
    torch.testing.assert_close(o, o_delta, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, ht_delta, rtol=1e-10, atol=1e-10)
