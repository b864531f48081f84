"""§1.2.1: naive attention over the d x seq grid: time, memory before backward, the OOM boundary, the formulas."""

from __future__ import annotations

import pandas as pd

from cs336_systems.accounting.attention_memory import naive_attention_memory
from cs336_systems.accounting.units import GIB, MIB
from cs336_systems.report.analysis import log_slope, phase_times
from cs336_systems.report.context import Context
from cs336_systems.report.formatting import mib_or_gib, or_dash, phase_cell, provenance_line

CELL = ["d", "seq_len"]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def render(ctx: Context) -> str:
    frame, metas = ctx.require("attention", "The attention benchmark")
    eager = frame[frame["variant"] == "eager"]
    on_cuda = eager["mem_before_backward_mib"].notna().any()
    batch, dtype = int(eager["batch_size"].iloc[0]), eager["dtype"].iloc[0]
    passes = eager[eager["status"] == "ok"].groupby(["d", "seq_len", "phase"]).size().max()
    out = [
        provenance_line(metas),
        f"Single-head causal attention (`cs336_systems.model.transformer.naive_attention`), batch {batch}, {dtype}; "
        f"{eager['warmup'].iloc[0]} warm-up passes, then {passes} timed forward and {passes} timed backward passes "
        "per cell, synchronising after each. Memory is allocated memory right before `out.backward(dO)`, minus "
        "what was allocated before the cell (CUDA only).",
        "",
        grid_table(eager, on_cuda),
        "",
        timing_findings(eager),
        "",
        oom_accounting(eager, batch, dtype),
        "",
        backward_scaling(eager, on_cuda),
        "",
        "**Removing the S² cost.** Everything quadratic above exists only because the (S × S) score and "
        "probability matrices are materialised in global memory and the probabilities are kept for backward. "
        "FlashAttention-2 tiles Q, K and V so that a block of scores lives only in on-chip SRAM, keeps a running "
        "max and sum to compute the softmax online, writes only the output and one logsumexp value per row, and "
        "recomputes the probabilities tile by tile in the backward pass. Its memory is linear in S: "
        + flash_memory_sentence(eager, batch, dtype),
    ]
    return "\n".join(out)


def measured_saved(frame: pd.DataFrame) -> pd.Series:
    """Memory allocated right before backward, minus what was allocated before the cell, per d x seq (MiB)."""
    rows = frame[(frame["status"] == "ok") & frame["mem_before_backward_mib"].notna()]
    rows = rows.drop_duplicates(CELL).set_index(CELL)
    return rows["mem_before_backward_mib"] - rows["baseline_mib"].fillna(0.0)


def grid_table(eager: pd.DataFrame, on_cuda: bool) -> str:
    cells = phase_times(eager, CELL)
    formula = eager.drop_duplicates(CELL).set_index(CELL)["formula_before_backward_mib"]
    table = pd.DataFrame(
        {
            "forward ms": cells.apply(phase_cell, axis=1, phase="forward"),
            "backward ms": cells.apply(phase_cell, axis=1, phase="backward"),
        }
    )
    if on_cuda:
        saved = measured_saved(eager).reindex(table.index)
        table["memory before backward MiB"] = saved.map(or_dash("{:,.1f}"))
    table["formula MiB"] = formula.reindex(table.index).map(lambda v: f"{v:,.1f}")
    table = table.sort_index()
    return table.reset_index().to_markdown(index=False, disable_numparse=True)


def timing_findings(eager: pd.DataFrame) -> str:
    cells = phase_times(eager, CELL).sort_index()
    ran = cells.dropna(subset=["forward", "backward"])
    if ran.empty:
        return "No cell finished both passes."
    ratio = ran["backward"] / ran["forward"]
    sentences = [
        f"Backward takes {ratio.median():.1f}× the forward time (median over cells; {ratio.min():.1f}–"
        f"{ratio.max():.1f}×)"
        + (
            ": it does twice the matmul work of the forward pass and reads the saved S² probabilities."
            if ratio.median() > 1
            else "."
        )
    ]
    largest_d = ran.index.get_level_values("d").max()
    rows = ran.loc[largest_d]
    if len(rows) >= 2:
        first, last = rows.index[0], rows.index[-1]
        sentences.append(
            f"At d = {largest_d}, going from seq {first} to {last} ({last / first:.0f}× longer, {(last / first) ** 2:.0f}× "
            f"the score entries) multiplies the forward time by {rows.loc[last, 'forward'] / rows.loc[first, 'forward']:.3g}× "
            f"and the backward time by {rows.loc[last, 'backward'] / rows.loc[first, 'backward']:.3g}×."
        )
    return " ".join(sentences)


def first_oom(eager: pd.DataFrame) -> pd.Series | None:
    """The out-of-memory cell that needs the least memory by the formula (the smallest failing configuration)."""
    oom = eager[eager["status"] == "OOM"]
    if oom.empty:
        return None
    return oom.sort_values(["formula_forward_peak_mib", "seq_len", "d"]).iloc[0]


def accounting_table(batch: int, seq: int, d: int, dtype_bytes: int) -> pd.DataFrame:
    terms = naive_attention_memory(batch, seq, d, dtype_bytes)
    b = dtype_bytes
    rows = [
        ("Q, K, V", f"3·B·S·d·{b}", terms["qkv"]),
        ("output O", f"B·S·d·{b}", terms["output"]),
        ("dO (allocated before the forward pass)", f"B·S·d·{b}", terms["grad_output"]),
        ("one score matrix (Q Kᵀ, scaled, masked)", f"B·S²·{b}", terms["score_matrix"]),
        ("causal mask, bool (and its inverse)", "S² (each)", terms["mask"]),
        ("softmax output P (saved for backward)", f"B·S²·{b}", terms["softmax_output"]),
        ("saved for backward: Q, K, V, ~mask, P", "", terms["saved_for_backward"]),
        ("allocated right before backward", "", terms["before_backward"]),
        ("forward peak: + two score matrices, both masks", "", terms["forward_peak"]),
        ("backward peak: + dV, dP, dS", "", terms["backward_peak"]),
    ]
    return pd.DataFrame(
        [(name, expr, f"{value / MIB:,.1f}", f"{value / GIB:,.2f}") for name, expr, value in rows],
        columns=["term", "bytes", "MiB", "GiB"],
    )


def oom_accounting(eager: pd.DataFrame, batch: int, dtype: str) -> str:
    worst = first_oom(eager)
    b = DTYPE_BYTES[dtype]
    out = ["### Out-of-memory boundary and memory accounting", ""]
    if worst is None:
        largest = eager.sort_values("formula_forward_peak_mib").iloc[-1]
        seq, d = int(largest["seq_len"]), int(largest["d"])
        out.append(
            "No configuration of this grid ran out of memory; the accounting below is for the largest one, "
            f"d = {d}, seq = {seq}."
        )
    else:
        seq, d = int(worst["seq_len"]), int(worst["d"])
        oom = eager[eager["status"] == "OOM"]
        per_seq = oom.groupby("seq_len")["d"].apply(lambda ds: ", ".join(str(x) for x in sorted(ds)))
        boundary = "; ".join(f"seq {s}: d = {ds}" for s, ds in per_seq.items())
        out.append(
            f"The smallest configuration that runs out of memory is d = {d}, seq = {seq} (in the {worst['phase']} "
            f"pass). Out of memory overall: {boundary}."
        )
    terms = naive_attention_memory(batch, seq, d, b)
    quadratic = 2 * terms["score_matrix"] + terms["mask"]
    out += [
        "",
        accounting_table(batch, seq, d, b).to_markdown(index=False, disable_numparse=True),
        "",
        f"For B = {batch}, S = {seq}, d = {d}, {b}-byte elements the forward pass needs "
        f"{mib_or_gib(terms['forward_peak'])} at its peak and backward {mib_or_gib(terms['backward_peak'])}; one (S × S) "
        f"matrix alone is {mib_or_gib(terms['score_matrix'])} while Q, K and V together are {mib_or_gib(terms['qkv'])}, so "
        f"the S² terms are {quadratic / terms['forward_peak']:.1%} of the forward peak"
        + (" and d hardly matters." if quadratic / terms["forward_peak"] >= 0.8 else "."),
    ]
    return "\n".join(out)


def backward_scaling(eager: pd.DataFrame, on_cuda: bool) -> str:
    """How the memory held for backward grows with seq: measured where CUDA measured it, else the formula."""
    formula = eager.drop_duplicates(CELL).set_index(CELL)["formula_before_backward_mib"]
    saved = measured_saved(eager) if on_cuda else formula
    source = "measured" if on_cuda else "by the formula (this run has no CUDA memory counters)"
    out = ["### Memory held for backward against sequence length", ""]
    if on_cuda:
        both = pd.DataFrame({"measured": saved, "formula": formula}).dropna()
        error = (both["measured"] / both["formula"] - 1).abs()
        out.append(
            f"Measured memory before backward is within {error.max():.1%} of the formula in all {len(both)} cells "
            f"that ran (median {error.median():.1%})."
            if len(both)
            else "No cell measured memory before backward."
        )
    sentences, exponents = [], []
    for d, rows in saved.groupby(level="d"):
        series = rows.droplevel("d").sort_index()
        if len(series) < 2:
            continue
        last_two = log_slope(series.index.to_series(), series)
        exponents.append(last_two)
        sentences.append(
            f"d = {d}: {series.iloc[0]:,.1f} MiB at seq {series.index[0]} → {series.iloc[-1]:,.1f} MiB at seq "
            f"{series.index[-1]}, growing as seq^{last_two:.2f} between the two longest"
        )
    if sentences:
        batch, dtype = int(eager["batch_size"].iloc[0]), eager["dtype"].iloc[0]
        seq, d = (
            int(saved.index.get_level_values("seq_len").max()),
            int(saved.index.get_level_values("d").min()),
        )
        terms = naive_attention_memory(batch, seq, d, DTYPE_BYTES[dtype])
        quadratic = (terms["softmax_output"] + terms["mask"]) / terms["saved_for_backward"]
        out.append(
            f"Memory held for backward, {source}: " + "; ".join(sentences) + ". "
            "Backward releases the saved tensors as it consumes them, so this is also what it reclaims. Its S² "
            f"part (the softmax output P and the bool mask) is {quadratic:.0%} of the saved tensors at d = {d}, "
            f"seq = {seq}, the rest is B·S·d"
            + (", so the growth approaches seq² (exponent 2) as seq grows." if min(exponents) >= 1.8 else ".")
        )
    return "\n".join(out)


def flash_memory_sentence(eager: pd.DataFrame, batch: int, dtype: str) -> str:
    worst = first_oom(eager)
    row = worst if worst is not None else eager.sort_values("formula_forward_peak_mib").iloc[-1]
    seq, d, b = int(row["seq_len"]), int(row["d"]), DTYPE_BYTES[dtype]
    naive = naive_attention_memory(batch, seq, d, b)
    flash = 5 * batch * seq * d * b + batch * seq * 4  # Q, K, V, O, dO and the fp32 logsumexp
    return (
        f"for d = {d}, seq = {seq} it holds Q, K, V, O, dO and the logsumexp, {mib_or_gib(flash)}, against "
        f"{mib_or_gib(naive['before_backward'])} before backward for the naive version "
        f"({naive['before_backward'] / flash:,.0f}×)."
    )
