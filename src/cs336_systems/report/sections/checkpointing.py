"""2026 §3.2: activation checkpointing, every policy of one size per autocast setting, the best one-level K
beside the residual model's optimum, selective against every:1, and (a) the nested strategy over depths."""

from __future__ import annotations

import pandas as pd

from cs336_systems.accounting.units import MIB
from cs336_systems.report.analysis import (
    analytic_optimum,
    best_one_level,
    checkpointing_cells,
    nested_asymptotics,
    ratio_of,
    time_baseline,
)
from cs336_systems.report.context import Context, reason_if_not_run
from cs336_systems.report.formatting import md, num, or_dash, provenance_line, text_md

PRECISION = {"none": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast"}
SKETCH = """```python
def nested(blocks, x):  # the top call is not checkpointed; each half is, recursively
    if len(blocks) == 1:
        return blocks[0](x)
    half = (len(blocks) + 1) // 2
    x = checkpoint(nested, blocks[:half], x, use_reentrant=False)
    return checkpoint(nested, blocks[half:], x, use_reentrant=False)
```"""


def render(ctx: Context) -> str:
    frame, metas = ctx.require("checkpointing", "Activation checkpointing")
    p = metas[0]["params"]
    on_cuda = "peak" in measured_column(frame)
    out = [
        provenance_line(metas),
        f"Model {p['size']} (d_model {p['d_model']}, d_ff {p['d_ff']}, {p['num_layers']} blocks), batch {p['batch_size']}, "
        f"context {p['context_length']}, {p['attention']} attention; per cell a fresh model with the policy as "
        f"`ModelConfig.checkpoint` (`torch.utils.checkpoint`, non-reentrant), {p['warmup']} warm-up train step(s), "
        + ("one step measured for memory, " if on_cuda else "")
        + f"the median of {p['steps']} timed steps, and the bytes one forward saves for "
        "backward (saved-tensor hooks plus selective checkpointing's cached outputs, each storage once). "
        + (
            "Peak = `torch.cuda.max_memory_allocated` before the optimizer step (reset per cell); activations = "
            "peak − memory with the gradients freed (weights + AdamW state); "
            if on_cuda
            else ""
        )
        + ("predicted" if on_cuda else "Predicted")
        + " = the residual model "
        "(`cs336_systems.model.checkpointing.predicted_peak`: R bytes saved per block, checkpoints of c bytes, gradients "
        "of w bytes per block appearing as backward runs) from one block's measured R, c and w.",
        "",
    ]
    if not on_cuda:
        out += [
            "Memory is measured on CUDA only; this run shows the bytes saved for backward in one forward instead.",
            "",
        ]
    cells, blocks = frame[frame["record"] == "cell"], frame[frame["record"] == "block"]
    ran = cells[cells["status"] == "ok"]
    if ran[ran["policy"].str.startswith("selective")]["saved_bytes"].isna().any():
        out += [
            "Saved for backward is — for a selective policy where this torch (before 2.12) does not show the "
            "policy the outputs it caches.",
            "",
        ]
    for autocast in [a for a in ("none", "bf16", "fp16") if a in set(cells["autocast"])]:
        block = blocks[blocks["autocast"] == autocast].iloc[0]
        table = checkpointing_cells(cells[cells["autocast"] == autocast], block)
        out += [f"### {PRECISION[autocast]}", "", policy_section(ctx, table, block, autocast, on_cuda, p), ""]
    out += [
        "### (a) The memory-optimal strategy: nested checkpointing",
        "",
        depth_section(ctx, frame, blocks),
    ]
    return "\n".join(out)


def measured_column(frame: pd.DataFrame) -> str:
    ok = frame[(frame["record"] == "cell") & (frame["status"] == "ok")]
    has_peak = "forward_backward_peak_mib" in ok and ok["forward_backward_peak_mib"].notna().any()
    return "forward_backward_peak_mib" if has_peak else "saved_mib"


def cell(row: pd.Series, column: str, fmt: str = "{:,.0f}") -> str:
    if row["status"] != "ok":
        return str(row["status"])
    return fmt.format(row[column]) if column in row and pd.notna(row[column]) else "—"


def policy_table(table: pd.DataFrame, on_cuda: bool) -> tuple[str, str | None]:
    baseline = time_baseline(table)
    shown = pd.DataFrame({"policy": table["policy"]})
    if on_cuda:
        shown["peak MiB"] = table.apply(cell, axis=1, column="forward_backward_peak_mib")
        shown["activations MiB"] = table.apply(cell, axis=1, column="activation_peak_mib")
        shown["step peak MiB"] = table.apply(cell, axis=1, column="step_peak_mib")
    shown["saved for backward MiB"] = table.apply(cell, axis=1, column="saved_mib", fmt="{:,.1f}")
    shown["predicted MiB"] = table["predicted_mib"].map(or_dash("{:,.1f}"))
    shown["step ms"] = table.apply(cell, axis=1, column="median_ms", fmt="{:,.1f}")
    if baseline:
        shown[f"time vs {baseline[0]}"] = [
            f"{ms / baseline[1] - 1:+.0%}" if status == "ok" and pd.notna(ms) else "—"
            for status, ms in zip(table["status"], table["median_ms"], strict=True)
        ]
    shown["block forwards"] = table["forward_evaluations"]
    return text_md(shown.astype(str)), baseline[0] if baseline else None


def policy_section(
    ctx: Context, table: pd.DataFrame, block: pd.Series, autocast: str, on_cuda: bool, params: dict
) -> str:
    text, _ = policy_table(table, on_cuda)
    if not on_cuda:
        text += "\n\n" + saved_against_predicted(table, block, params)
    n = int(block["num_layers"])
    r, c, w = (block[k] / MIB for k in ("residual_bytes", "checkpoint_bytes", "grad_bytes_per_block"))
    optimum = analytic_optimum(block)
    sentences = [
        f"One block saves R = {num(r)} MiB for backward, a checkpoint (one block input) is c = {num(c)} MiB and a "
        f"block's gradients w = {num(w)} MiB. The model's optimum one-level K* = {optimum['k']} (predicted "
        f"{optimum['predicted_mib']:,.1f} MiB of activations and gradients; without gradients K = "
        f"{optimum['k_activations_only']}, near √(N c / R) = {optimum['k_continuous']:.2f})."
    ]
    if on_cuda:
        sentences += best_k_sentences(table, optimum) + selective_sentences(table)
    figure = policy_figure(ctx, table, n, autocast, on_cuda)
    return "\n\n".join([text, " ".join(sentences), figure])


def saved_against_predicted(table: pd.DataFrame, block: pd.Series, params: dict) -> str:
    """Why saved for backward and predicted differ (shown where they stand side by side without a peak): what
    `checkpointing.saved_bytes` counts over the whole model's forward against what `predicted_peak` models."""
    text = (
        "**Saved for backward and predicted count different things.** *Saved for backward* is what one forward of "
        "the whole model holds for backward when it ends, before any backward has run: every tensor autograd saves "
        "in the embedding, the blocks, the final norm, the LM head and the loss, and selective checkpointing's "
        "cached outputs, each storage once; no gradients. Parameters are left out, but our Linear layers save their "
        "weight as a transposed view, which is counted: a block's R includes its weights, and the whole model's "
        "count includes the LM head's. *Predicted* is the residual model's peak during backward for the blocks alone: the "
        "checkpoints and recomputed residuals still held (from one block's R and c) plus the gradients of the "
        "blocks whose backward has already run (w each); nothing outside the blocks."
    )
    none = table[(table["policy"] == "none") & (table["status"] == "ok")]
    if len(none) and pd.notna(none["saved_mib"].iloc[0]):
        n, r = int(block["num_layers"]), block["residual_bytes"] / MIB
        outside = none["saved_mib"].iloc[0] - n * r
        p = params
        loss = (
            f" (mostly the loss's batch × context × vocabulary float32 log-softmax, "
            f"{p['batch_size'] * p['context_length'] * p['vocab_size'] * 4 / MIB:,.1f} MiB, and the LM head's weight)"
            if {"batch_size", "context_length", "vocab_size"} <= set(p)
            else ""
        )
        text += (
            f" Without checkpointing, saved for backward − N × R = {none['saved_mib'].iloc[0]:,.2f} − {n} × "
            f"{r:,.3f} = {outside:,.2f} MiB lies outside the blocks{loss}, the same under every policy; the "
            f"predicted peak instead adds the gradients of up to N − 1 = {n - 1} block(s), "
            f"{block['grad_bytes_per_block'] / MIB:,.2f} "
            "MiB each, which saved for backward never holds. Compare each column down the policies, not one with "
            "the other."
        )
    return text


def best_k_sentences(table: pd.DataFrame, optimum: dict) -> list[str]:
    best = best_one_level(table, "forward_backward_peak_mib")
    if best is None:
        return ["No every:K cell ran."]

    def beside(side: dict | None, word: str) -> str:
        if side is None:
            return f"there is no {word} K"
        return f"every:{side['k']} " + (
            f"peaks at {side['value']:,.0f} MiB" if side["value"] else f"is {side['status']}"
        )

    row = table[table["policy"] == f"every:{best['k']}"].iloc[0]
    predicted_total = row["base_mib"] + optimum["predicted_mib"]
    gap = best["value"] / predicted_total - 1
    return [
        f"(b) The memory-optimal one-level K measured is every:{best['k']} at {best['value']:,.0f} MiB; "
        f"{beside(best['smaller'], 'smaller')}, {beside(best['larger'], 'larger')}.",
        f"The model's K* = {optimum['k']} "
        + ("is" if optimum["k"] == best["k"] else "is not")
        + " the measured "
        f"best; its predicted peak with the measured {row['base_mib']:,.0f} MiB of weights and AdamW state is "
        f"{predicted_total:,.0f} MiB, and the measured best is {gap:+.1%} from it: "
        + ("within" if abs(gap) <= 0.05 else "not within")
        + " the 5 % goal.",
    ]


def selective_sentences(table: pd.DataFrame) -> list[str]:
    """Each selective policy against every:1: the goal is a faster step at a peak within 1.5×."""
    sentences = []
    for policy in [p for p in table["policy"] if p.startswith("selective")]:
        time = ratio_of(table, policy, "every:1", "median_ms")
        peak = ratio_of(table, policy, "every:1", "forward_backward_peak_mib")
        if time is None or peak is None:
            sentences.append(f"{policy} and every:1 did not both run, so they are not compared.")
            continue
        met = time < 1 and peak <= 1.5
        sentences.append(
            f"{policy} takes {time:.3f}× every:1's step time at {peak:.2f}× its peak: the goal "
            f"(faster, peak within 1.5×) is {'met' if met else 'not met'}."
        )
    return sentences


def policy_figure(ctx: Context, table: pd.DataFrame, n: int, autocast: str, on_cuda: bool) -> str:
    import matplotlib.pyplot as plt

    column, label = (
        ("forward_backward_peak_mib", "peak MiB") if on_cuda else ("saved_mib", "saved for backward MiB")
    )
    ok = table[table["status"] == "ok"]
    every, others = ok[ok["k"].notna()], ok[ok["k"].isna()]
    baseline = time_baseline(table)
    fig, (memory, time) = plt.subplots(1, 2, figsize=(11, 4))
    memory.plot(every["k"], every[column], "o-", color="C0", label="every:K measured")
    if on_cuda:
        predicted = table[table["k"].notna()]
        memory.plot(
            predicted["k"],
            predicted["predicted_mib"] + ok["base_mib"].median(),
            "--",
            color="C1",
            label="every:K model",
        )
    for i, (_, row) in enumerate(others.iterrows()):
        memory.plot([n + 1 + i], [row[column]], "s", color=f"C{2 + i}", label=row["policy"])
        if baseline:
            time.plot(
                [n + 1 + i], [row["median_ms"] / baseline[1] - 1], "s", color=f"C{2 + i}", label=row["policy"]
            )
    if baseline:
        time.plot(every["k"], every["median_ms"] / baseline[1] - 1, "o-", color="C0", label="every:K")
        time.set(xlabel="K (others to the right)", ylabel=f"step time overhead vs {baseline[0]}")
        time.legend()
    memory.set(xlabel="K (others to the right)", ylabel=label, title=PRECISION[autocast])
    memory.legend()
    return ctx.figure(
        fig, f"checkpointing_{autocast}", f"{label} and time overhead against K, {PRECISION[autocast]}"
    )


def depth_section(ctx: Context, frame: pd.DataFrame, blocks: pd.DataFrame) -> str:
    depths = sorted(int(n) for n in blocks["num_layers"].unique())
    block = blocks.iloc[0]
    model = nested_asymptotics(sorted({*depths, 4, 8, 16, 32, 64}), block)
    text = [
        "Checkpoint each half of the block list, and inside each half each of its halves, down to single blocks "
        "(`checkpoint=nested`). In backward only the inputs along one path of the recursion are held, at most "
        "⌊log₂ N⌋ checkpoints, plus one recomputed block's residuals: O(R + c log N) peak activation memory, "
        "against N R without checkpointing and R + (N−1) c with one block per checkpoint. The price is compute: each "
        "level of the recursion runs the forward of the first half of each segment again (PyTorch stops a "
        "recomputation once the tensors it needs exist), so a step runs about 2N + (N/2)(log₂ N − 1) block "
        "forwards, O(N log N), against 2N for any one-level policy.",
        "",
        SKETCH,
        "",
        f"The model with this size's measured R and c ({PRECISION[block['autocast']]}), without gradients:",
        "",
        text_md(
            model.assign(**{c: model[c].map(num) for c in ("none_mib", "every:1_mib", "nested_mib")})
            .rename(
                columns={
                    "num_layers": "N",
                    "none_mib": "none MiB",
                    "every:1_mib": "every:1 MiB",
                    "nested_mib": "nested MiB",
                    "nested_checkpoints": "nested checkpoints held",
                    "every_1_forwards": "every:1 block forwards",
                    "nested_forwards": "nested block forwards",
                }
            )
            .astype(str)
        ),
        "",
        depth_study(ctx),
    ]
    return "\n".join(text)


@reason_if_not_run
def depth_study(ctx: Context) -> str:
    frame, metas = ctx.require("checkpointing_depths", "The depth study")
    p = metas[0]["params"]
    column = measured_column(frame)
    cells, blocks = frame[frame["record"] == "cell"], frame[frame["record"] == "block"]
    rows, checks, selective = [], [], []
    for n, group in cells.groupby("num_layers"):
        block = blocks[blocks["num_layers"] == n].iloc[0]
        table = checkpointing_cells(group, block)
        if column != "saved_mib":
            selective.append(f"- N = {int(n)}: " + " ".join(selective_sentences(table)))
        for _, row in table.iterrows():
            measured = row["activation_peak_mib"] if column != "saved_mib" else row["saved_mib"]
            rows.append(
                {
                    "N": int(n),
                    "policy": row["policy"],
                    "status": row["status"],
                    "measured MiB": measured if row["status"] == "ok" else None,
                    "predicted MiB": row["predicted_mib"],
                    "step ms": row["median_ms"],
                }
            )
            if column != "saved_mib" and row["status"] == "ok" and pd.notna(row["predicted_mib"]):
                checks.append(measured / row["predicted_mib"])
    shown = pd.DataFrame(rows)
    shown["predicted MiB"] = shown["predicted MiB"].map(or_dash("{:,.1f}"))
    what = (
        "activations = peak − weights and AdamW state"
        if column != "saved_mib"
        else "bytes saved for backward in one forward, which counts other things than predicted does (see "
        "above), as memory is measured on CUDA only"
    )
    text = [
        provenance_line(metas),
        f"Measured on {p['size']} at depths {', '.join(str(n) for n in sorted(cells['num_layers'].unique()))} "
        f"({what}; predicted = the residual model with gradients, from each depth's measured block):",
        "",
        md(shown, floatfmt=",.1f"),
    ]
    if checks:
        text += [
            "",
            f"Measured over predicted: {min(checks):.2f}–{max(checks):.2f} over the policies and depths.",
        ]
    if selective and any("selective" in line for line in selective):
        text += [
            "",
            "The selective policies against every:1 (peak = the whole step's before the optimizer):",
            "",
            *selective,
        ]
    return "\n".join(text)
