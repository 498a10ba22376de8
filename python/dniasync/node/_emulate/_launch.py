"""``--role local --emulate``: the local launcher with every process on an emulated node of its own."""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from ...chaos import PROXY_ENV
from ...cluster.config import ConfigError, load_config
from ...cluster.modes import get_mode
from ...cluster.report import RunReport
from .._local import run_local
from ._hosts import Emulation, EmulationError, Link, missing
from ._spec import EmulateSpec, Plan

__all__ = ["run_emulated", "host_of"]


def host_of(role: str, index: int) -> str:
    """The emulated host a launcher process runs on: ``c`` (the coordinator), ``p<i>``, ``w<i>``."""
    return {"coordinator": "c", "ps": f"p{index}", "worker": f"w{index}"}[role]


def cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0))


class EmulatedPlacement:
    """:class:`dniasync.node._local.Placement` on an :class:`Emulation`: host, token, time dilation."""

    def __init__(self, emulation: Emulation, plan: Plan) -> None:
        self.emulation = emulation
        self.plan = plan
        self.dilation = plan.dilation
        self.token = secrets.token_hex(32).encode()
        self.token_file = emulation.state / "cluster.token"
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(self.token)

    def args(self, role: str, index: int) -> list[str]:
        address = self.emulation.address(host_of(role, index))
        return ["--listen", f"{address}:0", "--token-file", str(self.token_file),
                "--detect-s", f"{self.plan.detect_after_s:g}"]

    def preexec(self, role: str, index: int) -> Callable[[], None]:
        return self.emulation.preexec(host_of(role, index))

    def finish(self, summary: Path) -> list[str]:
        rescale_summary(summary, self.plan)
        plan = self.plan
        return [
            f"  emulated           {plan.spec.nodes} node(s) + {plan.processes - plan.spec.nodes} other process(es) "
            f"of one core each on {plan.cores} core(s): {plan.cpu_share:.3g} of a core each, "
            f"time dilation {plan.dilation:g}",
            f"  emulated links     {plan.spec.bandwidth} / {plan.spec.latency} (shaped to "
            f"{plan.link_bps / 1e6:.4g} Mbit/s, {1e3 * plan.delay_s:.3g} ms added); "
            f"times above divided by {plan.dilation:g}",
        ]


def rescale_summary(path: Path, plan: Plan) -> dict[str, Any]:
    """Divide the summary's times by the dilation (once: a summary with an ``emulation`` block is left
    as it is), add the block, and draw the accuracy plot again on the emulated clock."""
    doc: dict[str, Any] = json.loads(path.read_text())
    if "emulation" in doc:
        return doc
    d = plan.dilation
    measured = doc.get("wall_s")
    for key in ("wall_s", "time_to_target_s"):
        if isinstance(doc.get(key), (int, float)):
            doc[key] = doc[key] / d
    if isinstance(doc.get("samples_per_s"), (int, float)):
        doc["samples_per_s"] = doc["samples_per_s"] * d
    for entry in [*doc.get("history", []), *doc.get("events", [])]:
        entry["wall_s"] = entry["wall_s"] / d
    doc["emulation"] = {**plan.describe(), "measured_wall_s": measured}
    tmp = path.with_name(f".{path.name}.emulated")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
    try:
        RunReport.from_dict(doc).plot(path.with_name("accuracy.png"))
    except (ValueError, KeyError):
        pass  # the summary stands without its plot
    return doc


def run_emulated(config_path: str, spec: EmulateSpec, out: IO[str] = sys.stdout, *, resume: bool = False,
                 detect_s: float = 3.0) -> int:
    """Run the job at ``config_path`` on ``spec.nodes`` emulated nodes; the process exit status. ``detect_s``:
    the job's failure-detection interval on real nodes (``--detect-s`` or ``[node] detect_s``), dilated here."""
    why = missing()
    if why is not None:
        print(f"error: --emulate {why}", file=sys.stderr)
        return 2
    if os.environ.get(PROXY_ENV, "") not in ("", "0"):
        print(f"error: --emulate does not combine with {PROXY_ENV} (the fault proxies listen on loopback)",
              file=sys.stderr)
        return 2
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    mode = get_mode(config.mode)
    n_ps, n_workers = mode.processes(config)
    if n_workers != spec.nodes:
        print(f"error: --emulate {spec.text}: the job starts {n_workers} {mode.worker_kind} process(es), "
              f"not {spec.nodes}; NODES must be the job's count of {mode.worker_kind}s "
              f"(its {n_ps} PS process(es) and the coordinator get nodes of their own on top)", file=sys.stderr)
        return 2
    hosts = [host_of("coordinator", 0), *(host_of("ps", i) for i in range(n_ps)),
             *(host_of("worker", i) for i in range(n_workers))]
    plan = Plan(spec, processes=len(hosts), cores=cores(), detect_s=detect_s)
    try:
        emulation = Emulation(hosts, Link(plan.link_bps, plan.delay_s), plan.cpu_share)
        emulation.start()
    except EmulationError as exc:
        print(f"error: --emulate: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"emulation {emulation.rid}: {len(hosts)} hosts ({spec.nodes} {mode.worker_kind}(s), {n_ps} PS, "
              f"the coordinator), {plan.cpu_share:.3g} core each on {plan.cores}, time dilation {plan.dilation:g}; "
              f"links {spec.bandwidth} / {spec.latency} shaped to {plan.link_bps / 1e6:.4g} Mbit/s "
              f"+ {1e3 * plan.delay_s:.3g} ms; failure detection after {plan.detect_after_s:g} s",
              file=out, flush=True)
        placement = EmulatedPlacement(emulation, plan)
        emulation.enter_control()  # the launcher asks the coordinator for status across the bridge
        return run_local(config_path, out, resume=resume, placement=placement)
    finally:
        emulation.close()
