"""What every benchmark shares: machine info, the JSON layout, the ratio table.

See shared/BENCHMARKS.md: side by side in one run, ratios oriented so that
bigger is better, computed from the results in the same file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="small sizes, under a minute; results are not for committing")
    return p


def cpu() -> dict[str, Any]:
    """The CPU's model name and the vector ISAs the kernels choose between (from /proc/cpuinfo on Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"cpu_model": platform.processor() or None}
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in text.splitlines() if ":" in line)}
    model, flags = fields.get("model name"), set(fields.get("flags", "").split())
    return {"cpu_model": model, "isa": [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl") if f in flags]}


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version(), **cpu()}
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        import uvloop

        info["uvloop"] = str(getattr(uvloop, "__version__", "?"))
    except ImportError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
        info["commit"] = commit
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def write(bench: str, quick: bool, results: dict[str, Any], ratios: dict[str, float]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / (f"{bench}_quick.json" if quick else f"{bench}.json")
    doc = {"bench": bench, "quick": quick, "machine": machine(), "results": results, "ratios": ratios}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def table(rows: Sequence[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def say(text: str) -> None:
    print(text, flush=True)
    sys.stdout.flush()
