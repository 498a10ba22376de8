"""``python -m dniasync.compare``: one job under many methods, side by side."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from ..node.fork_server import FORK_ENV, SHARED_ENV, running
from ._plan import CompareError, Plan, known_methods, make_plan, parse_methods

__all__ = ["build_parser", "main"]

_DESCRIPTION = """\
Run one job (its model, data, split, batch size, worker processes and stop rule) under each named
method, one after another, each through the real launcher (python -m dniasync.node --role local),
and write a table (table.md, table.json) and figures (accuracy_vs_time.png, accuracy_vs_samples.png,
filters.png) into --out.
"""

_EPILOG = """\
methods:
  a mode by name (downpour, hogwild, p2p, sandblaster), sized to the job's worker processes;
  pipeline:<rule> (one pipeline, a stage per worker process) and pipeline:<rule>+ps (replicated
  pipelines sharing each stage's weights through PS shards: DNI x Downpour), for every rule of
  the pipeline registry; torch:1thread and torch:all-cores (plain torch in one process, its
  optimizer fused where torch has the kernel).
  --methods list prints them all.

the config's [compare] table (removed before the job reaches the launcher):
  [compare]
  workers = 4                      # worker processes of every method (default: the job's own)
  stages = 2                       # pipeline:<rule>+ps: stages x (workers / stages) replicas
  [compare."pipeline:cdni"]        # overrides for one method (or [compare.pipeline] for all
  optimizer = {name = "adam", lr = 3e-4}   # pipeline methods), deep-merged over the config

  Every difference from the base config is printed in table.md, per method.

exit status: 0 when the plan ran (failed runs are rows with their error), 2 on bad input (nothing
written), 130 when interrupted (Ctrl-C: the running job is stopped; the table of what finished is
written).
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dniasync.compare", description=_DESCRIPTION, epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="JOB.toml", help="the job config, with an optional [compare] table")
    parser.add_argument("--methods", metavar="M1,M2,...", required=True,
                        help="comma-separated methods ('list' prints the known ones)")
    parser.add_argument("--seeds", metavar="N", type=int, default=1,
                        help="runs per method, with job seeds seed, seed+1, ... (default 1)")
    parser.add_argument("--targets", metavar="A1,A2", help="held-out accuracies to time (default: the config's "
                        "stop.target_accuracy)")
    parser.add_argument("--out", metavar="DIR", help="where the table, figures and runs go "
                        "(default runs/compare/<job name>)")
    parser.add_argument("--run-timeout", metavar="S", type=float, help="stop a run still going after this many "
                        "seconds (default: stop.max_seconds + 300, or 3600)")
    return parser


def _targets(text: str | None) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise CompareError(f"--targets must be accuracies like 0.9,0.92, got {text!r}") from None
    if not values or any(not 0.0 < v <= 1.0 for v in values):
        raise CompareError(f"--targets must be accuracies in (0, 1], got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m dniasync.compare``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.methods == "list":
        print("\n".join(known_methods()))
        return 0

    def usage(message: str) -> int:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        return 2

    if not args.config:
        return usage("--config JOB.toml is required")
    if args.seeds < 1:
        return usage(f"--seeds must be at least 1, got {args.seeds}")
    try:
        methods = parse_methods(args.methods)
        plan = make_plan(args.config, methods, _targets(args.targets))
    except CompareError as exc:
        return usage(str(exc))
    if all(m.reason is not None for m in plan.methods):
        return usage("no method can run this job:\n" + "\n".join(f"  {m.method}: {m.reason}" for m in plan.methods))
    out = Path(args.out or f"runs/compare/{plan.name}")
    return _run_plan(plan, args, out)


def _run_plan(plan: Plan, args: argparse.Namespace, out: Path) -> int:
    from ._plots import plot_curves, plot_filters
    from ._run import Interrupted, Progress, RunResult, run_one
    from ._table import write_tables

    for m in plan.methods:
        if m.reason is not None:
            print(f"{m.method}: cannot run this job: {m.reason}", file=sys.stderr)
    seeds = [plan.base_seed + k for k in range(args.seeds)]
    todo = [(m, seed) for seed in seeds for m in plan.methods if m.config is not None]  # seeds interleaved
    stop_max = plan.base.get("stop", {}).get("max_seconds")
    timeout = args.run_timeout or (float(stop_max) + 300.0 if isinstance(stop_max, int | float) else 3600.0)
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    results: list[RunResult] = []
    progress = Progress(len(todo))
    interrupted = False
    forks = contextlib.ExitStack()
    try:
        if len(todo) > 1 and not os.environ.get(SHARED_ENV) and os.environ.get(FORK_ENV, "1") != "0":
            # every launch's fork server forked from one that imported torch once for the whole plan
            try:
                os.environ[SHARED_ENV] = forks.enter_context(running())
                forks.callback(os.environ.pop, SHARED_ENV, None)
            except RuntimeError as exc:
                print(f"note: {exc}; each run imports torch itself", file=sys.stderr)
        for m, seed in todo:
            if stopping:
                interrupted = True
                break
            slug = m.method.replace(":", "_").replace("+", "-")
            try:
                results.append(run_one(m, seed, out / "runs" / slug / f"seed{seed}", timeout_s=timeout,
                                       progress=progress, stopping=lambda: stopping))
            except Interrupted as exc:
                results.append(exc.args[0])
                interrupted = True
                break
    finally:
        forks.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    done = {(r.method, r.seed) for r in results}
    not_run = [(m.method, seed) for m, seed in todo if (m.method, seed) not in done]
    write_tables(plan, results, seeds, out, config_path=args.config, interrupted=interrupted, not_run=not_run)
    names = [m.method for m in plan.methods]
    plot_curves(results, names, plan.targets, out, plan.name)
    filters = plot_filters(results, names, out)
    print((out / "table.md").read_text())
    print(f"table: {out / 'table.md'}, {out / 'table.json'}; figures: {out / 'accuracy_vs_time.png'}, "
          f"{out / 'accuracy_vs_samples.png'}" + (f", {filters}" if filters else ""))
    return 130 if interrupted else 0
