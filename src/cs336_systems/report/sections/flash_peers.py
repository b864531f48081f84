"""Our FlashAttention-2 against PyTorch's fastest attention (SDPA's cuDNN and flash backends, compiled
FlexAttention), and the Nsight Compute profile that says where the time goes."""

from __future__ import annotations

import re

import matplotlib.pyplot as plt
import pandas as pd

from cs336_systems.report.context import Context, reason_if_not_run
from cs336_systems.report.formatting import commit_text, md, provenance_line, pytest_outcomes, text_md
from cs336_systems.report.sections import flash_goals
from cs336_systems.report.sections.flash import (
    CHECKED_ABOVE,
    INTERPRETED_ONLY,
    interpreted,
    interpreted_checks,
)

PEERS = {
    "triton": "ours",
    "triton_portable": "ours, portable tier",
    "triton_hopper": "ours, Hopper tier",
    "sdpa_cudnn": "cuDNN",
    "sdpa_flash": "SDPA flash",
    "flex": "FlexAttention",
}
# The kernel tiers ours runs (kernels/flash_tiers.py), as the writeup names them.
TIER_NAMES = {"hopper": "the Hopper tier (Gluon, sm_90)", "portable": "the portable Triton tier"}
PASSES = {"forward": "forward", "backward": "backward", "forward_backward": "fwd+bwd"}
# At or below this multiple of the sum of its passes timed alone, a forward+backward is bound by the GPU work.
HOST_BOUND = 1.25
ALT = "our FlashAttention-2 and PyTorch's attention backends, time as a multiple of cuDNN's, per sequence length"


def render(ctx: Context) -> str:
    return "\n\n".join(
        [
            f"### The kernels' tests on this GPU\n\n{gpu_tests(ctx)}",
            f"### Time against SDPA's cuDNN and flash backends and FlexAttention\n\n{peers(ctx)}",
            f"### Where the time goes: Nsight Compute\n\n{kernel_profile(ctx)}",
            f"### The Hopper tier's goals\n\n{flash_goals.render(ctx)}",
        ]
    )


@reason_if_not_run
def gpu_tests(ctx: Context) -> str:
    """The pass/fail table of the kernels' tests, run on the GPU of the timings (experiments/gpu_tests.py)."""
    frame, metas = ctx.require(
        "gpu_tests",
        "The kernels' tests on the GPU",
        off_gpu=f"the kernels' tests of this part run on a GPU, and {INTERPRETED_ONLY}; {CHECKED_ABOVE}",
    )
    return "\n".join(
        [
            provenance_line(metas),
            "",
            "Each file in a pytest process of its own on this GPU, at the commit above: the Hopper tier against a "
            "float64 reference (odd and power-of-two lengths, causal and not, head dims 64 and 128, bf16 and fp16) "
            "and against the portable tier compiled on CUDA; each tier's launch cache (after a shape's first call, "
            "no Triton dispatch, and the same results as that call).",
            "",
            pytest_outcomes(frame) + timed_elsewhere(ctx, metas),
        ]
    )


def timed_elsewhere(ctx: Context, tested: list[dict]) -> str:
    """A sentence naming the tables of the timings below (flash_peers', and the goal shapes' of flash_goals)
    measured at another commit than the tests' (each timing times the kernels of its own commit), by commit; nothing
    when they agree or there are no timings."""
    tested_at = {commit_text(m["provenance"]) for m in tested}
    elsewhere: dict[str, list[str]] = {}
    for deliverable in ("flash_peers", "flash_goals"):
        for frame, meta in ctx.tables(deliverable):
            if interpreted(frame) or (commit := commit_text(meta["provenance"])) in tested_at:
                continue
            elsewhere.setdefault(commit, []).append(table_name(deliverable, frame, meta.get("params", {})))
    if not elsewhere:
        return ""
    which = "; ".join(f"{', '.join(tables)} at {commit}" for commit, tables in sorted(elsewhere.items()))
    return (
        f" Timings below measured at another commit than the one tested here (each times the kernels of its own "
        f"commit): {which}."
    )


def table_name(deliverable: str, frame: pd.DataFrame, params: dict) -> str:
    """How the note above names a timed table: flash_peers' by mask and head dims, flash_goals' by its shape."""
    if deliverable == "flash_goals" and not frame.empty:
        row = frame.iloc[0]
        shape = tuple(int(row[c]) for c in ("batch_size", "heads", "seq_len", "d_head"))
        return f"the goal shape {flash_goals.shape_text(shape)}"
    if {"causal", "d_heads"} <= params.keys():
        return f"{mask(params['causal'])} d {'/'.join(map(str, params['d_heads']))}"
    return "a table"


def mask(causal: bool) -> str:
    return "causal" if causal else "not causal"


@reason_if_not_run
def peers(ctx: Context) -> str:
    frame, metas = ctx.require("flash_peers", "The comparison with PyTorch's fastest attention")
    if interpreted(frame):
        return interpreted_peers(frame, metas)
    ok = frame[frame["status"] == "ok"]
    wide = ok.pivot_table(
        index=["causal", "d_head", "seq_len", "batch_size", "pass"], columns="impl", values="ms"
    )
    p = metas[0]["params"]
    batch = f"batch = {p['tokens']:,} tokens / sequence length (at least 1)" if p.get("tokens") else "batch 1"
    out = [
        provenance_line(metas),
        "",
        f"{p['heads']} heads, {batch}, bf16; `triton.testing.do_bench` medians in ms, and each time as a multiple "
        f"of cuDNN's (below 1: faster). Failed measurements: {len(frame) - len(ok)}.",
    ]
    for causal in sorted(wide.index.unique("causal"), reverse=True):  # causal first
        table = wide.xs(causal, level="causal").reset_index()
        table = table.sort_values(["d_head", "seq_len", "pass"], key=pass_order)
        for impl in [i for i in PEERS if i != "sdpa_cudnn" and i in table]:
            if "sdpa_cudnn" in table:
                table[f"{PEERS[impl]} ÷ cuDNN"] = table[impl] / table["sdpa_cudnn"]
        table["pass"] = table["pass"].map(PASSES)
        table = table.rename(columns=PEERS)
        order = ["d_head", "seq_len", "batch_size", "pass", *[PEERS[i] for i in PEERS if PEERS[i] in table]]
        out += [
            "",
            f"**{mask(causal)}**",
            "",
            md(table[order + [c for c in table if "÷" in c]], floatfmt=".3f"),
        ]
    out += [
        "",
        throughput(ok, p.get("flop_convention")),
        "",
        peer_findings(wide, ok),
        "",
        ctx.figure(ratio_figure(wide), f"flash_peers_{ctx.run}", ALT),
    ]
    return "\n".join(out)


def throughput(ok: pd.DataFrame, convention: str | None) -> str:
    """Each implementation's TFLOP/s at the longest sequence of each mask and head dim."""
    longest = ok.groupby(["causal", "d_head"])["seq_len"].transform("max")
    at = ok[ok["seq_len"] == longest]
    table = at.pivot_table(index=["causal", "d_head", "seq_len", "pass"], columns="impl", values="tflops")
    table = table.reset_index().sort_values(
        ["causal", "d_head", "pass"], ascending=[False, True, True], key=pass_order
    )
    table["causal"] = table["causal"].map(mask)
    table["pass"] = table["pass"].map(PASSES)
    columns = ["causal", "d_head", "seq_len", "pass", *[i for i in PEERS if i in table]]
    table = table[columns].rename(columns={**PEERS, "causal": "mask"})
    rule = f" ({convention})" if convention else ""
    return f"**Throughput at the longest sequence**, TFLOP/s{rule}:\n\n{md(table, floatfmt='.0f')}"


def interpreted_peers(frame: pd.DataFrame, metas: list[dict]) -> str:
    """A run without CUDA: our kernels checked at this comparison's shapes; the peers are GPU kernels."""
    p = metas[0]["params"]
    batch = f"batch = {p['tokens']:,} tokens / sequence length" if p.get("tokens") else "batch 1"
    others = [PEERS[i] for i in p.get("impls", []) if i != "triton" and i in PEERS]
    text = interpreted_checks(
        frame, metas, f"Our kernels at this comparison's shapes ({p['heads']} heads, {batch})"
    )
    if others:
        text += f"\n\nWhat ours is timed against ({', '.join(others)}) runs on a GPU only: not run here."
    return text


def pass_order(column: pd.Series) -> pd.Series:
    """Sort key: forward, backward, forward+backward; other columns as they are."""
    return column.map(list(PASSES).index) if column.name == "pass" else column


def peer_findings(wide: pd.DataFrame, ok: pd.DataFrame) -> str:
    if not {"triton", "sdpa_cudnn"} <= set(wide.columns):
        return "_Needs our kernel and cuDNN in the same cells._"
    ratio = (wide["triton"] / wide["sdpa_cudnn"]).dropna().rename("ratio").reset_index()
    sentences = [tiers_ran(ok)]
    for pass_name in [p for p in PASSES if p in set(ratio["pass"])]:
        rows = ratio[ratio["pass"] == pass_name]
        won = rows[rows["ratio"] <= 1]
        worst = rows.loc[rows["ratio"].idxmax()]
        sentences.append(
            f"{PASSES[pass_name].capitalize()}: ours is at or below cuDNN's time in {len(won)} of {len(rows)} "
            f"cells; ours ÷ cuDNN {rows['ratio'].min():.2f}–{rows['ratio'].max():.2f} (median "
            f"{rows['ratio'].median():.2f}), worst at d {worst['d_head']}, seq {worst['seq_len']:,}, "
            f"{mask(worst['causal'])}."
        )
    by_d = ratio[ratio["pass"] == "forward_backward"].groupby("d_head")["ratio"].median()
    if len(by_d) > 1:
        medians = ", ".join(f"d {d}: {r:.2f}×" for d, r in by_d.items())
        sentences.append(
            f"Median forward+backward ratio by head dim: {medians}; widest at d {by_d.idxmax()}."
        )
    for other in ("triton_portable", "sdpa_flash", "flex"):
        if other in wide:
            fb = (wide[other] / wide["triton"]).xs("forward_backward", level="pass").dropna()
            if len(fb):
                name = "our portable tier" if other == "triton_portable" else PEERS[other]
                sentences.append(
                    f"Against {name}, ours is {fb.min():.2f}–{fb.max():.2f}× as fast for forward+backward "
                    f"(faster in {(fb > 1).sum()} of {len(fb)} cells)."
                )
    sentences += [host_bound(wide), first_calls(ok)]
    return " ".join(s for s in sentences if s)


def tiers_ran(ok: pd.DataFrame) -> str:
    """Which kernel tier "ours" ran, from the rows' tier column (results from before the tiers have none)."""
    if "tier" not in ok:
        return "Ours: the portable Triton kernels (these results predate the kernel tiers)."
    counts = ok[ok["impl"] == "triton"]["tier"].value_counts()
    ran = "; ".join(
        f"{TIER_NAMES.get(t, t)} in {n} of {counts.sum()} measurements" for t, n in counts.items()
    )
    return f"Ours ran {ran}." if ran else ""


def host_bound(wide: pd.DataFrame) -> str:
    """Cells where our forward+backward takes well over its forward plus its backward timed alone: the host's
    launch path, not the GPU, sets the pace there (the passes alone overlap their launches with GPU work)."""
    ours = wide["triton"].unstack("pass").dropna()
    ours["excess"] = ours["forward_backward"] / (ours["forward"] + ours["backward"])
    slow = ours[ours["excess"] > HOST_BOUND].reset_index()
    if slow.empty:
        return ""
    cells = "; ".join(
        f"d {r['d_head']}, seq {r['seq_len']:,} ({mask(r['causal'])}): {r['forward_backward']:.2f} ms against "
        f"{r['forward']:.2f} + {r['backward']:.2f}"
        for _, r in slow.iterrows()
    )
    return (
        f"Where our forward+backward exceeds its forward plus its backward timed alone by over "
        f"{HOST_BOUND - 1:.0%}, the step is bound by the host (Python autograd, the allocations and "
        f"the kernel launches), not by the GPU: {cells}."
    )


def first_calls(ok: pd.DataFrame) -> str:
    first = ok.groupby("impl")["first_call_s"].max()
    if "triton" not in first:
        return ""
    text = (
        f"Our first forward+backward in a cell (compiling the kernels, and autotuning the portable tier's, where "
        f"the cell opens a new key; from Triton's on-disk cache where an earlier process compiled them) took at most {first['triton']:.1f} s"
    )
    if "flex" in first:
        text += f"; FlexAttention's first call (compiling) at most {first['flex']:.1f} s"
    return text + "."


def ratio_figure(wide: pd.DataFrame) -> plt.Figure:
    cells = wide.reset_index()[["causal", "d_head"]].drop_duplicates()
    panels = list(cells.sort_values(["causal", "d_head"], ascending=[False, True]).itertuples(index=False))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.4), squeeze=False, sharey=True)
    for ax, (causal, d) in zip(axes.flat, panels, strict=True):
        cell = wide.xs((causal, d, "forward_backward"), level=("causal", "d_head", "pass")).droplevel(
            "batch_size"
        )
        for impl in [i for i in PEERS if i != "sdpa_cudnn" and i in cell]:
            ax.plot(cell.index, cell[impl] / cell["sdpa_cudnn"], marker="o", label=PEERS[impl])
        ax.axhline(1, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set(title=f"d {d}, {mask(causal)}", xlabel="sequence length")
    axes.flat[0].set_ylabel("fwd+bwd time ÷ cuDNN's")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------------------
# Nsight Compute
# ----------------------------------------------------------------------------------------------------------
def short_kernel(name: str) -> str:
    """cuDNN's generated names carry their tile knobs; keep what says what the kernel does."""
    if name.startswith("cudnn_generated"):
        return "cuDNN " + ("fprop" if "fprop" in name else "bprop" if "bprop" in name else "kernel")
    return re.split(r"[<(]", name.removeprefix("void "))[0]


# Profile table: column -> (heading, format).
PROFILE_COLUMNS = {
    "shape": ("shape (B×H×N×d)", "{}"),
    "impl": ("impl", "{}"),
    "pass": ("pass", "{}"),
    "kernel": ("kernel", "{}"),
    "duration_ms": ("ms (ncu)", "{:.3f}"),
    "tensor_pipe_pct": ("tensor pipe %", "{:.1f}"),
    "sm_throughput_pct": ("SM %", "{:.1f}"),
    "memory_throughput_pct": ("memory %", "{:.1f}"),
    "achieved_occupancy_pct": ("occupancy %", "{:.1f}"),
    "registers_per_thread": ("registers", "{:.0f}"),
    "block_size": ("threads", "{:.0f}"),
    "grid_size": ("CTAs", "{:,.0f}"),
    "top stalls": ("top stalls (cycles per issue)", "{}"),
}


@reason_if_not_run
def kernel_profile(ctx: Context) -> str:
    frame, metas = ctx.require(
        "flash_ncu",
        "The Nsight Compute profile",
        off_gpu=f"Nsight Compute profiles kernels on an NVIDIA GPU, and {INTERPRETED_ONLY}; {CHECKED_ABOVE}",
    )
    ok = frame[frame["status"] == "ok"].copy()
    out = [provenance_line(metas), ""]
    if ok.empty:
        return "\n".join(out + [f"No kernel was profiled: {frame['error'].dropna().iloc[0]}"])
    ok["shape"] = ok.apply(
        lambda r: flash_goals.shape_text((r["batch_size"], r["heads"], r["seq_len"], r["d_head"])), axis=1
    )
    ok["kernel"] = ok["kernel"].map(short_kernel)
    ok["impl"] = ok["impl"].map(PEERS)
    ok["top stalls"] = ok.apply(lambda r: f"{r['stall_1']} {r['stall_1_cycles']:.2f}, {r['stall_2']} "
                                f"{r['stall_2_cycles']:.2f}", axis=1)  # fmt: skip
    shown = pd.DataFrame(
        {label: ok[column].map(fmt.format) for column, (label, fmt) in PROFILE_COLUMNS.items()}
    )
    out += [
        "One forward and one backward per implementation, causal, bf16, profiled by `ncu` at the clocks the "
        "benchmarks run at. Tensor pipe: the share of active cycles the tensor cores were busy (on Hopper the "
        "counter includes wgmma); SM and memory: throughput as a share of peak; stalls: warp cycles per issued "
        "instruction, the two largest reasons.",
        "",
        text_md(shown),
        "",
        profile_findings(ok),
    ]
    return "\n".join(out)


def profile_findings(ok: pd.DataFrame) -> str:
    sentences = []
    for shape, rows in ok.groupby("shape", sort=False):
        units = rows.groupby(["impl", "pass"]).agg(ms=("duration_ms", "sum"), ops=("tensor_ops", "sum"))
        main = rows.loc[rows.groupby(["impl", "pass"])["duration_ms"].idxmax()].set_index(["impl", "pass"])
        for ours in (
            "ours, Hopper tier",
            "ours, portable tier",
            "ours",
        ):  # "ours": results from before the tiers
            if not {(impl, p) for impl in (ours, "cuDNN") for p in ("forward", "backward")} <= set(
                units.index
            ):
                continue
            ours_f, cudnn_f = main.loc[(ours, "forward")], main.loc[("cuDNN", "forward")]
            sentences.append(
                f"At {shape}, forward: {ours} keeps the tensor pipe busy {ours_f['tensor_pipe_pct']:.0f} % of the "
                f"time (a grid of {ours_f['grid_size']:,.0f} CTAs of {ours_f['block_size']:.0f} threads at "
                f"{ours_f['registers_per_thread']:.0f} registers each, {ours_f['achieved_occupancy_pct']:.1f} % "
                f"occupancy, top stall {ours_f['stall_1']}) against cuDNN's {cudnn_f['tensor_pipe_pct']:.0f} % "
                f"({cudnn_f['grid_size']:,.0f} CTAs of {cudnn_f['block_size']:.0f} threads at "
                f"{cudnn_f['registers_per_thread']:.0f} registers): "
                f"{units.loc[(ours, 'forward'), 'ms'] / units.loc[('cuDNN', 'forward'), 'ms']:.2f}× its time."
            )
            work = units.loc[(ours, "backward"), "ops"] / units.loc[("cuDNN", "backward"), "ops"]
            rate = (units.loc[(ours, "backward"), "ops"] / units.loc[(ours, "backward"), "ms"]) / (
                units.loc[("cuDNN", "backward"), "ops"] / units.loc[("cuDNN", "backward"), "ms"]
            )
            design = (
                "one pass, dQ accumulated across key tiles: 5 matmuls of the N² d kind, as cuDNN's"
                if ours == "ours, Hopper tier"
                else "our atomic-free dQ pass recomputes Q Kᵀ and dO Vᵀ: 7 matmuls of the N² d kind against 5"
            )
            sentences.append(
                f"Backward: {ours} executes {work:.2f}× cuDNN's tensor-core work ({design}) at {rate:.2f}× its "
                f"rate, so it takes {work / rate:.2f}× its time."
            )
    return " ".join(sentences)
