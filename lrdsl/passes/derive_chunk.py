"""derive_chunk: Recurrence IR -> chunk program (the chunkwise WY/UT form, docs/design.md §2).

Which stages exist follows from the recurrence, never from its name:
 - a gate gives the cumulative log2-decay G, the decay matrices and the gamma factors; no gate,
   none of them (the masks alone stay);
 - a constant gate is the same formula evaluated per head and broadcast over the rows;
 - the delta rule gives the triangular system T = (I + A)^-1 and W, U, the residual Vn = U - W H;
   a plain update writes Vn = beta * v directly;
 - beta scales the rows of A, W's and U's right-hand sides (or v) where the spec declares it;
 - a read vector (formulas.delta_read, rows R) takes k's place on the read side of the delta rule
   (A's rows and W), a written value (formulas.write_value, rows X) v's in U; the state is still
   written along k;
 - the dplr update (diagonal plus low rank) solves a system too, of its two low-rank vectors
   (`_low_rank_chunk`).

Per chunk (rows r = 1..C, entry state H), with G the cumulative decay in log2 units and R, X the
read vectors and written values (K and V unless the spec gives formulas for them):
    A  = StrictLower(diag(beta) (R K^T * exp2(G_i - G_j)))       T = (I + A)^-1
    W  = T (R * beta * gamma)     U = T (X * beta)     Vn = U - W H
    O  = scale (gamma * (Q H) + (Q K^T * exp2(G_i - G_j) * LowerIncl) Vn)
    H' = exp2(G_C) H + (K * exp2(G_C - G))^T Vn

A key-channel gate makes G a C x K tile (one cumulative decay per key channel) and every decay
per channel: K K^T * exp2(G_i - G_j) becomes the DecayedGram sum_c k_ic k_jc exp2(G_ic - G_jc)
(never factored over the whole chunk: that overflows at strong decay), gamma multiplies K and Q
entry by entry, and the exit state decays row by row: H' = Diag(exp2(G_C)) H + (K * exp2(G_C - G))^T Vn.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from ..ir.chunk import (
    Broadcast,
    ClampBelow,
    ChunkOp,
    ChunkProgram,
    Cumsum,
    DecayMatrix,
    DecayedGram,
    FiniteRows,
    Formula,
    LastRow,
    Load,
    Mask,
    MaskRows,
    MatMul,
    NoChunkForm,
    Normalize,
    Shape,
    StateIn,
    UnitLowerInverse,
)
from ..ir.formula import HEAD_INDEX
from ..ir.recurrence import GateKind, InputRole, Recurrence

LOG2E = 1 / sympy.log(2)
# Every token's log-decay is floored here before the chunk's cumulative sums (docs/design.md §2,
# "Hard resets"). exp(-30) = 9.4e-14: a token at the floor keeps less than fp32's resolution
# (6e-8) of the state before it, as a stronger decay would; and C tokens at the floor give the
# prefix sums the magnitudes a gate of -30 per token always gave (the gate extremes every spec is
# tested at). A log-decay of -1e9 or -inf would leave every later G_i - G_j of the chunk without a
# digit (-inf - -inf is NaN).
LOG_DECAY_FLOOR = -30.0

INPUT_SHAPES: dict[InputRole, Shape] = {
    InputRole.TOKEN: ("C",),
    InputRole.TOKEN_KEY: ("C", "K"),
    InputRole.HEAD: (),
    InputRole.HEAD_KEY: ("K",),
    InputRole.TOKEN_VALUE: ("C", "V"),
}


class Builder:
    """Appends ops with fresh value names; input names are taken first, so they keep theirs."""

    def __init__(self):
        self.ops: list[ChunkOp] = []
        self.shapes: dict[str, Shape] = {}

    def fresh(self, name: str) -> str:
        candidate = name
        while candidate in self.shapes:
            candidate += "_"
        return candidate

    def add(self, op: ChunkOp) -> sympy.Symbol:
        self.ops.append(op)
        self.shapes[op.out] = op.shape
        return sympy.Symbol(op.out)

    def load(self, source: str, shape: Shape, name: str | None = None) -> sympy.Symbol:
        return self.add(Load(self.fresh(name or source), shape, source))

    def formula(self, name: str, expr: sympy.Expr, shape: Shape) -> sympy.Symbol:
        return self.add(Formula(self.fresh(name), shape, sympy.sympify(expr)))

    def rows(self, name: str, vector: sympy.Symbol, shape: Shape) -> sympy.Symbol:
        """A per-row (C) vector spread over the columns of a C x _ tile."""
        return self.add(Broadcast(self.fresh(name), shape, str(vector)))

    def matmul(self, name, a, b, shape, transpose_a=False, transpose_b=False) -> sympy.Symbol:
        return self.add(MatMul(self.fresh(name), shape, str(a), str(b), transpose_a, transpose_b))

    def formula_of_inputs(self, name: str, expr: sympy.Expr, shape: Shape) -> sympy.Symbol:
        """`expr` over values of mixed shapes (a key-channel gate may read per-token, per-head
        and per-key-channel inputs): every non-scalar value of another shape is broadcast first."""
        spread = {}
        for symbol in sorted(expr.free_symbols, key=str):
            source = self.shapes[str(symbol)]
            if source not in ((), shape):
                spread[symbol] = self.add(Broadcast(self.fresh(f"{symbol}_tile"), shape, str(symbol)))
        return self.formula(name, expr.subs(spread, simultaneous=True), shape)

    def scale_rows(self, name: str, x: sympy.Symbol, factor, shape: Shape) -> sympy.Symbol:
        """x * factor_r row by row; `factor` None means 1 (nothing emitted)."""
        if factor is None:
            return x
        spread = self.rows(f"{name}_rows", factor, shape)
        return self.formula(name, x * spread, shape)


@dataclass(frozen=True)
class Tiles:
    """The values every update reads: inputs, the gate's cumulative decays, beta, the entry state."""

    q: sympy.Symbol
    k: sympy.Symbol
    v: sympy.Symbol
    scale: sympy.Symbol
    g: sympy.Symbol  # the log-decay per row (and key channel), 0 past the sequence end
    G: sympy.Symbol  # its inclusive cumulative sum, log2 units
    G_last: sympy.Symbol
    gamma: sympy.Symbol  # exp2(G)
    beta: sympy.Symbol | None
    H: sympy.Symbol


def _low_rank_chunk(b: Builder, rec: Recurrence, t: Tiles) -> ChunkProgram:
    """The dplr update S_t = Diag(exp(g_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t (beta_t v_t)^T in
    chunk form: a WY form with two sets of vectors. With G the inclusive and G- = G - g the
    exclusive cumulative decay, u_t = a_t^T S_{t-1} (the row the low-rank term writes along b_t):
        A_ab = StrictLower(sum_c a_ic b_jc exp2(G-_ic - G_jc))    A_ak: the same with k for b
        T = (I - A_ab)^-1      W = T (a * exp2(G-))      U = W H + T (A_ak (beta V))
        O  = scale ((q * exp2(G)) H + QK (beta V) + QB U)   QK, QB: inclusive decayed products
        H' = Diag(exp2(G_C)) H + (k * exp2(G_C - G))^T (beta V) + (b * exp2(G_C - G))^T U
    Every decayed product is a DecayedGram: exp2(G-_i - G_j) <= 1 for i > j, split at a row
    between the two, so nothing overflows at strong decay."""
    CK = ("C", "K")
    read = b.add(MaskRows(b.fresh("a_masked"), CK, str(b.formula_of_inputs("a_t", rec.low_rank_read, CK))))
    read = b.add(FiniteRows(b.fresh("a_finite"), CK, str(read)))
    write = b.add(MaskRows(b.fresh("b_masked"), CK, str(b.formula_of_inputs("b_t", rec.low_rank_write, CK))))
    write = b.add(FiniteRows(b.fresh("b_finite"), CK, str(write)))
    # the exclusive cumulative decay, summed directly (exactly 0 on the first row)
    G_excl = b.formula("G_excl", b.add(Cumsum(b.fresh("g_cumsum_excl"), CK, str(t.g), exclusive=True)) * LOG2E, CK)
    A_ab = b.add(DecayedGram(b.fresh("ABt_decayed"), ("C", "C"), str(read), str(write), str(G_excl), False, str(t.G)))
    T = b.add(UnitLowerInverse(b.fresh("T"), ("C", "C"), str(b.formula("minus_ABt", -A_ab, ("C", "C")))))
    read_from_entry = b.formula("a_decayed", read * 2**G_excl, CK)
    W = b.matmul("W", T, read_from_entry, CK)
    v_write = b.scale_rows("v_beta", t.v, t.beta, ("C", "V"))
    A_ak = b.add(DecayedGram(b.fresh("AKt_decayed"), ("C", "C"), str(read), str(t.k), str(G_excl), False, str(t.G)))
    U_base = b.matmul("U_base", T, b.matmul("AKtV", A_ak, v_write, ("C", "V")), ("C", "V"))
    U = b.formula("U", U_base + b.matmul("WH", W, t.H, ("C", "V")), ("C", "V"))

    # exit state: both writes decayed to the chunk's end, exclusive suffix sums of g
    to_end = b.add(Cumsum(b.fresh("g_to_end"), CK, str(t.g), reverse=True, exclusive=True))
    decay_to_end = b.formula("decay_to_end", 2 ** (to_end * LOG2E), CK)
    k_to_end = b.formula("k_decayed", t.k * decay_to_end, CK)
    write_to_end = b.formula("b_decayed", write * decay_to_end, CK)
    written = b.matmul("KtV", k_to_end, v_write, ("K", "V"), transpose_a=True)
    low_rank_written = b.matmul("BtU", write_to_end, U, ("K", "V"), transpose_a=True)
    decay_last = b.add(Broadcast(b.fresh("decay_last_rows"), ("K", "V"), str(b.formula("decay_last", 2**t.G_last, ("K",)))))
    H_next = b.formula("H_next", decay_last * t.H + written + low_rank_written, ("K", "V"))

    # output: both writes up to and including each row
    QK = b.add(DecayedGram(b.fresh("QKt_decayed"), ("C", "C"), str(t.q), str(t.k), str(t.G), inclusive=True))
    QB = b.add(DecayedGram(b.fresh("QBt_decayed"), ("C", "C"), str(t.q), str(write), str(t.G), inclusive=True))
    inter = b.matmul("QH", b.formula("q_decayed", t.q * t.gamma, CK), t.H, ("C", "V"))
    intra = b.matmul("QKtV", QK, v_write, ("C", "V")) + b.matmul("QBtU", QB, U, ("C", "V"))
    O = b.formula("O", t.scale * (inter + intra), ("C", "V"))
    return ChunkProgram(rec, tuple(b.ops), (("o", str(O)), ("state", str(H_next))))


def _delta_vector(b: Builder, name: str, expr: sympy.Expr, shape: Shape) -> sympy.Symbol:
    """The delta rule's read vector (C x K) or written value (C x V) from its formula: rows past
    the sequence end 0, and its non-finite entries guarded like the other per-token formulas'."""
    x = b.add(MaskRows(b.fresh(f"{name}_masked"), shape, str(b.formula_of_inputs(name, expr, shape))))
    return b.add(FiniteRows(b.fresh(f"{name}_finite"), shape, str(x)))


def derive_chunk(rec: Recurrence) -> ChunkProgram | NoChunkForm:
    b = Builder()
    per_channel = rec.gate is GateKind.KEY_CHANNEL
    gate_shape: Shape = ("C", "K") if per_channel else ("C",)
    # -- inputs of the chunk: declared inputs first, so their names are kept as written
    for inp in rec.inputs:
        b.load(inp.name, INPUT_SHAPES[inp.role])
    uses_h = any(e is not None and HEAD_INDEX in e.free_symbols for e in (rec.log_decay, rec.beta))
    if uses_h:
        b.load(str(HEAD_INDEX), ())
    q = b.add(Normalize(b.fresh("q"), ("C", "K"), str(b.load("q", ("C", "K"), "q_in"))))
    k = b.add(Normalize(b.fresh("k"), ("C", "K"), str(b.load("k", ("C", "K"), "k_in"))))
    v = b.load("v", ("C", "V"))
    scale = b.load("scale", ())

    # -- gate: G = cumsum(g) / ln 2, gamma = exp2(G), G_C = G at the last row
    gamma = G = G_last = None
    if rec.has_gate:
        per_row = rec.is_per_token(rec.log_decay)
        g = b.formula_of_inputs("g_t", rec.log_decay, gate_shape if per_row else ())
        if not per_row:  # a constant gate: the same decay on every row
            g = b.add(Broadcast(b.fresh("g_rows"), ("C",), str(g)))
        g = b.add(MaskRows(b.fresh("g_masked"), gate_shape, str(g)))  # rows past the end decay nothing
        if per_row:  # a non-finite gate poisons the rows from its token on (a per-head one: all)
            g = b.add(FiniteRows(b.fresh("g_finite"), gate_shape, str(g), log_decay=True))
        g = b.add(ClampBelow(b.fresh("g_floored"), gate_shape, str(g), LOG_DECAY_FLOOR))  # hard resets
        G = b.formula("G", b.add(Cumsum(b.fresh("g_cumsum"), gate_shape, str(g))) * LOG2E, gate_shape)
        G_last = b.add(LastRow(b.fresh("G_last"), gate_shape[1:], str(G)))
        gamma = b.formula("gamma", 2**G, gate_shape)

    beta = None
    if rec.has_beta:
        per_row = rec.is_per_token(rec.beta)
        beta = b.formula("beta_t", rec.beta, ("C",) if per_row else ())
        if per_row:
            beta = b.add(FiniteRows(b.fresh("beta_finite"), ("C",), str(beta)))
        else:
            beta = b.add(Broadcast(b.fresh("beta_rows"), ("C",), str(beta)))

    # -- the intra-chunk system and the residual Vn (what the state update writes)
    H = b.add(StateIn(b.fresh("H"), ("K", "V")))
    if rec.has_low_rank:
        return _low_rank_chunk(b, rec, Tiles(q, k, v, scale, g, G, G_last, gamma, beta, H))
    if rec.is_delta:
        # the read vector R (rows r_t) reads the state, the written value X (rows x_t) is what the
        # residual starts from; k and v unless the spec gives formulas for them. R replaces k on
        # the read side only: the state is still written along k (A's columns, the exit state, O).
        R = k if rec.delta_read is None else _delta_vector(b, "r_t", rec.delta_read, ("C", "K"))
        X = v if rec.write_value is None else _delta_vector(b, "x_t", rec.write_value, ("C", "V"))
        R_name = "K" if rec.delta_read is None else "R"
        if per_channel:
            KK = b.add(DecayedGram(b.fresh(f"{R_name}Kt_decayed"), ("C", "C"), str(R), str(k), str(G), inclusive=False))
        elif G is not None:
            KK = b.matmul(f"{R_name}Kt", R, k, ("C", "C"), transpose_b=True)
            decay = b.add(DecayMatrix(b.fresh("D"), ("C", "C"), str(G), inclusive=False))
            KK = b.formula(f"{R_name}Kt_decayed", KK * decay, ("C", "C"))
        else:
            KK = b.matmul(f"{R_name}Kt", R, k, ("C", "C"), transpose_b=True)
            KK = b.add(Mask(b.fresh(f"{R_name}Kt_strict"), ("C", "C"), str(KK), inclusive=False))
        A = b.scale_rows("A", KK, beta, ("C", "C"))
        T = b.add(UnitLowerInverse(b.fresh("T"), ("C", "C"), str(A)))
        r_name = str(R) if rec.delta_read is None else "r"
        if per_channel:  # the decay from the chunk start, channel by channel, then beta by rows
            r_weighted = b.scale_rows(f"{r_name}_weighted", b.formula(f"{r_name}_gamma", R * gamma, ("C", "K")), beta, ("C", "K"))
        else:
            if beta is not None and gamma is not None:
                weight = b.formula("beta_gamma", beta * gamma, ("C",))
            else:
                weight = beta if beta is not None else gamma
            r_weighted = b.scale_rows(f"{r_name}_weighted", R, weight, ("C", "K"))
        W = b.matmul("W", T, r_weighted, ("C", "K"))
        x_name = "v" if rec.write_value is None else "x"
        U = b.matmul("U", T, b.scale_rows(f"{x_name}_beta", X, beta, ("C", "V")), ("C", "V"))
        Vn = b.formula("Vn", U - b.matmul("WH", W, H, ("C", "V")), ("C", "V"))
    else:
        Vn = b.scale_rows("Vn", v, beta, ("C", "V"))

    # -- exit state: H' = exp2(G_C) H + (K * exp2(G_C - G))^T Vn, where G_C - G is the exclusive
    #    suffix sum of g, an op of its own (exactly 0 on the last row; its adjoint is an exclusive
    #    sum too, not a difference of large terms)
    if G is not None:
        to_end = b.add(Cumsum(b.fresh("g_to_end"), gate_shape, str(g), reverse=True, exclusive=True))
        decay_to_end = b.formula("decay_to_end", 2 ** (to_end * LOG2E), gate_shape)
        if per_channel:
            k_to_end = b.formula("k_decayed", k * decay_to_end, ("C", "K"))
        else:
            k_to_end = b.scale_rows("k_decayed", k, decay_to_end, ("C", "K"))
        written = b.matmul("KtVn", k_to_end, Vn, ("K", "V"), transpose_a=True)
        if per_channel:  # Diag(exp2(G_C)) H: state row c decays by its channel's total
            decay_last = b.formula("decay_last", 2**G_last, ("K",))
            decay_last = b.add(Broadcast(b.fresh("decay_last_rows"), ("K", "V"), str(decay_last)))
            H_next = b.formula("H_next", decay_last * H + written, ("K", "V"))
        else:
            H_next = b.formula("H_next", 2**G_last * H + written, ("K", "V"))
    else:
        written = b.matmul("KtVn", k, Vn, ("K", "V"), transpose_a=True)
        H_next = b.formula("H_next", H + written, ("K", "V"))

    # -- output: O = scale (gamma * (Q H) + (Q K^T * exp2(G_i - G_j) * LowerIncl) Vn)
    if per_channel:
        QK = b.add(DecayedGram(b.fresh("QKt_decayed"), ("C", "C"), str(q), str(k), str(G), inclusive=True))
        q_from_entry = b.formula("q_decayed", q * gamma, ("C", "K"))
    else:
        QK = b.matmul("QKt", q, k, ("C", "C"), transpose_b=True)
        if G is not None:
            QK = b.formula("QKt_decayed", QK * b.add(DecayMatrix(b.fresh("D_incl"), ("C", "C"), str(G), inclusive=True)), ("C", "C"))
        else:
            QK = b.add(Mask(b.fresh("QKt_causal"), ("C", "C"), str(QK), inclusive=True))
        q_from_entry = b.scale_rows("q_decayed", q, gamma, ("C", "K"))
    inter = b.matmul("QH", q_from_entry, H, ("C", "V"))
    intra = b.matmul("QKtVn", QK, Vn, ("C", "V"))
    O = b.formula("O", scale * (inter + intra), ("C", "V"))

    # Vn's row t is the value the recurrence writes at token t (beta_t (v_t - S_{t-1}^T k_t) for the
    # delta rule, with S_{t-1} the state just before the token; beta_t v_t for a plain write): the
    # same whatever chunk size the scan ran at
    return ChunkProgram(rec, tuple(b.ops), (("o", str(O)), ("state", str(H_next))), chunk_size_free=(str(Vn),))
