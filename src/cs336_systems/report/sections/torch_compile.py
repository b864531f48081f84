"""§1.3.1: torch.compile — (a) naive attention eager vs compiled, (b) the whole Transformer eager vs compiled."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from cs336_systems.report.analysis import paired_speedups, phase_times, speedups_by_size, trend
from cs336_systems.report.context import Context, model_order, reason_if_not_run
from cs336_systems.report.formatting import (
    MODE_LABEL,
    md,
    or_dash,
    phase_cell,
    provenance_line,
    span,
    speedup_sentences,
    speedup_table,
    trend_text,
)

LABELS = {"baseline": "eager ms", "other": "compiled ms"}  # compile=False is the baseline, True the other


def render(ctx: Context) -> str:
    return "\n".join(
        [
            "### (a) Naive attention, eager against compiled",
            "",
            attention(ctx),
            "",
            "### (b) The Transformer LM, eager against compiled",
            "",
            transformer(ctx),
        ]
    )


@reason_if_not_run
def attention(ctx: Context) -> str:
    frame, metas = ctx.require("attention", "The attention benchmark")
    if not {"eager", "compiled"} <= set(frame["variant"]):
        return "_This run did not benchmark both variants._"
    cells = phase_times(frame, ["variant", "d", "seq_len"])
    eager, compiled = cells.loc["eager"], cells.loc["compiled"]
    table = pd.DataFrame(index=eager.index)
    for phase in ("forward", "backward"):
        table[f"{phase} eager ms"] = eager.apply(phase_cell, axis=1, phase=phase)
        table[f"{phase} compiled ms"] = compiled.apply(phase_cell, axis=1, phase=phase).reindex(table.index)
        speedup = eager[phase] / compiled[phase].reindex(eager.index)
        table[f"{phase} speedup"] = speedup.map(or_dash("{:.2f}×"))
    out = [
        provenance_line(metas),
        "Same grid, warm-up and timed passes as §1.2.1; `torch.compile(naive_attention)` is compiled afresh for "
        "each cell (one static shape), and its compilation happens in the warm-up passes. Speedup = eager time / "
        "compiled time.",
        "",
        table.sort_index().reset_index().to_markdown(index=False, disable_numparse=True),
        "",
    ]
    sentences = []
    for phase in ("forward", "backward"):
        speedup = (eager[phase] / compiled[phase].reindex(eager.index)).dropna()
        if speedup.empty:
            continue
        best = speedup.idxmax()
        sentences.append(
            f"{phase.capitalize()}: compiled attention is {speedup.median():.2f}× as fast as eager (median over "
            f"{len(speedup)} cells; {speedup.min():.2f}–{speedup.max():.2f}×), most at d = {best[0]}, "
            f"seq = {best[1]}."
        )
    eager_oom = set(eager.index[eager["oom_phase"].notna()])
    compiled_oom = set(compiled.index[compiled["oom_phase"].notna()])
    if eager_oom - compiled_oom:
        fits = ", ".join(f"d = {d}, seq = {s}" for d, s in sorted(eager_oom - compiled_oom))
        sentences.append(f"Compiled attention fits where eager runs out of memory at {fits}.")
    elif eager_oom or compiled_oom:
        sentences.append(
            f"Both run out of memory in the same cells ({len(eager_oom)} eager, {len(compiled_oom)} compiled): "
            "compilation fuses the scaling, masking and softmax into fewer kernels, but the (S × S) matrices "
            "are still materialised."
        )
    faster = any((eager[p] / compiled[p].reindex(eager.index)).median() > 1 for p in ("forward", "backward"))
    if faster:  # the explanation of a gain, where there is one
        sentences.append(
            "Why: the compiler fuses the elementwise chain between the two matmuls (scale, mask, softmax) into one "
            "generated kernel (Triton on a GPU) that reads and writes the score matrix fewer times; the matmuls "
            "themselves stay cuBLAS calls, so the gain is bounded by the share of the memory-bound part."
        )
    out.append(" ".join(sentences))
    return "\n".join(out)


@reason_if_not_run
def transformer(ctx: Context) -> str:
    frame, metas = ctx.require("compile", "The compiled Transformer benchmark")
    order = model_order(metas)
    compared = paired_speedups(frame, "compile", "False", "True", ["size", "context_length", "mode"])
    table = speedup_table(compared, order, LABELS)
    steps = frame[frame["status"] == "ok"].groupby(["size", "context_length", "mode", "compile"]).size().max()
    cells = step_times(frame)
    findings = [
        speedup_sentences(speedups_by_size(compared, order), "the compiled model's speedup"),
        extremes(cells),
        out_of_memory(table),
    ]
    return "\n".join(
        [
            provenance_line(metas),
            coverage(ctx, frame),
            f"Batch size {frame['batch_size'].iloc[0]}, {frame['warmup'].iloc[0]} warm-up steps (which absorb "
            f"the compilation) and {steps} timed steps, as in §1.1.3. `torch.compile(model, dynamic=False)`, "
            "compiled afresh for every cell (`torch.compiler.reset()`), so each graph is specialised to its one "
            "input shape, as in a training run at one context length; the AdamW step is not compiled. Each size × "
            "context is one job that runs both variants. Median (± standard deviation) ms; speedup = eager median / "
            "compiled median.",
            "",
            md(table, floatfmt=".2f"),
            "",
            speedup_figure(ctx, speedups(cells), order),
            "",
            " ".join(f for f in findings if f),
            "",
            transformer_why(speedups_by_size(compared, order)),
            "",
            compile_cost(cells, metas),
        ]
    )


def transformer_why(by_size: dict[str, pd.Series]) -> str:
    """Why compiling helps, where it does; that the gain follows the elementwise share only where it shrinks
    with model size (larger models spend more of a step in matmuls) in every mode."""
    if not by_size or not all((v > 1).any() for v in by_size.values()):
        return ""
    text = (
        "Why: compilation removes Python overhead and fuses the elementwise work around the matmuls (RMSNorm, "
        "RoPE, SwiGLU's gate, attention's scale/mask/softmax) into fewer kernels; the matmuls are unchanged"
    )
    if all(len(v) > 1 and trend(v).direction == "shrinks" for v in by_size.values()):
        return (
            text + ", so the gain is largest where the elementwise, memory-bound part of a step is largest."
        )
    return text + "."


def step_times(frame: pd.DataFrame) -> pd.DataFrame:
    """Per cell that ran, indexed by (mode label, size, context): each variant's median step and first step in ms,
    as columns (`median_ms` | `first_ms`, "False" | "True"); `first_ms` is NaN for results that lack it."""
    ok = frame[frame["status"] == "ok"].astype({"compile": str})
    if "first_step_ms" not in ok:
        ok = ok.assign(first_step_ms=float("nan"))
    return (
        ok.groupby([ok["mode"].map(MODE_LABEL), "size", "context_length", "compile"])
        .agg(median_ms=("time_ms", "median"), first_ms=("first_step_ms", "first"))
        .unstack("compile")
    )


def speedups(cells: pd.DataFrame) -> pd.Series:
    """Eager median / compiled median per cell where both ran, indexed by (mode, size, context)."""
    if not {"False", "True"} <= set(cells["median_ms"].columns):
        return pd.Series(dtype=float)
    return (cells["median_ms"]["False"] / cells["median_ms"]["True"]).dropna()


def extremes(cells: pd.DataFrame) -> str:
    """Where compilation helps most and least, and whether eager is launch-bound where it helps most."""
    values = speedups(cells)
    if len(values) < 2:
        return ""
    (mode, size, context), (low_mode, low_size, low_context) = values.idxmax(), values.idxmin()
    out = (
        f"Over the {len(values)} cells that ran, the speedup is largest for {size}'s {mode} at context {context} "
        f"({values.max():.2f}×) and smallest for {low_size}'s {low_mode} at context {low_context} "
        f"({values.min():.2f}×)."
    )
    eager = cells["median_ms"]["False"].dropna()
    doubled = (mode, size, 2 * context)
    if doubled in eager.index:
        at, at_double = eager[mode, size, context], eager[doubled]
        if at_double < 1.5 * at:
            out += (
                f" There eager takes {at:.3g} ms against {at_double:.3g} ms at twice the context: its time does not "
                "follow the work, so it is bound by launching kernels from Python, the overhead a compiled graph "
                "removes."
            )
    return out


def out_of_memory(table: pd.DataFrame) -> str:
    eager_oom = table["eager ms"] == "OOM"
    compiled_oom = table["compiled ms"] == "OOM"
    name = lambda rows: ", ".join(
        f"{r['size']}'s {r['mode']} at context {r['context_length']}" for _, r in rows.iterrows()
    )
    sentences = []
    if (eager_oom & compiled_oom).any():
        sentences.append(f"Both variants run out of memory for {name(table[eager_oom & compiled_oom])}.")
    if (eager_oom & ~compiled_oom).any():
        sentences.append(f"Only eager runs out of memory for {name(table[eager_oom & ~compiled_oom])}.")
    if (compiled_oom & ~eager_oom).any():
        sentences.append(
            f"Only the compiled model runs out of memory for {name(table[compiled_oom & ~eager_oom])}."
        )
    return " ".join(sentences)


def speedup_figure(ctx: Context, values: pd.Series, order: list[str]) -> str:
    if values.empty:
        return ""
    modes = list(dict.fromkeys(values.index.get_level_values("mode")))
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.6), sharey=True, squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        for size in order:
            if (mode, size) in values.droplevel("context_length").index:
                line = values.loc[(mode, size)]
                ax.plot(line.index, line.to_numpy(), marker="o", label=size)
        ax.axhline(1, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        contexts = sorted(set(values.index.get_level_values("context_length")))
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.minorticks_off()
        ax.set_title(str(mode))
        ax.set_xlabel("context length")
    axes[0][0].set_ylabel("speedup (eager / compiled)")
    axes[0][-1].legend(title="size")
    return ctx.figure(fig, f"compile_speedup_{ctx.run}", "torch.compile speedup by context length and size")


def compile_cost(cells: pd.DataFrame, metas: list[dict]) -> str:
    """What compiling costs: the first step's extra time over eager's first step, and the steps it takes to win it
    back at the measured saving per step (`cells` from `step_times`)."""
    if not {"False", "True"} <= set(cells["median_ms"].columns):
        return ""
    cells = cells.dropna()
    if cells.empty:
        return ""
    cost_s = (cells[("first_ms", "True")] - cells[("first_ms", "False")]) / 1e3
    saving_ms = cells[("median_ms", "False")] - cells[("median_ms", "True")]
    payback = (cost_s * 1e3 / saving_ms).where(saving_ms > 0)
    per_cell = pd.DataFrame({"cost": cost_s, "payback": payback}).reset_index()
    layers = {m["params"]["size"]: m["params"]["num_layers"] for m in metas}
    widths = {m["params"]["size"]: m["params"]["d_model"] for m in metas}
    by_layers = sorted(set(per_cell["size"]), key=lambda s: (layers[s], s))
    rows = []
    for (size, mode), cell in per_cell.groupby(["size", "mode"]):
        paid = cell["payback"].dropna()
        rows.append(
            {
                "size": size,
                "layers": layers[size],
                "mode": mode,
                "compile cost s": span(cell["cost"], "{:.0f}"),
                "steps to pay back": span(paid.round(), "{:,.0f}") if len(paid) else "never (no saving)",
            }
        )
    cost = pd.DataFrame(rows)
    cost["size"] = pd.Categorical(cost["size"], categories=by_layers, ordered=True)
    cost = cost.sort_values(["mode", "size"])
    medians = per_cell.groupby(["mode", "size"])["cost"].median()
    sentences = []
    for mode, by_size in medians.groupby("mode"):
        by_size = by_size.droplevel("mode").reindex(by_layers).dropna()
        label = str(mode)
        sentence = (
            f"{label[0].upper()}{label[1:]}: compiling costs {span(by_size, '{:.0f}')} s (median per size)"
        )
        if len(by_size) > 1:
            sentence += (
                f"; ordered by layer count it {trend_text(*trend(by_size))} ({by_size.index[0]}: {by_size.iloc[0]:.0f} s, "
                f"{by_size.index[-1]}: {by_size.iloc[-1]:.0f} s)"
            )
        sentences.append(sentence + ".")
    widest, deepest = max(widths, key=widths.get), max(layers, key=layers.get)
    both = medians.unstack("size").reindex(columns=[widest, deepest]).dropna()  # modes where both have a cost
    if widest != deepest and len(both) and (both[widest] < both[deepest]).all():
        sentences.append(
            f"The widest model, {widest} (d_model {widths[widest]}, {layers[widest]} layers), compiles faster than "
            f"the deepest, {deepest} (d_model {widths[deepest]}, {layers[deepest]} layers): Dynamo unrolls every "
            "layer into one graph and Inductor lowers each one, so compilation follows depth, not width."
        )
    return "\n".join(
        [
            "**What compiling costs.** Compile cost = the compiled model's first step minus eager's first step "
            "(both are cold: eager's includes the math library's and the allocator's warm-up), per cell; steps to pay back = "
            "cost / (eager median − compiled median). Ranges are over the contexts of a size.",
            "",
            md(cost),
            "",
            " ".join(sentences)
            + " Each graph is specialised to its shape, so every new context length pays again.",
        ]
    )


def coverage(ctx: Context, frame: pd.DataFrame) -> str:
    """Which of the §1.1.3 table's sizes and contexts this run compiled, when it is a subset (config `compile`)."""
    e2e = ctx.table("e2e")
    ran = set(zip(frame["size"], frame["context_length"], strict=True))
    if e2e is None:
        return ""
    table = set(zip(e2e[0]["size"], e2e[0]["context_length"], strict=True))
    missing = table - ran
    if not missing:
        return ""
    return (
        f"This run compiled {len(ran & table)} of the §1.1.3 table's {len(table)} size × context cells "
        f"(sizes {', '.join(sorted(set(frame['size'])))}; contexts "
        f"{', '.join(map(str, sorted(set(frame['context_length']))))}), as set by `compile` in `config.yaml`. "
    )
