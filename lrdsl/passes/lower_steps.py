"""lower_steps: a recurrence with steps_per_token = n > 1 -> an ordinary one over T*n sub-steps.

Token t of Gated DeltaProduct decays once, takes n update steps and is read once. That is n
consecutive rows ("sub-steps") t*n + j of an ordinary recurrence in which

- the decay applies at sub-step 0 only: its log-decay is selected by a per-row input STEP_GATE,
  1 at sub-step 0 and 0 at the others, where it is 0 (exp(0) = 1: no decay) whatever the formula
  gives there (`selected`, not a product: a hard reset's -inf times 0 would be NaN), and the
  gate's own per-token inputs are repeated over the n rows;
- q is read at the last sub-step only, the output row of token t is that sub-step's;
- k, v and the inputs of beta and the low-rank vectors are one row per sub-step already.

Everything after this pass (the step program, the chunk form, the backward, the kernels) sees an
ordinary recurrence, so every kernel, plan, save policy and `lrdsl check --prove` applies unchanged.
The expansion of q and of the gate's inputs, the row selection of o and the scaling of cu_seqlens
are the generated module's host code (templates/steps_api.py.jinja), made of differentiable torch
operations: the gradients of q and of the gate's inputs flow back through them by autograd. Only a
scalar or key-channel gate can be confined to sub-step 0 (canonicalize refuses a constant one).
"""
from __future__ import annotations

from dataclasses import replace

import sympy

from ..ir.formula import selected
from ..ir.recurrence import Input, InputRole, Recurrence

# The per-row factor of the log-decay: 1 at a token's first sub-step, 0 at the others. A name
# starting with "_" is one no spec input can take (codegen/names.py).
STEP_GATE = "_step_gate"


def lower_steps(rec: Recurrence) -> Recurrence:
    if rec.steps_per_token == 1:
        return rec
    if not rec.has_gate:  # nothing to confine to sub-step 0: the rows are an ordinary recurrence
        return replace(rec, steps_per_token=1)
    gate = Input(STEP_GATE, InputRole.TOKEN)
    return replace(
        rec,
        inputs=rec.inputs + (gate,),
        log_decay=selected(sympy.Symbol(STEP_GATE), rec.log_decay),
        steps_per_token=1,
    )
