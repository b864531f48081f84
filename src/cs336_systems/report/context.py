"""What a writeup section sees: the run's tidy results (or why there are none), a place for figures, and the
models those results describe."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: figures are files
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from cs336_systems.measure.provenance import read_rows  # noqa: E402
from cs336_systems.model.transformer import ModelConfig  # noqa: E402
from cs336_systems.report.formatting import not_measured, not_run, provenance_line  # noqa: E402

Found = tuple[pd.DataFrame, list[dict[str, Any]]]


class NotRun(Exception):
    """A table a part of the writeup needs did not run (or was skipped); str() is the markdown shown in that part's
    place. report.render catches it for a whole section, `reason_if_not_run` for a part of one."""


def reason_if_not_run(part: Callable[..., str]) -> Callable[..., str]:
    """For a part of a section: when a table it needs did not run, the part reads as the reason and the rest of
    the section goes on."""

    @functools.wraps(part)
    def text(*args: Any, **kwargs: Any) -> str:
        try:
            return part(*args, **kwargs)
        except NotRun as reason:
            return str(reason)

    return text


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

    def table(self, deliverable: str) -> Found | None:
        """All tables of a deliverable concatenated, or None when the deliverable has not produced any."""
        found = self.tables(deliverable)
        if not found:
            return None
        return pd.concat([f for f, _ in found], ignore_index=True), [m for _, m in found]

    def require(self, deliverable: str, what: str, off_gpu: str | None = None) -> Found:
        """The deliverable's table and provenances, which the calling part of the writeup cannot do without: raises
        NotRun when `what` has no results in this run, or when every row says it was skipped. For a measurement
        only a GPU can make, `off_gpu` says what a run without one did instead, in place of the rows' reason."""
        found = self.table(deliverable)
        if found is None:
            raise NotRun(not_run(what))
        frame, metas = found
        reason = skipped_reason(frame)
        if reason:
            shown = off_gpu if off_gpu and not on_gpu(metas) else reason
            raise NotRun(f"{provenance_line(metas)}\n\n{not_measured(shown)}")
        return found

    def figure(self, fig: plt.Figure, name: str, alt: str) -> str:
        """Save `fig` as figures/<name>.png and return its markdown image link (relative to the writeup)."""
        path = self.out_dir / "figures" / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        return f"![{alt}](figures/{name}.png)"


def skipped_reason(frame: pd.DataFrame) -> str | None:
    """If every row of a table says `skipped`, the reason it gives (e.g. 'needs CUDA')."""
    if "status" in frame and (frame["status"] == "skipped").all():
        reasons = frame.get("reason", pd.Series(["not run"])).dropna().unique()
        return "; ".join(map(str, reasons)) or "not run"
    return None


def on_gpu(metas: list[dict[str, Any]]) -> bool:
    """Whether the tables of these provenances were made with a GPU (a CPU run's record no CUDA device)."""
    return bool(metas) and all(meta["provenance"].get("device_count") for meta in metas)


MODEL_FIELDS = ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff")


def num_parameters(params: dict[str, Any]) -> int:
    """The parameter count of the model an experiment's parameters describe (context length does not matter)."""
    return ModelConfig(**{name: params[name] for name in MODEL_FIELDS if name in params}).num_parameters()


def model_order(metas: list[dict[str, Any]]) -> list[str]:
    """Sizes from small to large by parameter count (file order is alphabetical)."""
    weights = {meta["params"]["size"]: num_parameters(meta["params"]) for meta in metas}
    return sorted(weights, key=weights.get)


def fsdp_units(params: dict[str, Any]) -> tuple[list[int], int]:
    """The sizes of the weights FSDP shards and the number of replicated parameters of the model an experiment's
    parameters describe (cs336_systems.bench.fsdp_variants.sharded_units)."""
    from cs336_systems.bench.fsdp_variants import model_units

    return model_units(ModelConfig(**{name: params[name] for name in MODEL_FIELDS if name in params}))
