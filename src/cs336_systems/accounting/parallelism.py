"""The parallelism analysis of the 2026 handout §8, derived symbolically (sympy) from the spec's setting.

Setting: one SwiGLU FFN (x: (B, D); W1, W2: (D, D_FF); W3: (D_FF, D)), fp16 (2 bytes) weights and activations,
each device computing at C FLOP/s with W bytes/s of egress. Collectives are the ring algorithms of §8.1, so a
ring all-gather or reduce-scatter of S bytes over n devices takes (n-1)/n S/W and a ring all-reduce twice that.
FLOPs and times are per device (every device does the same work at the same time). The largest device count is
where communication time stops fitting under compute time (they overlap), solved for the device count.

Each question is one function returning `Answer`s: the expression and a one-sentence justification built from it.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import sympy as sp

B, D, D_FF = sp.symbols("B D D_FF", positive=True)
C, W = sp.symbols("C W", positive=True)  # FLOP/s and egress bytes/s per device
S = sp.symbols("S", positive=True)  # bytes of one collective's full tensor
N, N_DP, N_FSDP, N_TP = sp.symbols("N N_DP N_FSDP N_TP", positive=True)
FP16_BYTES = 2


@dataclass(frozen=True)
class Answer:
    question: str  # "8.2(a)"
    quantity: str  # what the expression is, e.g. "backward FLOPs per device"
    expr: sp.Basic | None  # an expression, a relation (N <= bound) for the device counts; None for equations
    justification: str
    equations: tuple[str, ...] = ()  # LaTeX, where the answer is a series of equations (8.4(a))

    @property
    def latex(self) -> str:
        if self.equations:
            return r"\begin{aligned}" + r" \\ ".join(self.equations) + r"\end{aligned}"
        return sp.latex(self.expr)

    @property
    def is_bound(self) -> bool:
        return isinstance(self.expr, sp.core.relational.Relational)


def matmul_flops(rows: sp.Expr, inner: sp.Expr, cols: sp.Expr) -> sp.Expr:
    """(rows, inner) @ (inner, cols): one multiply and one add per term."""
    return 2 * rows * inner * cols


def ring_all_gather_time(size_bytes: sp.Expr, n: sp.Expr) -> sp.Expr:
    return (n - 1) / n * size_bytes / W


def ring_reduce_scatter_time(size_bytes: sp.Expr, n: sp.Expr) -> sp.Expr:
    return (n - 1) / n * size_bytes / W


def ring_all_reduce_time(size_bytes: sp.Expr, n: sp.Expr) -> sp.Expr:
    return ring_reduce_scatter_time(size_bytes, n) + ring_all_gather_time(size_bytes, n)


def alternate_all_reduce_time(size_bytes: sp.Expr, n: sp.Expr) -> sp.Expr:
    """§8.1's alternative: every step each device forwards one whole input x^(k), for n-1 steps."""
    return (n - 1) * size_bytes / W


def _s(expr: sp.Basic) -> sp.Basic:
    return sp.factor(sp.simplify(expr))


def max_devices(compute_time: sp.Expr, comm_time: sp.Expr, n: sp.Symbol) -> sp.Expr:
    """The largest n with comm_time <= compute_time: the positive root of comm = compute (comm grows in n,
    compute per device shrinks as 1/n, so below the root communication hides under compute)."""
    roots = sp.solve(sp.Eq(comm_time, compute_time), n)
    (root,) = [r for r in roots if r.is_positive]
    return sp.expand(sp.simplify(root))  # 1 + B W / C reads better than (B W + C) / C


# One FFN's matmuls for a batch of `rows` and an FFN width `width` (TP shards the width).
def _forward_flops(rows: sp.Expr, width: sp.Expr) -> sp.Expr:
    return 2 * matmul_flops(rows, D, width) + matmul_flops(rows, width, D)  # x W1, x W2, z W3


def _backward_flops(rows: sp.Expr, width: sp.Expr) -> sp.Expr:
    # dz = dy W3^T; dx = dx1 W1^T + dx2 W2^T; dW3 = z^T dy, dW2 = x^T dx2, dW1 = x^T dx1: twice the forward.
    activation_grads = matmul_flops(rows, D, width) + 2 * matmul_flops(rows, width, D)
    weight_grads = matmul_flops(width, rows, D) + 2 * matmul_flops(D, rows, width)
    return activation_grads + weight_grads


WEIGHT_BYTES = 3 * D * D_FF * FP16_BYTES  # W1, W2, W3 in fp16


def alternate_ring_all_reduce() -> list[Answer]:
    t = _s(alternate_all_reduce_time(S, N))
    return [
        Answer(
            "8.1",
            "alternate all-reduce time",
            t,
            f"In each of the N - 1 steps every device sends one whole input of S bytes (not a 1/N chunk) over "
            f"its W bytes/s egress, so it takes ${sp.latex(t)}$, N times the ring all-reduce's "
            f"${sp.latex(_s(ring_all_reduce_time(S, N)))}$ for large N.",
        )
    ]


def data_parallel() -> list[Answer]:
    flops = _s(_backward_flops(B / N_DP, D_FF))
    comm = _s(ring_all_reduce_time(WEIGHT_BYTES, N_DP))
    bound = max_devices(flops / C, comm, N_DP)
    return [
        Answer(
            "8.2(a)",
            "backward FLOPs per device",
            flops,
            f"The backward does six (B/N_DP, D) x (D, D_FF)-sized matmuls (dz, dx from two, dW1, dW2, dW3), "
            f"each 2 B D D_FF / N_DP FLOPs on a device's batch shard: ${sp.latex(flops)}$.",
        ),
        Answer(
            "8.2(b)",
            "backward communication time",
            comm,
            f"The gradients dW1, dW2, dW3 (${sp.latex(WEIGHT_BYTES)}$ bytes in fp16) are ring-all-reduced, "
            f"2 (N_DP - 1)/N_DP of their size leaving each device: ${sp.latex(comm)}$, independent of B.",
        ),
        Answer(
            "8.2(c)",
            "largest N_DP before communication-bound",
            sp.Le(N_DP, bound),
            f"Compute ${sp.latex(flops / C)}$ shrinks as 1/N_DP while the all-reduce tends to a constant, and "
            f"equating them (the D D_FF factors cancel) gives $N_{{DP}} \\le {sp.latex(bound)}$: the batch, "
            f"not the model, bounds data parallelism.",
        ),
    ]


def fsdp() -> list[Answer]:
    backward = _s(_backward_flops(B / N_FSDP, D_FF))
    forward = _s(_forward_flops(B / N_FSDP, D_FF))
    gather = ring_all_gather_time(WEIGHT_BYTES, N_FSDP)
    comm_backward = _s(gather + ring_reduce_scatter_time(WEIGHT_BYTES, N_FSDP))
    comm_forward = _s(gather)
    bound_backward = max_devices(backward / C, comm_backward, N_FSDP)
    bound_forward = max_devices(forward / C, comm_forward, N_FSDP)
    return [
        Answer(
            "8.3(a)",
            "backward FLOPs per device",
            backward,
            f"The same six batch-sharded matmuls as DP, since FSDP gathers full weights first: ${sp.latex(backward)}$.",
        ),
        Answer(
            "8.3(a)",
            "forward FLOPs per device",
            forward,
            f"The forward's three matmuls x W1, x W2, z W3 on a (B/N_FSDP)-row shard: ${sp.latex(forward)}$.",
        ),
        Answer(
            "8.3(b)",
            "backward communication time",
            comm_backward,
            f"An all-gather of the three weights plus a reduce-scatter of their gradients, each moving "
            f"(N_FSDP - 1)/N_FSDP of ${sp.latex(WEIGHT_BYTES)}$ bytes: ${sp.latex(comm_backward)}$.",
        ),
        Answer(
            "8.3(b)",
            "forward communication time",
            comm_forward,
            f"Only the all-gather of the three weight matrices: ${sp.latex(comm_forward)}$.",
        ),
        Answer(
            "8.3(c)",
            "largest N_FSDP before the backward is communication-bound",
            sp.Le(N_FSDP, bound_backward),
            f"Both compute and communication double from DP's all-reduce case, so the ratio and the bound are "
            f"DP's: $N_{{FSDP}} \\le {sp.latex(bound_backward)}$.",
        ),
        Answer(
            "8.3(c)",
            "largest N_FSDP before the forward is communication-bound",
            sp.Le(N_FSDP, bound_forward),
            f"The forward has half the backward's FLOPs and half its bytes (one all-gather), so the same "
            f"$N_{{FSDP}} \\le {sp.latex(bound_forward)}$.",
        ),
    ]


TP_BACKWARD_EQUATIONS = (
    r"dz^{(i)} = dy\, W_3^{(i)\top}",
    r"dx_2^{(i)} = dz^{(i)} * f(x_1^{(i)})",
    r"dx_1^{(i)} = dz^{(i)} * f'(x_1^{(i)}) * x_2^{(i)}",
    r"dx = \text{all-reduce}\left(\{dx_1^{(i)} W_1^{(i)\top} + dx_2^{(i)} W_2^{(i)\top}\}_{i=0}^{N_{TP}-1}\right)",
    r"dW_3^{(i)} = z^{(i)\top} dy",
    r"dW_2^{(i)} = x^\top dx_2^{(i)}",
    r"dW_1^{(i)} = x^\top dx_1^{(i)}",
)


def tensor_parallel() -> list[Answer]:
    forward = _s(_forward_flops(B, D_FF / N_TP))
    backward = _s(_backward_flops(B, D_FF / N_TP))
    activation_bytes = B * D * FP16_BYTES  # y (forward) or dx (backward): (B, D) in fp16
    comm_forward = _s(ring_all_reduce_time(activation_bytes, N_TP))
    comm_backward = _s(ring_all_reduce_time(activation_bytes, N_TP))
    bound_backward = max_devices(backward / C, comm_backward, N_TP)
    bound_forward = max_devices(forward / C, comm_forward, N_TP)
    return [
        Answer(
            "8.4(a)",
            "backward pass",
            None,
            "dy is replicated, so each device back-propagates through its own D_FF/N_TP slice without "
            "communication; only dx, a sum over the slices of W1 and W2, needs an all-reduce.",
            TP_BACKWARD_EQUATIONS,
        ),
        Answer(
            "8.4(b)",
            "forward FLOPs per device",
            forward,
            f"Each device does the three matmuls on the full batch but a D_FF/N_TP slice of the width: "
            f"${sp.latex(forward)}$.",
        ),
        Answer(
            "8.4(b)",
            "backward FLOPs per device",
            backward,
            f"The six backward matmuls on the same slice: ${sp.latex(backward)}$.",
        ),
        Answer(
            "8.4(c)",
            "forward communication time",
            comm_forward,
            f"One ring all-reduce of the (B, D) output y in fp16: ${sp.latex(comm_forward)}$, independent of D_FF.",
        ),
        Answer(
            "8.4(c)",
            "backward communication time",
            comm_backward,
            f"One ring all-reduce of the (B, D) input gradient dx; weight gradients stay sharded: "
            f"${sp.latex(comm_backward)}$.",
        ),
        Answer(
            "8.4(d)",
            "largest N_TP before the backward is communication-bound",
            sp.Le(N_TP, bound_backward),
            f"Compute ${sp.latex(backward / C)}$ against the all-reduce; B and D cancel, leaving "
            f"$N_{{TP}} \\le {sp.latex(bound_backward)}$: the FFN width, not the batch, bounds TP.",
        ),
        Answer(
            "8.4(d)",
            "largest N_TP before the forward is communication-bound",
            sp.Le(N_TP, bound_forward),
            f"The forward moves the same bytes for half the FLOPs: $N_{{TP}} \\le {sp.latex(bound_forward)}$.",
        ),
    ]


# 2D FSDP x TP forward (§8.5), per device (i, j).
def fsdp_tp_forward_flops() -> sp.Expr:
    return _s(_forward_flops(B / N_FSDP, D_FF / N_TP))


def fsdp_axis_time() -> sp.Expr:
    """All-gather over the FSDP axis of this TP rank's weight slices W^(i): 3 D D_FF / N_TP values."""
    return _s(ring_all_gather_time(WEIGHT_BYTES / N_TP, N_FSDP))


def tp_axis_time() -> sp.Expr:
    """All-reduce over the TP axis of the (B/N_FSDP, D) partial outputs y^(i,j)."""
    return _s(ring_all_reduce_time(B / N_FSDP * D * FP16_BYTES, N_TP))


def optimal_split(overlapped: bool) -> tuple[sp.Expr, sp.Expr]:
    """The (N_FSDP, N_TP) maximising N = N_FSDP N_TP with the forward compute-bound, found symbolically.

    Overlapped: max(FSDP, TP) <= compute holds iff each does, and each constraint involves one axis only
    (the other's factor cancels), so each axis takes its own bound. Not overlapped: FSDP + TP <= compute is
    linear in both after multiplying by N; on that line, maximise the product.
    """
    compute = fsdp_tp_forward_flops() / C
    if overlapped:
        return (
            max_devices(compute, fsdp_axis_time(), N_FSDP),
            max_devices(compute, tp_axis_time(), N_TP),
        )
    (tp_on_line,) = sp.solve(sp.Eq(fsdp_axis_time() + tp_axis_time(), compute), N_TP)
    product = N_FSDP * tp_on_line
    roots = [r for r in sp.solve(sp.diff(product, N_FSDP), N_FSDP) if r.is_positive is not False]
    (n_fsdp,) = [r for r in roots if sp.simplify(tp_on_line.subs(N_FSDP, r)).is_positive is not False]
    return _s(n_fsdp), _s(tp_on_line.subs(N_FSDP, n_fsdp))


def fsdp_tp() -> list[Answer]:
    flops = fsdp_tp_forward_flops()
    fsdp_t, tp_t = fsdp_axis_time(), tp_axis_time()
    comm = sp.Max(fsdp_t, tp_t)
    f_c, t_c = optimal_split(overlapped=True)
    n_c = _s(f_c * t_c)
    f_d, t_d = optimal_split(overlapped=False)
    n_d = _s(f_d * t_d)
    lead_c = sp.limit(n_c / W**2, W, sp.oo) * W**2  # the leading term when bandwidth is large
    lead_d = sp.limit(n_d / W**2, W, sp.oo) * W**2
    return [
        Answer(
            "8.5(a)",
            "forward FLOPs per device",
            flops,
            f"The three matmuls on a (B/N_FSDP)-row batch shard and a D_FF/N_TP width slice: ${sp.latex(flops)}$.",
        ),
        Answer(
            "8.5(b)",
            "forward communication time",
            comm,
            f"The FSDP axis all-gathers this TP rank's weight slices (${sp.latex(WEIGHT_BYTES / N_TP)}$ bytes) and "
            f"the TP axis all-reduces the $({sp.latex(B / N_FSDP)}, D)$ output; they overlap, so the longer counts.",
        ),
        Answer(
            "8.5(c)",
            "largest N with overlapped axes",
            sp.Le(N, n_c),
            f"Compute-bound needs each axis under compute, and each condition involves only its own axis: "
            f"$N_{{FSDP}} \\le {sp.latex(f_c)}$ (as in DP) and $N_{{TP}} \\le {sp.latex(t_c)}$ (as in the TP "
            f"forward); taking both at their bound gives $N \\le {sp.latex(n_c)} \\approx {sp.latex(lead_c)}$.",
        ),
        Answer(
            "8.5(d)",
            "largest N with serialised axes",
            sp.Le(N, n_d),
            f"Now FSDP + TP time must fit under compute, which (times N W / 2D) is the line "
            f"$3 D_{{FF}} (N_{{FSDP}} - 1) + 2 B (N_{{TP}} - 1) \\le 3 B D_{{FF}} W / C$; the product is largest "
            f"where both terms are equal, $N_{{FSDP}} = {sp.latex(f_d)}$, $N_{{TP}} = {sp.latex(t_d)}$, so "
            f"$N \\le {sp.latex(n_d)} \\approx {sp.latex(lead_d)}$, a quarter of the overlapped bound.",
        ),
    ]


@functools.cache  # deriving takes seconds; the answers are immutable
def all_answers() -> tuple[Answer, ...]:
    return (*alternate_ring_all_reduce(), *data_parallel(), *fsdp(), *tensor_parallel(), *fsdp_tp())


def best_integer_split(values: dict[sp.Symbol, float], overlapped: bool, limit: int = 512) -> tuple[int, int]:
    """Numeric check of optimal_split: every integer (N_FSDP, N_TP) up to limit, the largest compute-bound
    product (ties: the smaller N_FSDP)."""
    compute = sp.lambdify((N_FSDP, N_TP), (fsdp_tp_forward_flops() / C).subs(values))
    fsdp_t = sp.lambdify((N_FSDP, N_TP), fsdp_axis_time().subs(values))
    tp_t = sp.lambdify((N_FSDP, N_TP), tp_axis_time().subs(values))
    combine = max if overlapped else (lambda a, b: a + b)
    best = (1, 1)
    for f, t in itertools.product(range(1, limit + 1), repeat=2):
        # Relative tolerance: a split exactly on the boundary counts as compute-bound.
        fits = combine(fsdp_t(f, t), tp_t(f, t)) <= compute(f, t) * (1 + 1e-12)
        if fits and f * t > best[0] * best[1]:
            best = (f, t)
    return best


def evaluate(expr: sp.Basic, values: dict[sp.Symbol, float]) -> float:
    """A numeric value: of an expression, or of a relation's right-hand side (the bound)."""
    if isinstance(expr, sp.core.relational.Relational):
        expr = expr.rhs
    value = float(expr.subs(values))
    if not math.isfinite(value):
        raise ValueError(f"{expr} is not finite at {values}")
    return value


# What one device sends in each §8.1 collective of S bytes (its time times the egress rate), and in how many
# steps: the counts that ring_collectives.py measures.
COLLECTIVE_TIMES = {
    "all_gather": ring_all_gather_time,
    "reduce_scatter": ring_reduce_scatter_time,
    "all_reduce": ring_all_reduce_time,
    "alternate_all_reduce": alternate_all_reduce_time,
}
COLLECTIVE_STEPS = {
    "all_gather": N - 1,
    "reduce_scatter": N - 1,
    "all_reduce": 2 * (N - 1),
    "alternate_all_reduce": N - 1,
}


def bytes_sent_per_device(collective: str) -> sp.Expr:
    return sp.simplify(COLLECTIVE_TIMES[collective](S, N) * W)
