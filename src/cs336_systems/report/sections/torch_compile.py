"""§1.3.1: torch.compile — (a) naive attention eager vs compiled, (b) the whole Transformer eager vs compiled."""

from __future__ import annotations

import pandas as pd

from cs336_systems.report.context import (
    Context,
    md,
    model_order,
    not_measured,
    not_run,
    provenance_line,
    skipped_reason,
)
from cs336_systems.report.sections import attention as attention_section
from cs336_systems.report.sections.attention import cell_times, timing_cell
from cs336_systems.report.sections.mixed_precision import speedup_sentences, speedup_table


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


def attention(ctx: Context) -> str:
    found = attention_section.load(ctx)
    if isinstance(found, str):
        return found
    frame, metas = found
    if not {"eager", "compiled"} <= set(frame["variant"]):
        return "_This run did not benchmark both variants._"
    cells = cell_times(frame)
    eager, compiled = cells.loc["eager"], cells.loc["compiled"]
    table = pd.DataFrame(index=eager.index)
    for phase in ("forward", "backward"):
        table[f"{phase} eager ms"] = eager.apply(timing_cell, axis=1, phase=phase)
        table[f"{phase} compiled ms"] = compiled.apply(timing_cell, axis=1, phase=phase).reindex(table.index)
        speedup = eager[phase] / compiled[phase].reindex(eager.index)
        table[f"{phase} speedup"] = speedup.map(lambda s: f"{s:.2f}×" if pd.notna(s) else "—")
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
    sentences.append(
        "Why: the compiler fuses the elementwise chain between the two matmuls (scale, mask, softmax) into one "
        "generated kernel (Triton on a GPU) that reads and writes the score matrix fewer times; the matmuls themselves stay cuBLAS "
        "calls, so the gain is bounded by the share of the memory-bound part."
    )
    out.append(" ".join(sentences))
    return "\n".join(out)


def transformer(ctx: Context) -> str:
    found = ctx.table("compile")
    if found is None:
        return not_run("The compiled Transformer benchmark")
    frame, metas = found
    reason = skipped_reason(frame)
    if reason:
        return f"{provenance_line(metas)}\n\n{not_measured(reason)}"
    labels = {"False": "eager ms", "True": "compiled ms"}
    table = speedup_table(frame, "compile", "False", "True", model_order(metas), labels)
    steps = frame[frame["status"] == "ok"].groupby(["size", "context_length", "mode", "compile"]).size().max()
    return "\n".join(
        [
            provenance_line(metas),
            coverage(ctx, frame),
            f"Batch size {frame['batch_size'].iloc[0]}, {frame['warmup'].iloc[0]} warm-up steps (which absorb "
            f"the compilation) and {steps} timed steps, as in §1.1.3; `torch.compile(model)` with default "
            "settings, the AdamW step not compiled. Both variants of a size run in the same job. Median "
            "(± standard deviation) ms; speedup = eager median / compiled median.",
            "",
            md(table, floatfmt=".2f"),
            "",
            speedup_sentences(table, "the compiled model's speedup"),
            "",
            "Why: compilation removes Python overhead and fuses the elementwise work around the matmuls (RMSNorm, "
            "RoPE, SwiGLU's gate, attention's scale/mask/softmax) into fewer kernels; the matmuls are unchanged, so "
            "the gain is largest where the elementwise, memory-bound part of a step is largest.",
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
