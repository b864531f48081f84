"""§1.1.5: accumulation accuracy, the dtypes autocast produces in the toy model, and bf16 against fp32 timings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from cs336_systems.report.analysis import paired_speedups, speedups_by_size, trend
from cs336_systems.report.context import Context, model_order, reason_if_not_run
from cs336_systems.report.formatting import md, not_run, provenance_line, speedup_sentences, speedup_table

EXACT = 10.0


def render(ctx: Context) -> str:
    tables = {Path(meta["file"]).stem: (frame, meta) for frame, meta in ctx.tables("mixed_precision")}
    return "\n".join(
        [
            "### Accumulation (mixed_precision_accumulation)",
            "",
            accumulation(tables.get("accumulation")),
            "",
            "### (a) Dtypes under autocast in the toy model",
            "",
            autocast_dtypes(tables.get("autocast_dtypes")),
            "",
            "### (b) Layer normalisation in low precision",
            "",
            layer_norm(tables.get("autocast_dtypes")),
            "",
            "### (c) bf16 autocast against fp32, end to end",
            "",
            bf16_timings(ctx),
        ]
    )


def accumulation(found: tuple[pd.DataFrame, dict[str, Any]] | None) -> str:
    if found is None:
        return not_run("The accumulation experiment")
    frame, meta = found
    rows = frame.set_index("variant")
    table = pd.DataFrame(
        {
            "accumulator": rows["accumulator_dtype"],
            "addend": rows["addend_dtype"],
            "how the addend is added": rows["addend_cast"],
            "result": rows["value"].map(lambda v: f"{v:.6f}"),
            "abs error vs 10": rows["abs_error"].map(lambda e: f"{e:.2e}"),
        }
    )
    steps, addend = int(rows["steps"].iloc[0]), float(rows["addend"].iloc[0])
    out = [
        provenance_line([meta]),
        f"{steps} additions of {addend} starting from 0; the exact sum is {EXACT:g}.",
        "",
    ]
    out += [table.reset_index().to_markdown(index=False, disable_numparse=True), ""]
    sentences = []
    fp32 = rows[(rows["accumulator_dtype"] == "float32") & (rows["addend_dtype"] == "float32")]
    fp16 = rows[(rows["accumulator_dtype"] == "float16") & (rows["addend_dtype"] == "float16")]
    mixed = rows[(rows["accumulator_dtype"] == "float32") & (rows["addend_dtype"] == "float16")]
    if len(fp32):
        e1 = fp32["abs_error"].iloc[0]
        spacing32 = float(np.spacing(np.float32(EXACT)))
        sentences.append(
            f"All-float32 accumulation is off by {e1:.1e}: {addend} has no exact binary representation and each "
            f"of the {steps} additions rounds to the float32 grid (spacing {spacing32:.1e} near 10)."
        )
    if len(fp16) and len(fp32):
        v2, e2 = fp16["value"].iloc[0], fp16["abs_error"].iloc[0]
        spacing16 = float(np.spacing(np.float16(v2)))
        sentences.append(
            f"A float16 accumulator ends at {v2:.4f}, {e2 / e1:.0f}× the float32 error: with 10 mantissa bits, "
            f"adjacent float16 numbers near {v2:.0f} are {spacing16:.4f} apart, the same order as the addend, so "
            "every addition is rounded by a large fraction of what it adds."
        )
    if len(mixed) >= 2:
        values = mixed["value"]
        representation = steps * (float(np.float16(addend)) - addend)
        same = values.nunique() == 1
        sentences.append(
            f"Adding a float16 addend to a float32 accumulator gives {values.iloc[0]:.6f} "
            + (
                "whether type promotion or an explicit cast makes it float32 (the two variants agree exactly): "
                if same
                else f"by type promotion and {values.iloc[1]:.6f} with an explicit cast: "
            )
            + f"the sum is float32 but the addend was rounded once to float16 ({np.float16(addend):.10f}), and "
            f"{steps} × that rounding is {representation:.6f}, "
            + (
                "exactly the observed error."
                if np.isclose(representation, mixed["abs_error"].iloc[0], rtol=1e-2)
                else f"against an observed error of {mixed['abs_error'].iloc[0]:.6f}."
            )
        )
    if len(fp16) and len(mixed) and mixed["abs_error"].max() < fp16["abs_error"].iloc[0] / 10:
        sentences.append(
            "Accumulating in float32 is what matters; storing inputs in low precision costs only their one-time "
            "rounding."
        )
    out.append(" ".join(sentences))
    return "\n".join(out)


def autocast_dtypes(found: tuple[pd.DataFrame, dict[str, Any]] | None) -> str:
    if found is None:
        return not_run("The autocast dtype experiment")
    frame, meta = found
    table = frame.pivot_table(
        index="quantity", columns="autocast_dtype", values="dtype", aggfunc="first", sort=False
    )
    table.columns = [f"under {c} autocast" for c in table.columns]
    how = frame.drop_duplicates("quantity").set_index("quantity")["observed_by"]
    table["observed by"] = how
    device = frame["device"].iloc[0]
    out = [
        provenance_line([meta]),
        f"ToyModel (fc1 → ReLU → LayerNorm → fc2, float32 parameters) run on **{device}**; autocast's rules "
        "differ between CPU and CUDA, so the device matters.",
        "",
        md(table.reset_index()),
        "",
    ]
    sentences = []
    for dtype, rows in frame.groupby("autocast_dtype", sort=False):
        low = rows[rows["dtype"] == dtype]["quantity"].tolist()
        full = rows[rows["dtype"] == "float32"]["quantity"].tolist()
        sentences.append(
            f"Under {dtype} autocast on {device}, {', '.join(low) or 'nothing'} "
            f"{'is' if len(low) == 1 else 'are'} {dtype} and {', '.join(full) or 'nothing'} "
            f"{'stays' if len(full) == 1 else 'stay'} float32."
        )
    if casts_only_matmuls(frame):
        sentences.append(
            "Autocast casts the inputs of matrix multiplies (fc1, fc2) to the low-precision type but never the "
            "stored parameters, whose gradients therefore come back float32; the loss (cross-entropy, a "
            "reduction) is computed in float32."
        )
    out.append(" ".join(sentences))
    return "\n".join(out)


def casts_only_matmuls(frame: pd.DataFrame) -> bool:
    """Whether, under every autocast dtype, the matmul outputs have that dtype and parameters, gradients and
    loss stay float32."""
    dtypes = frame.pivot_table(index="quantity", columns="autocast_dtype", values="dtype", aggfunc="first")
    needed = ["fc1 output", "logits", "parameters", "gradients", "loss"]
    if not set(needed) <= set(dtypes.index):
        return False
    low = dtypes.loc[["fc1 output", "logits"]] == dtypes.columns.to_numpy()
    return bool(
        low.all().all() and (dtypes.loc[["parameters", "gradients", "loss"]] == "float32").all().all()
    )


def layer_norm(found: tuple[pd.DataFrame, dict[str, Any]] | None) -> str:
    fp16, bf16, fp32 = torch.finfo(torch.float16), torch.finfo(torch.bfloat16), torch.finfo(torch.float32)
    observed = ""
    if found is not None:
        frame = found[0]
        ln = frame[frame["quantity"] == "layernorm output"].set_index("autocast_dtype")["dtype"]
        observed = (
            " Here, on "
            + frame["device"].iloc[0]
            + ", LayerNorm's output is "
            + ", ".join(f"{dtype} under {autocast} autocast" for autocast, dtype in ln.items())
            + (
                " (autocast on CUDA lists layer_norm among the ops it runs in float32)."
                if (ln == "float32").all()
                else " (on CUDA autocast runs layer_norm in float32; this device's autocast does not)."
            )
        )
    return (
        "The sensitive parts are the reductions and what follows them: the mean and the variance sum many values "
        f"and their squares, the variance gets ε added, and rsqrt divides by a possibly tiny number. In float16 "
        f"squares overflow beyond {fp16.max:.0f}, a small variance or ε = 1e-5 falls below the smallest normal "
        f"number ({fp16.smallest_normal:.1e}), and a long sum rounded to 10 mantissa bits (ε_machine "
        f"{fp16.eps:.1e}) loses the small differences x − mean that normalisation is about.{observed} bfloat16 "
        f"has float32's 8 exponent bits (max {bf16.max:.1e}, smallest normal {bf16.smallest_normal:.1e}, as "
        f"float32's {fp32.smallest_normal:.1e}), so overflow and underflow stop being the problem and no loss "
        f"scaling is needed; but with only 7 mantissa bits (ε_machine {bf16.eps:.1e}, {bf16.eps / fp16.eps:.0f}× "
        "float16's) its reductions are even less precise, so LayerNorm statistics should still be computed in "
        "float32 under bf16."
    )


@reason_if_not_run
def bf16_timings(ctx: Context) -> str:
    frame, metas = ctx.require("mixed_precision_e2e", "The bf16 end-to-end benchmark")
    order = model_order(metas)
    compared = paired_speedups(frame, "autocast", "none", "bf16", ["size", "context_length", "mode"])
    table = speedup_table(compared, order, {"baseline": "fp32 ms", "other": "bf16 autocast ms"})
    by_size = speedups_by_size(compared, order)
    steps = (
        frame[frame["status"] == "ok"].groupby(["size", "context_length", "mode", "autocast"]).size().max()
    )
    out = [
        provenance_line(metas),
        f"Batch size {frame['batch_size'].iloc[0]}, {frame['warmup'].iloc[0]} warm-up and {steps} timed steps; "
        "both precisions of a size run in the same job, one after the other. Median (± standard deviation) ms; "
        "speedup = fp32 median / bf16 median (above 1: bf16 is faster).",
        "",
        md(table, floatfmt=".2f"),
        "",
        speedup_sentences(by_size, "the bf16 speedup"),
        "",
        bf16_why(by_size, compared, metas[0]["params"].get("device")),
    ]
    return "\n".join(out)


def bf16_why(by_size: dict[str, pd.Series], compared: pd.DataFrame, device: str | None) -> str:
    """Why bf16 helps where it does: on a GPU only where its gain grows with model size in every mode, on a
    CPU only where bf16 is slower somewhere."""
    if device == "cpu":
        slower = (compared["speedup"] < 1).any()
        return "On a CPU without native bf16 arithmetic bf16 is emulated and can be slower." if slower else ""
    grows = len(by_size) and all(len(v) > 1 and trend(v).direction == "grows" for v in by_size.values())
    if not grows:
        return ""
    return (
        "Why: bf16 matrix multiplies run on tensor cores at several times the fp32 rate and move half the "
        "bytes, but autocast adds casts of weights and activations, and normalisation, softmax and the loss stay "
        "in fp32; a small model's step is dominated by kernel launches and these elementwise ops, so the gain "
        "appears as the matmuls grow."
    )
