"""The Hopper tier's goals, each judged on every measurement of its shape: ours against cuDNN at the two
leaderboards' attention shapes (flash_goals, and flash_peers where its grid holds the shape), and against SDPA over
the spec's grid (flash)."""

from __future__ import annotations

import pandas as pd

from cs336_systems.report.context import Context
from cs336_systems.report.formatting import commit_text, md
from cs336_systems.report.sections.flash import interpreted

# (batch, heads, sequence, head dim), causal, bf16; the pass; the bound on ours ÷ cuDNN (same run).
CUDNN_GOALS = [
    ((1, 32, 32768, 128), "forward", 0.92),
    ((1, 32, 32768, 128), "backward", 0.92),
    ((1, 32, 32768, 128), "forward_backward", 0.92),
    ((1, 16, 16384, 64), "forward_backward", 1.0),
]
# The 2025 leaderboard's attention, forward + backward, in ms on an H100.
H100_GOAL = ((1, 16, 16384, 64), "forward_backward", 4.5)
# The spec's grid (§1.3.2): forward + backward at head dim 64 up to SHORT tokens within SHORT_BOUND x SDPA's time,
# and the median of ours ÷ SDPA over every cell and pass at most 1.
SHORT, SHORT_BOUND = 1024, 1.3
PASS_NAMES = {"forward": "forward", "backward": "backward", "forward_backward": "forward + backward"}
SHAPE = ["batch_size", "heads", "seq_len", "d_head", "pass"]


def render(ctx: Context) -> str:
    rows = cudnn_goals(ctx) + grid_goals(ctx)
    if not rows:
        return (
            "_Not judged in this run: the goals compare timings, and no table here timed ours on a GPU._"
            + (checked(ctx))
        )
    table = pd.DataFrame(rows)
    failed = table[table["result"] == "FAIL"]
    verdict = f"{len(table) - len(failed)} of {len(table)} pass"
    if len(failed):
        verdict += "; not met: " + "; ".join(
            f"{g} on {gpu}" for g, gpu in zip(failed["goal"], failed["measured on"], strict=True)
        )
    return "\n".join(
        [
            "Each goal judged on every measurement of its shape in this run, naming the GPU and commit it ran on: "
            "`do_bench` medians, ours and the reference timed in the same process (cuDNN's goals causal, bf16; the "
            "spec's grid causal, batch 1, one head).",
            "",
            md(table),
            "",
            f"Goals met: {verdict}.",
        ]
    )


def checked(ctx: Context) -> str:
    """What a run without a GPU did at the goals' (stand-in) shapes: our kernels checked in the interpreter."""
    found = ctx.table("flash_goals")
    if found is None or not interpreted(found[0]):
        return ""
    frame = found[0]
    ok = (frame["status"] == "ok").sum()
    return f" Our kernels at this run's goal shapes, checked in the Triton interpreter: {ok} of {len(frame)} checks pass."


def gpu(meta: dict) -> str:
    p = meta["provenance"]
    return f"{(p.get('device_name') or 'unknown GPU').removeprefix('NVIDIA ')}, {commit_text(p)}"


def shape_text(shape: tuple[int, ...]) -> str:
    """(batch, heads, sequence, head dim) as the writeup names a shape: 1×32×32,768×128."""
    return "×".join(f"{n:,}" for n in shape)


def cudnn_goals(ctx: Context) -> list[dict]:
    """Ours ÷ cuDNN at each goal's shape, from every timed table that holds it."""
    rows = []
    for deliverable in ("flash_goals", "flash_peers"):
        for frame, meta in ctx.tables(deliverable):
            if interpreted(frame) or "heads" not in frame:
                continue
            ok = frame[(frame["status"] == "ok") & frame["causal"].astype(bool)]
            wide = ok.pivot_table(index=SHAPE, columns="impl", values="ms")
            if not {"triton", "sdpa_cudnn"} <= set(wide.columns):
                continue
            for shape, pass_name, bound in CUDNN_GOALS:
                if (cell := (*shape, pass_name)) in wide.index:
                    ours, cudnn = wide.loc[cell, "triton"], wide.loc[cell, "sdpa_cudnn"]
                    rows.append(
                        judged(
                            f"{shape_text(shape)} {PASS_NAMES[pass_name]}: ours ≤ {bound:g} × cuDNN",
                            meta,
                            f"{ours / cudnn:.3f} × ({ours:.3f} against {cudnn:.3f} ms)",
                            f"≤ {bound:g}",
                            ours <= bound * cudnn,
                        )
                    )
            shape, pass_name, ms = H100_GOAL
            if "H100" in gpu(meta) and (cell := (*shape, pass_name)) in wide.index:
                ours = wide.loc[cell, "triton"]
                rows.append(
                    judged(
                        f"{shape_text(shape)} {PASS_NAMES[pass_name]} on an H100",
                        meta,
                        f"{ours:.3f} ms",
                        f"≤ {ms:g} ms",
                        ours <= ms,
                    )
                )
    return rows


def grid_goals(ctx: Context) -> list[dict]:
    """Ours against SDPA over the spec's grid: at short sequences (the host's per-call cost) and overall."""
    found = ctx.table("flash")
    if found is None or interpreted(found[0]):
        return []
    frame, metas = found
    ok = frame[frame["status"] == "ok"]
    wide = ok.pivot_table(index=["dtype", "d_head", "seq_len", "pass"], columns="impl", values="ms")
    if not {"triton", "sdpa"} <= set(wide.columns):
        return []
    ratio = wide.assign(ratio=wide["triton"] / wide["sdpa"]).dropna(subset=["ratio"]).reset_index()
    short = ratio[
        (ratio["d_head"] == 64) & (ratio["seq_len"] <= SHORT) & (ratio["pass"] == "forward_backward")
    ]
    rows = []
    for dtype, cells in short.groupby("dtype"):
        worst = cells.loc[cells["ratio"].idxmax()]
        rows.append(
            judged(
                f"spec grid, {dtype}, d 64, {cells['seq_len'].min():,}–{cells['seq_len'].max():,} tokens, "
                f"forward + backward: ours ≤ {SHORT_BOUND:g} × SDPA in every cell",
                where(metas, dtype, 64),
                f"worst {worst['ratio']:.2f} × ({worst['seq_len']:,} tokens: {worst['triton']:.3f} against "
                f"{worst['sdpa']:.3f} ms{apart(wide, worst)})",
                f"≤ {SHORT_BOUND:g}",
                worst["ratio"] <= SHORT_BOUND,
            )
        )
    median = ratio["ratio"].median()
    rows.append(
        judged(
            f"spec grid, all {len(ratio)} cells and passes: median of ours ÷ SDPA ≤ 1",
            where(metas),
            f"{median:.2f}",
            "≤ 1",
            median <= 1,
        )
    )
    return rows


def apart(wide: pd.DataFrame, cell: pd.Series) -> str:
    """Ours' forward and backward timed apart in the cell: where their sum is far below the forward + backward, the
    host's per-call path, not the kernels, set the latter."""
    key = (cell["dtype"], cell["d_head"], cell["seq_len"])
    try:
        forward, backward = (wide.loc[(*key, p), "triton"] for p in ("forward", "backward"))
    except KeyError:
        return ""
    return f"; ours' forward and backward timed apart: {forward:.3f} + {backward:.3f} ms"


def where(metas: list[dict], dtype: str | None = None, d_head: int | None = None) -> str:
    """The GPUs and commits of the grid's tables (those of one dtype and head dim, if given)."""

    def holds(params: dict) -> bool:
        return (dtype is None or dtype in params.get("dtypes", [dtype])) and (
            d_head is None or d_head in params.get("d_heads", [d_head])
        )

    return "; ".join(sorted({gpu(m) for m in metas if holds(m["params"])}))


def judged(goal: str, measured_on: dict | str, measured: str, bound: str, met: bool) -> dict:
    return {
        "goal": goal,
        "measured on": gpu(measured_on) if isinstance(measured_on, dict) else measured_on,
        "measured": measured,
        "bound": bound,
        "result": "pass" if met else "FAIL",
    }
