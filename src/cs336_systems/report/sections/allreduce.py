"""§2.1.3: all-reduce time and bandwidth per backend, process count and size; the latency-bandwidth model."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from cs336_systems.accounting.units import GIB, MIB
from cs336_systems.report.analysis import ALLREDUCE_KEYS as KEYS
from cs336_systems.report.analysis import allreduce_fits
from cs336_systems.report.context import Context
from cs336_systems.report.formatting import md, num, provenance_line, text_md


def render(ctx: Context) -> str:
    frame, metas = ctx.require("allreduce", "The all-reduce benchmark")
    ok = measured(frame)
    skipped = skipped_settings(frame)
    params = metas[0]["params"]
    out = [
        provenance_line(metas),
        "float32 tensors; gloo all-reduces CPU tensors, NCCL GPU tensors (one GPU per process). Per size "
        f"{params['warmup']} warm-up and {params['iters']} timed all-reduces, each started after a barrier and "
        "ended by a device synchronisation; an iteration's time is the slowest rank's. Median ± standard "
        "deviation in ms; algbw = bytes / median time, busbw = algbw · 2(n−1)/n (what each link of a ring "
        "carries). MB = 2^20 bytes.",
        "",
    ]
    if ok.empty:
        out.append(table(frame, lambda r: "", skipped))
        return "\n".join(out)
    fits = allreduce_fits(ok)
    out += [
        "Time per all-reduce (ms):",
        "",
        table(ok, lambda r: f"{r['median_ms']:.3g} ± {r['std_ms']:.2g}", skipped),
        "",
        "Bandwidth, algbw / busbw (GB/s):",
        "",
        table(ok, lambda r: f"{r['algbw_gbps']:.3g} / {r['busbw_gbps']:.3g}", skipped),
        "",
        ctx.figure(plot(ok, fits), f"allreduce_{ctx.run}", "all-reduce time and bandwidth per size"),
        "",
        "**Latency–bandwidth model.** Per backend and process count, least squares of "
        "t(n_bytes) = α + β·n_bytes on the medians, each weighted by 1/t so that every size counts by its "
        "relative error (an unweighted fit is decided by the largest size alone). α is the fixed cost of one "
        "call, 1/β the bandwidth the call approaches at large sizes.",
        "",
        text_md(fit_table(fits)),
        "",
        commentary(ok, fits),
    ]
    return "\n".join(out)


def measured(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["status"] == "ok"].sort_values([*KEYS, "size_mb"])


def skipped_settings(frame: pd.DataFrame) -> pd.DataFrame:
    """(backend, world_size, reason) of the settings the launcher skipped."""
    rows = frame[frame["status"] == "skipped"]
    return rows[[*KEYS, "reason"]].drop_duplicates().astype({"world_size": int})


def table(ok: pd.DataFrame, cell, skipped: pd.DataFrame) -> str:
    """Backend and process count per row, sizes across; skipped settings say why in every cell."""
    sizes = sorted(ok["size_mb"].unique())
    rows = []
    for (backend, world_size), group in ok.groupby(KEYS):
        by_size = {r["size_mb"]: cell(r) for _, r in group.iterrows()}
        rows.append(
            {
                "backend": backend,
                "processes": world_size,
                **{size_label(s): by_size.get(s, "—") for s in sizes},
            }
        )
    for _, r in skipped.iterrows():
        text = f"not run: {r['reason']}"
        rows.append(
            {"backend": r["backend"], "processes": r["world_size"], **{size_label(s): text for s in sizes}}
        )
    frame = pd.DataFrame(rows).sort_values(["backend", "processes"])
    return md(frame)


def size_label(size_mb: float) -> str:
    return f"{num(size_mb)} MB" if size_mb * MIB < GIB else f"{num(size_mb * MIB / GIB)} GB"


def fit_table(fits: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "backend": fits["backend"],
            "processes": fits["world_size"],
            "α (µs)": (fits["alpha_s"] * 1e6).map(num),
            "β (ps/byte)": (fits["beta_s_per_byte"] * 1e12).map(num),
            "1/β (GB/s)": (1 / fits["beta_s_per_byte"] / 1e9).map(num),
            "worst relative residual": fits["worst_relative_error"].map(lambda x: f"{x:.0%}"),
            "sizes": fits["sizes"],
        }
    )


def commentary(ok: pd.DataFrame, fits: pd.DataFrame) -> str:
    """2-3 sentences on backend, size and process count, every number computed from the table."""
    sentences = []
    wide = ok.pivot_table(index=["world_size", "size_mb"], columns="backend", values="median_ms")
    if {"gloo", "nccl"} <= set(wide.columns):
        speedup = (wide["gloo"] / wide["nccl"]).dropna()
        if len(speedup):
            world_size, size = speedup.idxmax()
            sentences.append(
                f"NCCL on GPUs is {speedup.min():.3g}–{speedup.max():.3g}× faster than gloo on CPUs at the same size "
                f"and process count (the largest gap at {size_label(size)} with {world_size} processes): gloo moves "
                "the data through host memory and TCP loopback, NCCL over NVLink between GPUs."
            )
    largest = ok["size_mb"].max()
    # One sentence on size and one on process count, each for NCCL where it ran (the GPU result), else gloo.
    by_backend = sorted(ok.groupby("backend"), key=lambda pair: pair[0] != "nccl")
    for backend, group in by_backend:
        smallest_n = group["world_size"].min()
        row = fits[(fits["backend"] == backend) & (fits["world_size"] == smallest_n)]
        sizes = group[group["world_size"] == smallest_n].set_index("size_mb")["median_ms"]
        if row.empty or len(sizes) < 2:
            continue
        alpha_ms, beta = row["alpha_s"].iloc[0] * 1e3, row["beta_s_per_byte"].iloc[0]
        small, big = sizes.index.min(), sizes.index.max()
        share = alpha_ms / sizes[small]
        half = alpha_ms / 1e3 / beta / MIB  # where the latency and the bandwidth term are equal
        sentences.append(
            f"With {backend} on {smallest_n} processes, growing the tensor {big / small:g}× "
            f"({size_label(small)} → {size_label(big)}) grows the time {sizes[big] / sizes[small]:.3g}×: "
            f"the fitted per-call cost α = {num(alpha_ms * 1e3)} µs is {min(share, 1):.0%} of the smallest call and "
            f"equals the transfer time at about {size_label(half)}, above which time grows in proportion to size."
        )
        break
    for backend, group in by_backend:
        at_largest = group[group["size_mb"] == largest].set_index("world_size")
        if len(at_largest) < 2:
            continue
        lo, hi = at_largest.index.min(), at_largest.index.max()
        bus_lo, bus_hi = at_largest.loc[lo, "busbw_gbps"], at_largest.loc[hi, "busbw_gbps"]
        falls = bus_hi < 0.8 * bus_lo
        sentences.append(
            f"From {lo} to {hi} {backend} processes the {size_label(largest)} all-reduce takes "
            f"{at_largest.loc[hi, 'median_ms'] / at_largest.loc[lo, 'median_ms']:.2f}× as long. A ring sends "
            f"2(n−1)/n of the tensor per rank ({2 * (lo - 1) / lo:.2f} → {2 * (hi - 1) / hi:.2f}), so if every "
            f"process brought its own links busbw would hold; it goes from {bus_lo:.3g} to {bus_hi:.3g} GB/s"
            + (
                ": the processes share the same links, cores or memory bandwidth."
                if falls
                else ", so it does."
            )
        )
        break
    return " ".join(sentences)


def plot(ok: pd.DataFrame, fits: pd.DataFrame) -> plt.Figure:
    fig, (ax_time, ax_alg, ax_bus) = plt.subplots(1, 3, figsize=(14, 3.8))
    for (backend, world_size), group in ok.groupby(KEYS):
        label = f"{backend}, {world_size} proc."
        line = ax_time.loglog(group["bytes"], group["median_ms"], "o", label=label)[0]
        row = fits[(fits["backend"] == backend) & (fits["world_size"] == world_size)]
        if not row.empty:
            n = np.geomspace(group["bytes"].min(), group["bytes"].max(), 50)
            model = (row["alpha_s"].iloc[0] + row["beta_s_per_byte"].iloc[0] * n) * 1e3
            ax_time.loglog(n, model, "-", color=line.get_color(), alpha=0.6)
        ax_alg.semilogx(group["bytes"], group["algbw_gbps"], "o-", color=line.get_color(), label=label)
        ax_bus.semilogx(group["bytes"], group["busbw_gbps"], "o-", color=line.get_color(), label=label)
    ax_time.set(title="time (points) and fitted α + β·n (lines)", xlabel="bytes", ylabel="ms")
    ax_alg.set(title="algbw", xlabel="bytes", ylabel="GB/s")
    ax_bus.set(title="busbw", xlabel="bytes", ylabel="GB/s")
    ax_time.legend(fontsize=8)
    return fig
