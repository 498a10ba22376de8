"""An emulated cluster of N nodes on one machine: ``python -m dniasync.node --role local --emulate``.

``--emulate NODES[:BANDWIDTH[:LATENCY]]`` (e.g. ``4:100mbit:5ms``; defaults 1gbit and 0.2ms)
runs the job of ``--config`` as the multi-node path does (coordinator, PS shards, workers as
separate nodes joined with a cluster token), each process on an emulated node of one core:

- a network namespace of its own, with its own host name (a UTS namespace: dniasync sees
  separate machines and sends tensors over the link, not through same-host shared memory),
  joined to one bridge by a veth pair shaped with ``tc tbf`` each way;
- a cgroup with a CPU quota. With C cores and P processes (NODES workers, the PS shards and
  the coordinator), each gets min(1, C/P) of a core, so the job runs d = max(1, P/C) times
  slower than on P one-core machines (time dilation, as in DieCast);
- links shaped to BANDWIDTH / d, with LATENCY x d added to every connection each way by a
  user-space delay proxy (``tc netem`` is not in every kernel) behind an nftables redirect,
  so compute and communication keep the ratio they have on real one-core nodes.

NODES must equal the job's count of worker processes (replicas, pipelines' workers, peers).
The summary's times (``wall_s``, ``samples_per_s``, ``time_to_target_s``, history and event
times) are divided by d, and its ``emulation`` block says so (nodes, processes, cores, share,
dilation, the links as asked and as shaped, the clock's ``measured_wall_s``). Time limits in
the job config (``[stop] max_seconds``) run on the clock, i.e. in d x emulated seconds.

Needs root, iproute2 (``ip``, ``tc``), nftables (``nft``) and a cgroup hierarchy with the
``cpu`` controller (v1 ``cpu.cfs_quota_us`` or v2 ``cpu.max``); without them it exits 2
saying what is missing. Everything it makes (namespaces, links, cgroups, processes) is removed
at the end, and also when the launcher is killed: a guardian process started first removes it
all when the launcher's pipe to it closes.
"""

from ._hosts import CONTROL_ADDRESS, Emulation, EmulationError, Link, missing, wait_gone
from ._launch import cores, host_of, rescale_summary, run_emulated
from ._spec import EmulateSpec, Plan, SpecError, parse_spec

__all__ = [
    "CONTROL_ADDRESS",
    "EmulateSpec",
    "Emulation",
    "EmulationError",
    "Link",
    "Plan",
    "SpecError",
    "cores",
    "host_of",
    "missing",
    "parse_spec",
    "rescale_summary",
    "run_emulated",
    "wait_gone",
]
