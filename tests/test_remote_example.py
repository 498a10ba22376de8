"""The two-process example runs as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "remote_actors.py"


@pytest.mark.timeout(60)
def test_remote_actors_example_talks_between_two_processes() -> None:
    result = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    assert "worker: push 4 -> version 5" in result.stdout
    assert result.stdout.count("shard applied version") == 5  # callbacks through a ref sent in each Push
    assert "pulled float32 parameters of shape (1000,)" in result.stdout
