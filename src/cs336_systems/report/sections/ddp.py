"""§2.2-2.3: the DDP correctness check; step times of our four wrappers beside PyTorch's DDP and one rank alone;
the overlap timeline; the bucket-size model with its optimum from the same run's all-reduce fit."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from cs336_systems.accounting.units import MIB
from cs336_systems.report.analysis import allreduce_fits, concurrency, step_stats
from cs336_systems.report.context import Context, NotRun, reason_if_not_run
from cs336_systems.report.formatting import count, num, or_dash, provenance_line, text_md

ORDER = ["naive", "flat", "overlap", "bucketed", "torch_ddp", "single"]
LABEL = {
    "naive": "naive (all-reduce per parameter, after backward)",
    "flat": "flat (one all-reduce, after backward)",
    "overlap": "overlap (async all-reduce per parameter, during backward)",
    "bucketed": "bucketed (ours)",
    "torch_ddp": "PyTorch DDP",
    "single": "one rank alone (floor)",
}
CELL = ["variant", "bucket_size_mb"]
COMPUTE_COLOR, COMM_COLOR = "tab:blue", "tab:orange"


def render(ctx: Context) -> str:
    return "\n\n".join(
        [
            f"### Correctness (naive_ddp)\n\n{check(ctx)}",
            "### Training-step benchmark (naive_ddp_benchmarking, minimal_ddp_flat_benchmarking, …)\n\n"
            + benchmark(ctx),
        ]
    )


# ---------------------------------------------------------------------------------------------------------
# §2.2.2 correctness


@reason_if_not_run
def check(ctx: Context) -> str:
    frame, metas = ctx.require("naive_ddp", "The DDP correctness check")
    out = [provenance_line(metas)]
    first = frame.iloc[0]
    out += [
        f"The toy model (fc1 → ReLU → LayerNorm → fc2) on {first['world_size']} ranks ({first['backend']}): every "
        "rank starts from its own random weights, the wrapper installs rank 0's, and each rank trains with SGD on "
        f"its {first['batch_per_rank']} examples of a shared random batch for {first['steps']} steps; a "
        "single-process replica of rank 0's initial model trains on the whole batch. Afterwards every rank's "
        f"parameters are compared with the replica's (`torch.allclose`, rtol {first['rtol']:g}, atol "
        f"{first['atol']:g}).",
        "",
        text_md(
            pd.DataFrame(
                {
                    "wrapper": frame["wrapper"],
                    "matches single-process training": frame["match"].map({True: "match", False: "MISMATCH"}),
                    "largest absolute difference": frame["max_abs_diff"].map(lambda x: f"{x:.1e}"),
                }
            )
        ),
        "",
    ]
    bad = frame[~frame["match"].astype(bool)]
    if bad.empty:
        out.append(
            f"All {len(frame)} wrappers match single-process training; the largest difference, "
            f"{frame['max_abs_diff'].max():.1e}, is float32 rounding from summing the gradients in another order."
        )
    else:
        out.append(
            f"Mismatch for {', '.join(bad['wrapper'])}: these wrappers do not average gradients correctly."
        )
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# §2.2.3, §2.3.1-2.3.3 benchmark


def benchmark(ctx: Context) -> str:
    try:
        frame, metas = ctx.require("ddp", "The DDP benchmark")
    except NotRun as reason:  # the bucket-size model needs no measurement
        return f"{reason}\n\n{bucket_model_text()}"
    out = [provenance_line(metas)]
    stats = cell_stats(frame)
    ok = stats[~stats["oom"]]
    first = frame[frame["status"] == "ok"].iloc[0]
    floor = ok[ok["variant"] == "single"]["median_ms"]
    floor_ms = floor.iloc[0] if len(floor) else math.nan
    fits = allreduce_fit(ctx, first["backend"], int(first["world_size"]))
    s_bytes = float(first["param_bytes"])
    on_gpu = first["device"] == "cuda"
    out += [
        f"Model {first['size']} (d_model {first['d_model']}, {first['num_layers']} layers, "
        f"{count(s_bytes / 4)} fp32 parameters = {s_bytes / MIB:,.3g} MB of gradients in "
        f"{first['num_tensors']} tensors), {first['batch_size_per_rank']} sequences of {first['context_length']} "
        f"tokens per rank, {first['world_size']} ranks on {first['backend']} ({'one GPU each' if on_gpu else 'CPU'}"
        f"), AdamW. Per variant a fresh model, {first['warmup']} warm-up and {stats['steps'].max():.0f} timed steps "
        "(zero_grad, forward, backward, gradient synchronisation, optimizer step) between device "
        "synchronisations; a step's time is the slowest rank's. *Communication* is the time blocked in "
        "`finish_gradient_synchronization`: all of it for naive and flat, only what backward did not hide for "
        "overlap and bucketed; PyTorch DDP's cannot be separated from its backward. The floor runs the same "
        "step on one rank without any communication. Median and min–max in ms.",
        "",
        text_md(benchmark_table(stats, floor_ms)),
        "",
        text_md(bucket_table(ok)),
        "",
        comparisons(ok, floor_ms, fits, on_gpu),
        "",
        ctx.figure(
            plot(ok, floor_ms, optimum_mb(s_bytes, fits)), f"ddp_{ctx.run}", "DDP step times per variant"
        ),
        "",
        "### Overlap of computation and communication (ddp_overlap_individual_parameters_benchmarking b)",
        "",
        timeline(ctx, ok, on_gpu),
        "",
        bucket_model_text(),
        "",
        bucket_model_numbers(ok, floor_ms, s_bytes, fits, first),
    ]
    return "\n".join(out)


def cell_stats(frame: pd.DataFrame) -> pd.DataFrame:
    """Median, min and max of step time and median communication time per (variant, bucket size); OOM cells
    flagged."""
    frame = frame.assign(bucket_size_mb=frame["bucket_size_mb"].fillna(0.0))
    ok = frame[frame["status"] == "ok"].assign(comm_share=lambda f: f["comm_ms"] / f["step_ms"])
    extra = ok.groupby(CELL).agg(
        comm_ms=("comm_ms", "median"),
        comm_share=("comm_share", "median"),
        buckets=("num_buckets", "first"),
        num_tensors=("num_tensors", "first"),
    )
    stats = step_stats(frame, CELL, "step_ms").join(extra, on=CELL)
    stats["oom"] = stats["oom"].eq(True)
    stats["order"] = stats["variant"].map(ORDER.index)
    return stats.sort_values(["order", "bucket_size_mb"]).reset_index(drop=True)


def name(variant: str, bucket_mb: float) -> str:
    return LABEL[variant] + (f", {bucket_mb:g} MB buckets" if bucket_mb else "")


def benchmark_table(stats: pd.DataFrame, floor_ms: float) -> pd.DataFrame:
    rows = []
    for _, r in stats.iterrows():
        if r["oom"]:
            rows.append({"variant": name(r["variant"], r["bucket_size_mb"]), "step (ms)": "OOM"})
            continue
        overhead = r["median_ms"] - floor_ms
        rows.append(
            {
                "variant": name(r["variant"], r["bucket_size_mb"]),
                "buckets": "" if pd.isna(r["buckets"]) else f"{r['buckets']:.0f}",
                "step (ms)": f"{r['median_ms']:.1f}",
                "min–max": f"{r['min_ms']:.1f}–{r['max_ms']:.1f}",
                "communication (ms)": or_dash("{:.1f}")(r["comm_ms"]),
                "share of step": or_dash("{:.0%}")(r["comm_share"]),
                "over the floor": ""
                if r["variant"] == "single"
                else f"{overhead:+.1f} ms ({overhead / floor_ms:+.1%})",
            }
        )
    return pd.DataFrame(rows).fillna("")


def bucket_table(ok: pd.DataFrame) -> pd.DataFrame:
    """Our bucketed wrapper and PyTorch's DDP side by side per bucket size."""
    wide = ok[ok["variant"].isin(["bucketed", "torch_ddp"])].pivot_table(
        index="bucket_size_mb", columns="variant", values="median_ms"
    )
    table = pd.DataFrame({"bucket size (MB)": [f"{b:g}" for b in wide.index]})
    for variant in ("bucketed", "torch_ddp"):
        if variant in wide:
            table[f"{LABEL[variant]} (ms)"] = [f"{v:.1f}" for v in wide[variant]]
    if {"bucketed", "torch_ddp"} <= set(wide.columns):
        table["ours / PyTorch"] = [f"{v:.2f}" for v in wide["bucketed"] / wide["torch_ddp"]]
    return table


def median_of(ok: pd.DataFrame, variant: str, column: str = "median_ms") -> float:
    rows = ok[ok["variant"] == variant]
    return rows[column].iloc[0] if len(rows) else math.nan


def comparisons(ok: pd.DataFrame, floor_ms: float, fits: pd.Series | None, on_gpu: bool) -> str:
    sentences = []
    naive, flat, overlap = (median_of(ok, v) for v in ("naive", "flat", "overlap"))
    naive_comm, flat_comm, overlap_comm = (median_of(ok, v, "comm_ms") for v in ("naive", "flat", "overlap"))
    tensors = int(ok["num_tensors"].dropna().iloc[0])
    if not math.isnan(naive) and not math.isnan(flat):
        text = (
            f"**Naive vs flat.** One all-reduce of all gradients instead of {tensors} takes the step from "
            f"{naive:.1f} to {flat:.1f} ms ({flat / naive - 1:+.1%}) and the communication from {naive_comm:.1f} "
            f"to {flat_comm:.1f} ms ({flat_comm - naive_comm:+.1f} ms). The bytes are the same, so batching "
            "can only remove per-call costs"
        )
        if fits is not None:
            predicted = (tensors - 1) * fits["alpha_s"] * 1e3
            saved = naive_comm - flat_comm
            text += (
                f": at the fitted α = {num(fits['alpha_s'] * 1e6)} µs per call the {tensors - 1} calls it removes "
                f"predict {predicted:.1f} ms, and {saved:.1f} ms ({saved / predicted:.0%} of that) is saved"
            )
            if saved < 0.5 * predicted:
                text += (
                    ". α was fitted on isolated calls, each waited for; the naive wrapper queues its calls back to "
                    "back on the communication stream, so most of their fixed cost overlaps the previous transfer"
                )
        sentences.append(text + ".")
    if not math.isnan(naive) and not math.isnan(overlap):
        hidden = 1 - overlap_comm / naive_comm if naive_comm > 0 else math.nan
        sentences.append(
            f"**Overlap vs naive.** Launching each parameter's all-reduce from its gradient hook takes the step from "
            f"{naive:.1f} to {overlap:.1f} ms ({overlap / naive - 1:+.1%}); the communication left after backward "
            f"drops from {naive_comm:.1f} to {overlap_comm:.1f} ms, so {hidden:.0%} of naive's communication time "
            "is now hidden behind the backward pass"
            + (
                f". Hidden is not free: the step still takes {overlap - floor_ms:.1f} ms more than one rank "
                + (
                    "alone, as NCCL's kernels share the GPU's SMs and memory bandwidth with backward's."
                    if on_gpu
                    else "alone, as gloo's threads share the CPU's cores and memory bandwidth with backward's."
                )
                if not math.isnan(floor_ms) and overlap - floor_ms > overlap_comm + 0.01 * floor_ms
                else "."
            )
        )
    ours = ok[ok["variant"] == "bucketed"].set_index("bucket_size_mb")["median_ms"]
    theirs = ok[ok["variant"] == "torch_ddp"].set_index("bucket_size_mb")["median_ms"]
    if len(ours):
        best = ours.idxmin()
        text = f"**Buckets vs PyTorch DDP.** Our fastest bucket size is {best:g} MB ({ours[best]:.1f} ms"
        if best in theirs.index:
            text += f"; PyTorch DDP with the same `bucket_cap_mb` takes {theirs[best]:.1f} ms, ratio {ours[best] / theirs[best]:.2f}"
        if len(theirs):
            text += f"; PyTorch's fastest is {theirs.idxmin():g} MB at {theirs.min():.1f} ms"
        spread = ours.max() / ours.min() - 1
        sentences.append(text + f"). Across bucket sizes our step time varies by {spread:.1%}.")
    if not math.isnan(floor_ms):
        distributed = ok[ok["variant"] != "single"]
        best_row = distributed.loc[distributed["median_ms"].idxmin()]
        sentences.append(
            f"**Overhead over the floor.** One rank alone takes {floor_ms:.1f} ms per step; the fastest "
            f"data-parallel variant, {name(best_row['variant'], best_row['bucket_size_mb'])}, adds "
            f"{best_row['median_ms'] - floor_ms:+.1f} ms ({best_row['median_ms'] / floor_ms - 1:+.1%}), naive "
            f"{naive - floor_ms:+.1f} ms ({naive / floor_ms - 1:+.1%})."
        )
    return "\n\n".join(sentences)


def plot(ok: pd.DataFrame, floor_ms: float, best_mb: float | None) -> plt.Figure:
    fig, (ax_bar, ax_sweep) = plt.subplots(1, 2, figsize=(13, 0.45 * len(ok) + 1.8), width_ratios=[1.4, 1])
    labels = [name(v, b) for v, b in zip(ok["variant"], ok["bucket_size_mb"], strict=True)]
    y = np.arange(len(ok))[::-1]
    ax_bar.barh(y, ok["median_ms"], color=COMPUTE_COLOR, label="step (median)")
    ax_bar.barh(y, ok["comm_ms"].fillna(0), color=COMM_COLOR, label="communication after backward")
    ax_bar.errorbar(
        ok["median_ms"],
        y,
        xerr=[ok["median_ms"] - ok["min_ms"], ok["max_ms"] - ok["median_ms"]],
        fmt="none",
        color="k",
    )
    if not math.isnan(floor_ms):
        ax_bar.axvline(floor_ms, color="k", linestyle=":", label="floor (one rank)")
    ax_bar.set_yticks(y, labels, fontsize=8)
    ax_bar.set(xlabel="ms per step")
    ax_bar.legend(fontsize=8, loc="lower right")
    for variant, marker in (("bucketed", "o-"), ("torch_ddp", "s--")):
        rows = ok[ok["variant"] == variant]
        if len(rows):
            ax_sweep.semilogx(rows["bucket_size_mb"], rows["median_ms"], marker, label=LABEL[variant])
    for variant, style in (("naive", "r-."), ("flat", "g-."), ("overlap", "m-."), ("single", "k:")):
        value = median_of(ok, variant)
        if not math.isnan(value):
            ax_sweep.axhline(
                value, linestyle=style[1:], color=style[0], label=LABEL[variant].split(" (")[0], lw=1
            )
    if best_mb is not None:
        ax_sweep.axvline(best_mb, color="gray", lw=4, alpha=0.3, label="model optimum b*")
    ax_sweep.set(xlabel="bucket size (MB)", ylabel="ms per step", title="bucket-size sweep")
    ax_sweep.legend(fontsize=7)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------------------
# §2.3.2 (b) the overlap picture


@reason_if_not_run
def timeline(ctx: Context, ok: pd.DataFrame, on_gpu: bool) -> str:
    frame, _ = ctx.require("ddp_timeline", "The profiler timeline")
    frame = frame[frame["status"] == "ok"].assign(bucket_size_mb=frame["bucket_size_mb"].fillna(0.0))
    ours = ok[ok["variant"] == "bucketed"]
    best_bucket = ours.loc[ours["median_ms"].idxmin(), "bucket_size_mb"] if len(ours) else None
    shown = [("naive", 0.0), ("overlap", 0.0)] + (
        [("bucketed", best_bucket)] if best_bucket is not None else []
    )
    shown = [(v, b) for v, b in shown if ((frame["variant"] == v) & (frame["bucket_size_mb"] == b)).any()]
    if not shown:
        return "_The timeline has none of the variants to show._"
    where = (
        "Kernels of one training step on rank 0's GPU, by CUDA stream, from the PyTorch profiler (the last of the "
        "traced steps, after warm-up): compute kernels blue, NCCL kernels orange."
        if on_gpu
        else "This run has no GPU: the lanes are threads of rank 0 (the main thread's outermost operators, and "
        "gloo's collectives, which run on gloo's own worker threads) in one traced training step; compute blue, "
        "communication orange."
    )
    overlap_rows = [overlap_stats(frame, v, b) for v, b in shown]
    sentences = [
        f"{name(r['variant'], r['bucket_size_mb'])}: {r['comm_ms']:.1f} ms of communication, "
        f"{r['overlapped']:.0%} of it concurrent with computation ({r['comm_ms'] * (1 - r['overlapped']):.1f} ms "
        "exposed)."
        for r in overlap_rows
    ]
    out = [
        where,
        "",
        ctx.figure(
            plot_timeline(frame, shown), f"ddp_timeline_{ctx.run}", "compute and communication per lane"
        ),
        "",
        " ".join(sentences),
        "",
        overlap_why(overlap_rows),
    ]
    return "\n".join(out)


def overlap_why(rows: list[dict]) -> str:
    """How the wrappers differ on the timeline, where the overlapping ones do overlap more than naive."""
    shares = {r["variant"]: r["overlapped"] for r in rows}
    others = [share for variant, share in shares.items() if variant != "naive"]
    if "naive" not in shares or not others or min(others) <= shares["naive"]:
        return ""
    return (
        "Naive DDP waits for the whole backward pass and then all-reduces, so its communication sits in a block "
        "after the last compute kernel; the overlapping wrappers launch each all-reduce from the gradient hook, so "
        "it runs on the communication stream while the compute stream continues with earlier layers' backward, "
        "and only the last gradients' all-reduce is left after backward."
    )


def overlap_stats(frame: pd.DataFrame, variant: str, bucket_mb: float) -> dict:
    """Communication time (union of its intervals) and the share of it concurrent with computation."""
    rows = frame[(frame["variant"] == variant) & (frame["bucket_size_mb"] == bucket_mb)]
    spans = {
        is_comm: list(zip(part["start_ms"], part["end_ms"], strict=True))
        for is_comm, part in ((True, rows[rows["communication"]]), (False, rows[~rows["communication"]]))
    }
    comm_ms, overlapped = concurrency(spans[True], spans[False])
    return {"variant": variant, "bucket_size_mb": bucket_mb, "comm_ms": comm_ms, "overlapped": overlapped}


def plot_timeline(frame: pd.DataFrame, shown: list[tuple[str, float]]) -> plt.Figure:
    fig, axes = plt.subplots(
        len(shown), 1, figsize=(13, 1.3 + 1.1 * len(shown) * 2), squeeze=False, sharex=True
    )
    for ax, (variant, bucket_mb) in zip(axes[:, 0], shown, strict=True):
        rows = frame[(frame["variant"] == variant) & (frame["bucket_size_mb"] == bucket_mb)]
        # Lanes with computation first, then the communication-only ones; busiest first.
        busy = (
            rows.assign(ms=rows["end_ms"] - rows["start_ms"])
            .groupby("lane")
            .agg(comm=("communication", "all"), ms=("ms", "sum"))
        )
        lanes = list(busy.sort_values(["comm", "ms"], ascending=[True, False]).index)
        for position, lane in enumerate(lanes):
            on_lane = rows[rows["lane"] == lane]
            for is_comm, color in ((False, COMPUTE_COLOR), (True, COMM_COLOR)):
                part = on_lane[on_lane["communication"] == is_comm]
                spans = list(zip(part["start_ms"], part["end_ms"] - part["start_ms"], strict=True))
                ax.broken_barh(spans, (len(lanes) - position - 0.4, 0.8), color=color, linewidth=0)
        ax.set_yticks([len(lanes) - i for i in range(len(lanes))], lanes, fontsize=8)
        ax.set_title(name(variant, bucket_mb), fontsize=9, loc="left")
        ax.set_xlim(0, max(ax.get_xlim()[1], rows["end_ms"].max() * 1.01))
    axes[-1, 0].set_xlabel("ms from the start of the step")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (COMPUTE_COLOR, COMM_COLOR)]
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.legend(handles, ["computation", "communication"], loc="upper center", ncol=2, fontsize=8)
    return fig


# ---------------------------------------------------------------------------------------------------------
# §2.3.3 (b) the bucket model


def allreduce_fit(ctx: Context, backend: str, world_size: int) -> pd.Series | None:
    """α and β of this run's all-reduce benchmark for the DDP run's backend and world size, if it ran."""
    found = ctx.table("allreduce")
    if found is None:
        return None
    frame, _ = found
    fits = allreduce_fits(frame[frame["status"] == "ok"].sort_values("size_mb"))
    match = fits[(fits["backend"] == backend) & (fits["world_size"] == world_size)]
    return match.iloc[0] if len(match) and match["alpha_s"].iloc[0] > 0 else None


def optimum_mb(s_bytes: float, fits: pd.Series | None) -> float | None:
    if fits is None:
        return None
    return math.sqrt(s_bytes * fits["alpha_s"] / fits["beta_s_per_byte"]) / MIB


def bucket_model_text() -> str:
    return r"""### Bucket-size model (ddp_bucketed_benchmarking b)

Let $s$ be the bytes of gradients, $w$ the all-reduce bandwidth (bytes/s), $o$ the fixed cost of one
all-reduce call, and split the gradients into $n_b$ equal buckets of $s/n_b$ bytes. One bucket's all-reduce takes
$o + s/(n_b w)$. The assumption: computing one bucket's gradients takes as long as transferring them,
$t = s/(n_b w)$, so bucket $k = 1 \dots n_b$ is ready at $k t$ and backward ends at $n_b t$. The all-reduces run one
after another on one stream; bucket $k$'s starts at $\max(k t, e_{k-1})$, where $e_k$ is when it ends. From
$e_1 = 2t + o$, induction gives $e_k = (k+1)\,t + k\,o$ (each start is the previous end, since
$e_{k-1} = k t + (k-1) o \ge k t$). The overhead of DDP, the time after backward until the last all-reduce ends:

$$\text{overhead}(n_b) = e_{n_b} - n_b t = \frac{s}{n_b\,w} + n_b\,o
\qquad\text{or, with bucket size } b = s/n_b:\qquad \text{overhead}(b) = \frac{b}{w} + \frac{o\,s}{b}.$$

The last bucket's transfer is exposed, and every call adds its fixed cost $o$ (transfers keep pace with
computation, so the per-call costs accumulate). Setting $\frac{d}{d n_b} = -\frac{s}{n_b^2 w} + o = 0$:

$$n_b^* = \sqrt{\frac{s}{o\,w}},\qquad b^* = \frac{s}{n_b^*} = \sqrt{s\,o\,w},\qquad
\text{overhead}^* = 2\sqrt{\frac{s\,o}{w}}.$$

Smaller buckets expose less of the last transfer but pay the per-call cost more often; $b^*$ balances the two."""


def bucket_model_numbers(
    ok: pd.DataFrame, floor_ms: float, s_bytes: float, fits: pd.Series | None, first: pd.Series
) -> str:
    if fits is None:
        return (
            f"_This run has no all-reduce fit for {first['backend']} with {first['world_size']} processes (or a "
            "non-positive α), so the optimum is not evaluated._"
        )
    o, w = fits["alpha_s"], 1 / fits["beta_s_per_byte"]
    b_star = math.sqrt(s_bytes * o * w)
    rows = []
    for _, r in ok[ok["variant"] == "bucketed"].iterrows():
        nb = r["buckets"]
        rows.append(
            {
                "bucket size (MB)": f"{r['bucket_size_mb']:g}",
                "buckets": f"{nb:.0f}",
                "model s/(n_b w) + n_b o (ms)": f"{(s_bytes / (nb * w) + nb * o) * 1e3:.1f}",
                "measured over the floor (ms)": f"{r['median_ms'] - floor_ms:.1f}",
                "measured communication after backward (ms)": f"{r['comm_ms']:.1f}",
            }
        )
    ours = ok[ok["variant"] == "bucketed"].set_index("bucket_size_mb")["median_ms"]
    text = (
        f"With this run's all-reduce fit for {first['backend']} on {first['world_size']} processes, "
        f"$o \\approx \\alpha$ = {num(o * 1e6)} µs and $w = 1/\\beta$ = {num(w / 1e9)} GB/s, and "
        f"$s$ = {num(s_bytes / MIB)} MB: $b^* = \\sqrt{{s o w}}$ = {num(b_star / MIB)} MB "
        f"($n_b^*$ ≈ {s_bytes / b_star:.1f}), predicted overhead {num(2 * math.sqrt(s_bytes * o / w) * 1e3)} ms; "
        f"the whole gradient's transfer alone, $s/w$, is {num(s_bytes / w * 1e3)} ms."
    )
    if len(ours):
        best, nearest = ours.idxmin(), min(ours.index, key=lambda b: abs(math.log(b * MIB / b_star)))
        text += f" The measured sweep is fastest at {best:g} MB"
        if best == nearest:
            text += ", the configured size nearest the model's optimum."
        else:
            gap = ours[nearest] - ours[best]
            text += (
                f"; {nearest:g} MB, the configured size nearest the optimum, is {gap:.1f} ms slower"
                + (" (within the step-to-step noise)" if gap < 0.01 * ours[best] else "")
                + ". The model assumes that computing and transferring a bucket take equally long, and it ignores "
                "the wait for the first bucket and the contention of communication and computation for the same "
                "GPU (or CPU cores) and memory" + contention(ok[ok["variant"] == "bucketed"], floor_ms)
            )
    return "\n".join([text_md(pd.DataFrame(rows)), "", text]) if rows else text


def contention(bucketed: pd.DataFrame, floor_ms: float) -> str:
    """The end of the sentence on what the bucket model ignores: that contention costs more than the exposed
    transfers, where every bucket size's overhead over the floor exceeds its communication after backward."""
    ratio = (bucketed["median_ms"] - floor_ms) / bucketed["comm_ms"]
    if ratio.empty or ratio.isna().any() or (ratio <= 1).any():
        return "."
    return (
        ", which here costs more than the exposed transfers: the measured overhead over the floor is "
        f"{ratio.min():.2g}–{ratio.max():.2g}× the communication left after backward."
    )
