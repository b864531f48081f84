"""2026 §7: our FSDP beside PyTorch's FSDP2, our bucketed DDP and one rank alone, per world size (step time, peak
memory, exposed all-gather, bytes) with the goals checked; fsdp_accounting (a), the expected peak saving against
the measured one; (b), whether the all-gathers finish before each layer's forward, from a profiled step."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import pandas as pd

from cs336_systems.accounting.formulas import fsdp_memory, values
from cs336_systems.accounting.units import MIB
from cs336_systems.report.analysis import IN_TIME_MS, fsdp_goals, gather_exposure
from cs336_systems.report.context import Context, fsdp_units, reason_if_not_run
from cs336_systems.report.formatting import (
    binary_unit,
    capitalized,
    count,
    not_measured,
    or_dash,
    provenance_line,
    pytest_outcomes,
    text_md,
)

ORDER = ["ours", "ours_exact", "fsdp2", "ddp", "single"]
LABEL = {
    "ours": "our FSDP",
    "ours_exact": "our FSDP, exact mode",
    "fsdp2": "PyTorch FSDP2",
    "ddp": "our bucketed DDP",
    "single": "one rank alone (floor)",
}
KIND_COLOR = {
    "compute": "tab:blue",
    "memcpy": "tab:cyan",
    "all_gather": "tab:orange",
    "reduce_scatter": "tab:green",
    "all_reduce": "tab:purple",
    "communication": "tab:gray",
}
EXPOSED_COLOR = "tab:red"
VARIANT_COLOR = {"ours": "0.2", "fsdp2": "0.65"}
BYTES_COLUMNS = {
    "bytes_all_gathered": "all-gathered (MiB)",
    "bytes_reduce_scattered": "reduce-scattered (MiB)",
    "bytes_all_reduced": "all-reduced (MiB)",
    "bytes_activations_gathered": "activations and output gradients all-gathered (MiB)",
}


def render(ctx: Context) -> str:
    frame, metas = ctx.require("fsdp", "The FSDP benchmark")
    cells = cell_table(frame)
    out = [provenance_line(metas), "", setup(frame)]
    for world_size in sorted(frame["world_size"].dropna().unique()):
        out += ["", f"### World size {world_size:.0f}", "", world(frame, cells, int(world_size))]
    out += ["", "### Expected vs measured peak memory (fsdp_accounting a)", "", accounting(cells, metas)]
    out += ["", "### Do the all-gathers finish in time? (fsdp_accounting b)", "", timeline(ctx, cells)]
    out += ["", "### Our FSDP's GPU tests", "", gpu_tests(ctx)]
    return "\n".join(out)


@reason_if_not_run
def gpu_tests(ctx: Context) -> str:
    """The pass/fail table of our FSDP's GPU tests, run on the run's GPUs (experiments/gpu_tests.py -m gpu)."""
    frame, metas = ctx.require(
        "fsdp_gpu_tests",
        "Our FSDP's GPU tests",
        off_gpu="these tests need CUDA; on the CPU the suite runs the same protocol over gloo "
        "(tests/parallel/test_fsdp.py)",
    )
    return "\n".join(
        [
            provenance_line(metas),
            "",
            "The `gpu` tests of `tests/parallel/test_fsdp.py` in a pytest process on this run's GPUs, at the "
            "commit above: the assignment's protocol cases (training equal to one process's, bitwise in fp32) with "
            "every rank's model and data on a GPU, and over NCCL with a GPU per rank, where the reduce-scatter "
            "averages inside NCCL (two GPUs or more).",
            "",
            pytest_outcomes(frame),
        ]
    )


def cell_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (world size, variant) that ran or ran out of memory: the step statistics (the same on every
    rank's row), the largest rank's peak and waits, rank 0's bytes and how they were obtained."""
    ran = frame[frame["status"].isin(["ok", "OOM"])]
    if ran.empty:
        return pd.DataFrame(columns=["world_size", "variant", "status"])
    keys = ["world_size", "variant"]
    cells = ran.groupby(keys, sort=False).agg(
        status=("status", "first"),
        ranks=("status", "size"),
        **{
            c: (c, "first")
            for c in ("step_ms", "step_min_ms", "step_max_ms", "steps", "bytes_source")
            if c in ran
        },
        **{c: (c, "max") for c in ("peak_mib", "gather_wait_ms", "sync_wait_ms") if c in ran},
        **{c: (c, "first") for c in BYTES_COLUMNS if c in ran},
    )
    cells = cells.reset_index()
    cells["order"] = cells["variant"].map(ORDER.index)
    return cells.sort_values(["world_size", "order"]).drop(columns="order").reset_index(drop=True)


def setup(frame: pd.DataFrame) -> str:
    first = frame[frame["status"] == "ok"].iloc[0] if (frame["status"] == "ok").any() else frame.iloc[0]
    if "size" not in first or pd.isna(first.get("size")):
        return ""
    batch = ", ".join(
        f"{b:.0f} at world size {w:.0f}"
        for w, b in frame.dropna(subset=["batch_size_per_rank"])
        .groupby("world_size")["batch_size_per_rank"]
        .first()
        .items()
    )
    bf16 = first["compute_dtype"] == "bf16"
    precision = (
        "Compute in bf16 for every variant: the forward runs under `torch.autocast(bf16)` everywhere, our FSDP "
        "(`compute_dtype`) and FSDP2 (`param_dtype`) also cast the weights to bf16 before gathering them, DDP and "
        "the floor cast them per operator; all keep fp32 master weights, gradients and AdamW state and reduce "
        "gradients in fp32."
        if bf16
        else "Everything in fp32 (no casts)."
    )
    return (
        f"Model {first['size']} (d_model {first['d_model']:.0f}, {first['num_layers']:.0f} layers, "
        f"{count(first['num_params'])} parameters), context {first['context_length']:.0f}, "
        f"{first['attention']} attention; sequences per rank: {batch}; {first['backend']} "
        f"({'one GPU per rank' if first['device'] == 'cuda' else 'CPU processes'}); AdamW. Per variant a fresh "
        f"model, {first['warmup']:.0f} warm-up and {first['steps']:.0f} timed steps between device "
        "synchronisations; a step's time is the slowest rank's (median, min–max). "
        f"{precision} Prefetch distance {first['prefetch_distance']:.0f}: a unit's all-gather starts once the "
        "unit that many before it has finished its forward (our units: every Linear and Embedding weight; FSDP2's: "
        "each Transformer block and the root). Our FSDP runs in its usual mode (each rank's weight gradients "
        "reduce-scattered), the mode of every other section's timings; *exact mode*, where it ran, is the one the "
        "assignment's fp32 test gets through our adapter: training equal to the bit to one process's, because every "
        "unit runs its forward and backward over the whole batch (its inputs and output gradients all-gathered "
        "in batch order) and each rank keeps its shard of the weight gradients, with no reduce-scatter. "
        "*Exposed all-gather*: ours counts the time its compute stream waited for "
        "all-gathers, in as many more steps run back to back as in training (the largest rank's median; a sync "
        "after every step would make each rank start the next at its own time, and the first all-gather would "
        "count that skew); FSDP2 does not expose that wait (the timeline below measures both). Bytes: what one rank "
        "sends per step, counted by our FSDP, computed from the parameters for the others."
    )


def world(frame: pd.DataFrame, cells: pd.DataFrame, world_size: int) -> str:
    rows = frame[frame["world_size"] == world_size]
    if (rows["status"] == "skipped").all():
        return not_measured("; ".join(rows["reason"].dropna().unique()) or "skipped")
    here = cells[cells["world_size"] == world_size]
    out = [text_md(results_table(here)), ""]
    if (rows["device"] != "cuda").all():
        out += [
            "Peak memory: the CPU has no allocator statistics, so it is not measured here. The goals (step time and "
            "peak memory against FSDP2, the exposed all-gather's share of the step) are judged on GPUs, where "
            "NCCL's collectives run on their own streams beside the compute; here the ranks are CPU processes on "
            "gloo, whose collectives block the computing thread, so they are not judged."
        ]
    else:
        out += [goals_text(here, world_size)]
    if "ours_exact" in set(here["variant"]):
        out += ["", exact_text(here)]
    if world_size == 1:
        out += ["", overhead_text(here)]
    return "\n".join(out)


def mib(value: float) -> str:
    return "—" if pd.isna(value) else f"{value / MIB:,.1f}"


def results_table(cells: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for _, c in cells.iterrows():
        if c["status"] == "OOM":
            rows.append({"variant": LABEL[c["variant"]], "step (ms)": "OOM"})
            continue
        wait = c.get("gather_wait_ms", math.nan)
        rows.append(
            {
                "variant": LABEL[c["variant"]],
                "ranks": f"{c['ranks']:.0f}",
                "step (ms)": f"{c['step_ms']:.1f}",
                "min–max": f"{c['step_min_ms']:.1f}–{c['step_max_ms']:.1f}",
                "peak per rank (MiB)": or_dash("{:,.0f}")(c.get("peak_mib")),
                "exposed all-gather (ms)": "not counted" if pd.isna(wait) else f"{wait:.2f}",
                "share of step": "" if pd.isna(wait) else f"{wait / c['step_ms']:.1%}",
                **{label: mib(c[column]) for column, label in BYTES_COLUMNS.items() if column in c},
                "bytes": c.get("bytes_source", ""),
            }
        )
    return pd.DataFrame(rows).fillna("")


def goals_text(cells: pd.DataFrame, world_size: int) -> str:
    ran = cells[cells["status"] == "ok"]
    if "ours" not in set(ran["variant"]):
        return "_Our FSDP did not run at this world size, so its goals are not checked._"
    goals = fsdp_goals(ran)
    table = pd.DataFrame(
        {
            "goal": goals["goal"],
            "measured": [fmt(v, u) for v, u in zip(goals["measured"], goals["unit"], strict=True)],
            "bound": [fmt(v, u) for v, u in zip(goals["bound"], goals["unit"], strict=True)],
            "result": goals["passed"].map({True: "pass", False: "FAIL"}).fillna("not measured"),
        }
    )
    checked = goals.dropna(subset=["passed"])
    verdict = (
        f"Our FSDP meets {int(checked['passed'].sum())} of the {len(checked)} goals measurable at world size "
        f"{world_size}"
        + (
            f" (not measurable here: {', '.join(goals[goals['passed'].isna()]['goal'])})"
            if len(checked) < len(goals)
            else ""
        )
        + "."
    )
    return "\n".join([text_md(table), "", verdict])


def fmt(value: float, unit: str) -> str:
    return "—" if pd.isna(value) else f"{value:,.1f} {unit}" if unit == "MiB" else f"{value:.2f} {unit}"


def exact_text(cells: pd.DataFrame) -> str:
    """What exact mode costs against the usual mode in the same run: step time and bytes per rank."""
    by = cells[cells["status"] == "ok"].set_index("variant")
    if "ours_exact" not in by.index:
        return "**Exact mode** ran out of memory here." if (cells["variant"] == "ours_exact").any() else ""
    exact = by.loc["ours_exact"]
    moved = lambda c: sum(c.get(k, 0.0) for k in BYTES_COLUMNS if not pd.isna(c.get(k, math.nan)))
    text = f"**Exact mode** (bit-equal to one process's training): {exact['step_ms']:.1f} ms per step"
    if "ours" in by.index:
        usual = by.loc["ours"]
        text += (
            f", {exact['step_ms'] / usual['step_ms']:.2f}× our usual mode's {usual['step_ms']:.1f} ms; it moves "
            f"{moved(exact) / MIB:,.1f} MiB per rank per step against {moved(usual) / MIB:,.1f} MiB"
        )
    activations = exact.get("bytes_activations_gathered", math.nan)
    if not pd.isna(activations):
        text += (
            f" ({activations / MIB:,.1f} MiB of them activations and output gradients, "
            f"{exact['bytes_reduce_scattered'] / MIB:,.1f} MiB reduce-scattered)"
        )
    return text + "."


def overhead_text(cells: pd.DataFrame) -> str:
    ran = cells[cells["status"] == "ok"].set_index("variant")["step_ms"]
    if "single" not in ran or not ({"ours", "fsdp2"} & set(ran.index)):
        return ""
    parts = [
        f"{LABEL[v]} {ran[v]:.1f} ms ({ran[v] / ran['single'] - 1:+.1%})"
        for v in ("ours", "fsdp2")
        if v in ran
    ]
    return (
        f"**Overhead on one rank.** Nothing is communicated, so what a wrapper adds over the unwrapped model's "
        f"{ran['single']:.1f} ms is its gather/free machinery: {', '.join(parts)}."
    )


# ---------------------------------------------------------------------------------------------------------
# (a) expected vs measured peak saving


def accounting(cells: pd.DataFrame, metas: list[dict]) -> str:
    params_by_world = {m["params"].get("world_size"): m["params"] for m in metas if "size" in m["params"]}
    sharded = sorted(w for w in params_by_world if w and w > 1)
    if not sharded:
        return "_No run at more than one rank, so FSDP shards nothing to compare._"
    out = []
    for world_size in sharded:
        params = params_by_world[world_size]
        units, replicated = fsdp_units(params)
        expected = values(
            fsdp_memory(units, replicated, world_size, params["compute_dtype"], params["prefetch_distance"])
        )
        out += [
            f"World size {world_size}, per rank (activations ignored: the same batch per rank in every variant):",
            "",
        ]
        out += [
            text_md(expected_table(expected)),
            "",
            measured_text(cells[cells["world_size"] == world_size], expected),
        ]
    return "\n".join(out)


def expected_table(e: dict[str, float]) -> pd.DataFrame:
    unit, scale = binary_unit(e["ddp_state_bytes"])
    rows = [
        ("DDP: fp32 weights, gradients, AdamW (16 Ψ)", e["ddp_state_bytes"]),
        ("our bucketed DDP's gradient buckets (4 Ψ)", e["ddp_bucket_bytes"]),
        ("FSDP: the same, sharded units / n, norms whole", e["fsdp_state_bytes"]),
        ("FSDP: gathered units at the prefetch distance, one unit's fp32 gradient", e["fsdp_gathered_bytes"]),
        ("expected saving, the handout's (buffers ignored): 16 Ψ − FSDP state", e["saving_handout_bytes"]),
        ("expected saving against our bucketed DDP, net of gathered units", e["saving_vs_our_ddp_bytes"]),
    ]
    return pd.DataFrame({"quantity": [r[0] for r in rows], unit: [f"{r[1] / scale:,.2f}" for r in rows]})


def measured_text(cells: pd.DataFrame, expected: dict[str, float]) -> str:
    peaks = (
        cells[cells["status"] == "ok"].set_index("variant").get("peak_mib", pd.Series(dtype=float)).dropna()
    )
    if "ddp" not in peaks:
        why = (
            "no allocator statistics (CPU)"
            if cells.get("peak_mib", pd.Series(dtype=float)).isna().all()
            else "DDP did not run"
        )
        return f"Measured saving: not available here ({why})."
    target = expected["saving_vs_our_ddp_bytes"]
    unit, scale = binary_unit(expected["ddp_state_bytes"])
    parts = []
    for variant in ("ours", "fsdp2"):
        if variant in peaks:
            saved = (peaks["ddp"] - peaks[variant]) * MIB
            parts.append(
                f"{LABEL[variant]} peaks at {peaks[variant] * MIB / scale:,.2f} {unit} against DDP's "
                f"{peaks['ddp'] * MIB / scale:,.2f} {unit}, a measured saving of {saved / scale:,.2f} {unit} "
                f"({saved / target:.0%} of the {target / scale:,.2f} {unit} expected)"
            )
    return "Measured (largest rank's peak): " + "; ".join(parts) + "." if parts else ""


# ---------------------------------------------------------------------------------------------------------
# (b) the all-gather timeline


@reason_if_not_run
def timeline(ctx: Context, cells: pd.DataFrame) -> str:
    frame, _ = ctx.require("fsdp_timeline", "The FSDP all-gather timeline")
    ok = frame[frame["status"] == "ok"]
    if ok.empty:
        reasons = "; ".join(frame["reason"].dropna().unique())
        return not_measured(reasons or "no traced step")
    world_size = int(ok["world_size"].max())
    ok = ok[ok["world_size"] == world_size]
    shown = [v for v in ORDER if v in set(ok["variant"])]
    exposure = {v: gather_exposure(ok[ok["variant"] == v]) for v in shown}
    out = [
        f"One profiled training step at world size {world_size} (rank 0's GPU, after warm-up): kernels by CUDA "
        "stream, compute blue, all-gathers orange, reduce-scatters green; red where an all-gather ran while no "
        "compute kernel did (exposed). A layer's window runs from the end of the previous layer's forward kernels "
        "to the end of its own; the kernels of a layer are those its forward launched (the profiler's launch "
        "correlation).",
        "",
        ctx.figure(plot(ok, shown, exposure), f"fsdp_timeline_{ctx.run}", "FSDP forward: kernels per stream"),
        "",
    ]
    out += [exposure_sentence(v, *exposure[v], cells, world_size) for v in shown]
    return "\n\n".join(part for part in out if part)


def exposure_sentence(
    variant: str, layers: pd.DataFrame, s: dict, cells: pd.DataFrame, world_size: int
) -> str:
    text = f"**{capitalized(LABEL[variant])}.** "
    if s["layers"]:
        verdict = (
            "finish in time for every layer's forward"
            if s["layers_in_time"] == s["layers"]
            else "do not always finish in time"
        )
        text += (
            f"The all-gathers {verdict}: in {s['layers_in_time']} of {s['layers']} layers less than "
            f"{IN_TIME_MS} ms of all-gather ran with no compute kernel running in the layer's window; the worst is "
            f"layer {s['worst_layer']}, {s['worst_exposed_ms']:.2f} ms exposed ({s['forward_exposed_ms']:.2f} ms "
            "over the forward's layers). "
        )
    else:
        text += "The trace names no layers (no kernel launch matched a block's forward). "
    text += (
        f"Over the whole traced step ({s['step_ms']:.1f} ms) {s['step_exposed_ms']:.2f} ms of all-gather was "
        f"exposed ({s['step_exposed_ms'] / s['step_ms']:.1%})."
    )
    counted = cells[(cells["world_size"] == world_size) & (cells["variant"] == variant)]
    if len(counted) and not pd.isna(counted["gather_wait_ms"].iloc[0]):
        text += f" Its own count over the counted steps (run back to back): {counted['gather_wait_ms'].iloc[0]:.2f} ms of all-gather wait per step."
    return text


def plot(ok: pd.DataFrame, shown: list[str], exposure: dict) -> plt.Figure:
    fig, axes = plt.subplots(len(shown) + 1, 1, figsize=(13, 2.2 * len(shown) + 2.4), squeeze=False)
    for ax, variant in zip(axes[:-1, 0], shown, strict=True):
        rows = ok[ok["variant"] == variant]
        layers, _ = exposure[variant]
        end = layers["window_end_ms"].max() * 1.02 if len(layers) else rows["end_ms"].max()
        rows = rows[rows["start_ms"] <= end]
        streams = list(
            rows.groupby("stream")["kind"]
            .agg(lambda k: k.isin(["compute", "memcpy"]).mean())
            .sort_values(ascending=False)
            .index
        )
        for position, stream in enumerate(streams):
            on = rows[rows["stream"] == stream]
            for kind, color in KIND_COLOR.items():
                part = on[on["kind"] == kind]
                spans = list(zip(part["start_ms"], part["end_ms"] - part["start_ms"], strict=True))
                ax.broken_barh(spans, (len(streams) - position - 0.4, 0.8), color=color, linewidth=0)
        exposed = [(start, stop - start) for start, stop in exposure[variant][1]["exposed"] if start <= end]
        ax.broken_barh(exposed, (-0.4, 0.8), color=EXPOSED_COLOR, linewidth=0)
        for boundary in layers["window_end_ms"]:
            ax.axvline(boundary, color="k", lw=0.4, alpha=0.4)
        ax.set_yticks(
            [len(streams) - i for i in range(len(streams))] + [0],
            [f"stream {s:.0f}" for s in streams] + ["exposed"],
            fontsize=8,
        )
        ax.set_xlim(0, end)
        ax.set_title(
            f"{LABEL[variant]}: the forward (vertical lines: ends of layers)", fontsize=9, loc="left"
        )
        ax.set_xlabel("ms from the start of the step", fontsize=8)
    bars = axes[-1, 0]
    width = 0.8 / len(shown)
    for i, variant in enumerate(shown):
        layers, _ = exposure[variant]
        offset = (i - (len(shown) - 1) / 2) * width
        bars.bar(
            layers["layer"] + offset,
            layers["exposed_ms"],
            width=width,
            label=LABEL[variant],
            color=VARIANT_COLOR[variant],
        )
    bars.axhline(IN_TIME_MS, color="k", ls=":", lw=1, label=f"{IN_TIME_MS} ms (in time below)")
    ticks = sorted({layer for layers, _ in exposure.values() for layer in layers["layer"]})
    bars.set_xticks(ticks, [str(t) for t in ticks], fontsize=7)
    bars.set(
        xlabel="layer", ylabel="exposed all-gather (ms)", title="exposed all-gather in each layer's window"
    )
    bars.legend(fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in [*KIND_COLOR.values(), EXPOSED_COLOR]]
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.legend(handles, [*KIND_COLOR, "exposed all-gather"], loc="upper center", ncol=7, fontsize=8)
    return fig
