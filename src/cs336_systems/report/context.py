"""What a writeup section sees: the run's tidy results, a place for figures, and formatting helpers."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: figures are files
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from cs336_systems.provenance import read_rows  # noqa: E402


@dataclass
class Context:
    run: str
    results: Path  # results/<run>
    out_dir: Path  # report/<run>; figures go to out_dir/figures
    provenances: list[dict[str, Any]] = field(default_factory=list)

    def tables(self, deliverable: str) -> list[tuple[pd.DataFrame, dict[str, Any]]]:
        """Every table under results/<run>/<deliverable>/, each with its provenance sidecar."""
        found = []
        for csv in sorted((self.results / deliverable).glob("*.csv")):
            if csv.with_suffix(".json").exists():
                frame, meta = read_rows(csv)
                meta["file"] = str(csv.relative_to(self.results))
                found.append((frame, meta))
                self.provenances.append(meta)
        return found

    def table(self, deliverable: str) -> tuple[pd.DataFrame, list[dict[str, Any]]] | None:
        """All tables of a deliverable concatenated, or None when the deliverable has not produced any."""
        found = self.tables(deliverable)
        if not found:
            return None
        return pd.concat([f for f, _ in found], ignore_index=True), [m for _, m in found]

    def figure(self, fig: plt.Figure, name: str, alt: str) -> str:
        """Save `fig` as figures/<name>.png and return its markdown image link (relative to the writeup)."""
        path = self.out_dir / "figures" / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        return f"![{alt}](figures/{name}.png)"


def md(frame: pd.DataFrame, floatfmt: str = ".2f") -> str:
    """A pandas table as GitHub markdown."""
    return frame.to_markdown(index=False, floatfmt=floatfmt)


def provenance_line(metas: list[dict[str, Any]]) -> str:
    """One line naming the hardware and software that produced a section's numbers, and the code's commits."""
    setups: dict[str, dict[str, list[str]]] = {}
    for meta in metas:
        p = meta["provenance"]
        count = p.get("device_count") or 0
        device = (
            f"{p['device_name']} ×{count}"
            if count
            else f"CPU ({p.get('cpu_threads')} thread{'' if p.get('cpu_threads') == 1 else 's'})"
        )
        setup = f"{device}; torch {p['torch']}, CUDA {p.get('cuda') or '—'}, triton {p.get('triton') or '—'}"
        seen = setups.setdefault(setup, {"commits": [], "dates": []})
        commit = (p.get("git_commit") or "unknown")[:10] + (" (dirty)" if p.get("git_dirty") else "")
        for key, value in (("commits", commit), ("dates", p["timestamp"][:10])):
            if value not in seen[key]:
                seen[key].append(value)
    parts = [
        f"{setup}; commit{'s' if len(seen['commits']) > 1 else ''} {', '.join(seen['commits'])}; "
        f"{', '.join(seen['dates'])}"
        for setup, seen in setups.items()
    ]
    return "_Measured on " + " | ".join(parts) + "._" if parts else ""


def not_run(what: str) -> str:
    return f"_{what} has no results in this run yet._"


def not_measured(reason: str) -> str:
    """What a section says when its deliverable only recorded why it did not run here (see skipped_reason)."""
    return f"Not measured in this run: {reason}."


def skipped_reason(frame: pd.DataFrame) -> str | None:
    """If every row of a table says `skipped`, the reason it gives (e.g. 'needs CUDA')."""
    if "status" in frame and (frame["status"] == "skipped").all():
        reasons = frame.get("reason", pd.Series(["not run"])).dropna().unique()
        return "; ".join(map(str, reasons)) or "not run"
    return None


def model_order(metas: list[dict[str, Any]]) -> list[str]:
    """Sizes from small to large by their non-embedding parameter count (file order is alphabetical)."""
    weights = {}
    for meta in metas:
        p = meta["params"]
        weights[p["size"]] = p["num_layers"] * (4 * p["d_model"] ** 2 + 3 * p["d_model"] * p["d_ff"])
    return sorted(weights, key=weights.get)
