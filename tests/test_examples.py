"""The shipped examples run as a user would run them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_embed_actors_example_runs_restarts_and_exits_cleanly() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "embed_actors.py")],
        capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert "squarer restarts: 2" in proc.stdout
    assert "sink received 18 squares" in proc.stdout
    assert proc.stdout.count("[squarer] crashed") == 2
