"""How numbers and tables look in the writeup: number formats, markdown tables, the provenance line, the lines a
section shows instead of results. Nothing here computes a finding (that is analysis.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd

from cs336_systems.accounting.units import GIB, MIB
from cs336_systems.report.analysis import MODES, trend

# Timed modes of a Transformer step, as the e2e, profiling, mixed-precision and compile sections name them.
MODE_LABEL = dict(zip(MODES, ["forward", "forward+backward", "train step (AdamW)"], strict=True))


def md(frame: pd.DataFrame, floatfmt: str = ".2f") -> str:
    """A pandas table as GitHub markdown."""
    return frame.to_markdown(index=False, floatfmt=floatfmt)


def text_md(frame: pd.DataFrame) -> str:
    """A table whose cells are already formatted (tabulate would re-format number-like strings)."""
    return frame.to_markdown(index=False, disable_numparse=True)


def count(n: float) -> str:
    """A parameter count in millions or billions."""
    return f"{n / 1e9:.3g} B" if n >= 1e9 else f"{n / 1e6:.3g} M"


def num(x: float) -> str:
    """Three significant digits without an exponent for numbers of at least 100."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def or_dash(fmt: str) -> Callable[[Any], str]:
    """A table cell's formatter: the value in `fmt` (a str.format pattern), or — where it is missing."""
    return lambda value: "—" if pd.isna(value) else fmt.format(value)


def binary_unit(n_bytes: float) -> tuple[str, int]:
    """The unit a size reads best in, and its bytes: GiB from one GiB on, MiB below."""
    return ("GiB", GIB) if n_bytes >= GIB else ("MiB", MIB)


def mib_or_gib(n_bytes: float) -> str:
    """A size in prose: GiB with two decimals from one GiB on, MiB with one decimal below."""
    return f"{n_bytes / GIB:,.2f} GiB" if n_bytes >= GIB else f"{n_bytes / MIB:,.1f} MiB"


def span(values: pd.Series, fmt: str) -> str:
    """`lo–hi` in `fmt`, or the one value when all are equal."""
    lo, hi = values.min(), values.max()
    return f"{fmt.format(lo)}–{fmt.format(hi)}" if lo != hi else fmt.format(lo)


def capitalized(text: str) -> str:
    """The first letter upper case, the rest as it is (str.capitalize would lower `AdamW`)."""
    return text[:1].upper() + text[1:]


def trend_text(direction: str, spread: float) -> str:
    """A verb phrase for analysis.trend's verdict."""
    if direction == "flat":
        return f"is flat (all within {spread:.0%} of each other)"
    return {"grows": "grows", "shrinks": "shrinks"}.get(direction, "has no consistent trend")


def not_run(what: str) -> str:
    return f"_{what} has no results in this run yet._"


def not_measured(reason: str) -> str:
    """What a section says when its deliverable only recorded why it did not run here."""
    return f"Not measured in this run: {reason}."


def provenance_line(metas: list[dict[str, Any]]) -> str:
    """One line naming the hardware and software that produced a section's numbers, and the code's commits."""
    setups: dict[str, dict[str, list[str]]] = {}
    for meta in metas:
        p = meta["provenance"]
        seen = setups.setdefault(setup_text(p), {"commits": [], "dates": []})
        for key, value in (("commits", commit_text(p)), ("dates", p["timestamp"][:10])):
            if value not in seen[key]:
                seen[key].append(value)
    parts = [
        f"{setup}; commit{'s' if len(seen['commits']) > 1 else ''} {', '.join(seen['commits'])}; "
        f"{', '.join(seen['dates'])}"
        for setup, seen in setups.items()
    ]
    return "_Measured on " + " | ".join(parts) + "._" if parts else ""


def commit_text(p: dict[str, Any]) -> str:
    """A provenance's commit as the writeup names it: 10 characters, and whether the checkout was dirty."""
    return (p.get("git_commit") or "unknown")[:10] + (" (dirty)" if p.get("git_dirty") else "")


def run_text(p: dict[str, Any]) -> str:
    """A provenance's commit and, where recorded, its GPU: two results compare only where these agree (machines
    of one kind differ by a few percent)."""
    uuid = p.get("device_uuid")
    return commit_text(p) + (f" on GPU {uuid[:8]}" if uuid else "")


def setup_text(p: dict[str, Any]) -> str:
    count = p.get("device_count") or 0
    threads = p.get("cpu_threads")
    device = (
        f"{p['device_name']} ×{count}" if count else f"CPU ({threads} thread{'' if threads == 1 else 's'})"
    )
    return f"{device}; torch {p['torch']}, CUDA {p.get('cuda') or '—'}, triton {p.get('triton') or '—'}"


def speedup_table(compared: pd.DataFrame, order: list[str], labels: dict[str, str]) -> pd.DataFrame:
    """analysis.paired_speedups as a table: per size × context × mode both variants' median (± std) or OOM, and
    the speedup; `labels` names the two columns ("baseline", "other")."""
    table = compared[["size", "context_length", "mode"]].copy()
    for side in ("baseline", "other"):
        table[labels[side]] = [
            "OOM" if oom is True else "—" if pd.isna(median) else f"{median:.4g} (± {std:.2g})"
            for oom, median, std in zip(
                compared[f"oom_{side}"],
                compared[f"median_ms_{side}"],
                compared[f"std_ms_{side}"],
                strict=True,
            )
        ]
    table["speedup"] = compared["speedup"].map(or_dash("{:.2f}×"))
    table["size"] = pd.Categorical(table["size"], categories=order, ordered=True)
    table["mode"] = pd.Categorical(
        table["mode"].map(MODE_LABEL), categories=list(MODE_LABEL.values()), ordered=True
    )
    return table.sort_values(["mode", "size", "context_length"])


def speedup_sentences(by_size: dict[str, pd.Series], what: str) -> str:
    """Per mode (analysis.speedups_by_size): `what` for each size, and its trend across sizes."""
    sentences = []
    for mode, speedups in by_size.items():
        listed = ", ".join(f"{s:.2f}× for {size}" for size, s in speedups.items())
        slower = " (below 1: slower than the baseline)" if (speedups < 1).any() else ""
        verdict = (
            "one size, so no trend to read"
            if len(speedups) == 1
            else f"it {trend_text(*trend(speedups))} across model sizes"
        )
        sentences.append(f"{capitalized(MODE_LABEL[mode])}: {what} is {listed}{slower}; {verdict}.")
    return " ".join(sentences)


def phase_cell(row: pd.Series, phase: str) -> str:
    """One phase's time from a row of analysis.phase_times: ms, or OOM where this phase (or the forward pass
    before it) ran out of memory, or — where it did not run."""
    if pd.notna(row[phase]):
        return f"{row[phase]:.3g}"
    if row["oom_phase"] == "forward" or row["oom_phase"] == phase:
        return "OOM"
    return "—"


def pytest_outcomes(frame: pd.DataFrame) -> str:
    """A table of pytest results (experiments/gpu_tests.py) as its outcome counts per file, then one verdict
    sentence: every test that ran passed, or which failed and why, and why any were skipped."""
    counts = frame.pivot_table(index="file", columns="outcome", values="test", aggfunc="count", fill_value=0)
    counts = counts.reindex(columns=[o for o in ("passed", "failed", "error", "skipped") if o in counts])
    failed = frame[frame["outcome"].isin(["failed", "error"])]
    verdict = (
        f"All {int((frame['outcome'] == 'passed').sum())} tests that ran passed"
        if failed.empty
        else f"**{len(failed)} failed**: "
        + "; ".join(f"`{t}` ({m})" for t, m in zip(failed["test"], failed["message"], strict=True))
    )
    skipped = frame[frame["outcome"] == "skipped"]["message"].value_counts()
    why = "; ".join(f"{n} skipped: {m}" for m, n in skipped.items())
    return f"{md(counts.reset_index())}\n\n{verdict}." + (f" {why}." if why else "")
