"""The comparison's numbers: a row per method and seed, medians and spread per method, as JSON and Markdown."""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._plan import MethodPlan, Plan
from ._run import RunResult

__all__ = ["aggregate", "run_row", "write_tables"]


_TRAINERS = ("worker", "torch")
"""The processes that train (the launcher, coordinator and PS processes are listed in the JSON too)."""


def _target_key(target: float) -> str:
    return f"{target:g}"


def run_row(result: RunResult, targets: Sequence[float]) -> dict[str, Any]:
    """The figures of one run (None where the run has none)."""
    doc = result.summary or {}
    history = doc.get("history") or []
    samples = doc.get("samples") or 0
    metrics = doc.get("metrics") or {}
    rate = metrics.get("train_samples_per_s", doc.get("samples_per_s"))
    moved = (doc.get("bytes_pushed") or 0) + (doc.get("bytes_pulled") or 0)
    reached = {_target_key(t): next((p for p in history if p["accuracy"] >= t), None) for t in targets}
    rss = dict(result.peak_rss)
    if "peak_rss_bytes" in metrics and "torch" not in rss:
        rss["torch"] = int(metrics["peak_rss_bytes"])
    return {
        "method": result.method, "seed": result.seed, "status": result.status, "error": result.error,
        "run_dir": result.run_dir, "stop_reason": doc.get("stop_reason"),
        "time_to_target_s": {k: (p["wall_s"] if p else None) for k, p in reached.items()},
        "samples_to_target": {k: (p["samples"] if p else None) for k, p in reached.items()},
        "final_accuracy": doc.get("final_accuracy"), "best_accuracy": doc.get("best_accuracy"),
        "wall_s": doc.get("wall_s"), "samples": samples,
        "samples_per_s": rate,
        "bytes_per_sample": moved / samples if samples else None,
        "peak_rss_bytes": rss, "peak_rss_max_bytes": max(rss.values(), default=None),
        "peak_rss_trainer_bytes": max((v for k, v in rss.items() if k.startswith(_TRAINERS)), default=None),
        "process_s": result.process_s,
    }


def _spread(values: Sequence[float | None]) -> dict[str, Any]:
    got = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not got:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "n": len(got)}


def aggregate(rows: Sequence[dict[str, Any]], targets: Sequence[float]) -> dict[str, Any]:
    """Medians and min-max over a method's seeds (runs that finished; a target counts the seeds reaching it)."""
    ok = [r for r in rows if r["status"] == "ok"]
    out: dict[str, Any] = {"runs": len(rows), "ok": len(ok)}
    for key in ("final_accuracy", "best_accuracy", "samples_per_s", "bytes_per_sample", "peak_rss_trainer_bytes",
                "wall_s"):
        out[key] = _spread([r[key] for r in ok])
    for key in ("time_to_target_s", "samples_to_target"):
        out[key] = {_target_key(t): _spread([r[key][_target_key(t)] for r in ok]) for t in targets}
    return out


def _fmt(value: float | None, kind: str) -> str:
    if value is None:
        return "–"
    if kind == "pct":
        return f"{100 * value:.2f}%"
    if kind == "s":
        return f"{value:.1f} s"
    if kind == "mib":
        return f"{value / 2**20:,.0f} MiB"
    return f"{value:,.0f}"


def _cell(spread: dict[str, Any], kind: str, of: int | None = None) -> str:
    if spread["median"] is None:
        return "not reached" if of is not None else "–"
    text = _fmt(spread["median"], kind)
    if spread["n"] > 1:
        text += f" [{_fmt(spread['min'], kind)}–{_fmt(spread['max'], kind)}]"
    if of is not None and spread["n"] < of:
        text += f" ({spread['n']}/{of})"
    return text


def _short(error: str) -> str:
    """An error in one cell: its first line and its last (table.json has it whole)."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    text = lines[0] if len(lines) < 2 else f"{lines[0]} … {lines[-1]}"
    return text.replace("|", "/")


def _markdown(plan: Plan, doc: dict[str, Any]) -> str:
    targets = [_target_key(t) for t in plan.targets]
    lines = [f"# {plan.name}: {len(plan.methods)} methods, {len(doc['seeds'])} seed(s), "
             f"{plan.workers} worker process(es) each", ""]
    if doc["interrupted"]:
        lines += ["**Interrupted**: the table holds what finished.", ""]
    head = ["method", *(f"time to {t}" for t in targets), *(f"samples to {t}" for t in targets),
            "final acc", "best acc", "samples/s", "bytes sent/sample", "peak RSS/trainer"]
    lines += ["## Per method (median [min–max] over seeds)", "", "| " + " | ".join(head) + " |",
              "|" + "---|" * len(head)]
    for m in plan.methods:
        entry = doc["methods"][m.method]
        if m.reason is not None:
            lines.append(f"| {m.method} | cannot run this job: {m.reason.replace('|', '/')} |")
            continue
        a = entry["aggregate"]
        if a["ok"] == 0:
            lines.append(f"| {m.method} | no run finished ({a['runs']} run(s)) |")
            continue
        cells = [m.method, *(_cell(a["time_to_target_s"][t], "s", a["ok"]) for t in targets),
                 *(_cell(a["samples_to_target"][t], "n", a["ok"]) for t in targets),
                 _cell(a["final_accuracy"], "pct"), _cell(a["best_accuracy"], "pct"), _cell(a["samples_per_s"], "n"),
                 _cell(a["bytes_per_sample"], "n"), _cell(a["peak_rss_trainer_bytes"], "mib")]
        lines.append("| " + " | ".join(cells) + " |")
    head = ["method", "seed", "status", *(f"time to {t}" for t in targets), *(f"samples to {t}" for t in targets),
            "final acc", "best acc", "samples/s", "bytes sent/sample", "peak RSS/trainer", "stop / error"]
    lines += ["", "## Per run", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in doc["runs"]:
        note = _short(r["error"]) if r["error"] else (r["stop_reason"] or "")
        cells = [r["method"], str(r["seed"]), r["status"],
                 *(_fmt(r["time_to_target_s"][t], "s") for t in targets),
                 *(_fmt(r["samples_to_target"][t], "n") for t in targets),
                 _fmt(r["final_accuracy"], "pct"), _fmt(r["best_accuracy"], "pct"), _fmt(r["samples_per_s"], "n"),
                 _fmt(r["bytes_per_sample"], "n"), _fmt(r["peak_rss_trainer_bytes"], "mib"), note]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Differences from the base config", ""]
    for m in plan.methods:
        diffs = doc["methods"][m.method]["differences"]
        if m.reason is not None:
            lines.append(f"- **{m.method}**: not run (cannot run this job)")
        else:
            lines.append(f"- **{m.method}**: " + ("; ".join(f"`{d}`" for d in diffs) if diffs else "none"))
    if doc["not_run"]:
        lines += ["", "## Not run (interrupted)", ""] + [f"- {m} seed {s}" for m, s in doc["not_run"]]
    lines += ["", "Times are the job's wall clock from the start of training to the first held-out evaluation "
              "at or above the target; bytes sent per sample: payload bytes pushed and pulled (PS shards, "
              "peers) per training sample; peak RSS/trainer: the largest of the training processes (workers, or "
              "the torch process; table.json has every process's, the launcher's, coordinator's and PS shards' "
              "too).", ""]
    return "\n".join(lines)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_tables(plan: Plan, results: Sequence[RunResult], seeds: Sequence[int], out: Path, *,
                 config_path: str, interrupted: bool, not_run: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """``table.json`` and ``table.md`` in ``out``; the JSON document."""
    rows = [run_row(r, plan.targets) for r in results]
    methods: dict[str, Any] = {}
    for m in plan.methods:
        mine = [r for r in rows if r["method"] == m.method]
        methods[m.method] = _method_doc(m, mine, plan.targets)
    doc = {"job": plan.name, "config": config_path, "workers": plan.workers,
           "targets": list(plan.targets), "seeds": list(seeds), "interrupted": interrupted,
           "methods": methods, "runs": rows, "not_run": [list(x) for x in not_run]}
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "table.json", json.dumps(doc, indent=2) + "\n")
    _write(out / "table.md", _markdown(plan, doc))
    return doc


def _method_doc(m: MethodPlan, rows: list[dict[str, Any]], targets: Sequence[float]) -> dict[str, Any]:
    return {"reason": m.reason, "differences": m.differences, "worker_processes": m.workers,
            "ps_processes": m.ps, "torch_threads": m.threads, "aggregate": aggregate(rows, targets)}
