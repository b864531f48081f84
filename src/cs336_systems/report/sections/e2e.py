"""§1.1.3: forward / forward+backward / train-step times per model size and context length, and warm-up."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.ticker import LogFormatter, NullLocator

from cs336_systems.report.analysis import fewest_sufficient, step_stats
from cs336_systems.report.context import Context, model_order, on_gpu, reason_if_not_run
from cs336_systems.report.formatting import MODE_LABEL, md, provenance_line


def cell(row: pd.Series) -> str:
    return "OOM" if row.get("oom") is True else f"{row['mean_ms']:.1f} ± {row['std_ms']:.1f}"


def render(ctx: Context) -> str:
    frame, metas = ctx.require("e2e", "The end-to-end benchmark")
    order = model_order(metas)
    stats = step_stats(frame, ["size", "context_length", "mode"])
    stats = stats.sort_values(
        ["size", "context_length"], key=lambda c: c.map(order.index) if c.name == "size" else c
    )
    stats["cell"] = stats.apply(cell, axis=1)
    table = stats.pivot_table(
        index=["size", "context_length"], columns="mode", values="cell", aggfunc="first", sort=False
    )
    table = table.reindex(columns=[m for m in MODE_LABEL if m in table.columns]).rename(columns=MODE_LABEL)
    warm = frame["warmup"].iloc[0]
    steps = frame[frame["status"] == "ok"].groupby(["size", "context_length", "mode"]).size().max()
    out = [
        provenance_line(metas),
        f"Batch size {frame['batch_size'].iloc[0]}, {warm} warm-up steps, {steps} timed steps, fp32, "
        + (
            "`torch.cuda.synchronize()` after every step"
            if on_cuda(metas)
            else "on the CPU, where an operation has finished when it returns, so nothing is synchronised and a "
            "step's time is the wall-clock time of its call (`timeit.default_timer`)"
        )
        + "; mean ± standard deviation in milliseconds. `forward` is inference (no autograd graph).",
        "",
        md(table.reset_index()),
        "",
        findings(stats, order),
        "",
        ctx.figure(plot(stats, order), f"e2e_{ctx.run}", "end-to-end step time per model size"),
        "",
        warmup_study(ctx),
    ]
    return "\n".join(out)


def on_cuda(metas: list[dict]) -> bool:
    """Whether the benchmark ran on CUDA: its --device, or where that was `auto`, the machine's GPUs."""
    device = str(metas[0]["params"].get("device", "auto"))
    return device.startswith("cuda") or (device == "auto" and on_gpu(metas))


def findings(stats: pd.DataFrame, order: list[str]) -> str:
    ok = stats[stats["oom"] != True]  # noqa: E712 - NaN means ran
    sentences = []
    wide = ok.pivot_table(index=["size", "context_length"], columns="mode", values="mean_ms", sort=False)
    if {"forward", "forward_backward"} <= set(wide.columns):
        ratio = (wide["forward_backward"] / wide["forward"]).dropna()
        sentences.append(
            f"Forward+backward costs {ratio.min():.1f}–{ratio.max():.1f}× the forward pass "
            f"(median {ratio.median():.1f}×; backward does about twice the forward's matmul FLOPs)."
        )
    if {"forward_backward", "train_step"} <= set(wide.columns):
        extra = ((wide["train_step"] / wide["forward_backward"] - 1) * 100).dropna()
        med = extra.median()
        sentences.append(
            f"The AdamW step {'adds' if med >= 0 else 'changes'} {med:+.0f} % (median over cells) "
            "relative to forward+backward alone."
        )
    largest = next((size for size in reversed(order) if size in set(ok["size"])), None)
    if largest is not None:
        rows = ok[(ok["size"] == largest) & (ok["mode"] == "forward")].sort_values("context_length")
        if len(rows) >= 2:
            first, last = rows.iloc[0], rows.iloc[-1]
            sentences.append(
                f"For {largest}, going from context {first['context_length']} to {last['context_length']} "
                f"({last['context_length'] / first['context_length']:.0f}× the tokens) multiplies the forward time "
                f"by {last['mean_ms'] / first['mean_ms']:.1f}×."
            )
    spread = (ok["std_ms"] / ok["mean_ms"]).dropna()
    if len(spread):
        worst = spread.max()
        verdict = "small" if worst < 0.05 else "large enough to matter when comparing close cells"
        sentences.append(
            f"Step-to-step spread is {verdict}: the coefficient of variation is at most {worst:.1%} "
            f"(median {spread.median():.1%})."
        )
    oom = stats[stats["oom"] == True]  # noqa: E712
    if len(oom):
        cells = ", ".join(
            f"{r['size']}/{r['context_length']}/{MODE_LABEL[r['mode']]}" for _, r in oom.iterrows()
        )
        sentences.append(f"Out of memory: {cells}.")
    return " ".join(sentences)


def plot(stats: pd.DataFrame, order: list[str]) -> plt.Figure:
    ok = stats[stats["oom"] != True]  # noqa: E712
    modes = [m for m in MODE_LABEL if m in set(ok["mode"])]
    fig, axes = plt.subplots(1, len(modes), figsize=(4.2 * len(modes), 3.4), sharey=True, squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        for size in [s for s in order if s in set(ok["size"])]:
            rows = ok[(ok["mode"] == mode) & (ok["size"] == size)].sort_values("context_length")
            ax.errorbar(rows["context_length"], rows["mean_ms"], yerr=rows["std_ms"], marker="o", label=size)
        ax.set(title=MODE_LABEL[mode], xlabel="context length", xscale="log", yscale="log")
        # Plain numbers at the measured lengths only: a log axis would also label its minor ticks (6×10¹, ...),
        # which collide with these within a decade.
        ax.set_xticks(sorted(ok["context_length"].unique()), labels=sorted(ok["context_length"].unique()))
        ax.xaxis.set_minor_locator(NullLocator())
    axes[0][0].set_ylabel("ms per step")
    # Plain numbers on the shared log y-axis too (20, 30, ... within a decade, 10, 100, ... across decades).
    axes[0][0].yaxis.set_major_formatter(LogFormatter())
    axes[0][0].yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    axes[0][-1].legend(title="size", fontsize=8)
    return fig


@reason_if_not_run
def warmup_study(ctx: Context) -> str:
    frame, metas = ctx.require("e2e_warmup", "The warm-up study")
    stats = step_stats(frame, ["size", "context_length", "mode", "warmup"])
    stats = stats[stats["oom"] != True]  # noqa: E712
    first = frame[(frame["status"] == "ok") & (frame["step"] == 0)]
    first = first.groupby(["size", "mode", "warmup"], sort=False)["time_ms"].first().rename("first_step_ms")
    stats = stats.join(first, on=["size", "mode", "warmup"])
    shown = stats[
        ["size", "context_length", "mode", "warmup", "mean_ms", "std_ms", "median_ms", "first_step_ms"]
    ]
    out = [
        "### Warm-up study (c)",
        "",
        provenance_line(metas),
        "Each warm-up count runs in a fresh process, so the first timed step of the 0-warm-up run is the first "
        "step the process ever ran.",
        "",
        md(shown),
        "",
    ]
    out += [warmup_sentences(stats), "", warmup_why(stats, metas[0]["params"].get("device") == "cuda")]
    return "\n".join(out)


def cold_and_warm(stats: pd.DataFrame) -> pd.DataFrame:
    """Per size and mode, the run with the fewest warm-up steps beside the one with the most (suffixes _cold,
    _warm); cells with a single warm-up count are left out."""
    keys = ["size", "mode"]
    cold = stats.loc[stats.groupby(keys, sort=False)["warmup"].idxmin()].set_index(keys)
    warm = stats.loc[stats.groupby(keys, sort=False)["warmup"].idxmax()].set_index(keys)
    pairs = cold.add_suffix("_cold").join(warm.add_suffix("_warm"))
    return pairs[pairs["warmup_cold"] != pairs["warmup_warm"]]


def warmup_sentences(stats: pd.DataFrame) -> str:
    return " ".join(
        f"{size} {MODE_LABEL[mode]}: with {r['warmup_cold']} warm-up steps the mean is "
        f"{r['mean_ms_cold'] / r['mean_ms_warm']:.1f}× and the standard deviation "
        f"{r['std_ms_cold'] / max(r['std_ms_warm'], 1e-9):.1f}× those with {r['warmup_warm']}; the first timed "
        f"step took {r['first_step_ms_cold']:.0f} ms against a median of {r['median_ms_warm']:.1f} ms."
        for (size, mode), r in cold_and_warm(stats).iterrows()
    )


def warmup_why(stats: pd.DataFrame, on_cuda: bool) -> str:
    """Why warm-up matters, each claim only where every size and mode of the study shows it."""
    pairs = cold_and_warm(stats)
    slow_start = len(pairs) and (pairs["first_step_ms_cold"] > pairs["median_ms_warm"]).all()
    if not (on_cuda and slow_start):
        return ""
    text = (
        "Why: the first steps pay one-time costs that later steps do not — the CUDA context and cuBLAS handles "
        "are created lazily, kernels are loaded and (for cuBLAS / Triton) heuristics or autotuning pick "
        "algorithms, and the caching allocator grows its pool with `cudaMalloc` calls that later steps reuse."
    )
    inflated = (pairs["mean_ms_cold"] > pairs["mean_ms_warm"]) & (pairs["std_ms_cold"] > pairs["std_ms_warm"])
    if not inflated.all():
        return text
    text += " Without warm-up these costs land in the mean and inflate the spread"
    means = stats.pivot_table(index=["size", "mode"], columns="warmup", values="mean_ms").sort_index(axis=1)
    enough = fewest_sufficient(means.dropna())
    if enough is None:
        return text + "."
    count, share = enough
    return text + (
        f"; {count} warm-up step{'' if count == 1 else 's'} already remove{'s' if count == 1 else ''} "
        f"{share:.0%} or more of the extra mean time."
    )
