"""2026 §8: the parallelism answers derived with sympy, as math with their justifications, and their device-count
bounds on the configured hardware and FFNs."""

from __future__ import annotations

import pandas as pd

from cs336_systems.report.context import Context
from cs336_systems.report.formatting import capitalized, md, provenance_line, text_md


def render(ctx: Context) -> str:
    found = ctx.table_or_reason("parallelism", "The parallelism analysis")
    if isinstance(found, str):
        return found
    frame, metas = found
    answers = frame[frame.kind == "answer"]
    lines = [
        provenance_line(metas),
        "Every answer below is built by `cs336_systems.parallelism` as a sympy expression from the handout's setting "
        "(N devices in a ring, each computing at C FLOP/s with W bytes/s of egress; fp16, 2 bytes; one SwiGLU FFN "
        "with x of (B, D), W1 and W2 of (D, D_FF), W3 of (D_FF, D)), simplified, and printed here with the "
        "justification generated beside it. FLOPs and times are per device; the device bounds solve "
        "communication time = compute time for the device count (they overlap). "
        "`cs336_systems.ring_collectives` runs the §8.1 collectives on point-to-point messages and "
        "`tests/test_ring_collectives.py` checks their bytes and steps against these formulas on gloo.",
        "",
    ]
    for question, group in answers.groupby("question", sort=False):
        lines += [f"### {question}", ""]
        for _, row in group.iterrows():
            lines += [f"**{capitalized(row['quantity'])}.** {row['justification']}", "", f"$${row['latex']}$$", ""]
    lines += ["### The device bounds on real hardware", "", bounds_text(frame)]
    return "\n".join(lines)


def bounds_text(frame: pd.DataFrame) -> str:
    """Per FFN: each bound (rows) on each hardware (columns), then the optimal 2D splits."""
    bounds, splits = frame[frame.kind == "bound"], frame[frame.kind == "split"]
    hardware = list(dict.fromkeys(bounds["hardware"]))
    parts = []
    for ffn, group in bounds.groupby("ffn", sort=False):
        first = group.iloc[0]
        table = group.pivot_table(index=["question", "quantity"], columns="hardware", values="value", sort=False)
        table = table[hardware].reset_index()
        split_rows = splits[splits.ffn == ffn].assign(
            split=lambda s: [f"{f:.1f} × {t:.1f}" for f, t in zip(s.N_FSDP, s.N_TP, strict=True)]
        )
        split_table = split_rows.pivot_table(index="question", columns="hardware", values="split", aggfunc="first",
                                             sort=False)[hardware].reset_index()
        parts += [
            f"**FFN {ffn}** (B = {int(first.B)} tokens, D = {int(first.D)}, D_FF = {int(first.D_FF)}): the largest "
            "device count before communication outgrows compute (a fraction: round down).",
            "",
            md(table, floatfmt=".1f"),
            "",
            "The optimal split N_FSDP × N_TP of 8.5 (continuous):",
            "",
            text_md(split_table),
            "",
        ]
    hw = frame[frame.kind == "bound"].drop_duplicates("hardware")
    parts.append("Hardware, per device: " + "; ".join(
        f"{row.hardware}: C = {row.C / 1e12:g} TFLOP/s, W = {row.W / 1e9:g} GB/s" for row in hw.itertuples()
    ) + " (config.yaml `parallelism.hardware`, with sources).")
    return "\n".join(parts)
