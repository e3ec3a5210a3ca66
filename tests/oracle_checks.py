"""One call of a generated module against the float64 oracle: outputs, final state and every
gradient. Shared by the tests of specs written on the fly (test_hygiene, test_fuzz_specs)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lrdsl import reference
from lrdsl.verification.workloads import Shape, make_inputs, relative_error


@dataclass(frozen=True)
class Call:
    """The options of one call, and what it is compared on."""

    shape: Shape
    bounds: tuple[int, ...] | None = None  # varlen: cu_seqlens (then shape.B == 1)
    h0: bool = False
    dht: bool = False  # a gradient flows into the final state
    l2norm: bool = False
    scale: float | None = None

    @property
    def N(self) -> int:
        return len(self.bounds) - 1 if self.bounds else self.shape.B


def same_layout(t: torch.Tensor) -> torch.Tensor:
    return t


def oracle_errors(rec, mod, call: Call, generator, kernel="chunk", gradients=True, tensors=None, device="cpu",
                  layout=same_layout, spreads: dict | None = None, **options) -> dict:
    """Relative errors against the oracle: "o", "ht", and with `gradients` one per input ("d_q",
    "d_<input>", "d_h0"). `tensors` (q, k, v and the inputs) default to make_inputs'; the kernel
    gets them on `device`, each (and the initial state and cu_seqlens) through `layout`, which may
    return a strided tensor of the same values. A dict passed as `spreads` receives, under the
    same names, rounding_spread's measure of how far the oracle itself moves when its inputs move
    by one rounding of the tensors' dtype."""
    shape = call.shape
    if tensors is None:
        tensors = make_inputs(rec, shape, generator=generator)
    h0 = torch.randn(call.N, shape.HV, shape.K, shape.V, generator=generator) if call.h0 else None
    cu = torch.tensor(call.bounds, dtype=torch.int32) if call.bounds else None
    kwargs = dict(scale=call.scale, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=call.l2norm)

    def leaf(t):
        return layout(t.detach().to(device)).detach().requires_grad_(gradients)

    leaves = [leaf(t) for t in tensors]
    h0_leaf = leaf(h0) if h0 is not None else None
    device_kwargs = dict(kwargs, cu_seqlens=layout(cu.to(device)) if cu is not None else None)
    with torch.set_grad_enabled(gradients):
        o, ht = getattr(mod, kernel)(*leaves, initial_state=h0_leaf, **device_kwargs, **options)
    refs = [t.detach().double().requires_grad_(gradients) for t in tensors]
    h0_ref = h0.double().requires_grad_(gradients) if h0 is not None else None
    ref_o, ref_ht = reference.run(rec, *refs, initial_state=h0_ref, **kwargs)
    errors = {"o": relative_error(o, ref_o), "ht": relative_error(ht, ref_ht)}
    assert o.dtype == tensors[2].dtype and o.is_contiguous() and ht.is_contiguous()
    if not gradients:
        if spreads is not None:
            spreads.update(rounding_spread(rec, tensors, h0, None, None, kwargs, generator))
        return errors

    # the cotangents in the outputs' dtypes: autograd hands the kernels d_o rounded to o's dtype,
    # and the oracle must differentiate the same loss (in bf16 the rounding alone is up to 3.9e-3
    # of each entry, which on a tiny case does not average out)
    d_o = torch.randn(o.shape, generator=generator).to(o.dtype)
    loss, ref_loss = (o * d_o.to(device)).sum(), (ref_o * d_o.double()).sum()
    if call.dht:  # else no gradient reaches the final state (the backward gets None for it)
        d_final = torch.randn(ht.shape, generator=generator).to(ht.dtype)
        loss, ref_loss = loss + (ht * d_final.to(device)).sum(), ref_loss + (ref_ht * d_final.double()).sum()
    loss.backward()
    ref_loss.backward()
    names = ["q", "k", "v"] + [i.name for i in rec.inputs]
    for name, leaf, ref in zip(names, leaves, refs):
        assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == leaf.dtype, name
        errors[f"d_{name}"] = relative_error(leaf.grad, ref.grad)
    if h0 is not None:
        errors["d_h0"] = relative_error(h0_leaf.grad, h0_ref.grad)
    if spreads is not None:
        spreads.update(rounding_spread(rec, tensors, h0, d_o, d_final if call.dht else None, kwargs, generator))
    return errors


def rounding_spread(rec, tensors, h0, d_o, d_final, kwargs, generator, draws: int = 3) -> dict:
    """How ill-conditioned a case is at the tensors' precision: the largest relative move of the
    oracle's outputs (and, with a cotangent d_o, its gradients) over `draws` runs on inputs, initial
    state and cotangents each multiplied by 1 + e, e uniform within one unit roundoff of the
    tensors' dtype. A backward-stable kernel's error is a small multiple of it; on large cases it
    is far below the dtype's tolerance, on tiny ones where a few terms cancel it is not (a
    one-token delta rule in bf16: errors up to 1.2e-2 where this gave 1.0e-2-1.3e-2)."""
    unit = torch.finfo(tensors[2].dtype).eps / 2
    names = ["q", "k", "v"] + [i.name for i in rec.inputs]

    def run(move):
        refs = [move(t.double()).requires_grad_(d_o is not None) for t in tensors]
        h0_ref = move(h0.double()).requires_grad_(d_o is not None) if h0 is not None else None
        with torch.set_grad_enabled(d_o is not None):
            o, ht = reference.run(rec, *refs, initial_state=h0_ref, **kwargs)
        found = {"o": o.detach(), "ht": ht.detach()}
        if d_o is None:
            return found
        loss = (o * move(d_o.double())).sum() + ((ht * move(d_final.double())).sum() if d_final is not None else 0)
        loss.backward()
        found.update({f"d_{name}": ref.grad for name, ref in zip(names, refs)})
        if h0_ref is not None:
            found["d_h0"] = h0_ref.grad
        return found

    exact = run(lambda t: t)
    spread = dict.fromkeys(exact, 0.0)
    for _ in range(draws):
        moved = run(lambda t: t * (1 + unit * (2 * torch.rand(t.shape, generator=generator, dtype=torch.float64) - 1)))
        for name in spread:
            spread[name] = max(spread[name], relative_error(moved[name], exact[name]))
    return spread


def assert_errors(errors: dict, limit: float | dict, what: str) -> None:
    """Each error within `limit` (one number, or one per name)."""
    limits = limit if isinstance(limit, dict) else dict.fromkeys(errors, limit)
    bad = {name: error for name, error in errors.items() if not error <= limits[name]}
    shown = f"{limit:.0e}" if not isinstance(limit, dict) else "their limits " + str({n: f"{limits[n]:.1e}" for n in bad})
    assert not bad, f"{what}: errors above {shown}: {bad} (all: {errors})"


def nonfinite_rows(x: torch.Tensor) -> torch.Tensor:
    """Whether any entry along the last axis is NaN or inf (per output row of one token and value
    head; a state's K x V tile is asked per key row, then summed with .any(-1))."""
    return ~torch.isfinite(x).all(dim=-1)


def causality_errors(rec, mod, call: Call, tensors, kernel="chunk", device="cpu", h0=None, spreads: dict | None = None,
                     generator=None, **options) -> dict:
    """A call whose inputs hold NaN or inf, against the oracle, without gradients: the output rows
    (token, value head) and final states (sequence, value head) that are not finite must be
    exactly the oracle's, and the finite ones must match it. Returns "o" and "ht" (relative errors
    over the finite rows and states) and "rows"/"states", the number of rows and states whose
    finiteness differs from the oracle's (so that assert_errors' limit, < 1, requires 0).
    `h0`: the initial state (call.h0 is not read). A dict passed as `spreads` receives the rounding
    spread of "o" and "ht" (rounding_spread, drawn from `generator`) on the same inputs with the
    non-finite entries replaced by 0: the finite rows do not depend on them."""
    cu = torch.tensor(call.bounds, dtype=torch.int32) if call.bounds else None
    kwargs = dict(scale=call.scale, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=call.l2norm)
    device_kwargs = dict(kwargs, cu_seqlens=cu.to(device) if cu is not None else None)
    with torch.no_grad():
        o, ht = getattr(mod, kernel)(*[t.to(device) for t in tensors], initial_state=None if h0 is None else h0.to(device),
                                     **device_kwargs, **options)
        ref_o, ref_ht = reference.run(rec, *[t.double() for t in tensors], initial_state=None if h0 is None else h0.double(),
                                      **kwargs)
    o, ht = o.cpu().double(), ht.cpu().double()
    if spreads is not None:
        finite = [torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) for t in tensors]
        spreads.update(rounding_spread(rec, finite, h0, None, None, kwargs, generator))
    bad_rows, ref_bad_rows = nonfinite_rows(o), nonfinite_rows(ref_o)
    bad_states, ref_bad_states = nonfinite_rows(ht).any(-1), nonfinite_rows(ref_ht).any(-1)
    rows, states = ~ref_bad_rows & ~bad_rows, ~ref_bad_states & ~bad_states
    return {
        "rows": float((bad_rows != ref_bad_rows).sum()),
        "states": float((bad_states != ref_bad_states).sum()),
        "o": relative_error(o[rows], ref_o[rows]),
        "ht": relative_error(ht[states], ref_ht[states]),
    }
