"""What the writeup computes from tidy results before it says anything: fits, interval overlap, step statistics,
trends and the tests that decide whether a finding is stated. Pure functions of numbers and DataFrames; no text."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from cs336_systems.accounting.units import MIB

# ---------------------------------------------------------------------------------------------------------
# The latency-bandwidth model of a collective: t(n) = α + β·n


def fit_latency_bandwidth(n_bytes: np.ndarray, seconds: np.ndarray) -> dict[str, float]:
    """Least squares of t = α + β·n, each point weighted by 1/t so that every size counts by its relative error
    (an unweighted fit is decided by the largest size alone); also the worst relative residual."""
    n, t = np.asarray(n_bytes, dtype=float), np.asarray(seconds, dtype=float)
    design = np.stack([np.ones_like(n), n], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    worst = np.max(np.abs((alpha + beta * n) / t - 1))
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "worst_relative_error": worst, "sizes": len(t)}


ALLREDUCE_KEYS = ["backend", "world_size"]


def allreduce_fits(ok: pd.DataFrame) -> pd.DataFrame:
    """One α–β fit per (backend, world_size) with at least two sizes, from median times in ms."""
    rows = [
        {
            "backend": backend,
            "world_size": world_size,
            **fit_latency_bandwidth(group["bytes"].to_numpy(), group["median_ms"].to_numpy() / 1e3),
        }
        for (backend, world_size), group in ok.groupby(ALLREDUCE_KEYS)
        if group["size_mb"].nunique() >= 2
    ]
    columns = [*ALLREDUCE_KEYS, "alpha_s", "beta_s_per_byte", "worst_relative_error", "sizes"]
    return pd.DataFrame(rows, columns=columns)


# ---------------------------------------------------------------------------------------------------------
# Intervals (ms) on a timeline

Intervals = list[tuple[float, float]]


def union(intervals: Intervals) -> Intervals:
    """Sorted, disjoint intervals covering the same time."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def intersection_length(a: Intervals, b: Intervals) -> float:
    """Time covered by both of two unions (each sorted and disjoint, as `union` returns them)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def concurrency(busy: Intervals, other: Intervals) -> tuple[float, float]:
    """How long `busy` lasts (overlaps counted once) and the share of that time during which `other` runs too."""
    busy, other = union(busy), union(other)
    total = sum(end - start for start, end in busy)
    return total, intersection_length(busy, other) / total if total else 0.0


# ---------------------------------------------------------------------------------------------------------
# Step statistics

MODES = ["forward", "forward_backward", "train_step"]  # the timed modes of a Transformer step, in order


def step_stats(frame: pd.DataFrame, keys: list[str], value: str = "time_ms") -> pd.DataFrame:
    """Mean, std, median, min, max and count of the timed steps per cell; cells that ran out of memory are
    rows with `oom` True (and NaN statistics), those that ran have `oom` NaN."""
    ok = frame[frame["status"] == "ok"]
    stats = ok.groupby(keys, sort=False)[value].agg(
        mean_ms="mean", std_ms="std", median_ms="median", min_ms="min", max_ms="max", steps="size"
    )
    oom = frame[frame["status"] == "OOM"][keys].drop_duplicates().assign(oom=True)
    return pd.concat([stats.reset_index(), oom], ignore_index=True)


def paired_speedups(
    frame: pd.DataFrame, column: str, baseline: str, other: str, keys: list[str]
) -> pd.DataFrame:
    """Per cell: the step statistics where `column` is `baseline` (suffix _baseline) and where it is `other`
    (suffix _other), and speedup = baseline median / other median, NaN unless both ran. Medians, since one slow
    step (a late allocation) moves a mean of ten but not the median."""
    stats = step_stats(frame.astype({column: str}), [*keys, column])
    side = {v: stats[stats[column] == v].drop(columns=column).set_index(keys) for v in (baseline, other)}
    both = side[baseline].add_suffix("_baseline").join(side[other].add_suffix("_other"), how="outer")
    both["speedup"] = both["median_ms_baseline"] / both["median_ms_other"]
    return both.reset_index()


def speedups_by_size(compared: pd.DataFrame, order: list[str], decimals: int = 2) -> dict[str, pd.Series]:
    """Per mode (in MODES order), the median over contexts of paired_speedups' speedup per size, sizes in
    `order`; sizes where no cell has both variants are left out. The median is of the speedups rounded as the
    table shows them (`decimals`), so that a reader can check it against the table."""
    ran = compared.dropna(subset=["speedup"])
    by_size = {}
    for mode in [m for m in MODES if m in set(ran["mode"])]:
        medians = (
            ran[ran["mode"] == mode].groupby("size")["speedup"].agg(lambda v: v.round(decimals).median())
        )
        by_size[mode] = medians.reindex([s for s in order if s in medians.index])
    return by_size


def phase_times(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per cell: mean forward and backward ms (NaN where absent) and `oom_phase`, the phase that ran out of
    memory (NaN where none did)."""
    ok = frame[frame["status"] == "ok"]
    times = ok.pivot_table(index=keys, columns="phase", values="time_ms", aggfunc="mean")
    times = times.reindex(columns=["forward", "backward"])
    oom = frame[frame["status"] == "OOM"].set_index(keys)["phase"].rename("oom_phase")
    return frame[keys].drop_duplicates().set_index(keys).join(times).join(oom)


def share_removed(cold: float, warm: float, reference: float) -> float:
    """How much of the extra time `cold` has over `reference` is gone at `warm` (1 = all of it, capped at 1);
    NaN when `cold` has no extra time."""
    extra = cold - reference
    return min(1.0, (cold - warm) / extra) if extra > 0 else math.nan


def fewest_sufficient(means: pd.DataFrame, enough: float = 0.5) -> tuple[Any, float] | None:
    """`means`: one row per cell, one column per warm-up count in increasing order (mean step time). The
    fewest warm-up steps, short of the most, that remove at least `enough` of the first column's extra time
    over the last column's in every cell, with the smallest share removed there; None if no count does."""
    cold, reference = means.iloc[:, 0], means.iloc[:, -1]
    for count in means.columns[1:-1]:
        shares = [share_removed(*row) for row in zip(cold, means[count], reference, strict=True)]
        if all(share >= enough for share in shares):  # a NaN share (nothing to remove) never is
            return count, min(shares)
    return None


# ---------------------------------------------------------------------------------------------------------
# Trends


class Trend(NamedTuple):
    direction: str  # "flat", "grows", "shrinks" or "mixed"
    spread: float  # (max − min) / |median|


def trend(values: pd.Series, flat_within: float = 0.05, agreement: float = 0.7) -> Trend:
    """How values, in the order given (e.g. by model size), change: flat when all lie within `flat_within` of
    their median; otherwise grows or shrinks when the rank correlation with the order reaches ±`agreement`
    (with two values, their order decides), else mixed."""
    scale = abs(values.median())
    spread = (values.max() - values.min()) / scale if scale else math.inf
    if spread < flat_within:
        return Trend("flat", spread)
    if len(values) < 3:
        return Trend("grows" if values.iloc[-1] > values.iloc[0] else "shrinks", spread)
    rank = np.corrcoef(np.arange(len(values)), values.rank().to_numpy())[0, 1]
    return Trend("grows" if rank >= agreement else "shrinks" if rank <= -agreement else "mixed", spread)


def log_slope(x: pd.Series, y: pd.Series) -> float:
    """The exponent k of y ∝ x^k between the last two points."""
    lx, ly = np.log(x.to_numpy(float)), np.log(y.to_numpy(float))
    return (ly[-1] - ly[-2]) / (lx[-1] - lx[-2])


# ---------------------------------------------------------------------------------------------------------
# Activation checkpointing (2026 §3.2): measured policies beside the residual model of cs336_systems.model.checkpointing


def checkpoint_policy_key(policy: str) -> tuple[int, int, str]:
    """Sort key: none, every:1 .. every:N, nested, the selective ones."""
    kind, _, k = policy.partition(":")
    return (
        {"none": 0, "every": 1, "nested": 2, "selective": 3}.get(kind, 4),
        int(k) if k.isdigit() else 0,
        policy,
    )


def checkpointing_cells(cells: pd.DataFrame, block: pd.Series) -> pd.DataFrame:
    """The cells of one (depth, autocast), in policy order, with `k` (every:K, else NaN), `saved_mib`, and the
    residual model's `predicted_mib` (activations and block gradients at the backward's peak, from the block's
    measured R, c, w; NaN for selective, which the model leaves out) and `forward_evaluations`."""
    from cs336_systems.model import checkpointing

    n = int(block["num_layers"])
    sizes = [block[key] for key in ("residual_bytes", "checkpoint_bytes", "grad_bytes_per_block")]
    out = (
        cells.assign(order=cells["policy"].map(checkpoint_policy_key))
        .sort_values("order")
        .drop(columns="order")
    )
    out["k"] = out["policy"].map(lambda p: float(p.split(":")[1]) if p.startswith("every:") else math.nan)
    out["saved_mib"] = out.get("saved_bytes", pd.Series(math.nan, index=out.index)) / MIB
    out["predicted_mib"] = [
        math.nan if p.startswith("selective") else checkpointing.predicted_peak(p, n, *sizes) / MIB
        for p in out["policy"]
    ]
    out["forward_evaluations"] = [checkpointing.forward_evaluations(p, n) for p in out["policy"]]
    return out.reset_index(drop=True)


def time_baseline(cells: pd.DataFrame) -> tuple[str, float] | None:
    """The policy step times are compared with: none where it ran, else the fastest that ran."""
    ok = cells[(cells["status"] == "ok") & cells["median_ms"].notna()]
    if ok.empty:
        return None
    none = ok[ok["policy"] == "none"]
    row = none.iloc[0] if len(none) else ok.loc[ok["median_ms"].idxmin()]
    return str(row["policy"]), float(row["median_ms"])


def best_one_level(cells: pd.DataFrame, value: str) -> dict[str, Any] | None:
    """The every:K whose measured `value` (a peak) is smallest, with the next smaller and larger K that exist
    (their value, or their status where they did not run)."""
    every = cells[cells["k"].notna()].set_index("k")
    ok = every[(every["status"] == "ok") & every[value].notna()]
    if ok.empty:
        return None
    best = ok[value].idxmin()

    def neighbour(k: float) -> dict[str, Any] | None:
        if k not in every.index:
            return None
        row = every.loc[k]
        return {"k": int(k), "status": row["status"], "value": row[value] if row["status"] == "ok" else None}

    return {
        "k": int(best),
        "value": float(ok.loc[best, value]),
        "smaller": neighbour(best - 1),
        "larger": neighbour(best + 1),
    }


def analytic_optimum(block: pd.Series) -> dict[str, float]:
    """K* of the residual model (the smallest predicted peak, activations and block gradients) and its predicted
    peak in MiB; also the K of the pure activation model (no gradients) and sqrt(N c / R), its continuous
    approximation."""
    from cs336_systems.model import checkpointing

    n = int(block["num_layers"])
    r, c, w = (float(block[key]) for key in ("residual_bytes", "checkpoint_bytes", "grad_bytes_per_block"))
    k = checkpointing.optimal_k(n, r, c, w)
    return {
        "k": k,
        "predicted_mib": checkpointing.predicted_peak(f"every:{k}", n, r, c, w) / MIB,
        "k_activations_only": checkpointing.optimal_k(n, r, c),
        "k_continuous": math.sqrt(n * c / r),
    }


def ratio_of(cells: pd.DataFrame, policy: str, other: str, value: str) -> float | None:
    """cells' `value` of `policy` over that of `other`, where both ran."""
    ok = cells[(cells["status"] == "ok") & cells[value].notna()].set_index("policy")[value]
    return float(ok[policy] / ok[other]) if {policy, other} <= set(ok.index) else None


def nested_asymptotics(depths: list[int], block: pd.Series) -> pd.DataFrame:
    """Per depth N, the residual model's peak activation memory (no gradients: §3.2 a) of none, every:1 and
    nested, the checkpoints nested holds at its peak, and the block forwards (compute) of every:1 and nested."""
    from cs336_systems.model import checkpointing

    r, c = float(block["residual_bytes"]), float(block["checkpoint_bytes"])
    rows = []
    for n in depths:
        peaks = {p: checkpointing.predicted_peak(p, n, r, c) / MIB for p in ("none", "every:1", "nested")}
        rows.append(
            {
                "num_layers": n,
                **{f"{p}_mib": v for p, v in peaks.items()},
                "nested_checkpoints": round((peaks["nested"] * MIB - r) / c),
                "every_1_forwards": checkpointing.forward_evaluations("every:1", n),
                "nested_forwards": checkpointing.forward_evaluations("nested", n),
            }
        )
    return pd.DataFrame(rows)


# 2026 §3.1 autograd residuals: totals per configuration, what each size of tensor costs, eager vs compiled

RESIDUAL_KEYS = ["module", "attention", "heads", "mode", "source"]
_ITEMSIZE = {"bool": 1, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def residual_totals(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration and source: status (ok, or the first other status), tensors saved, distinct
    storages counted, counted MiB (each non-parameter storage once) and the handout's MiB (every saved tensor's
    bytes, aliases included, except `nn.Parameter` objects)."""
    frame = frame.assign(heads=frame["heads"].fillna(0).astype(int))
    rows = []
    for key, group in frame.groupby(RESIDUAL_KEYS, sort=False):
        ok = group[group["status"] == "ok"]
        status = "ok" if len(ok) else str(group["status"].iloc[0])
        rows.append(
            {
                **dict(zip(RESIDUAL_KEYS, key, strict=True)),
                "status": status,
                "reason": group["reason"].dropna().iloc[0]
                if "reason" in group and group["reason"].notna().any()
                else None,
                "tensors": len(ok),
                "storages": int(ok["counted"].astype(bool).sum()),
                "counted_mib": ok["counted_bytes"].sum() / MIB if len(ok) else math.nan,
                "handout_mib": ok.loc[~ok["is_parameter_object"].astype(bool), "bytes"].sum() / MIB
                if len(ok)
                else math.nan,
            }
        )
    return pd.DataFrame(rows)


def residual_size_formulas(
    batch: int, seq: int, d_model: int, d_ff: int, heads: int | None
) -> dict[str, int]:
    """Element counts of the tensor sizes a block makes, by formula (B batch, T context, h heads)."""
    formulas = {
        "B·T·d": batch * seq * d_model,
        "3·B·T·d": 3 * batch * seq * d_model,
        "B·T·d_ff": batch * seq * d_ff,
        "B·T": batch * seq,
        "T²": seq * seq,
        "d": d_model,
    }
    if heads:
        formulas |= {
            "B·h·T²": batch * heads * seq * seq,
            "B·h·T": batch * heads * seq,
            "T·d_head/2": seq * (d_model // heads) // 2,
        }
    return formulas


def residual_size_class(row: pd.Series) -> str:
    """The formula(s) of a counted tensor's storage size ("B·T·d", "B·h·T²", ...); several joined by " = " when
    the dimensions make them equal, "other" when none fits."""
    heads = int(row["heads"]) if pd.notna(row.get("heads")) and row["heads"] else None
    formulas = residual_size_formulas(
        int(row["batch_size"]), int(row["context_length"]), int(row["d_model"]), int(row["d_ff"]), heads
    )
    elements = row["storage_bytes"] // _ITEMSIZE.get(row["dtype"], 4)
    names = [name for name, count in formulas.items() if count == elements]
    return " = ".join(names) or "other"


def residuals_by_size(frame: pd.DataFrame) -> pd.DataFrame:
    """Counted MiB and tensor count per size class of the measured configurations (ok rows):
    columns module, attention, heads, mode, size_class, tensors, mib."""
    counted = frame[
        (frame["source"] == "measured") & (frame["status"] == "ok") & frame["counted"].astype(bool)
    ]
    if counted.empty:
        return pd.DataFrame(columns=["module", "attention", "heads", "mode", "size_class", "tensors", "mib"])
    counted = counted.assign(
        size_class=counted.apply(residual_size_class, axis=1), heads=counted["heads"].fillna(0).astype(int)
    )
    grouped = counted.groupby(["module", "attention", "heads", "mode", "size_class"], sort=False)
    return grouped.agg(
        tensors=("counted_bytes", "size"), mib=("counted_bytes", lambda b: b.sum() / MIB)
    ).reset_index()


def fusion_changes(by_size: pd.DataFrame) -> pd.DataFrame:
    """Per configuration (module, attention, heads) and size class: eager and compiled tensors and MiB, and the
    change compiled − eager; only configurations measured in both modes."""
    wide = by_size.pivot_table(
        index=["module", "attention", "heads", "size_class"],
        columns="mode",
        values=["tensors", "mib"],
        aggfunc="sum",
        fill_value=0,
    )
    if not {"eager", "compiled"} <= set(wide.columns.get_level_values(1)):
        return pd.DataFrame(
            columns=[
                "module",
                "attention",
                "heads",
                "size_class",
                "eager_tensors",
                "compiled_tensors",
                "eager_mib",
                "compiled_mib",
                "change_mib",
            ]
        )
    both = by_size.groupby(["module", "attention", "heads"])["mode"].nunique() == 2
    wide.columns = [f"{mode}_{value}" for value, mode in wide.columns]
    out = wide.reset_index()
    out = out[out.set_index(["module", "attention", "heads"]).index.map(both).fillna(False).astype(bool)]
    out = out.assign(change_mib=out["compiled_mib"] - out["eager_mib"])
    columns = [
        "module",
        "attention",
        "heads",
        "size_class",
        "eager_tensors",
        "compiled_tensors",
        "eager_mib",
        "compiled_mib",
        "change_mib",
    ]
    return out[columns].astype({"eager_tensors": int, "compiled_tensors": int}).reset_index(drop=True)


# ---------------------------------------------------------------------------------------------------------
# FSDP (2026 §7): the goals of the benchmark and the exposed all-gathers of a traced step

# An all-gather counts as exposed where it runs while no compute kernel does; a layer had its weights in time when
# less than this was exposed in its window: well above the few µs between back-to-back kernels, well below a layer.
IN_TIME_MS = 0.02
COMPUTE_KINDS = ("compute", "memcpy")


def difference(a: Intervals, b: Intervals) -> Intervals:
    """The time of `a` not covered by `b` (both any intervals), as sorted disjoint intervals."""
    out, cover = [], union(b)
    for start, end in union(a):
        for c_start, c_end in cover:
            if c_end <= start or c_start >= end:
                continue
            if c_start > start:
                out.append((start, c_start))
            start = max(start, c_end)
        if start < end:
            out.append((start, end))
    return out


def gather_exposure(kernels: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Where a traced step's all-gathers were exposed (ran while no compute kernel ran), from its kernels
    (columns stream, kind, start_ms, end_ms, layer: bench.fsdp_variants' timeline rows of one variant). Compute
    kernels are the compute kernels and copies on the streams that run compute kernels: a copy on a communication
    stream (FSDP2's copy-in before its all-gather) is part of the communication, not computation it could hide
    behind, while a collective on the compute stream (a synchronous one: torch runs it on the current stream)
    does not make that stream a communication stream.

    Per Transformer layer of the forward (the compute kernels its forward launched): its window, from the end of
    the previous layer's last kernel (the step's start for the first) to the end of its own, the exposed
    all-gather time in it, and `in_time` (less than IN_TIME_MS exposed). The summary: the exposed time in the
    forward layers and in the whole step, the step's span, the worst layer and the exposed intervals."""
    spans = lambda rows: list(zip(rows["start_ms"], rows["end_ms"], strict=True))
    compute_streams = set(kernels.loc[kernels["kind"] == "compute", "stream"])
    compute = kernels[kernels["kind"].isin(COMPUTE_KINDS) & kernels["stream"].isin(compute_streams)]
    exposed = difference(spans(kernels[kernels["kind"] == "all_gather"]), spans(compute))
    layered = compute.dropna(subset=["layer"])
    ends = layered.groupby(layered["layer"].astype(int))["end_ms"].max().sort_index()
    starts = [0.0, *ends.to_numpy()[:-1]][: len(ends)]
    layers = pd.DataFrame(
        {
            "layer": ends.index,
            "window_start_ms": starts,
            "window_end_ms": ends.to_numpy(),
            "exposed_ms": [
                intersection_length(exposed, [(start, end)]) for start, end in zip(starts, ends, strict=True)
            ],
        }
    )
    layers["in_time"] = layers["exposed_ms"] < IN_TIME_MS
    worst = layers.loc[layers["exposed_ms"].idxmax()] if len(layers) else None
    summary = {
        "layers": len(layers),
        "layers_in_time": int(layers["in_time"].sum()),
        "forward_exposed_ms": layers["exposed_ms"].sum(),
        "step_exposed_ms": sum(end - start for start, end in exposed),
        "step_ms": kernels["end_ms"].max() if len(kernels) else math.nan,
        "worst_layer": int(worst["layer"]) if worst is not None else None,
        "worst_exposed_ms": worst["exposed_ms"] if worst is not None else math.nan,
        "exposed": exposed,
    }
    return layers, summary


def fsdp_goals(cells: pd.DataFrame) -> pd.DataFrame:
    """The FSDP benchmark's goals for one world size, from its cells (one row per variant: step_ms, peak_mib
    (the largest rank's), gather_wait_ms): our step time at most FSDP2's, our peak at most FSDP2's + 5 %, our
    exposed all-gather wait under 5 % of our step, and on one rank our overhead over the unwrapped model under
    5 %. Per goal the measured value, the bound and `passed` (None where a value is missing)."""
    by = cells.set_index("variant")
    get = lambda variant, column: by[column].get(variant, math.nan) if column in by else math.nan
    ours_step, ours_peak, wait = (
        get("ours", "step_ms"),
        get("ours", "peak_mib"),
        get("ours", "gather_wait_ms"),
    )
    goals = [  # (goal, measured, bound, unit, whether the bound itself fails)
        ("step time ≤ FSDP2's", ours_step, get("fsdp2", "step_ms"), "ms", False),
        ("peak memory ≤ FSDP2's + 5 %", ours_peak, 1.05 * get("fsdp2", "peak_mib"), "MiB", False),
        ("exposed all-gather < 5 % of the step", wait, 0.05 * ours_step, "ms", True),
    ]
    if "single" in by.index and cells["world_size"].iloc[0] == 1:
        single = 1.05 * get("single", "step_ms")
        goals.append(("overhead over the unwrapped model < 5 %", ours_step, single, "ms", True))
    rows = []
    for goal, value, bound, unit, strict in goals:
        known = not (pd.isna(value) or pd.isna(bound))
        passed = bool(value < bound if strict else value <= bound) if known else None
        rows.append({"goal": goal, "measured": value, "bound": bound, "unit": unit, "passed": passed})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------------------
# What one layer of the training step costs, kernel by kernel


def per_layer_kernels(kernels: pd.DataFrame) -> pd.DataFrame:
    """Per stack and kernel, what one more layer costs: the least-squares slopes over depth of the kernel's
    milliseconds and calls per step (a kernel absent at a depth counts 0 there); stack, kernel, component,
    ms_per_layer, calls_per_layer."""
    depths = sorted(kernels["num_layers"].unique())
    rows = []
    for (stack, kernel), runs in kernels.groupby(["stack", "kernel"], sort=False):
        by_depth = runs.set_index("num_layers").reindex(depths).fillna({"kernel_ms": 0.0, "calls": 0.0})
        ms = np.polyfit(depths, by_depth["kernel_ms"], 1)[0]
        calls = np.polyfit(depths, by_depth["calls"], 1)[0]
        rows.append([stack, kernel, runs["component"].iloc[0], ms, calls])
    return pd.DataFrame(rows, columns=["stack", "kernel", "component", "ms_per_layer", "calls_per_layer"])
