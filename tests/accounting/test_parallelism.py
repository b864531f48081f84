"""The §8 parallelism answers: values at hand-computed points, the symbolic 2D optimum against an integer search,
and homogeneity in the units (times scale as 1/bandwidth, device counts not at all)."""

from __future__ import annotations

import pytest
import sympy as sp

from cs336_systems.accounting import parallelism as p
from cs336_systems.accounting.parallelism import D_FF, N_DP, N_FSDP, N_TP, B, C, D, N, S, W


def answer(question: str, quantity: str) -> p.Answer:
    (found,) = [a for a in p.all_answers() if a.question == question and a.quantity.startswith(quantity)]
    return found


# A point small enough to compute by hand: B 8, D 4, D_FF 16, C 1, W 1, 4 devices.
POINT = {B: 8, D: 4, D_FF: 16, C: 1, W: 1, S: 10, N: 4, N_DP: 4, N_FSDP: 4, N_TP: 4}

HAND_VALUES = [
    ("8.1", "alternate", 30),  # 3 steps x 10 bytes
    ("8.2(a)", "backward FLOPs", 12 * 8 * 4 * 16 / 4),  # six matmuls of 2 * 2 * 4 * 16
    ("8.2(b)", "backward comm", 2 * 3 / 4 * (3 * 4 * 16 * 2)),  # all-reduce of 384 bytes
    ("8.2(c)", "largest", 9),  # 1 + B W / C
    ("8.3(a)", "forward FLOPs", 6 * 8 * 4 * 16 / 4),
    ("8.3(b)", "backward comm", 2 * 3 / 4 * 384),  # all-gather + reduce-scatter
    ("8.3(b)", "forward comm", 3 / 4 * 384),
    ("8.3(c)", "largest N_FSDP before the forward", 9),
    ("8.4(b)", "forward FLOPs", 6 * 8 * 4 * 16 / 4),
    ("8.4(c)", "forward comm", 2 * 3 / 4 * (8 * 4 * 2)),  # all-reduce of y: 64 bytes
    ("8.4(d)", "largest N_TP before the backward", 1 + 3 * 16),
    ("8.4(d)", "largest N_TP before the forward", 1 + 1.5 * 16),
    ("8.5(a)", "forward FLOPs", 6 * 8 * 4 * 16 / 16),
    # FSDP axis: gather 384/4 bytes over 4 = 72; TP axis: all-reduce 2*4*2 = 16 bytes over 4 = 24.
    ("8.5(b)", "forward comm", 72),
    ("8.5(c)", "largest", 9 * 25),
]


@pytest.mark.parametrize(("question", "quantity", "expected"), HAND_VALUES)
def test_each_answer_at_a_hand_computed_point(question: str, quantity: str, expected: float):
    assert p.evaluate(answer(question, quantity).expr, POINT) == pytest.approx(expected)


def test_the_device_bounds_are_where_communication_equals_compute():
    """At N_DP = 1 + B W / C the DP backward's all-reduce takes exactly its compute time; one more device and
    communication is longer."""
    flops, comm = answer("8.2(a)", "backward FLOPs").expr, answer("8.2(b)", "backward comm").expr
    at = {**POINT, N_DP: 9}
    assert float((flops / C).subs(at)) == pytest.approx(float(comm.subs(at)))
    beyond = {**POINT, N_DP: 10}
    assert float(comm.subs(beyond)) > float((flops / C).subs(beyond))


def test_the_alternate_all_reduce_is_n_over_2_times_the_ring():
    ratio = sp.simplify(p.alternate_all_reduce_time(S, N) / p.ring_all_reduce_time(S, N))
    assert ratio == N / 2


def test_the_backward_costs_twice_the_forward():
    assert answer("8.3(a)", "backward FLOPs").expr == 2 * answer("8.3(a)", "forward FLOPs").expr
    assert answer("8.4(b)", "backward FLOPs").expr == 2 * answer("8.4(b)", "forward FLOPs").expr


@pytest.mark.parametrize("overlapped", [True, False])
def test_the_symbolic_optimal_split_is_the_integer_search_optimum(overlapped: bool):
    # Chosen so the continuous optimum is integral: (c) N_FSDP 1 + B W/C = 7, N_TP 1 + 3 D_FF W/(2 C) = 7;
    # (d) 3 D_FF (N_FSDP - 1) + 2 B (N_TP - 1) <= 72 is best at N_FSDP = N_TP = 4.
    values = {B: 6, D: 8, D_FF: 4, C: 1, W: 1}
    n_fsdp, n_tp = p.optimal_split(overlapped)
    symbolic = (float(n_fsdp.subs(values)), float(n_tp.subs(values)))
    assert symbolic == ((7.0, 7.0) if overlapped else (4.0, 4.0))
    assert p.best_integer_split(values, overlapped, limit=40) == tuple(int(v) for v in symbolic)


@pytest.mark.parametrize("overlapped", [True, False])
def test_the_integer_optimum_never_beats_the_symbolic_bound(overlapped: bool):
    """At awkward values the integer search's product is below the continuous optimum but not by much."""
    values = {B: 10, D: 64, D_FF: 7, C: 3, W: 2}
    n_fsdp, n_tp = p.optimal_split(overlapped)
    bound = float((n_fsdp * n_tp).subs(values))
    f, t = p.best_integer_split(values, overlapped, limit=60)
    assert f * t <= bound + 1e-9
    assert f * t >= 0.6 * bound


def test_the_serialised_bound_is_a_quarter_of_the_overlapped_one_for_large_bandwidth():
    overlapped = answer("8.5(c)", "largest").expr.rhs
    serialised = answer("8.5(d)", "largest").expr.rhs
    assert sp.limit(serialised / overlapped, W, sp.oo) == sp.Rational(1, 4)


@pytest.mark.parametrize("answer_index", range(len(p.all_answers())))
def test_answers_are_dimensionally_sane(answer_index: int):
    """Scaling the time unit (C and W by k) scales a time by 1/k and leaves FLOPs and device counts alone;
    the FLOPs do not depend on the hardware at all."""
    a = p.all_answers()[answer_index]
    if a.question == "8.4(a)":
        pytest.skip("equations, not a quantity")
    k = sp.Symbol("k", positive=True)
    expr = a.expr.rhs if a.is_bound else a.expr
    scaled = expr.subs({C: k * C, W: k * W}, simultaneous=True)
    if "time" in a.quantity:
        # A max of times is a time when each argument is.
        pairs = zip(scaled.args, expr.args, strict=True) if isinstance(expr, sp.Max) else [(scaled, expr)]
        for scaled_part, part in pairs:
            assert sp.simplify(scaled_part - part / k) == 0
    else:
        assert sp.simplify(scaled - expr) == 0
    if "FLOPs" in a.quantity:
        assert not expr.free_symbols & {C, W}


def test_every_answer_has_a_justification_that_renders_its_expression():
    for a in p.all_answers():
        assert a.justification.endswith(".")
        if a.question != "8.4(a)" and not isinstance(a.expr, sp.Max):
            rhs = a.expr.rhs if a.is_bound else a.expr
            assert sp.latex(rhs) in a.justification, a


def test_the_tp_backward_is_a_series_of_equations_ending_in_one_all_reduce():
    a = answer("8.4(a)", "backward pass")
    assert a.latex.startswith(r"\begin{aligned}") and a.latex.count(r"\\") == len(a.equations) - 1
    assert sum("all-reduce" in e for e in a.equations) == 1
    assert {e.split(" = ")[0] for e in a.equations} >= {"dx", "dW_1^{(i)}", "dW_2^{(i)}", "dW_3^{(i)}"}


def test_the_cli_writes_every_answer_and_each_bound_per_hardware_and_ffn(tmp_path):
    from cs336_systems.experiments import parallelism_analysis
    from cs336_systems.measure.provenance import read_rows

    out = tmp_path / "answers.csv"
    parallelism_analysis.main(
        ["--hardware", "unit:1:1", "fast:2:1", "--ffn", "hand:6:8:4", "--out", str(out)]
    )
    frame, meta = read_rows(out)
    answers, bounds = frame[frame.kind == "answer"], frame[frame.kind == "bound"]
    assert len(answers) == len(p.all_answers())
    assert len(bounds) == 2 * sum(a.is_bound for a in p.all_answers())
    unit = bounds[bounds.hardware == "unit"].set_index(["question", "quantity"])["value"]
    assert unit[("8.2(c)", "largest N_DP before communication-bound")] == pytest.approx(7)  # 1 + B W / C
    assert unit[("8.5(c)", "largest N with overlapped axes")] == pytest.approx(49)  # the split test's point
    split = frame[(frame.kind == "split") & (frame.hardware == "unit") & (frame.question == "8.5(d)")].iloc[0]
    assert (split.N_FSDP, split.N_TP) == pytest.approx((4, 4))
    assert meta["params"]["ffn"] == [["hand", 6, 8, 4]]


@pytest.mark.parametrize(
    "flags", [["--hardware", "h100:1e15"], ["--hardware", "h100:-1:1"], ["--ffn", "x:1:2"]]
)
def test_the_cli_names_a_malformed_flag(flags, capsys):
    from cs336_systems.experiments import parallelism_analysis

    defaults = {"--hardware": ["u:1:1"], "--ffn": ["f:1:1:1"]}
    argv = [*flags, *(word for key, value in defaults.items() if key not in flags for word in [key, *value])]
    with pytest.raises(SystemExit):
        parallelism_analysis.parse_args([*argv, "--out", "x.csv"])
    assert flags[0] in capsys.readouterr().err


def test_the_section_renders_each_answer_as_math_and_the_bounds_table(tmp_path):
    from cs336_systems.experiments import parallelism_analysis
    from cs336_systems.report.context import Context, NotRun
    from cs336_systems.report.sections import parallelism as section

    ctx = Context(run="t", results=tmp_path, out_dir=tmp_path / "report")
    with pytest.raises(
        NotRun, match="has no results in this run yet"
    ):  # report.render shows it as the section
        section.render(ctx)
    out = tmp_path / "parallelism" / "answers.csv"
    parallelism_analysis.main(["--hardware", "unit:1:1", "--ffn", "hand:6:8:4", "--out", str(out)])
    text = section.render(Context(run="t", results=tmp_path, out_dir=tmp_path / "report"))
    assert text.count("$$") == 2 * len(p.all_answers())
    assert r"$$N_{DP} \leq \frac{B W}{C} + 1$$" in text
    assert "| 8.5(c)     | largest N with overlapped axes" in text and "49.0" in text  # (1 + 6) (1 + 6)
    assert "7.0 × 7.0" in text and "4.0 × 4.0" in text  # the optimal splits of the split test's point
