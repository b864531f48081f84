"""2026 §8: the parallelism answers derived with sympy, as math with their justifications, their device-count
bounds on the configured hardware and FFNs, and §8.1's two all-reduce algorithms timed against their predicted
ratio."""

from __future__ import annotations

import pandas as pd

from cs336_systems.report.context import Context, reason_if_not_run
from cs336_systems.report.formatting import capitalized, md, provenance_line, text_md


def render(ctx: Context) -> str:
    frame, metas = ctx.require("parallelism", "The parallelism analysis")
    answers = frame[frame.kind == "answer"]
    lines = [
        provenance_line(metas),
        "Every answer below is built by `cs336_systems.accounting.parallelism` as a sympy expression from the handout's setting "
        "(N devices in a ring, each computing at C FLOP/s with W bytes/s of egress; fp16, 2 bytes; one SwiGLU FFN "
        "with x of (B, D), W1 and W2 of (D, D_FF), W3 of (D_FF, D)), simplified, and printed here with the "
        "justification generated beside it. FLOPs and times are per device; the device bounds solve "
        "communication time = compute time for the device count (they overlap). "
        "`cs336_systems.parallel.ring_collectives` runs the §8.1 collectives on point-to-point messages and "
        "`tests/parallel/test_ring_collectives.py` checks their bytes and steps against these formulas on gloo.",
        "",
    ]
    for question, group in answers.groupby("question", sort=False):
        lines += [f"### {question}", ""]
        for _, row in group.iterrows():
            lines += [
                f"**{capitalized(row['quantity'])}.** {row['justification']}",
                "",
                f"$${row['latex']}$$",
                "",
            ]
    lines += [
        "### The device bounds on real hardware",
        "",
        bounds_text(frame),
        "",
        "### Checked by running them",
        "",
        checks_text(ctx),
        "",
        "### 8.1 timed: the ring and the alternate all-reduce",
        "",
        timing_text(ctx),
    ]
    return "\n".join(lines)


@reason_if_not_run
def checks_text(ctx: Context) -> str:
    """Pass/fail of every check per world size, the largest error, and the counted numbers beside the derived
    ones at the largest world size (rank 0)."""
    frame, metas = ctx.require("parallelism_checks", "The checks")
    errors = frame[frame["quantity"].str.startswith("max error")]
    summary = (
        frame.groupby("check", sort=False)
        .agg(
            world_sizes=("world_size", lambda w: ", ".join(map(str, sorted(set(w))))),
            checks=("passed", "size"),
            passed=("passed", "sum"),
        )
        .reset_index()
    )
    largest = frame["world_size"].max()
    counted = frame[
        (frame["world_size"] == largest)
        & (frame["rank"] == 0)
        & ~frame["quantity"].str.startswith(("max error", "input"))
    ]
    counted = counted.drop_duplicates(["check", "quantity"])[
        ["check", "shape", "quantity", "counted", "derived", "passed"]
    ]
    failed = frame[~frame["passed"]]
    verdict = (
        f"All {len(frame)} checks passed"
        if failed.empty
        else f"{len(failed)} of {len(frame)} checks FAILED: "
        + "; ".join(
            f"{r['check']} {r['quantity']} at N = {r['world_size']}" for _, r in failed.head(5).iterrows()
        )
    )
    return "\n".join(
        [
            provenance_line(metas),
            "`cs336_systems.bench.strategy_checks` on every rank (gloo, float64): each ring collective against "
            "torch.distributed's own and the FFN under DP, FSDP, TP and 2D FSDP × TP against the single-device FFN "
            "(outputs and gradients, error relative to the reference's largest value, within 1e-12); bytes sent, ring "
            "steps and matmul FLOPs (`FlopCounterMode`) counted during the run against the expressions above (bytes "
            "scaled from fp16 to the float64 sent).",
            "",
            text_md(summary.astype(str)),
            "",
            f"{verdict}; the largest error is {errors['counted'].max():.1e}.",
            "",
            f"Counted beside derived at N = {largest} (rank 0, the first shape of each check):",
            "",
            text_md(
                counted.assign(
                    counted=counted["counted"].map("{:,.0f}".format),
                    derived=counted["derived"].map("{:,.0f}".format),
                ).astype(str)
            ),
        ]
    )


@reason_if_not_run
def timing_text(ctx: Context) -> str:
    """Each world size and message size: both algorithms' medians, their measured ratio beside the predicted one,
    and a sentence on the largest message (the bandwidth-bound end) computed from the rows."""
    frame, metas = ctx.require("parallelism_timing", "The all-reduce timing")
    times = frame.pivot_table(index=["world_size", "size_mb"], columns="algorithm", values="median_ms")
    ratios = frame.groupby(["world_size", "size_mb"])[["measured_ratio", "predicted_ratio"]].first()
    table = (
        times[["ring", "alternate"]]
        .join(ratios)
        .reset_index()
        .astype({"world_size": int})
        .rename(
            columns={
                "world_size": "N",
                "size_mb": "MiB",
                "ring": "ring ms",
                "alternate": "alternate ms",
                "measured_ratio": "alternate / ring, measured",
                "predicted_ratio": "predicted (N / 2)",
            }
        )
    )
    largest = table[table["MiB"] == table["MiB"].max()]
    findings = ", ".join(
        f"{r['alternate / ring, measured']:.2f} at N = {int(r['N'])} (predicted {r['predicted (N / 2)']:.1f})"
        for _, r in largest.iterrows()
    )
    smallest = table[table["MiB"] == table["MiB"].min()]
    return "\n".join(
        [
            provenance_line(metas),
            "Both algorithms on `cs336_systems.parallel.ring_collectives` (point-to-point send/recv, gloo, one process per "
            "rank on one machine, messages over loopback); median over iterations of the slowest rank, each iteration "
            "from a barrier.",
            "",
            text_md(
                table.assign(**{"MiB": table["MiB"].map("{:g}".format)})
                .astype({"N": str})
                .round(2)
                .astype(str)
            ),
            "",
            f"At {largest['MiB'].iloc[0]:g} MiB the alternate all-reduce takes {findings} times the ring's; at "
            f"{smallest['MiB'].iloc[0]:g} MiB {smallest['alternate / ring, measured'].min():.2f}–"
            f"{smallest['alternate / ring, measured'].max():.2f} times. The model assumes that each device's egress "
            "bandwidth (its W) is the limit; over one machine's loopback these numbers show it is not: the "
            "alternate's N − 1 full-size messages do not cost N/2 times the ring's 2 (N − 1) chunks, and for small "
            "messages the ring's twice as many steps, each a round trip, make it the slower one. Checking the ratio "
            "needs links whose bandwidth is the limit (NCCL between GPUs, or gloo between machines).",
        ]
    )


def bounds_text(frame: pd.DataFrame) -> str:
    """Per FFN: each bound (rows) on each hardware (columns), then the optimal 2D splits."""
    bounds, splits = frame[frame.kind == "bound"], frame[frame.kind == "split"]
    hardware = list(dict.fromkeys(bounds["hardware"]))
    parts = []
    for ffn, group in bounds.groupby("ffn", sort=False):
        first = group.iloc[0]
        table = group.pivot_table(
            index=["question", "quantity"], columns="hardware", values="value", sort=False
        )
        table = table[hardware].reset_index()
        split_rows = splits[splits.ffn == ffn].assign(
            split=lambda s: [f"{f:.1f} × {t:.1f}" for f, t in zip(s.N_FSDP, s.N_TP, strict=True)]
        )
        split_table = split_rows.pivot_table(
            index="question", columns="hardware", values="split", aggfunc="first", sort=False
        )[hardware].reset_index()
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
    parts.append(
        "Hardware, per device: "
        + "; ".join(
            f"{row.hardware}: C = {row.C / 1e12:g} TFLOP/s, W = {row.W / 1e9:g} GB/s"
            for row in hw.itertuples()
        )
        + " (config.yaml `parallelism.hardware`, with sources)."
    )
    return "\n".join(parts)
