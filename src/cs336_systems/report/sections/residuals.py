"""2026 §3.1: what RMSNorm and one Transformer block save for backward, eager and compiled, naive and flash."""

from __future__ import annotations

import pandas as pd

from cs336_systems.accounting.units import MIB
from cs336_systems.report import analysis
from cs336_systems.report.context import Context
from cs336_systems.report.formatting import provenance_line, text_md

# The handout's published total (2026 §3.2): one compiled xl block, counted its way (parameters skipped, aliases
# and views counted each time they are saved).
HANDOUT_MIB = 3651.31
HANDOUT_SETUP = {"d_model": 2560, "d_ff": 10240, "heads": 16, "batch_size": 4, "context_length": 2048}
CONFIG = ["module", "attention", "heads"]


def _mib(value: float, sign: str = "") -> str:
    """MiB with two decimals, or three significant digits below 1 MiB (smoke-scale runs)."""
    return f"{value:{sign},.2f}" if abs(value) >= 1 or value == 0 else f"{value:{sign}.3g}"


def render(ctx: Context) -> str:
    frame, metas = ctx.require("residuals", "The residuals experiment")
    p = metas[0]["params"]
    row = frame.iloc[0]
    totals = analysis.residual_totals(frame)
    by_size = analysis.residuals_by_size(frame)
    return "\n".join(
        [
            provenance_line(metas),
            f"Float32 input of batch {p['batch_size']} × context {p['context_length']} × d_model {int(row['d_model'])} "
            f"(size {p['size']}, d_ff {int(row['d_ff'])}); the block is ours (`cs336_systems.model.transformer.TransformerBlock`) "
            "with each head count. Every tensor saved for backward is recorded with "
            "`torch.autograd.graph.saved_tensors_hooks`; **counted** MiB count each storage once (a view or a second "
            "save of the same tensor adds nothing; a view costs its whole storage) and leave out parameters and buffers; "
            "the **analytic** column is the eager count computed from the dimensions (`cs336_systems.measure.saved_tensors`).",
            "",
            "### Totals per configuration (counted MiB)",
            "",
            totals_table(totals),
            "",
            agreement(totals),
            "",
            "### The largest residuals of the eager block, by op",
            "",
            by_op(frame),
            "",
            "### Eager vs compiled: what operator fusion removes",
            "",
            fusion(by_size),
            "",
            "### FlashAttention: the attention residuals",
            "",
            flash(totals, by_size),
            "",
            "### The handout's number",
            "",
            handout(totals, row, p),
        ]
    )


def _cell(totals: pd.DataFrame, key: tuple, mode: str, source: str, value: str = "counted_mib") -> str:
    found = totals[
        (totals[CONFIG].apply(tuple, axis=1) == key) & (totals["mode"] == mode) & (totals["source"] == source)
    ]
    if found.empty:
        return "—"
    row = found.iloc[0]
    return (
        _mib(row[value])
        if row["status"] == "ok"
        else f"{row['status']} ({row['reason']})"
        if isinstance(row["reason"], str)
        else str(row["status"])
    )


def totals_table(totals: pd.DataFrame) -> str:
    keys = list(dict.fromkeys(totals[CONFIG].apply(tuple, axis=1)))
    table = pd.DataFrame(
        [
            {
                "module": module,
                "attention": attention,
                "heads": heads or "—",
                "analytic eager": _cell(totals, key, "eager", "analytic"),
                "measured eager": _cell(totals, key, "eager", "measured"),
                "compiled": _cell(totals, key, "compiled", "measured"),
                "compiled, handout's way": _cell(totals, key, "compiled", "measured", "handout_mib"),
            }
            for key in keys
            for module, attention, heads in [key]
        ]
    )
    return (
        text_md(table) + "\n\n\"Handout's way\": every saved tensor's bytes except `nn.Parameter` objects, a "
        "tensor saved twice counted twice, as the handout's script adds them up."
    )


def agreement(totals: pd.DataFrame) -> str:
    eager = totals[(totals["mode"] == "eager") & (totals["status"] == "ok")]
    wide = eager.pivot_table(index=CONFIG, columns="source", values="counted_mib")
    if not {"analytic", "measured"} <= set(wide.columns) or wide.dropna().empty:
        return "_No eager configuration has both an analytic and a measured total._"
    both = wide.dropna()
    differ = both[(both["analytic"] - both["measured"]).abs() * MIB >= 0.5]
    if differ.empty:
        return (
            f"The analytic count equals the measured eager total to the byte in all {len(both)} eager "
            "configurations: every saved tensor of our RMSNorm and block is accounted for by an op's formula."
        )
    listed = "; ".join(
        f"{' '.join(map(str, k))}: analytic {r['analytic']:,.2f} vs measured {r['measured']:,.2f} MiB"
        for k, r in differ.iterrows()
    )
    return f"The analytic count differs from the measurement in {len(differ)} of {len(both)} configurations: {listed}."


def by_op(frame: pd.DataFrame, top: int = 12) -> str:
    eager = frame[
        (frame["module"] == "block")
        & (frame["mode"] == "eager")
        & (frame["source"] == "measured")
        & (frame["status"] == "ok")
    ]
    if eager.empty:
        return "_No eager block was measured._"
    heads = int(eager["heads"].min())
    eager = eager[eager["heads"] == heads]
    columns = {}
    for attention, rows in eager.groupby("attention", sort=False):
        grouped = rows.groupby(["module_path", "saved_by"], sort=False)
        columns[f"{attention} MiB"] = grouped["counted_bytes"].sum() / MIB
        columns[f"{attention} tensors"] = grouped.size()
    table = pd.DataFrame(columns).sort_values(next(iter(columns)), ascending=False).head(top)
    for name in table.columns:
        show = _mib if name.endswith("MiB") else (lambda v: f"{int(v)}")
        table[name] = table[name].map(lambda v, show=show: "—" if pd.isna(v) else show(v))
    table = table.reset_index().rename(
        columns={"module_path": "submodule", "saved_by": "saved by (autograd node)"}
    )
    return (
        f"Eager block, {heads} heads: counted MiB and saved tensors per submodule and the autograd node that saved "
        f"them (the {top} largest; a tensor saved again, such as RMSNorm's input, counts at its first save).\n\n"
        + text_md(table)
    )


def _change_text(changes: pd.DataFrame) -> str:
    parts = []
    for _, r in changes.iterrows():
        fewer = r["eager_tensors"] - r["compiled_tensors"]
        if fewer > 0:
            parts.append(
                f"{fewer} fewer {r['size_class']} tensor{'s' if fewer > 1 else ''} "
                f"({_mib(r['change_mib'], '+')} MiB)"
            )
        elif fewer < 0:
            parts.append(f"{-fewer} more {r['size_class']} ({_mib(r['change_mib'], '+')} MiB)")
    return ", ".join(parts) or "the same tensors"


def fusion(by_size: pd.DataFrame) -> str:
    changes = analysis.fusion_changes(by_size)
    if changes.empty:
        return "_Needs eager and compiled measurements of the same configuration._"
    sentences = []
    for (module, attention, heads), rows in changes.groupby(CONFIG, sort=False):
        eager, compiled = rows["eager_mib"].sum(), rows["compiled_mib"].sum()
        what = "RMSNorm" if module == "rmsnorm" else f"The block ({attention} attention, {heads} heads)"
        sentences.append(
            f"{what} keeps {_mib(compiled)} MiB compiled instead of {_mib(eager)} MiB eager "
            f"({_mib(compiled - eager, '+')} MiB, {100 * (compiled / eager - 1):+.0f} %): "
            f"{_change_text(rows)}."
        )
    text = " ".join(sentences)
    why = fusion_why(changes)
    table = changes[changes["change_mib"] != 0].assign(
        heads=lambda f: f["heads"].map(lambda h: h or "—"),
        eager_mib=lambda f: f["eager_mib"].map(_mib),
        compiled_mib=lambda f: f["compiled_mib"].map(_mib),
        change_mib=lambda f: f["change_mib"].map(lambda v: _mib(v, "+")),
    )
    table = table.rename(
        columns={
            "size_class": "size (elements)",
            "eager_tensors": "eager tensors",
            "compiled_tensors": "compiled tensors",
            "eager_mib": "eager MiB",
            "compiled_mib": "compiled MiB",
            "change_mib": "Δ MiB",
        }
    )
    return (
        "Counted residuals by size, where compile changes them (B batch, T context, d d_model, h heads; sizes "
        "that coincide at these dimensions are joined by =).\n\n"
        + text_md(table.astype(str))
        + "\n\n"
        + text
        + (f"\n\n{why}" if why else "")
    )


def fusion_why(changes: pd.DataFrame) -> str:
    """Why, for each change the data show: each sentence only where its pattern is in the table."""

    def fewer(module: str, size: str) -> pd.Series:
        rows = changes[
            (changes["module"] == module)
            & (changes["size_class"].str.split(" = ").map(lambda names: size in names))
        ]
        return (
            rows.set_index(["attention", "heads"])["eager_tensors"]
            - rows.set_index(["attention", "heads"])["compiled_tensors"]
        )

    parts = []
    norm = fewer("rmsnorm", "B·T·d")
    if len(norm) and (norm == 1).all():
        parts.append(
            "RMSNorm compiled is one function of (x, weight) whose backward recomputes x·rsqrt from the "
            "input and the per-token rsqrt, so of its two full-size tensors only the input is kept."
        )
    ffn = fewer("block", "B·T·d_ff")
    if len(ffn) and (ffn == 1).all():
        parts.append(
            "In the SwiGLU, eager keeps four d_ff-wide tensors (w1·x for silu, silu(w1·x) and w3·x for "
            "their product, the product for w2); compiled keeps three: one of them is recomputed "
            "elementwise in backward."
        )
    block = fewer("block", "B·T·d")
    if len(block) and (block == 2).all() and len(norm) and (norm == 1).all():
        parts.append(
            "The block keeps two fewer d_model-wide tensors, one per RMSNorm, as the RMSNorm alone does."
        )
    rope = fewer("block", "T·d_head/2")
    if len(rope) and (rope > 0).all():
        parts.append(
            "RoPE's cos and sin rows, indexed afresh per call in eager, are saved by the compiled graph as "
            "the module's buffers themselves (module state, not counted)."
        )
    return "Why: " + " ".join(parts) if parts else ""


def flash(totals: pd.DataFrame, by_size: pd.DataFrame) -> str:
    ok = totals[(totals["module"] == "block") & (totals["source"] == "measured") & (totals["status"] == "ok")]
    wide = ok.pivot_table(index=["mode", "heads"], columns="attention", values="counted_mib")
    skipped = totals[
        (totals["attention"] == "flash") & (totals["source"] == "measured") & (totals["status"] != "ok")
    ]
    note = ""
    if len(skipped):
        note = (
            "Flash not measured: "
            + "; ".join(
                f"{r['mode']}, {r['heads']} heads: {r['status']} ({r['reason']})"
                for _, r in skipped.iterrows()
            )
            + "."
        )
    analytic = totals[
        (totals["module"] == "block") & (totals["source"] == "analytic") & (totals["status"] == "ok")
    ]
    counted = analytic.pivot_table(index="heads", columns="attention", values="counted_mib")
    if {"naive", "flash"} <= set(counted.columns) and len(counted.dropna()):
        note = " ".join(
            f"Analytic, eager, {heads} heads: flash keeps {_mib(r['flash'])} MiB against naive's {_mib(r['naive'])} "
            f"MiB ({_mib(r['flash'] - r['naive'], '+')} MiB)."
            for heads, r in counted.dropna().iterrows()
        ) + (f"\n\n{note}" if note else "")
    if not {"naive", "flash"} <= set(wide.columns) or wide.dropna().empty:
        return note or "_Needs naive and flash measurements of the same configuration._"
    sentences = []
    for (mode, heads), r in wide.dropna().sort_index(ascending=[False, True]).iterrows():
        sizes = by_size[
            (by_size["module"] == "block") & (by_size["mode"] == mode) & (by_size["heads"] == heads)
        ]
        naive = set(sizes.loc[sizes["attention"] == "naive", "size_class"])
        flashed = sizes[sizes["attention"] == "flash"]
        gone = sizes[(sizes["attention"] == "naive") & ~sizes["size_class"].isin(flashed["size_class"])]
        new = flashed[~flashed["size_class"].isin(naive)]
        sentences.append(
            f"Measured, {mode}, {heads} heads: flash keeps {_mib(r['flash'])} MiB against naive's "
            f"{_mib(r['naive'])} MiB ({_mib(r['flash'] - r['naive'], '+')} MiB)"
            + (
                "; gone: "
                + ", ".join(f"{s['size_class']} ({_mib(s['mib'])} MiB)" for _, s in gone.iterrows())
                if len(gone)
                else ""
            )
            + (
                "; new: " + ", ".join(f"{s['size_class']} ({_mib(s['mib'])} MiB)" for _, s in new.iterrows())
                if len(new)
                else ""
            )
            + "."
        )
    why = (
        "The attention function saves only Q, K, V, O and the logsumexp L (B·h·T) instead of the probabilities "
        "(B·h·T²) and the causal mask (T²); V is a view of the QKV projection's output, so that output (3·B·T·d) "
        "stays alive whole, where naive attention's bmm kept a B·T·d copy of V."
    )
    classes = by_size.groupby("attention")["size_class"].agg(" ".join)
    shows = "B·h·T²" in classes.get("naive", "") and "3·B·T·d" in classes.get("flash", "")
    return " ".join(sentences) + (f" {why}" if shows else "") + f"\n\n{note}"


def handout(totals: pd.DataFrame, row: pd.Series, p: dict) -> str:
    ours = {
        "d_model": int(row["d_model"]),
        "d_ff": int(row["d_ff"]),
        "batch_size": p["batch_size"],
        "context_length": p["context_length"],
    }
    quoted = (
        f"The handout's number (2026 §3.2, its own reference block, not ours): **{HANDOUT_MIB:,.2f} MiB** saved "
        "by one compiled xl block (d_model 2560, d_ff 10240, 16 heads, batch 4, context 2048, naive attention), "
        "counted as every saved tensor's bytes except `nn.Parameter` objects."
    )
    if any(ours[k] != v for k, v in HANDOUT_SETUP.items() if k != "heads"):
        return quoted + " This run's dimensions differ, so there is no like-for-like number of ours."
    compiled = totals[
        (totals["module"] == "block")
        & (totals["attention"] == "naive")
        & (totals["heads"] == 16)
        & (totals["mode"] == "compiled")
        & (totals["status"] == "ok")
    ]
    if compiled.empty:
        return quoted + " Our compiled naive block with 16 heads was not measured in this run."
    r = compiled.iloc[0]
    return (
        quoted + f" Ours, same configuration: {r['handout_mib']:,.2f} MiB counted the handout's way "
        f"({r['handout_mib'] - HANDOUT_MIB:+,.2f} MiB against the handout's), {r['counted_mib']:,.2f} MiB with each "
        "storage once."
    )
