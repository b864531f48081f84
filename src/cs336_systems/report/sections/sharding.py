"""§3: optimizer state sharding — memory per phase beside the predicted breakdown, time per iteration, and the
comparison with ZeRO stage 1 in memory and communication volume."""

from __future__ import annotations

import math

import pandas as pd

from cs336_systems.accounting.formulas import data_parallel_communication, values
from cs336_systems.report.context import Context, NotRun
from cs336_systems.report.formatting import count, provenance_line, text_md

VARIANT = {
    "unsharded": "AdamW, unsharded",
    "sharded": "ShardedOptimizer (ours)",
    "zero": "PyTorch ZeroRedundancyOptimizer",
}
PHASE = {
    "after_init": "after model initialisation",
    "forward_backward": "after forward + backward",
    "before_step": "directly before the optimizer step",
    "after_step": "directly after the optimizer step",
}


def render(ctx: Context) -> str:
    try:
        frame, metas = ctx.require("sharding", "The optimizer state sharding benchmark")
    except NotRun as reason:  # the comparison with ZeRO stands without a measurement
        return f"{reason}\n\n{zero_comparison(None)}"
    out = [provenance_line(metas)]
    oom = frame[frame["status"] == "OOM"]["variant"].unique()
    frame = frame[frame["status"] != "OOM"]
    first = frame.iloc[0]
    n = int(first["world_size"])
    out += [
        f"Model {first['size']} ({count(first['num_params'])} parameters), {first['batch_size_per_rank']} "
        f"sequences of {first['context_length']} tokens per rank, {n} ranks on {first['backend']}; fp32 "
        "parameters and gradients, AdamW (two fp32 moments). Gradients are averaged by one flat all-reduce in all "
        "three variants; `unsharded` keeps AdamW's state for every parameter on every rank, the two sharded "
        "optimizers only for their rank's share and all-gather (ours) or broadcast (PyTorch's) the updated "
        f"parameters after the step. {first['warmup']} warm-up iterations first, so the optimizer state exists."
        + (f" Out of memory: {', '.join(VARIANT[v] for v in oom)}." if len(oom) else ""),
        "",
        "### (a) Memory",
        "",
        memory(frame, n),
        "",
        "### (b) Time per iteration",
        "",
        timing(frame, n),
        "",
        "### (c) Compared with ZeRO stage 1",
        "",
        zero_comparison(frame),
    ]
    return "\n".join(out)


def scale(largest: float) -> tuple[float, str]:
    return (1e9, "GB") if largest >= 1e9 else (1e6, "MB")


def memory(frame: pd.DataFrame, n: int) -> str:
    """Rank 0's predicted breakdown and measured memory per phase and variant (measured only on CUDA)."""
    rows = frame[(frame["rank"] == 0) & frame["phase"].isin(list(PHASE))]
    wide = rows.pivot_table(index=["variant", "phase"], columns="quantity", values="value", sort=False)
    unit, label = scale(wide["predicted_total_bytes"].max())
    measured = "max_memory_allocated_bytes" in wide and wide["max_memory_allocated_bytes"].notna().any()

    def cell(value: float) -> str:
        return "—" if pd.isna(value) else f"{value / unit:.3g}"

    table = pd.DataFrame(
        {
            "variant": [VARIANT[v] for v, _ in wide.index],
            "phase": [PHASE[p] for _, p in wide.index],
            f"parameters ({label})": wide["predicted_parameters_bytes"].map(cell),
            f"gradients ({label})": wide["predicted_gradients_bytes"].map(cell),
            f"optimizer state ({label})": wide["predicted_optimizer_state_bytes"].map(cell),
            f"predicted sum ({label})": wide["predicted_total_bytes"].map(cell),
            f"allocated ({label})": wide.get("memory_allocated_bytes", pd.Series(math.nan, wide.index)).map(
                cell
            ),
            f"peak ({label})": wide.get("max_memory_allocated_bytes", pd.Series(math.nan, wide.index)).map(
                cell
            ),
            f"peak − predicted ({label})": wide.get("remainder_bytes", pd.Series(math.nan, wide.index)).map(
                cell
            ),
        }
    )
    out = [
        "Rank 0. *Predicted*: parameters, gradients and AdamW state (`accounting.training_state_memory`; ours "
        "with its own partition of whole tensors, PyTorch's at the ideal 1/n). *Measured*: "
        + (
            "`torch.cuda.memory_allocated` at the end of each phase and `max_memory_allocated` during it (the peak "
            "is reset between phases)."
            if measured
            else "on a GPU, the CUDA allocator's allocated bytes at the end of each phase and its peak during it."
        )
        + " *Peak − predicted* is what the breakdown does not name: the activations saved "
        "for backward (after forward + backward), the flat gradient copy of the all-reduce (before the step) and "
        "the step's temporaries (after the step).",
        "",
        text_md(table),
        "",
    ]
    if not measured:
        reasons = frame[frame["quantity"] == "max_memory_allocated_bytes"]["reason"].dropna().unique()
        out.append(
            f"The measured columns are empty in this run ({'; '.join(reasons) or 'not measured'}): PyTorch's "
            "CPU allocator keeps no peak statistics, so only a CUDA run measures them."
        )
    out += ["", memory_findings(frame, wide, n, unit, label, measured)]
    return "\n".join(out)


def memory_findings(
    frame: pd.DataFrame, wide: pd.DataFrame, n: int, unit: float, label: str, measured: bool
) -> str:
    state = frame[frame["quantity"] == "measured_optimizer_state_bytes"].pivot_table(
        index="variant", columns="rank", values="value"
    )
    sentences = []
    if {"unsharded", "sharded"} <= set(state.index):
        shares = ", ".join(f"rank {r}: {v / unit:.3g}" for r, v in state.loc["sharded"].items())
        fullest = state.loc["sharded"].max() / state.loc["unsharded"].max()
        sentences.append(
            f"Measured on the optimizer objects: the fullest rank of ours holds {fullest:.1%} of the unsharded "
            f"optimizer state ({shares} {label}, against {state.loc['unsharded'].max() / unit:.3g} {label} "
            f"unsharded); the ideal is 1/{n} = {1 / n:.1%}"
            + ("; whole tensors do not split evenly." if fullest > 1.005 / n else ".")
        )
    if measured and {"unsharded", "sharded"} <= {v for v, _ in wide.index}:
        for phase in ("before_step", "after_step"):
            before, after = (
                wide.loc[(v, phase), "max_memory_allocated_bytes"] for v in ("unsharded", "sharded")
            )
            saving = (
                wide.loc[("unsharded", phase), "predicted_optimizer_state_bytes"]
                - wide.loc[("sharded", phase), "predicted_optimizer_state_bytes"]
            )
            sentences.append(
                f"Peak {PHASE[phase]}: {before / unit:.3g} → {after / unit:.3g} {label} with sharding "
                f"({(after - before) / unit:+.3g} {label}; the state removed is {saving / unit:.3g} {label})."
            )
        if "zero" in {v for v, _ in wide.index}:
            ours, theirs = (
                wide.loc[(v, "after_step"), "max_memory_allocated_bytes"] for v in ("sharded", "zero")
            )
            sentences.append(
                f"PyTorch's ZeroRedundancyOptimizer peaks at {theirs / unit:.3g} {label} after the step, ours at "
                f"{ours / unit:.3g} {label}."
            )
    return " ".join(sentences)


def timing(frame: pd.DataFrame, n: int) -> str:
    times = frame[frame["quantity"].isin(["iteration_ms", "optimizer_step_ms"])]
    slowest = times.groupby(["variant", "quantity", "step"])["value"].max().reset_index()  # the slowest rank
    stats = slowest.groupby(["variant", "quantity"])["value"].agg(["median", "min", "max"])
    comm = frame[frame["quantity"] == "predicted_communication_bytes"].groupby("variant")["value"].first()
    variants = [v for v in VARIANT if v in stats.index.get_level_values(0)]
    unit, label = scale(comm.max())
    table = pd.DataFrame(
        {
            "variant": [VARIANT[v] for v in variants],
            "iteration (ms)": [cell(stats.loc[(v, "iteration_ms")]) for v in variants],
            "of which optimizer step (ms)": [cell(stats.loc[(v, "optimizer_step_ms")]) for v in variants],
            f"predicted bytes sent per rank and step ({label})": [f"{comm[v] / unit:.3g}" for v in variants],
        }
    )
    out = [
        f"Median (min–max) over {int(slowest['step'].nunique())} iterations of the slowest rank, each between "
        "device synchronisations; the optimizer step includes the exchange of updated parameters.",
        "",
        text_md(table),
        "",
    ]
    if {"unsharded", "sharded"} <= set(variants):
        it = {v: stats.loc[(v, "iteration_ms"), "median"] for v in variants}
        step = {v: stats.loc[(v, "optimizer_step_ms"), "median"] for v in variants}
        extra = (comm["sharded"] - comm["unsharded"]) / unit
        zero = (
            f" PyTorch's ZeroRedundancyOptimizer takes {it['zero']:.1f} ms per iteration."
            if "zero" in it
            else ""
        )
        out.append(
            f"Sharding changes the iteration from {it['unsharded']:.1f} to {it['sharded']:.1f} ms "
            f"({it['sharded'] / it['unsharded'] - 1:+.0%}) and the optimizer step from {step['unsharded']:.1f} to "
            f"{step['sharded']:.1f} ms: each rank updates about 1/{n} of the parameters but then receives the "
            f"others' ({extra:.3g} {label} more sent per rank and step).{zero}"
        )
    return "\n".join(out)


def cell(row: pd.Series) -> str:
    return f"{row['median']:.1f} ({row['min']:.1f}–{row['max']:.1f})"


def zero_comparison(frame: pd.DataFrame | None) -> str:
    text = [
        "ZeRO stage 1 (P_os, Rajbhandari et al. 2020) and our optimizer shard the same thing — the optimizer "
        "state, 8Ψ/n bytes per rank for fp32 AdamW instead of 8Ψ — and both keep full parameters (4Ψ) and full "
        "gradients (4Ψ) on every rank; gradients are sharded only from stage 2 on. They differ in three ways:",
        "",
        "- **Communication.** ZeRO-1 reduce-scatters the gradients (each rank needs only its shard's average) "
        "and all-gathers the updated parameters: (n−1)/n·Ψ each, 2Ψ in all — the same volume as DDP's "
        "all-reduce. We all-reduce the whole gradient (2Ψ) and then all-gather the parameters (Ψ): 3Ψ, 1.5× DDP. "
        "PyTorch's ZeroRedundancyOptimizer, used after DDP's all-reduce, also moves 3Ψ.",
        "- **Partition.** ZeRO-1 splits the flattened parameters into n equal slices; we assign whole tensors "
        "(largest first to the least-loaded rank), so a rank can hold more than 1/n, and the gain stops at one "
        "tensor per rank.",
        "- **Mixed precision.** In the paper's mixed-precision setting the sharded state also includes the fp32 "
        "master weights (K = 12 bytes per parameter: 2Ψ + 2Ψ + 12Ψ/n per rank); here training is fp32 without a "
        "master copy, so K = 8.",
    ]
    if frame is None:
        return "\n".join(text)
    first = frame.iloc[0]
    psi, n = int(first["num_params"]), int(first["world_size"])
    volume = values(data_parallel_communication(psi, n))
    memory = frame[
        (frame["phase"] == "after_step") & (frame["quantity"] == "predicted_optimizer_state_bytes")
    ]
    ours_max = memory[memory["variant"] == "sharded"]["value"].max()
    full = memory[memory["variant"] == "unsharded"]["value"].max()
    unit, label = scale(volume["sharded_bytes_per_rank"])
    table = pd.DataFrame(
        {
            "": ["bytes sent per rank and step", "optimizer state on the fullest rank"],
            "DDP + AdamW": [
                f"{volume['ddp_bytes_per_rank'] / unit:.3g} {label}",
                f"{full / unit:.3g} {label}",
            ],
            "ZeRO stage 1": [
                f"{volume['zero1_bytes_per_rank'] / unit:.3g} {label}",
                f"{full / n / unit:.3g} {label}",
            ],
            "ours": [
                f"{volume['sharded_bytes_per_rank'] / unit:.3g} {label}",
                f"{ours_max / unit:.3g} {label}",
            ],
        }
    )
    text += [
        "",
        f"For this run's model (Ψ = {count(psi)} parameters, fp32) on {n} ranks, from "
        "`accounting.data_parallel_communication` (ring collectives) and the predicted state above:",
        "",
        text_md(table),
    ]
    return "\n".join(text)
