"""Run a job the way a user does: a TOML file, ``python -m dniasync.node --role local``, its ``summary.json``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def write_job(tmp_path: Path, name: str, template: str, **fields: Any) -> tuple[Path, Path]:
    """``template`` filled with ``name``, ``out`` (the job's output_dir) and ``fields``: (config path, output dir)."""
    out = tmp_path / name
    config = tmp_path / f"{name}.toml"
    config.write_text(template.format(name=name, out=out, **fields))
    return config, out


def launch(config: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """The local launcher on ``config``, to the end."""
    return subprocess.run(
        [sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
        capture_output=True, text=True, timeout=timeout,
    )


def summary(out: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return doc


def run_job(tmp_path: Path, name: str, template: str, *, timeout: float = 400,
            **fields: Any) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """Write, launch, check it exited 0; (its summary, the launcher's process)."""
    config, out = write_job(tmp_path, name, template, **fields)
    proc = launch(config, timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return summary(out), proc
