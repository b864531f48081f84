"""2026 §9: the leaderboard's training step by stack and depth, the per-layer fit and its extrapolation to 34
layers, what each of our pieces is worth, and the one-GPU goals."""

from __future__ import annotations

import pandas as pd

from cs336_systems.report.context import Context
from cs336_systems.report.formatting import provenance_line, text_md

LABEL = {
    "plain": "plain TransformerLM (the spec's naive baseline)",
    "native": "PyTorch-native stack",
    "ours": "ours",
    "ours_sdpa": "ours with SDPA's attention",
    "ours_chunked_head": "ours with PyTorch's chunked head",
    "ours_no_checkpoint": "ours without checkpointing",
}
HEAD = {"eager": "logits, then cross_entropy", "chunked": "chunks, logits recomputed (PyTorch)",
        "fused": "fused Triton head + loss (ours)"}
# One-GPU goals of the issue: our step extrapolated to the leaderboard's depth, and per layer against the native
# stack measured in the same run.
GOAL_STEP_S = 4.2


def render(ctx: Context) -> str:
    found = ctx.table_or_reason("train_step", "The leaderboard's training step")
    if isinstance(found, str):
        return found
    frame, metas = found
    p = metas[0]["params"]
    cells, fits = frame[frame["kind"] == "cell"], frame[frame["kind"] == "fit"].set_index("stack")
    stacks = list(dict.fromkeys(cells["stack"]))
    on_cuda = bool(cells["peak_mib"].notna().any())
    timing = (f"`triton.testing.do_bench` median over {p.get('rep_ms')} ms after {p.get('warmup_ms')} ms of warm-up"
              if on_cuda else f"median of {p.get('steps')} timed steps")
    out = [
        provenance_line(metas),
        f"Model: d_model {p['d_model']}, d_ff {p['d_ff']}, {p['num_heads']} heads, vocabulary {p['vocab_size']:,}, "
        f"context {p['context_length']:,}; {p['batch_size']} sequence(s) per step, weights, gradients and AdamW "
        f"state in {p['dtype']}. Each cell builds a fresh model and times the spec's whole step "
        "(`zero_grad(set_to_none=True)`, forward, summed cross-entropy, backward, `optimizer.step()`): "
        f"{timing}. Peak: `torch.cuda.max_memory_allocated` over the cell. MFU counts model FLOPs only, "
        "6·T·(L·(4d² + 3·d·d_ff) + d·V) + L·6·T²·d per sequence, over the GPU's dense bf16 peak.",
        "",
        text_md(stack_table(cells, stacks)),
        "",
        text_md(cell_table(cells, stacks)),
        "",
    ]
    if len(fits):
        out += [
            "**Extrapolation to the leaderboard's depth** (not a measurement): per stack, per-layer time = the "
            "least-squares slope of step time over the depths measured, and step(L) = intercept + slope × L at "
            f"L = {int(fits['num_layers'].iloc[0])}.",
            "",
            text_md(fit_table(fits, stacks)),
            "",
            worth_sentences(fits, cells),
            "",
            goal_text(fits),
        ]
    out += ["", components_text(ctx)]
    return "\n".join(part for part in out if part is not None)


def components_text(ctx: Context) -> str:
    """Where one step's time goes by component, per stack, from the profiled step of train_step_components."""
    found = ctx.table("train_step_components")
    if found is None:
        return ""
    frame, metas = found
    parts = frame[frame["kind"] == "component"]
    if parts.empty:
        return ""
    layers = int(parts["num_layers"].iloc[0])
    table = parts.pivot_table(index="component", columns="stack", values="component_ms", sort=False)
    stacks = list(dict.fromkeys(parts["stack"]))
    shown = pd.DataFrame({"component": table.index})
    for stack in stacks:
        shown[f"{LABEL.get(stack, stack)} (ms)"] = [f"{ms:,.1f}" for ms in table[stack]]
    total = pd.DataFrame({"component": ["all kernels"],
                          **{f"{LABEL.get(s, s)} (ms)": [f"{table[s].sum():,.1f}"] for s in stacks}})
    text = [
        provenance_line(metas),
        "",
        "**Where the time goes.** One profiled step (`torch.profiler`, after "
        f"one untimed) per stack at {layers} layers, each kernel's device time put in the first component its name matches "
        "(attention: ours, cuDNN's or FlashAttention's kernels; head + loss: the cross-entropy kernels, the head's "
        "matmuls count as matmul; the rest: norms, activations, RoPE, casts, mostly torch.compile's fused kernels). "
        "Profiling adds its own overhead; the step times above are the measurements.",
        "",
        text_md(pd.concat([shown, total], ignore_index=True)),
    ]
    if {"ours", "native"} <= set(stacks):
        gap = table["ours"] - table["native"]
        biggest = gap.abs().idxmax()
        text += ["", f"Ours against the native stack: {'; '.join(f'{c} {signed(g)} ms' for c, g in gap.items())} per "
                     f"step at {layers} layers; the largest difference is in {biggest}."]
    return "\n".join(text)


def stack_table(cells: pd.DataFrame, stacks: list[str]) -> pd.DataFrame:
    first = cells.drop_duplicates("stack").set_index("stack").loc[stacks]
    return pd.DataFrame({
        "stack": [LABEL.get(s, s) for s in stacks],
        "attention": first["attention"].tolist(),
        "LM head + loss": [HEAD.get(h, h) for h in first["head"]],
        "checkpointing": first["checkpoint"].tolist(),
        "blocks compiled": ["yes" if str(c) == "True" else "no" for c in first["compiled"]],
    })


def cell_table(cells: pd.DataFrame, stacks: list[str]) -> pd.DataFrame:
    rows = []
    for stack in stacks:
        for _, c in cells[cells["stack"] == stack].sort_values("num_layers").iterrows():
            ok = c["status"] == "ok"
            rows.append({
                "stack": LABEL.get(stack, stack), "layers": str(int(c["num_layers"])),
                "step (ms)": f"{c['step_ms']:,.1f}" if ok else c["status"],
                "peak (GiB)": f"{c['peak_mib'] / 1024:,.1f}" if ok and pd.notna(c["peak_mib"]) else "—",
                "MFU": f"{c['mfu']:.1%}" if ok and pd.notna(c["mfu"]) else "—",
            })
    return pd.DataFrame(rows)


def fit_table(fits: pd.DataFrame, stacks: list[str]) -> pd.DataFrame:
    shown = [s for s in stacks if s in fits.index]
    return pd.DataFrame({
        "stack": [LABEL.get(s, s) for s in shown],
        "per layer (ms)": [f"{fits.loc[s, 'per_layer_ms']:,.1f}" for s in shown],
        "intercept (ms)": [f"{fits.loc[s, 'intercept_ms']:,.1f}" for s in shown],
        f"step at {int(fits['num_layers'].iloc[0])} layers (s, extrapolated)":
            [f"{fits.loc[s, 'step_ms'] / 1e3:.2f}" for s in shown],
        "MFU (extrapolated)": [f"{fits.loc[s, 'mfu']:.1%}" if pd.notna(fits.loc[s, "mfu"]) else "—" for s in shown],
        "fitted on": [fits.loc[s, "reason"].rsplit("depths ", 1)[-1] for s in shown],
    })


def worth_sentences(fits: pd.DataFrame, cells: pd.DataFrame) -> str:
    """What each of our pieces is worth: ours against ours with that piece replaced by PyTorch's, per layer (the
    slope), per step outside the layers (the intercept: embedding, head and loss, optimizer) and in peak memory
    at the largest depth measured; then the fastest stack."""
    parts = []
    if "ours" in fits.index:
        ours = fits.loc["ours"]
        deepest = int(cells["num_layers"].max())
        peak = cells[cells["num_layers"] == deepest].set_index("stack")["peak_mib"] / 1024
        for variant, piece in (("ours_sdpa", "Our FlashAttention, against SDPA's"),
                               ("ours_chunked_head", "Our fused head + loss, against PyTorch's chunked one"),
                               ("ours_no_checkpoint", "Selective checkpointing, against none")):
            if variant not in fits.index:
                continue
            other = fits.loc[variant]
            text = (f"{piece}: {signed(ours['per_layer_ms'] - other['per_layer_ms'])} ms per layer and "
                    f"{signed(ours['intercept_ms'] - other['intercept_ms'])} ms per step outside the layers, "
                    f"{signed((ours['step_ms'] - other['step_ms']) / 1e3, '.2f')} s at {int(ours['num_layers'])} layers")
            if pd.notna(peak.get("ours")) and pd.notna(peak.get(variant)):
                text += f"; peak at {deepest} layers {signed(peak['ours'] - peak[variant], '.1f')} GiB"
            parts.append(text + ".")
    fastest = fits["step_ms"].idxmin()
    parts.append(f"Fastest extrapolated step: {LABEL.get(fastest, fastest)}, {fits.loc[fastest, 'step_ms'] / 1e3:.2f} s "
                 f"({fits.loc[fastest, 'mfu']:.1%} MFU)." if pd.notna(fits.loc[fastest, "mfu"]) else
                 f"Fastest extrapolated step: {LABEL.get(fastest, fastest)}, {fits.loc[fastest, 'step_ms'] / 1e3:.2f} s.")
    return "\n\n".join(parts)


def signed(x: float, fmt: str = ".1f") -> str:
    return f"{x:+{fmt}}".replace("-", "−")


def goal_text(fits: pd.DataFrame) -> str:
    if "ours" not in fits.index:
        return ""
    ours = fits.loc["ours"]
    rows = [("34-layer step, one sequence (extrapolated)", f"{ours['step_ms'] / 1e3:.2f} s", f"≤ {GOAL_STEP_S} s",
             "pass" if ours["step_ms"] / 1e3 <= GOAL_STEP_S else "FAIL")]
    if "native" in fits.index:
        native = fits.loc["native", "per_layer_ms"]
        rows.insert(0, ("per-layer time ≤ the native stack's (same run)", f"{ours['per_layer_ms']:.1f} ms",
                        f"{native:.1f} ms", "pass" if ours["per_layer_ms"] <= native else "FAIL"))
    table = pd.DataFrame(rows, columns=["goal (one GPU)", "ours", "bound", "result"])
    met = (table["result"] == "pass").sum()
    return f"{text_md(table)}\n\nOurs meets {met} of the {len(table)} one-GPU goals."
