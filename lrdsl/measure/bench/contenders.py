"""The inputs every implementation receives, and the implementations (contenders) that receive them."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ... import reference
from ...errors import LrdslError
from ...ir.recurrence import Recurrence
from ...verification.workloads import Shape, make_inputs
from .shapes import FORWARD_BACKWARD, LRDSL, is_decode
from .peers import DirectPeer, FLA, FLA_BACKEND_LABELS, FLA_TRITON, FlaBaseline, FlaFunction, environment, fla_dispatch_path, fla_keywords, missing_parameters, triton_switches
from .timing import _first_line


@dataclass(frozen=True)
class Call:
    """One set of inputs, as every implementation receives it."""

    tensors: tuple  # q, k, v, then the spec's inputs in order
    initial_state: torch.Tensor | None
    d_o: torch.Tensor | None  # the upstream gradient of o, for forward + backward
    scale: float
    l2norm: bool

    def prefix(self, rec: Recurrence, sequences: int, tokens: int) -> Call:
        """The same call on the first `sequences` sequences' first `tokens` tokens."""

        def cut(x, per_token=True, rows_per_token=1):
            return x[:sequences, :tokens * rows_per_token].contiguous() if per_token else x

        q, k, v, *extras = self.tensors
        steps = rec.steps_per_token  # k, v and the inputs of the steps hold one row per step
        sliced = [cut(q), cut(k, rows_per_token=steps), cut(v, rows_per_token=steps)]
        sliced += [cut(x, i.role.per_token, rec.rows_per_token(i)) for i, x in zip(rec.inputs, extras)]
        return replace(
            self,
            tensors=tuple(sliced),
            initial_state=None if self.initial_state is None else self.initial_state[:sequences].contiguous(),
            d_o=None if self.d_o is None else cut(self.d_o),
        )

    def requiring_grad(self) -> Call:
        return replace(self, tensors=tuple(t.detach().requires_grad_() for t in self.tensors))

    def nbytes(self) -> int:
        tensors = [*self.tensors, self.initial_state, self.d_o]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def make_call(rec: Recurrence, shape: Shape, dtype, device, generator, l2norm: bool) -> Call:
    """Fresh random inputs: an fp32 initial state for decode shapes (state in, state out), an
    upstream gradient of o for training shapes."""
    tensors = make_inputs(rec, shape, dtype=dtype, generator=generator, normalize_keys=not l2norm and rec.is_delta)
    h0 = d_o = None
    if is_decode(shape):
        h0 = torch.randn(shape.B, shape.HV, shape.K, shape.V, generator=generator).to(device)
    else:
        d_o = torch.randn(shape.B, shape.T, shape.HV, shape.V, generator=generator).to(device, dtype)
    return Call(tuple(t.to(device) for t in tensors), h0, d_o, shape.K**-0.5, l2norm)


@dataclass(frozen=True)
class Contender:
    """One implementation of one kernel kind: forward(call) -> (o, final state)."""

    impl: str  # LRDSL or a peer's column: FLA_TRITON, a backend FLA dispatches to, FLASHQLA_DIRECT
    kernel: str  # what runs: "chunk[split]", "recurrent", the peer's function name
    forward: Callable
    path: Callable = lambda call: LRDSL  # which code runs for this call
    problem: str | None = None  # why it cannot run at all (its rows are FAILED with this reason)
    scope: Callable = contextlib.nullcontext  # entered around all its calls (FLA's backends switched off)
    expects: str | None = None  # the path its column stands for: a row that ran another is FAILED


def lrdsl_contenders(module, decode: bool, plans, chunk_sizes=(None,)) -> list[Contender]:
    """lrdsl's recurrent kernel at decode shapes; else its chunk kernels per plan x chunk size
    (None: the module's own choice for the shape; a size pins the backward's to it too)."""
    def caller(function, options):
        def forward(call: Call):
            return function(*call.tensors, scale=call.scale, initial_state=call.initial_state,
                            output_final_state=True, use_qk_l2norm_in_kernel=call.l2norm, **options)
        return forward

    if decode:
        return [Contender(LRDSL, "recurrent", caller(module.recurrent, {}))]
    return [Contender(LRDSL, f"chunk[{plan}]" if size is None else f"chunk[{plan},C={size}]",
                      caller(module.chunk, {"plan": plan} if size is None else {"plan": plan, "chunk_size": size}))
            for plan in plans for size in chunk_sizes]


def fla_contender(rec: Recurrence, function: FlaFunction, fla_function, l2norm: bool,
                  importer=importlib.import_module, impl: str = FLA, switches: dict | None = None,
                  expects: str | None = None, problem: str | None = None) -> Contender:
    """FLA's public function, called by keyword; with `switches`, under those environment settings
    (its backends switched off). `impl` names its column (FLA: whatever its dispatcher runs)."""
    missing = missing_parameters(rec, function, fla_function, l2norm)
    if missing and problem is None:
        problem = f"fla-core's {function.name} has no parameter {', '.join(missing)} (this harness expects fla-core 0.6.0)"

    def forward(call: Call):
        return fla_function(**fla_keywords(rec, function, call))

    def path(call: Call) -> str:
        return fla_dispatch_path(fla_function, fla_keywords(rec, function, call), importer)

    scope = (lambda: environment(switches)) if switches else contextlib.nullcontext
    return Contender(impl, function.name, forward, path, problem, scope, expects)


def fla_peers(rec: Recurrence, function: FlaFunction, fla_function, l2norm: bool, call: Call, mode: str,
              importer=importlib.import_module) -> list[Contender]:
    """FLA's columns for one group: its Triton kernels (every backend its dispatcher would pick
    for this call switched off, FLA_TRITON), and, where its dispatcher picks a backend, the
    function as FLA runs it (a column named after the backend, "flashqla"). Asked with the
    mode's gradient setting: a backend may serve grad-free calls only."""
    mode_call = call.requiring_grad() if mode == FORWARD_BACKWARD else call
    keywords = fla_keywords(rec, function, mode_call)
    with torch.set_grad_enabled(mode == FORWARD_BACKWARD):
        path = fla_dispatch_path(fla_function, keywords, importer)
        try:
            switches, problem = triton_switches(fla_function, keywords, importer), None
        except LrdslError as exc:
            switches, problem = {}, str(exc)
        except AttributeError:  # the dispatch machinery moved: the path check below says so
            switches, problem = {}, None
    peers = [fla_contender(rec, function, fla_function, l2norm, importer, FLA_TRITON, switches, FLA_TRITON, problem)]
    if path not in (FLA_TRITON, "unknown"):
        peers.append(fla_contender(rec, function, fla_function, l2norm, importer, path, expects=path))
    return peers


def direct_peers(rec: Recurrence, baseline: FlaBaseline | None, shape: Shape, dtype, l2norm: bool,
                 importer=importlib.import_module, on_note=None) -> list[Contender]:
    """The libraries called directly (FlashQLA) where the spec is their recurrence in its plain
    form, the shape and dtype are theirs, and they import; training shapes only."""
    if baseline is None or is_decode(shape):
        return []
    peers = []
    for peer in baseline.direct:
        if dtype not in peer.dtypes or (shape.K, shape.V) != peer.head_dims:
            continue
        try:
            module = importer(peer.module)
        except Exception as exc:  # flash_qla raises ValueError at import on cards it does not support
            if on_note is not None and not isinstance(exc, ImportError):
                on_note(f"{peer.module} does not import ({type(exc).__name__}: {_first_line(exc)}): no {peer.label} column")
            continue
        peers.append(direct_contender(rec, peer, getattr(module, peer.function.name), l2norm))
    return peers


def direct_contender(rec: Recurrence, peer: DirectPeer, entry, l2norm: bool) -> Contender:
    missing = missing_parameters(rec, peer.function, entry, l2norm, peer.options)
    problem = None
    if missing:
        problem = f"{peer.module}.{peer.function.name} has no parameter {', '.join(missing)}"

    def forward(call: Call):
        return entry(**fla_keywords(rec, peer.function, call, peer.options))

    ran = FLA_BACKEND_LABELS.get(peer.module, peer.module)  # flash_qla: "flashqla", as FLA's column says
    return Contender(peer.label, f"{peer.module}.{peer.function.name}", forward, lambda call: ran, problem)


def run_mode(contender: Contender, call: Call, mode: str, leaf_names) -> dict:
    """One call in a mode: the named outputs the gate compares (o, final state, gradients)."""
    if mode != FORWARD_BACKWARD:
        with torch.no_grad():
            o, final_state = contender.forward(call)
        return {"o": o, "final state": final_state}
    o, final_state = contender.forward(call)
    # allow_unused: an input an implementation ignores gets no gradient, which the gate names
    grads = torch.autograd.grad(o, call.tensors, call.d_o, allow_unused=True)
    return {"o": o.detach(), "final state": final_state.detach(),
            **{f"grad {name}": g for name, g in zip(leaf_names, grads)}}


def oracle_outputs(rec: Recurrence, call: Call, leaf_names, gradients: bool) -> dict:
    """The float64 oracle's outputs for `call` (gradients of <o, d_o> too when asked)."""
    leaves = [t.detach().to(torch.float64).requires_grad_(gradients) for t in call.tensors]
    h0 = None if call.initial_state is None else call.initial_state.to(torch.float64)
    with torch.set_grad_enabled(gradients):
        o, final_state = reference.run(rec, *leaves, scale=call.scale, initial_state=h0, output_final_state=True,
                                       use_qk_l2norm_in_kernel=call.l2norm)
    outputs = {"o": o.detach(), "final state": final_state.detach()}
    if gradients:
        grads = torch.autograd.grad(o, leaves, call.d_o.to(torch.float64))
        outputs.update({f"grad {name}": g for name, g in zip(leaf_names, grads)})
    return outputs
