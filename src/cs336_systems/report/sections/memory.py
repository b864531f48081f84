"""§1.1.6: CUDA memory snapshots of the forward pass and the training step; peaks in fp32 and bf16."""

from __future__ import annotations

import math
import shutil
from typing import Any

import pandas as pd

from cs336_systems.accounting.units import MIB
from cs336_systems.report.analysis import trend
from cs336_systems.report.context import Context, num_parameters, reason_if_not_run, skipped_reason
from cs336_systems.report.formatting import md, not_measured, or_dash, provenance_line

MODE_LABEL = {"forward": "forward", "train_step": "train step"}
PRECISION_LABEL = {"none": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast"}


def render(ctx: Context) -> str:
    frame, metas = ctx.require("memory", "Memory profiling")
    params = metas[0]["params"]
    peaks = frame[frame["record"] == "peak"]
    residual = frame[frame["record"] == "residual_activation"]
    reason = skipped_reason(peaks) if len(peaks) else "no peak rows"
    if reason:  # nothing was recorded: say what would have been
        return "\n".join(
            [
                provenance_line(metas),
                f"Model {params['size']}, batch size {params['batch_size']}. (a)–(c) and (e) read the snapshots and "
                "peaks of CUDA's caching allocator, recorded on a GPU only; (d) is arithmetic.",
                "",
                f"(a)–(c), (e): {not_measured(reason)}",
                "",
                "### (d) One residual-stream activation",
                "",
                residual_stream(residual),
            ]
        )
    out = [
        provenance_line(metas),
        f"Model {params['size']}, batch size {params['batch_size']}; per cell {params['warmup']} warm-up step(s) "
        f"(so a train step's AdamW state exists), then {params['steps']} step(s) recorded with "
        "`torch.cuda.memory._record_memory_history(max_entries=1_000_000)`. The snapshots "
        f"(`results/{ctx.run}/memory_snapshots/*.pickle`, open in https://pytorch.org/memory_viz) are not committed.",
        "",
    ]
    ok = peaks[peaks["status"] == "ok"]
    parameter_mib = num_parameters(params) * 4 / MIB
    out += [
        "### (a) Active memory timelines",
        "",
        timelines(ctx, ok, parameter_mib),
        "",
        "### (b) Peak memory, fp32",
        "",
        peak_table(peaks),
        "",
        "### (c) Peak memory with bf16 autocast",
        "",
        precision_deltas(peaks),
        "",
        "### (d) One residual-stream activation",
        "",
        residual_stream(residual),
        "",
        "### (e) The largest allocations of the forward pass",
        "",
        largest_allocations(ctx, params),
    ]
    return "\n".join(out)


def timelines(ctx: Context, ok: pd.DataFrame, parameter_mib: float) -> str:
    """The fp32 timelines of the longest context that ran, forward and train step, copied into the figures."""
    fp32 = ok[(ok["autocast"] == "none") & ok["snapshot"].notna()]
    if fp32.empty:
        return "_No fp32 cell produced a snapshot._"
    out, sentences, shown = [], [], {}
    for mode in MODE_LABEL:
        rows = fp32[fp32["mode"] == mode].sort_values("context_length")
        if rows.empty:
            continue
        row = shown[mode] = rows.iloc[-1]  # the longest context that ran
        context = int(row["context_length"])
        png = ctx.results / "memory_snapshots" / str(row["snapshot"]).replace(".pickle", "_timeline.png")
        if png.exists():
            target = ctx.out_dir / "figures" / png.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(png, target)
            out.append(f"![{MODE_LABEL[mode]} memory timeline, context {context}](figures/{png.name})")
        start, peak = row["start_allocated_mib"], row["peak_allocated_mib"]
        sentences.append(
            f"{MODE_LABEL[mode].capitalize()} (context {context}): the recorded step starts at {start:,.0f} MiB, "
            f"{start / parameter_mib:.2f}× the {parameter_mib:,.0f} MiB of fp32 parameters, and peaks at "
            f"{peak:,.0f} MiB, {peak - start:,.0f} MiB above its start."
        )
        if mode == "train_step" and pd.notna(row.get("optimizer_step_peak_mib")):
            sentences.append(phase_sentence(row, parameter_mib))
    why = timeline_why(shown.get("forward"), shown.get("train_step"), parameter_mib)
    return "\n\n".join(out + [" ".join(sentences + ([why] if why else []))])


def timeline_why(forward: pd.Series | None, train: pd.Series | None, parameter_mib: float) -> str:
    """Why the timelines look as they do, each part only where the recorded step shows it."""
    parts = []
    if (
        forward is not None
        and forward["peak_allocated_mib"] - forward["start_allocated_mib"] < 0.1 * parameter_mib
    ):
        parts.append(  # nothing accumulates: the forward pass rises by less than a tenth of the weights
            "in the forward-only step (no autograd graph) each block's temporaries are freed as the next block "
            "runs, so the timeline is a saw-tooth on top of the parameters that peaks where the largest "
            "temporaries (attention scores, the logits and the loss) are alive."
        )
    if train is not None and round(train["start_allocated_mib"] / parameter_mib) == 4:
        parts.append(
            "The train step starts from parameters, the last step's gradients and AdamW's two moments (about 4× "
            "the parameters); `zero_grad(set_to_none=True)` frees the gradients, memory climbs through the forward "
            "pass as activations are saved for backward and falls through the backward pass as they are released "
            "while gradients appear."
        )
    if train is not None and train.get("optimizer_step_peak_mib", 0) > train.get(
        "forward_backward_peak_mib", 0
    ):
        parts.append(
            "PyTorch's default (foreach) AdamW then updates all parameters as one list, so its intermediates, such "
            "as the square root of the second moment, exist for every parameter at once."
        )
    return "Why: " + " ".join(parts) if parts else ""


def phase_sentence(row: pd.Series, parameter_mib: float) -> str:
    """Where a train step peaks: during forward + backward or during the optimizer step (measured by hooks)."""
    before, during = row["forward_backward_peak_mib"], row["optimizer_step_peak_mib"]
    if during > before:
        return (
            f"Its peak comes during the optimizer step: forward and backward reach {before:,.0f} MiB, the AdamW "
            f"update {during:,.0f} MiB, {during - row['start_allocated_mib']:,.0f} MiB above the step's start, "
            f"{(during - row['start_allocated_mib']) / parameter_mib:.2f}× the parameters' size."
        )
    return (
        f"Its peak comes during forward and backward ({before:,.0f} MiB); the AdamW update reaches "
        f"{during:,.0f} MiB."
    )


def peak_cell(row: pd.Series) -> str:
    if row["status"] == "OOM":
        return "OOM"
    return f"{row['peak_allocated_mib']:,.0f}" if row["status"] == "ok" else str(row["status"])


def peak_table(peaks: pd.DataFrame) -> str:
    fp32 = peaks[peaks["autocast"] == "none"].assign(cell=lambda f: f.apply(peak_cell, axis=1))
    table = fp32.pivot_table(index="context_length", columns="mode", values="cell", aggfunc="first")
    table = table.reindex(columns=[m for m in MODE_LABEL if m in table.columns])
    table.columns = [f"{MODE_LABEL[m]} peak MiB" for m in table.columns]
    ok = fp32[fp32["status"] == "ok"].pivot_table(
        index="context_length", columns="mode", values="peak_allocated_mib"
    )
    sentences = []
    if {"forward", "train_step"} <= set(ok.columns) and len(ok.dropna()):
        ratio = (ok["train_step"] / ok["forward"]).dropna()
        sentences.append(
            f"A full training step needs {ratio.min():.1f}–{ratio.max():.1f}× the forward pass's peak."
        )
    for mode in ok.columns:
        series = ok[mode].dropna()
        if len(series) >= 2:
            first, last = series.index[0], series.index[-1]
            sentences.append(
                f"{MODE_LABEL[mode].capitalize()}: from context {first} to {last} the peak changes by "
                f"{series[last] - series[first]:+,.0f} MiB ({series[last] / series[first]:.2f}×)."
            )
    if "forward_backward_peak_mib" in fp32:
        train = fp32[(fp32["mode"] == "train_step") & (fp32["status"] == "ok")].set_index("context_length")
        before = train["forward_backward_peak_mib"].dropna()
        if len(before) >= 2:
            first, last = before.index[0], before.index[-1]
            sentences.append(
                f"Forward and backward alone grow from {before[first]:,.0f} to {before[last]:,.0f} MiB over the same "
                "contexts (the saved activations)"
                + (
                    "; the train step's peak stays where it is because the optimizer step sets it."
                    if (train["optimizer_step_peak_mib"] > train["forward_backward_peak_mib"]).all()
                    else "."
                )
            )
    oom = fp32[fp32["status"] == "OOM"]
    if len(oom):
        sentences.append(
            "Out of memory: "
            + ", ".join(
                f"{MODE_LABEL[r['mode']]} at context {r['context_length']}" for _, r in oom.iterrows()
            )
            + "."
        )
    return (
        "Peak allocated memory (`torch.cuda.max_memory_allocated`) during the recorded step, MiB.\n\n"
        + md(table.reset_index())
        + "\n\n"
        + " ".join(sentences)
    )


def precision_deltas(peaks: pd.DataFrame) -> str:
    ok = peaks[peaks["status"] == "ok"]
    wide = ok.pivot_table(index=["context_length", "mode"], columns="autocast", values="peak_allocated_mib")
    if not {"none", "bf16"} <= set(wide.columns):
        return "_Needs both fp32 and bf16 cells._"
    cells = peaks.assign(cell=peaks.apply(peak_cell, axis=1)).pivot_table(
        index=["context_length", "mode"], columns="autocast", values="cell", aggfunc="first"
    )
    table = pd.DataFrame({"fp32 peak MiB": cells["none"], "bf16 peak MiB": cells["bf16"]})
    delta = pd.DataFrame(
        {"Δ MiB": wide["bf16"] - wide["none"], "Δ %": 100 * (wide["bf16"] / wide["none"] - 1)}
    ).reindex(table.index)
    table["Δ MiB"] = delta["Δ MiB"].map(or_dash("{:+,.0f}"))
    table["Δ %"] = delta["Δ %"].map(or_dash("{:+.1f} %"))
    table = table.reset_index()
    table["mode"] = table["mode"].map(MODE_LABEL)
    delta = delta.reset_index().assign(mode=lambda f: f["mode"].map(MODE_LABEL))
    sentences = []
    for mode, rows in delta.dropna(subset=["Δ %"]).groupby("mode", sort=False):
        sentences.append(
            f"{mode.capitalize()}: bf16 changes the peak by {rows['Δ %'].min():+.1f} % to {rows['Δ %'].max():+.1f} % "
            f"({rows['Δ MiB'].min():+,.0f} to {rows['Δ MiB'].max():+,.0f} MiB) over the context lengths."
        )
    sentences.append(precision_why(delta.dropna(subset=["Δ %"])))
    return md(table) + "\n\n" + " ".join(sentences)


def precision_why(delta: pd.DataFrame) -> str:
    """Why bf16 moves the peak as it does; each consequence named only for the modes whose deltas (per
    context, in increasing order) show it."""
    by_mode = {mode: rows.sort_values("context_length") for mode, rows in delta.groupby("mode", sort=False)}
    saving_grows = [m for m, rows in by_mode.items() if trend(rows["Δ MiB"]).direction == "shrinks"]
    grows = [m for m, rows in by_mode.items() if (rows["Δ MiB"] > 0).all()]
    little = [m for m, rows in by_mode.items() if (rows["Δ %"].abs() < 1).all() and m not in grows]
    text = (
        "Why: autocast keeps the fp32 parameters (and, in training, fp32 gradients and AdamW state: 16 bytes per "
        "parameter that bf16 does not touch) and adds bf16 copies of the weights it casts; only activations "
        "produced by matmuls become bf16, while norms, softmax and the loss stay fp32."
    )
    if saving_grows:
        text += (
            " So the saving grows with the activations: the longer the context, the more bf16 lowers the "
            f"{' and '.join(saving_grows)} peak relative to fp32."
        )
    if grows or little:
        where = [f"the {m} peak grows" for m in grows] + [
            f"the {m} peak moves by less than 1 %" for m in little
        ]
        text += (
            " Where fixed state or the weight copies dominate, the peak moves little or even grows: here "
            + " and ".join(where)
            + "."
        )
    return text


def residual_stream(residual: pd.DataFrame) -> str:
    if residual.empty:
        return "_No residual-stream rows._"
    rows = residual.sort_values("context_length")
    parts = [
        f"{int(r['batch_size'])} × {int(r['context_length'])} × {int(r['d_model'])} × 4 B = {int(r['bytes']):,} B "
        f"= {r['mib']:.4g} MiB (context {int(r['context_length'])})"
        for _, r in rows.iterrows()
    ]
    return (
        "One residual-stream activation is a (batch × context × d_model) tensor of fp32 values, 4 bytes each, "
        "and 1 MiB = 1024² bytes: " + "; ".join(parts) + "."
    )


def tensor_names(params: dict[str, Any], batch: int, context: int, dtype_bytes: int) -> dict[int, str]:
    """Byte sizes of the tensors the model makes (rounded up to the allocator's 512-byte blocks) -> their names."""
    d, d_ff, heads, vocab = params["d_model"], params["d_ff"], params["num_heads"], params["vocab_size"]
    shapes = {
        f"logits (B·T·V = {batch}·{context}·{vocab})": batch * context * vocab,
        f"attention scores (B·H·T² = {batch}·{heads}·{context}²)": batch * heads * context**2,
        f"feed-forward hidden (B·T·d_ff = {batch}·{context}·{d_ff})": batch * context * d_ff,
        f"Q, K, V together (B·T·3d = {batch}·{context}·{3 * d})": batch * context * 3 * d,
        f"residual stream (B·T·d = {batch}·{context}·{d})": batch * context * d,
        f"embedding / LM-head weight (V·d = {vocab}·{d})": vocab * d,
        f"feed-forward weight (d·d_ff = {d}·{d_ff})": d * d_ff,
    }
    names: dict[int, str] = {}
    for element_bytes in sorted({dtype_bytes, 4}):
        for name, count in shapes.items():
            size = math.ceil(count * element_bytes / 512) * 512
            names.setdefault(size, f"{name} × {element_bytes} B")
    names.setdefault(math.ceil(context**2 / 512) * 512, f"causal mask (T² = {context}², bool)")
    return names


@reason_if_not_run
def largest_allocations(ctx: Context, params: dict[str, Any], top: int = 10) -> str:
    frame, _ = ctx.require("memory_allocations", "The largest-allocation list")
    fp32 = frame[frame["autocast"] == "none"]
    frame = fp32 if len(fp32) else frame
    context = int(frame["context_length"].max())
    rows = frame[frame["context_length"] == context].sort_values("rank").head(top)
    autocast = rows["autocast"].iloc[0]
    names = tensor_names(params, int(rows["batch_size"].iloc[0]), context, 2 if autocast != "none" else 4)
    table = pd.DataFrame(
        {
            "rank": rows["rank"],
            "MiB": rows["size_mib"],
            "tensor (matched by size)": rows["size_bytes"].map(lambda b: names.get(int(b), "—")),
            "allocated at": rows["origin"].fillna("(inside torch)"),
            "stack (innermost first)": rows["stack"].fillna(""),
        }
    )
    biggest = table.iloc[0]
    same = table[table["MiB"] == biggest["MiB"]]
    sentence = (
        f"The largest allocation of the forward pass (context {context}, {PRECISION_LABEL.get(autocast, autocast)}) "
        f"is {biggest['MiB']:,.1f} MiB, "
        + (
            f"the size of the {biggest['tensor (matched by size)']}, "
            if biggest["tensor (matched by size)"] != "—"
            else ""
        )
        + f"made at `{biggest['allocated at']}`"
        + (f"; {len(same)} of the top {len(table)} have this size" if len(same) > 1 else "")
        + "."
    )
    return md(table, floatfmt=",.1f") + "\n\n" + sentence
