"""Fault injection against a running job: kill, freeze, and a TCP fault proxy between nodes.

``python -m dniasync.chaos --job-dir <output_dir>`` reads the launcher's
``cluster.json`` and, on a seeded schedule, SIGKILLs or freezes (SIGSTOP, then
SIGCONT) a random non-coordinator process (``kill_ps_copy``: a copy of a
replicated PS shard; ``kill_coordinator``: the active coordinator of a job
with a standby), and resets, black-holes or slows a link through the fault proxies the launcher runs under ``DNIASYNC_CHAOS_PROXY=1``.
Every fault is a JSON line (time, kind, target) in ``<output_dir>/chaos.jsonl``;
the tool also measures every surviving process's open file descriptors, asyncio
tasks and RSS before the first fault and after the last (the soak check).
"""

from ._control import PROXY_ENV, ChaosControl
from ._proxy import FaultProxy, LinkState

__all__ = ["PROXY_ENV", "ChaosControl", "FaultProxy", "LinkState"]
