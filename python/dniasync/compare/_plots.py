"""The comparison's figures: held-out accuracy against wall time and against samples (a curve per method, its
seeds as a band), and the first layer's filters of each method side by side."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..cluster.report import MAX_FILTERS, first_layer, plot_filter_rows
from ._run import RunResult

__all__ = ["plot_curves", "plot_filters"]


def _curves(results: Sequence[RunResult], x_key: str) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    out: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for r in results:
        history = (r.summary or {}).get("history") or []
        if history:
            xs = np.array([float(p[x_key]) for p in history])
            ys = np.array([float(p["accuracy"]) for p in history])
            out.setdefault(r.method, []).append((xs, ys))
    return out


def plot_curves(results: Sequence[RunResult], methods: Sequence[str], targets: Sequence[float], out: Path,
                title: str) -> list[Path]:
    """``accuracy_vs_time.png`` and ``accuracy_vs_samples.png``: at every seed's evaluations, the median over the
    seeds (each seed's accuracy held from one evaluation to its next), min-max as a band where two or more seeds
    ran that far."""
    from matplotlib.figure import Figure

    written = []
    for x_key, label, name in (("wall_s", "wall time (s)", "accuracy_vs_time.png"),
                               ("samples", "training samples", "accuracy_vs_samples.png")):
        curves = _curves(results, x_key)
        fig = Figure(figsize=(8, 5))
        ax = fig.subplots()
        for method in methods:
            runs = curves.get(method)
            if not runs:
                continue
            grid = np.unique(np.concatenate([xs for xs, _ in runs]))  # every evaluation of every seed
            held = np.full((len(runs), len(grid)), np.nan)
            for i, (xs, ys) in enumerate(runs):
                at = np.searchsorted(xs, grid, side="right") - 1
                inside = (at >= 0) & (grid <= xs[-1])
                held[i, inside] = ys[at[inside]]
            covered = np.sum(~np.isnan(held), axis=0)
            median = np.array([np.nanmedian(c) if n else np.nan for c, n in zip(held.T, covered)])
            seeds = f"{len(runs)} seed{'s' if len(runs) > 1 else ''}"
            (line,) = ax.plot(grid, median, marker=".", label=f"{method} ({seeds})")
            band = covered >= 2
            if band.any():
                lo = np.where(band, np.nanmin(np.where(band, held, 0.0), axis=0), np.nan)
                hi = np.where(band, np.nanmax(np.where(band, held, 0.0), axis=0), np.nan)
                ax.fill_between(grid, lo, hi, where=band, color=line.get_color(), alpha=0.2, linewidth=0)
        for target in targets:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel(label)
        ax.set_ylabel("held-out accuracy")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize="small")
        ax.set_title(f"{title}: held-out accuracy against {label.split(' (')[0]}")
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=100, format="png")
        written.append(path)
    return written


def plot_filters(results: Sequence[RunResult], methods: Sequence[str], out: Path) -> Path | None:
    """``filters.png``: a row per method (its first finished seed), up to 16 first-layer filters each."""
    import safetensors.numpy

    rows: list[tuple[str, np.ndarray]] = []
    for method in methods:
        run = next((r for r in results if r.method == method and r.status == "ok"
                    and (Path(r.run_dir) / "final_weights.safetensors").exists()), None)
        if run is None:
            continue
        filters = first_layer(safetensors.numpy.load_file(str(Path(run.run_dir) / "final_weights.safetensors")))
        if filters is not None:
            rows.append((f"{method} (seed {run.seed})", filters[:MAX_FILTERS]))
    if not rows:
        return None
    return plot_filter_rows(rows, out / "filters.png")
