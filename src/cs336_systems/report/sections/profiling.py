"""§1.1.4: torch.profiler (and nsys where present) of the forward, backward and AdamW steps per size and context."""

from __future__ import annotations

import re

import pandas as pd

from cs336_systems.report.analysis import step_stats
from cs336_systems.report.context import Context, model_order
from cs336_systems.report.formatting import MODE_LABEL, md, provenance_line

CELL = ["size", "context_length", "mode"]


def render(ctx: Context) -> str:
    frame, metas = ctx.require("profile", "Profiling")
    ok = in_model_order(frame[frame["status"] == "ok"], model_order(metas))
    on_cuda = (ok["device"] == "cuda").any()
    unit = "CUDA kernel" if on_cuda else "aten op"
    layers = {m["params"]["size"]: m["params"]["num_layers"] for m in metas}
    params = metas[0]["params"]
    out = [
        provenance_line(metas),
        f"Batch size {int(ok['batch_size'].iloc[0])}, {params['warmup']} warm-up steps outside the profiled window, "
        f"{params['steps']} profiled steps per cell; every time is per step. "
        + (
            "Kernel times are GPU time from the profiler's CUDA activity."
            if on_cuda
            else "This run has no GPU: each `aten` op stands in for a kernel and its time is self CPU time, so "
            "the shares below describe the CPU, not a GPU."
        ),
        "",
        "### (a) Profiled forward pass against the Python timer",
        "",
        timer_comparison(ctx, ok, on_cuda),
        "",
        f"### (b) The {unit} with the most time",
        "",
        top_kernels(ok, unit, layers),
        "",
        f"### (c) Non-matmul {unit}s that matter",
        "",
        non_matmul(ok, unit),
        "",
        "### (d) Matrix-multiply share: inference against a full AdamW training step",
        "",
        matmul_share(ok, unit, on_cuda),
        "",
        "### (e) Softmax against matrix multiplication inside attention",
        "",
        softmax_vs_matmul(ok, on_cuda),
        "",
        out_of_memory(frame),
        "",
        traces(ctx, metas),
    ]
    return "\n".join(out)


def in_model_order(frame: pd.DataFrame, order: list[str]) -> pd.DataFrame:
    rank = frame["size"].map({size: i for i, size in enumerate(order)})
    return (
        frame.assign(_rank=rank).sort_values(["_rank", "context_length"], kind="stable").drop(columns="_rank")
    )


def short_kernel(name: str, width: int = 70) -> str:
    """A kernel name fit for a table cell: no `void`, no anonymous namespaces, at most `width` characters."""
    name = re.sub(r"\(anonymous namespace\)::", "", name.removeprefix("void ")).replace("`", "'")
    name = name if len(name) <= width else name[: width - 1] + "…"
    return f"`{name}`"


def records(ok: pd.DataFrame, record: str) -> pd.DataFrame:
    return ok[ok["record"] == record]


def timer_comparison(ctx: Context, ok: pd.DataFrame, on_cuda: bool) -> str:
    timer = records(ok, "python_timer").set_index(CELL)
    ranges = records(ok, "range")
    forward = ranges[(ranges["name"] == "forward") & (ranges["mode"] == "forward")].set_index(CELL)
    table = pd.DataFrame(
        {
            "python timer ms": timer["time_ms_per_step"],
            "± std": timer["std_ms"],
            "profiler forward ms": forward["time_ms_per_step"],
        },
        index=timer.index,
    ).dropna(subset=["profiler forward ms"])
    if on_cuda:  # how much of the forward pass the GPU spent running kernels rather than waiting for launches
        table["GPU busy"] = forward["device_busy_ms_per_step"] / forward["device_span_ms_per_step"]
    table["profiler / timer"] = table["profiler forward ms"] / table["python timer ms"]
    e2e = ctx.table("e2e")
    if e2e is not None:  # the same cell benchmarked without a profiler attached (§1.1.3)
        stats = step_stats(e2e[0], CELL)
        stats = stats[stats["oom"] != True].set_index(CELL)  # noqa: E712 - NaN means ran
        table["§1.1.3 benchmark ms"] = stats["mean_ms"].reindex(table.index)
    table = table.reset_index().drop(columns="mode")
    if table.empty:
        return "_No forward-only cell ran._"
    ratio = table["profiler / timer"]
    basis = "device span, from the first to the last kernel it launched" if on_cuda else "CPU duration"
    sentences = [
        f"The profiler's `forward` range (its {basis}) is {ratio.min():.0%}–{ratio.max():.0%} of the Python-timed "
        f"step (median {ratio.median():.0%}): the range holds the whole forward pass and its loss, and the rest "
        "of the step is Python around it and the final synchronisation (on a GPU also the launch latency before "
        "the first kernel)."
    ]
    if "§1.1.3 benchmark ms" in table and table["§1.1.3 benchmark ms"].notna().any():
        overhead = (table["python timer ms"] / table["§1.1.3 benchmark ms"]).dropna()
        sentences.append(
            f"With the profiler attached the Python-timed step is {overhead.min():.2f}–{overhead.max():.2f}× "
            f"(median {overhead.median():.2f}×) the §1.1.3 benchmark of the same cell, run in another process "
            "without a profiler."
        )
        if overhead.max() > 1.05:
            most, least = table.loc[overhead.idxmax()], table.loc[overhead.idxmin()]
            sentence = (
                f"It costs most for {most['size']} at context {most['context_length']} "
                f"({overhead.max():.2f}× a {most['§1.1.3 benchmark ms']:.1f} ms step) and least for "
                f"{least['size']} at context {least['context_length']} ({overhead.min():.2f}× "
                f"{least['§1.1.3 benchmark ms']:.1f} ms)"
            )
            # The explanation only where the GPU idles more in the most affected cell than in the least.
            if "GPU busy" in table and most["GPU busy"] < least["GPU busy"]:
                sentence += (
                    ": the profiler records every operator on the CPU, which slows the step where the CPU's kernel "
                    "launches, not the GPU, set its pace — there the GPU is busy for "
                    f"{most['GPU busy']:.0%} of the profiled forward pass, against {least['GPU busy']:.0%} in the "
                    "least affected cell"
                )
            sentences.append(sentence + ".")
        else:
            sentences.append(
                "The profiler adds no overhead that stands out from the difference between processes."
            )
    return md(table) + "\n\n" + " ".join(sentences)


def top_by_cell(kernels: pd.DataFrame, mode: str) -> pd.DataFrame:
    rows = kernels[kernels["mode"] == mode].sort_values("time_ms_per_step", ascending=False)
    top = rows.groupby(["size", "context_length"], sort=False).head(1)
    order = kernels[["size", "context_length"]].drop_duplicates()
    return order.merge(top, on=["size", "context_length"]).set_index(["size", "context_length"])


def top_kernels(ok: pd.DataFrame, unit: str, layers: dict[str, int]) -> str:
    kernels = records(ok, "kernel")
    forward, both = top_by_cell(kernels, "forward"), top_by_cell(kernels, "forward_backward")
    if forward.empty:
        return "_No forward-only cell ran._"
    shown = forward.index.intersection(both.index) if not both.empty else forward.index
    shown = pd.MultiIndex.from_frame(  # per size, the longest context where both modes ran
        shown.to_frame(index=False).groupby("size", sort=False).tail(1)
    )
    table = pd.DataFrame(
        {
            "forward: top": forward.loc[shown, "name"].map(short_kernel),
            "calls / forward": forward.loc[shown, "count_per_step"],
            "share": forward.loc[shown, "share"].map(lambda s: f"{s:.0%}"),
        }
    )
    if not both.empty:
        table["fwd+bwd: top"] = both.loc[shown, "name"].map(short_kernel)
        table["calls / step"] = both.loc[shown, "count_per_step"]
        table["share "] = both.loc[shown, "share"].map(lambda s: f"{s:.0%}")
    name = forward["name"].value_counts().index[0]
    cells = forward[forward["name"] == name]
    calls = "; ".join(
        f"{c:g} times for {size} at context {context}"
        + (f" ({c / layers[size]:.2g} per layer)" if c >= layers.get(size, float("inf")) else "")
        for (size, context), c in cells.groupby(level=["size", "context_length"], sort=False)[
            "count_per_step"
        ]
        .first()
        .groupby(level="size", sort=False)
        .tail(1)
        .items()
    )
    sentences = [
        f"In the forward pass the {unit} with the most time is {short_kernel(name)} in {len(cells)} of the "
        f"{len(forward)} size × context cells; where it is on top it is launched, per forward pass, {calls} (the "
        "longest such context per size)."
    ]
    if not both.empty:
        paired = both.reindex(forward.index).dropna(subset=["name"])
        same = paired["name"] == forward.loc[paired.index, "name"]
        others = sorted(set(paired.loc[~same, "name"].map(short_kernel)))
        sentences.append(
            f"In forward+backward the top {unit} is the forward pass's top one in {same.sum()} of {len(paired)} "
            "cells" + (f"; in the others it is {', '.join(others)}." if others else ".")
        )
    return (
        "Per size at the longest context where both modes ran:\n\n"
        + md(table.reset_index(), floatfmt=".4g")
        + "\n\n"
        + " ".join(sentences)
    )


def mean_share(kernels: pd.DataFrame, cells: pd.DataFrame) -> pd.DataFrame:
    """Each kernel's share of its cell's kernel time, averaged over the `cells` of each mode (0 where absent)."""
    per_mode = []
    for mode, rows in kernels.groupby("mode", sort=False):
        n_cells = (cells["mode"] == mode).sum()
        per_mode.append((rows.groupby("name")["share"].sum() / n_cells).rename(mode))
    return pd.concat(per_mode, axis=1).fillna(0.0)


def matmuls(kernels: pd.DataFrame) -> pd.Series:
    return kernels["is_matmul"].astype(str).str.lower() == "true"


def non_matmul(ok: pd.DataFrame, unit: str, top: int = 5) -> str:
    kernels = records(ok, "kernel")
    cells = kernels[CELL].drop_duplicates()
    shares = mean_share(kernels[~matmuls(kernels)], cells)
    if "forward" not in shares:
        return "_No forward-only cell ran._"
    totals = mean_share(kernels.assign(name=matmuls(kernels).map({True: "matmul", False: "other"})), cells)
    chosen = shares.sort_values("forward", ascending=False).head(top)
    table = chosen.rename(columns=MODE_LABEL).map(lambda s: f"{s:.1%}")
    table.index = table.index.map(short_kernel)
    first = chosen.index[0]
    sentence = (
        f"Outside matrix multiplies, {unit}s take {totals.loc['other', 'forward']:.0%} of forward time (mean "
        f"over cells); the largest is {short_kernel(first)} at {chosen.loc[first, 'forward']:.1%}, and the "
        f"{len(chosen)} listed together take {chosen['forward'].sum():.0%}."
    )
    return (
        "Mean share of each cell's total time, over all sizes and context lengths:\n\n"
        + md(table.reset_index(names=unit))
        + "\n\n"
        + sentence
    )


def matmul_share(ok: pd.DataFrame, unit: str, on_cuda: bool) -> str:
    kernels = records(ok, "kernel")
    cells = kernels[CELL].drop_duplicates()
    shares = kernels[matmuls(kernels)].groupby(CELL, sort=False)["share"].sum()
    shares = shares.reindex(cells.set_index(CELL).index, fill_value=0.0)
    table = shares.unstack("mode").reindex(columns=[m for m in MODE_LABEL if m in set(ok["mode"])])
    if "forward" not in table or "train_step" not in table:
        return "_Needs both forward-only and train-step cells._"
    sentences = [
        f"Matrix multiplies take a median {table['forward'].median():.0%} of {unit} time in inference "
        f"(forward only) and {table['train_step'].median():.0%} in a full training step."
    ]
    shift = mean_share(kernels[~matmuls(kernels)], cells)
    if {"forward", "train_step"} <= set(shift.columns):
        gain = (shift["train_step"] - shift["forward"]).sort_values(ascending=False)
        gain = gain[gain >= 0.001]  # at least 0.1 points
        if len(gain):
            sentences.append(
                f"Among the others, {short_kernel(gain.index[0])} gains most ({gain.iloc[0] * 100:+.1f} points, "
                "mean over cells)"
                + (
                    f", then {short_kernel(gain.index[1])} ({gain.iloc[1] * 100:+.1f})"
                    if len(gain) > 1
                    else ""
                )
                + "."
            )
    ranges = records(ok, "range")
    optimizer = ranges[(ranges["name"] == "optimizer_step") & (ranges["mode"] == "train_step")].set_index(
        CELL
    )
    if len(optimizer):
        busy = optimizer["device_busy_ms_per_step"] if on_cuda else optimizer["time_ms_per_step"]
        total = kernels[kernels["mode"] == "train_step"].groupby(CELL)["time_ms_per_step"].sum()
        fraction = (busy / total.reindex(busy.index)).dropna()
        sentences.append(
            f"The AdamW step itself is {fraction.median():.0%} of the train step's {unit} time (median; "
            f"{fraction.min():.0%}–{fraction.max():.0%}): elementwise updates of every parameter and both moments."
        )
    arrow = (
        table["forward"].map(lambda s: f"{s:.0%}")
        + " → "
        + table["train_step"].map(lambda s: f"{s:.0%}" if pd.notna(s) else "OOM")
    )
    grid = arrow.unstack("context_length").reindex(
        index=list(dict.fromkeys(table.index.get_level_values("size")))
    )
    grid.columns = [f"context {c}" for c in grid.columns]
    return (
        f"Matrix-multiply share of {unit} time, forward only → full train step:\n\n"
        + grid.fillna("—").reset_index().to_markdown(index=False, disable_numparse=True)
        + "\n\n"
        + " ".join(sentences)
    )


def softmax_vs_matmul(ok: pd.DataFrame, on_cuda: bool) -> str:
    ranges = records(ok, "range")
    ranges = ranges[ranges["mode"] == "forward"]
    # On a GPU the kernels' own time: a range's device span also holds the gaps where kernels wait for launches.
    time = "device_busy_ms_per_step" if on_cuda else "time_ms_per_step"
    wide = ranges.pivot_table(index=["size", "context_length"], columns="name", values=time, sort=False)
    flops = ranges.pivot_table(
        index=["size", "context_length"], columns="name", values="flops_per_step", sort=False
    )
    needed = ["attention/scores", "attention/softmax", "attention/output"]
    if not set(needed) <= set(wide.columns):
        return "_No forward-only cell with attention ranges ran._"
    table = wide[needed].rename(columns=lambda n: n.split("/")[1] + " ms")
    table["softmax / P·V time"] = wide["attention/softmax"] / wide["attention/output"]
    table["softmax / P·V FLOPs"] = flops["attention/softmax"] / flops["attention/output"]
    per_flop = table["softmax / P·V time"] / table["softmax / P·V FLOPs"]
    basis = "kernel time (the sum of the CUDA kernels each range launched)" if on_cuda else "CPU time"
    sentence = (
        f"Softmax takes {table['softmax / P·V time'].median():.2f}× the time of the P·V matrix multiply (median "
        f"over cells; {table['softmax / P·V time'].min():.2f}–{table['softmax / P·V time'].max():.2f}×) while doing "
        f"only {table['softmax / P·V FLOPs'].median():.3f}× its FLOPs, so each softmax FLOP costs "
        f"{per_flop.median():.0f}× a matmul FLOP. Softmax reads and writes every (S × S) score with a few FLOPs "
        "each, so it is bound by memory bandwidth, while the matmul reuses each loaded element d times "
        "(and on a GPU runs on tensor cores)."
    )
    return (
        f"Forward pass, all layers, {basis} per step. `scores` is Q Kᵀ with its scaling and causal mask; `output` "
        "is P·V, a pure matmul with the same FLOPs as Q Kᵀ (2·B·H·S²·d_head); softmax is counted as "
        "5·B·H·S² FLOPs (max, subtract, exp, sum, divide).\n\n"
        + md(table.reset_index(), floatfmt=".3g")
        + "\n\n"
        + sentence
    )


def out_of_memory(frame: pd.DataFrame) -> str:
    oom = frame[frame["status"] == "OOM"]
    if oom.empty:
        return "No cell ran out of memory."
    cells = ", ".join(
        f"{r['size']} / {r['context_length']} / {MODE_LABEL[r['mode']]}" for _, r in oom.iterrows()
    )
    return f"Out of memory ({len(oom)} cell{'s' if len(oom) > 1 else ''}: size / context / mode): {cells}."


def traces(ctx: Context, metas: list[dict]) -> str:
    folder = ctx.results / "traces"
    found = sorted(folder.glob("*/trace_*.json")) if folder.is_dir() else []
    where = f"{len(found)} of them in this checkout" if found else "none in this checkout"
    text = (
        "Traces: the run writes one Chrome/Perfetto trace per size and mode at the first context length "
        f"(`results/{ctx.run}/traces/<size>/trace_<size>_<context>_<mode>.json`; open in https://ui.perfetto.dev). "
        f"They are large, so not committed ({where}). "
    )
    under_nsys = sorted(meta["params"]["size"] for meta in metas if meta["params"].get("under_nsys"))
    if under_nsys:
        text += f"Sizes also profiled under Nsight Systems (`nsys_<size>.nsys-rep`, NVTX ranges): {', '.join(under_nsys)}."
    else:
        text += "`nsys` was not on the PATH of this run, so only torch.profiler ran."
    return text
