"""Model factories for tests/test_compare.py (importable by the job's processes through PYTHONPATH)."""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from dniasync.train.models import mlp


def mlp_failing_in_coordinator(**kwargs: Any) -> nn.Sequential:
    """:func:`mlp` in every process but a job's coordinator, where it raises: a job valid on paper that fails
    when it runs."""
    if "coordinator" in sys.argv:
        raise RuntimeError("this factory fails in the coordinator")
    return mlp(**kwargs)
