"""Launcher environments for ``--role auto``: Slurm, torchrun-style launchers and Kubeflow.

A node started by a cluster engine learns from the engine's environment its
rank, the world size and where rank 0 is; from the job config it learns how
many PS shards and workers the job needs (``get_mode(mode).processes``).
Rank 0 is the coordinator, ranks ``1..n_ps`` the PS shards, the next
``n_workers`` the workers, then, with ``[job] standby = true``, a standby
coordinator (:mod:`dniasync.cluster.standby`: it follows the job and takes it
over if rank 0 dies; the other ranks then follow it), and the last
``--spares N`` spares: PS hosts that wait until a copy of a replicated PS
shard dies and take its place (:mod:`dniasync.cluster.chains`). A world size that does not fit the job,
spares for a job without replicated PS shards, or a missing or malformed
variable, fail at start naming the variables, the flag or the key.

Where rank 0 listens:

- Slurm (``srun``): the first host of ``SLURM_STEP_NODELIST`` (else
  ``SLURM_JOB_NODELIST``), port ``DNIASYNC_PORT`` or
  ``10000 + SLURM_JOB_ID mod 20000`` (two jobs sharing a node do not collide).
- torchrun, Kubeflow PyTorchJob (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT``) and Kubeflow Trainer v2 without torchrun (``PET_NODE_RANK``,
  ``PET_NNODES``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``): ``MASTER_ADDR``,
  port ``DNIASYNC_PORT`` or ``MASTER_PORT + 1`` (torchrun's own rendezvous
  store already listens on ``MASTER_PORT``).

When every rank is on one host, everything listens on 127.0.0.1 and no token
is needed. Across hosts the coordinator listens on every interface and the
other ranks on the interface that routes to it; the cluster token then comes
from ``DNIASYNC_TOKEN_FILE`` (a file on a shared path) or ``DNIASYNC_TOKEN``,
never from the command line.

Under a launcher a node lives as long as its job (:func:`follow_job`): when
the job ends every rank leaves and exits, so ``srun`` and ``sbatch --wait``
return; SIGTERM (``scancel``) stops a rank cleanly at any time. A rank
follows whichever coordinator runs the job now: after a takeover, the
standby's (its membership learns it from the new runner).
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..actors import ActorError, ActorNotFound, ActorStopped, AskTimeout
from ..cluster.config import Config, load_config
from ..cluster.modes import get_mode
from ..cluster.protocol import COORDINATOR_NAME, JobStatus, JobStatusReply
from ..remote import is_loopback, parse_hostport
from ._membership import GetCoordinator, GetMembers, Members
from ._roles import NodeContext

__all__ = [
    "SLURM_PORT_BASE",
    "SLURM_PORT_SPAN",
    "AutoStart",
    "LaunchEnv",
    "LauncherError",
    "Placement",
    "detect_launcher",
    "follow_job",
    "parse_nodelist",
    "place",
    "resolve_auto",
    "role_of_rank",
    "spares_problem",
    "token_from_env",
]

log = logging.getLogger("dniasync.node")

SLURM_PORT_BASE = 10000
SLURM_PORT_SPAN = 20000
"""Under Slurm the coordinator's default port is ``SLURM_PORT_BASE + SLURM_JOB_ID % SLURM_PORT_SPAN``."""

START_TIMEOUT_S = 120.0
"""A rank whose coordinator has not answered this long after start gives up (exit status 1).

The coordinator serves before it builds the job, so this covers only starting
Python and importing torch on the coordinator's host."""
LOST_AFTER_S = 30.0
"""A coordinator silent this long after it answered is gone: the rank stops (exit status 1)."""
POLL_S = 1.0
"""How often a rank asks how the job goes."""
LEAVE_GRACE_S = 30.0
"""How long the coordinator waits, once the job ended, for the other ranks to leave."""


class LauncherError(ValueError):
    """The launcher's environment is missing, malformed or does not fit the job."""


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher's environment says about this process."""

    launcher: str
    """``slurm``, ``torchrun`` (``torch-style`` when set by another launcher, e.g. PyTorchJob) or ``kubeflow``."""
    rank: int
    world_size: int
    coordinator_host: str
    """The host the other ranks reach rank 0 at (``127.0.0.1`` when every rank is on one host)."""
    port: int
    """The coordinator's port."""
    one_host: bool
    """Every rank runs on this host: everything stays on loopback."""
    sources: str
    """The variables the above came from, named in messages."""
    size_hint: str
    """How the user sets the world size with this launcher (for the misfit error)."""
    job_id: str | None = None


@dataclass(frozen=True)
class Placement:
    """What ``--role auto`` makes of this rank: the ordinary node options."""

    launch: LaunchEnv
    role: str
    listen: str
    join: str | None
    advertise: str | None
    config: Config = field(repr=False)
    config_path: str = ""

    def describe(self) -> str:
        env = self.launch
        job = f", job {env.job_id}" if env.job_id else ""
        where = (self.advertise or self.listen) if self.join is None else self.join
        return (f"dniasync --role auto: {env.launcher} rank {env.rank} of {env.world_size}{job} -> {self.role}; "
                f"coordinator at {where}")


# -- Slurm hostlists ------------------------------------------------------------------

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_nodelist(text: str) -> list[str]:
    """Expand a Slurm hostlist (``node[01-03,07],gpu5``, ``rack[1-2]-n[1-4]``) in order.

    Zero padding follows the range's lower bound, as Slurm writes it. Raises
    ``ValueError`` on an empty list, unbalanced brackets or a bad range.
    """
    hosts: list[str] = []
    for item in _split_top(text.strip(), text):
        hosts.extend(_expand(item, text))
    if not hosts:
        raise ValueError(f"empty host list {text!r}")
    return hosts


def _split_top(text: str, whole: str) -> list[str]:
    """Split at the commas outside brackets."""
    items: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in host list {whole!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {whole!r}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in host list {whole!r}")
    items.append(text[start:])
    for item in items:
        if not item.strip():
            raise ValueError(f"empty host name in host list {whole!r}")
    return [item.strip() for item in items]


def _expand(item: str, whole: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    prefix, body, rest = item[:open_at], item[open_at + 1:close_at], item[close_at + 1:]
    values: list[str] = []
    for part in body.split(","):
        match = _RANGE.match(part.strip())
        if match is None:
            raise ValueError(f"bad range {part!r} in host list {whole!r}")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"range {part!r} runs backwards in host list {whole!r}")
        values.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    tails = _expand(rest, whole)
    return [f"{prefix}{value}{tail}" for value in values for tail in tails]


# -- the environments ------------------------------------------------------------------

_TORCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_PET_VARS = ("PET_NODE_RANK", "PET_NNODES", "PET_MASTER_ADDR", "PET_MASTER_PORT")


def _int(env: Mapping[str, str], name: str, *, low: int = 0) -> int:
    text = env[name].strip()
    if not text.isdigit() or int(text) < low:
        raise LauncherError(f"--role auto: {name}={env[name]!r} is not an integer >= {low}")
    return int(text)


def _require(env: Mapping[str, str], launcher: str, names: tuple[str, ...]) -> None:
    missing = [name for name in names if not env.get(name, "").strip()]
    if missing:
        raise LauncherError(f"--role auto: {launcher} environment without {', '.join(missing)} "
                            f"(it needs {', '.join(names)})")


def _port_override(env: Mapping[str, str]) -> int | None:
    if "DNIASYNC_PORT" not in env:
        return None
    port = _int(env, "DNIASYNC_PORT", low=1)
    if port > 65535:
        raise LauncherError(f"--role auto: DNIASYNC_PORT={port} is not a TCP port (1-65535)")
    return port


def _check_host(host: str, name: str) -> str:
    try:
        parse_hostport(f"{host}:0")
    except ValueError:
        raise LauncherError(f"--role auto: {name}={host!r} is not a host name or address") from None
    return host


def detect_launcher(env: Mapping[str, str]) -> LaunchEnv:
    """Which launcher started this process, and what it says; :class:`LauncherError` naming the variables.

    torchrun's variables win over Slurm's (torchrun started under ``srun``
    numbers its own processes); Kubeflow Trainer's ``PET_*`` forms are read
    when no ``RANK`` is set.
    """
    if "RANK" in env:
        return _torch_style(env)
    if "PET_NODE_RANK" in env:
        return _kubeflow_pet(env)
    if "SLURM_PROCID" in env:
        return _slurm(env)
    partial = [name for name in _TORCH_VARS if name in env]
    if partial:
        raise LauncherError(f"--role auto: {', '.join(partial)} set but not RANK (torchrun-style launchers set "
                            f"{', '.join(_TORCH_VARS)})")
    raise LauncherError(
        "--role auto found no launcher environment: start it with srun (SLURM_PROCID, SLURM_NTASKS, "
        "SLURM_JOB_NODELIST, SLURM_JOB_ID), torchrun or Kubeflow (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, "
        "or the PET_ forms), or pick a role: --role coordinator|ps|worker|local"
    )


def _slurm(env: Mapping[str, str]) -> LaunchEnv:
    if "SLURM_STEP_ID" not in env:
        raise LauncherError("--role auto: SLURM_PROCID is set but not SLURM_STEP_ID: this is the batch script, "
                            "not a job step; start every rank with srun")
    nodelist_var = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    tasks_var = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    _require(env, "Slurm", ("SLURM_PROCID", tasks_var, nodelist_var, "SLURM_JOB_ID"))
    rank = _int(env, "SLURM_PROCID")
    world = _int(env, tasks_var, low=1)
    job_id = _int(env, "SLURM_JOB_ID")
    try:
        hosts = parse_nodelist(env[nodelist_var])
    except ValueError as exc:
        raise LauncherError(f"--role auto: {nodelist_var}: {exc}") from None
    if rank >= world:
        raise LauncherError(f"--role auto: SLURM_PROCID={rank} is not below {tasks_var}={world}")
    first = _check_host(hosts[0], nodelist_var)
    one_host = len(set(hosts)) == 1
    node = env.get("SLURMD_NODENAME")
    if rank == 0 and not one_host and node and node != first:
        raise LauncherError(f"--role auto: rank 0 runs on SLURMD_NODENAME={node}, not on the first host of "
                            f"{nodelist_var} ({first}) where the other ranks look for it; use the default "
                            "block or cyclic task distribution")
    port = _port_override(env) or SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN
    return LaunchEnv(
        "slurm", rank, world, "127.0.0.1" if one_host else first, port, one_host,
        sources=f"SLURM_PROCID, {tasks_var}, {nodelist_var}, SLURM_JOB_ID"
        + (", DNIASYNC_PORT" if "DNIASYNC_PORT" in env else ""),
        size_hint="sbatch/srun --ntasks", job_id=str(job_id),
    )


def _torch_style(env: Mapping[str, str]) -> LaunchEnv:
    launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "torch-style (RANK/WORLD_SIZE)"
    _require(env, launcher, _TORCH_VARS)
    rank = _int(env, "RANK")
    world = _int(env, "WORLD_SIZE", low=1)
    if rank >= world:
        raise LauncherError(f"--role auto: RANK={rank} is not below WORLD_SIZE={world}")
    host = _check_host(env["MASTER_ADDR"].strip(), "MASTER_ADDR")
    master_port = _int(env, "MASTER_PORT", low=1)
    local_world = env.get("LOCAL_WORLD_SIZE", "").strip()
    one_host = is_loopback(host) or (local_world.isdigit() and int(local_world) == world)
    port = _port_override(env) or master_port + 1
    if port > 65535:
        raise LauncherError(f"--role auto: MASTER_PORT={master_port} leaves no port above it; set DNIASYNC_PORT")
    return LaunchEnv(
        "torchrun" if launcher == "torchrun" else "torch-style", rank, world,
        "127.0.0.1" if one_host else host, port, one_host,
        sources="RANK, WORLD_SIZE, MASTER_ADDR, " + ("DNIASYNC_PORT" if "DNIASYNC_PORT" in env else "MASTER_PORT"),
        size_hint="WORLD_SIZE (torchrun --nnodes x --nproc-per-node; PyTorchJob replicas)",
        job_id=env.get("TORCHELASTIC_RUN_ID"),
    )


def _kubeflow_pet(env: Mapping[str, str]) -> LaunchEnv:
    _require(env, "Kubeflow Trainer", _PET_VARS)
    per_node = env.get("PET_NPROC_PER_NODE", "1").strip()
    if per_node != "1":
        raise LauncherError(f"--role auto: PET_NPROC_PER_NODE={per_node!r}: without torchrun each node runs one "
                            "dniasync process; set numProcPerNode to 1, or start dniasync under torchrun")
    rank = _int(env, "PET_NODE_RANK")
    world = _int(env, "PET_NNODES", low=1)
    if rank >= world:
        raise LauncherError(f"--role auto: PET_NODE_RANK={rank} is not below PET_NNODES={world}")
    host = _check_host(env["PET_MASTER_ADDR"].strip(), "PET_MASTER_ADDR")
    master_port = _int(env, "PET_MASTER_PORT", low=1)
    one_host = world == 1 or is_loopback(host)
    port = _port_override(env) or master_port + 1
    if port > 65535:
        raise LauncherError(f"--role auto: PET_MASTER_PORT={master_port} leaves no port above it; "
                            "set DNIASYNC_PORT")
    return LaunchEnv(
        "kubeflow", rank, world, "127.0.0.1" if one_host else host, port, one_host,
        sources="PET_NODE_RANK, PET_NNODES, PET_MASTER_ADDR, "
        + ("DNIASYNC_PORT" if "DNIASYNC_PORT" in env else "PET_MASTER_PORT"),
        size_hint="PET_NNODES (the TrainJob's numNodes)",
    )


# -- roles and addresses ------------------------------------------------------------------

def role_of_rank(rank: int, n_ps: int, n_workers: int | None = None, *, standby: bool = False) -> str:
    """Rank 0 coordinates, ranks ``1..n_ps`` hold the PS shards, the next ``n_workers`` (default: all the rest) are
    workers, then (``standby``) one standby coordinator, and the ranks after them spares."""
    if rank == 0:
        return "coordinator"
    if rank <= n_ps:
        return "ps"
    if n_workers is None or rank <= n_ps + n_workers:
        return "worker"
    return "standby" if standby and rank == n_ps + n_workers + 1 else "spare"


def spares_problem(config: Config, config_path: str = "") -> str | None:
    """Why spares cannot serve this job (a spare stands in for a dead copy of a replicated PS shard), or None."""
    job = f"job {config.job.name} ({config_path or config.mode})"
    copies = getattr(config.settings, "ps_replicas", None)  # the modes with replicated PS shards have the key
    if copies is None or get_mode(config.mode).processes(config)[0] == 0:
        return f"{job} has no replicated PS shards (mode {config.mode}, sync.kind {config.sync_kind!r})"
    if copies < 2:
        return f"{job} has {config.mode}.ps_replicas = {copies}: set it to 2 or more"
    return None


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def route_address(host: str, port: int) -> str:
    """This host's address on the interface that routes to ``host`` (a UDP connect sends nothing)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect(sockaddr)
        own: str = sock.getsockname()[0]
    return own


def place(
    launch: LaunchEnv,
    config: Config,
    config_path: str = "",
    *,
    spares: int = 0,
    route: Callable[[str, int], str] = route_address,
) -> Placement:
    """This rank's role and addresses; :class:`LauncherError` if the world size does not fit the job and its
    ``spares``, or spares cannot serve the job."""
    mode = get_mode(config.mode)
    n_ps, n_workers = mode.processes(config)
    if spares < 0:
        raise LauncherError(f"--spares {spares}: the count of spare ranks is 0 or more")
    problem = spares_problem(config, config_path) if spares else None
    if problem is not None:
        raise LauncherError(f"--spares {spares}: a spare stands in for a dead copy of a replicated PS shard, and "
                            f"{problem}; or drop --spares")
    standby = config.job.standby
    needed = 1 + n_ps + n_workers + standby + spares
    if launch.world_size != needed:
        extra = launch.world_size - needed
        hint = (f" (or keep the {extra} extra rank(s) as spares: --spares {spares + extra})"
                if extra > 0 and spares_problem(config) is None else "")
        raise LauncherError(
            f"--role auto: the launcher started {launch.world_size} rank(s) ({launch.sources}) but job "
            f"{config.job.name} ({config_path or config.mode}) needs {needed}: 1 coordinator, {n_ps} PS shard(s), "
            f"{n_workers} {mode.worker_kind}(s)" + (", 1 standby coordinator (job.standby)" if standby else "")
            + (f", {spares} spare(s) (--spares)" if spares else "")
            + f"; set {launch.size_hint} to {needed}{hint}"
        )
    role = role_of_rank(launch.rank, n_ps, n_workers, standby=standby)
    coordinator = _hostport(launch.coordinator_host, launch.port)
    if role == "coordinator":
        if launch.one_host:
            return Placement(launch, role, coordinator, None, None, config, config_path)
        wildcard = "[::]" if ":" in launch.coordinator_host else "0.0.0.0"
        return Placement(launch, role, f"{wildcard}:{launch.port}", None, coordinator, config, config_path)
    if launch.one_host:
        return Placement(launch, role, "127.0.0.1:0", coordinator, None, config, config_path)
    try:
        own = route(launch.coordinator_host, launch.port)
    except OSError as exc:
        raise LauncherError(f"--role auto: no route to the coordinator host {launch.coordinator_host} "
                            f"({launch.sources}): {exc.strerror or exc}") from None
    return Placement(launch, role, _hostport(own, 0), coordinator, None, config, config_path)


@dataclass(frozen=True)
class AutoStart:
    """What ``--role auto`` resolved: the rank's placement and where its cluster token comes from."""

    placement: Placement
    token_file: str | None
    token: bytes | None


def resolve_auto(config_path: str, env: Mapping[str, str], *, token_file: str | None = None,
                 spares: int = 0) -> AutoStart:
    """The launcher's environment and the job config -> this rank's options; :class:`LauncherError` if not."""
    placement = place(detect_launcher(env), load_config(config_path), config_path, spares=spares)
    env_file, token = token_from_env(env)
    token_file = token_file or env_file
    if token_file is not None:
        token = None
    if not placement.launch.one_host and token_file is None and token is None:
        raise LauncherError(
            f"--role auto: the ranks run on several hosts ({placement.launch.sources}), so the cluster needs a "
            "token: set DNIASYNC_TOKEN_FILE (a file on a shared path, >= 16 bytes) or DNIASYNC_TOKEN"
        )
    return AutoStart(placement, token_file, token)


def token_from_env(env: Mapping[str, str]) -> tuple[str | None, bytes | None]:
    """``(DNIASYNC_TOKEN_FILE, DNIASYNC_TOKEN)``: where the cluster token comes from under a launcher."""
    path = env.get("DNIASYNC_TOKEN_FILE") or None
    text = env.get("DNIASYNC_TOKEN", "").strip()
    if path is not None or not text:
        return path, None
    token = text.encode()
    if len(token) < 16:
        raise LauncherError(f"--role auto: DNIASYNC_TOKEN holds {len(token)} bytes; use at least 16 random bytes")
    return None, token


# -- living as long as the job ---------------------------------------------------------

async def _stopped_within(stop: asyncio.Event, seconds: float) -> bool:
    try:
        async with asyncio.timeout(seconds):
            await stop.wait()
    except TimeoutError:
        return False
    return True


def _say(placement: Placement, text: str) -> None:
    print(f"dniasync rank {placement.launch.rank} ({placement.role}): {text}", flush=True)


async def follow_job(context: NodeContext) -> int:
    """Run while the job runs; then set ``context.stop``. The rank's exit status.

    The coordinator prints the summary once the job ended, waits (at most
    :data:`LEAVE_GRACE_S`) for the other ranks to leave, and exits 0 if the
    job finished, 1 if it failed. The other ranks ask the coordinator how the
    job goes and exit 0 once it ended, 1 if the coordinator never answers or
    goes silent. A signal (``context.stop`` set from outside) ends a rank with 0.
    """
    placement: Placement = context.options["launch"]
    if context.role == "coordinator":
        return await _follow_as_coordinator(context, placement)
    return await _follow_as_member(context, placement, standby=context.role == "standby")


async def _follow_as_coordinator(context: NodeContext, placement: Placement) -> int:
    stop = context.stop
    trainer = context.system.ref(COORDINATOR_NAME)
    status: JobStatusReply | None = None
    state = "waiting"
    while True:
        try:
            status = await trainer.ask(JobStatus(), timeout=10.0)
        except AskTimeout:
            status = None  # the runner is busy (ending the job, scoring): ask again
        except ActorStopped:
            _say(placement, "the job runner stopped unexpectedly; stopping")
            stop.set()
            return 1
        if status is not None and status.state in ("finished", "failed"):
            break
        if status is not None and status.state == "fenced":  # it was frozen or cut off, and a standby took over
            _say(placement, "fenced: the standby coordinator runs the job now; stopping")
            stop.set()
            return 0
        if status is not None and status.state != state:
            state = status.state
            _say(placement, f"job {state}")
        if await _stopped_within(stop, POLL_S):
            _say(placement, "stopping on a signal")
            return 0
    from ._local import _summary

    assert status is not None
    _summary(placement.config, status, sys.stdout)
    sys.stdout.flush()
    deadline = time.monotonic() + LEAVE_GRACE_S
    while time.monotonic() < deadline and not stop.is_set():
        assert context.membership is not None
        members: Members = await context.membership.ask(GetMembers(), timeout=5.0)
        staying = [m.node for m in members.members if m.alive and m.node != context.transport.address]
        if not staying:
            break
        await _stopped_within(stop, 0.2)
    else:
        if not stop.is_set():
            log.warning("ranks still in the cluster %.0f s after the job ended", LEAVE_GRACE_S)
    _say(placement, f"job {status.state}; stopping")
    stop.set()
    return 0 if status.state == "finished" else 1


async def _coordinator_now(context: NodeContext) -> str:
    """The node of the coordinator this rank's membership follows now (``--join``'s, or a standby's after a
    takeover)."""
    if context.membership is None:
        return context.join or ""
    try:
        node: str = await context.membership.ask(GetCoordinator(), timeout=5.0)
    except ActorError:
        return context.join or ""
    return node


async def _took_over(context: NodeContext) -> bool:
    """A job runner of this node's own is up: its standby took the job over."""
    try:  # looked up each time: there is none until a takeover
        await context.system.ref(COORDINATOR_NAME).ask(JobStatus(), timeout=5.0)
    except ActorError:  # none (ActorNotFound), or busy starting: asked again next round
        return False
    return True


async def _follow_as_member(context: NodeContext, placement: Placement, *, standby: bool = False) -> int:
    """A PS, worker or spare rank: it asks the coordinator how the job goes until it ended. With ``standby`` (the
    standby rank) it follows rank 0 until its standby takes the job over (a runner of its own is then up on this
    node), and from then on ends as the coordinator rank does; if rank 0 goes silent and no takeover comes
    (another standby claimed the epoch, or the job's output directory, where the epoch file is, is not shared with
    this host), it stops as any rank does."""
    stop = context.stop
    following = context.join or ""
    trainer = context.system.ref(f"{COORDINATOR_NAME}@{following}")
    started = time.monotonic()
    answered: float | None = None
    while not stop.is_set():
        if standby and await _took_over(context):
            _say(placement, "took the job over")
            return await _follow_as_coordinator(context, placement)
        now = time.monotonic()
        node = following if standby else await _coordinator_now(context)  # a standby joins no membership
        if node != following:  # a standby took the job over: its runner is the one to ask
            _say(placement, f"following the coordinator at {node} (it took the job over from {following})")
            following, answered = node, now
            trainer = context.system.ref(f"{COORDINATOR_NAME}@{following}")
        try:
            status: JobStatusReply = await trainer.ask(JobStatus(), timeout=5.0)
        except ActorNotFound:
            answered = now  # the coordinator node is up; its job runner is not yet
        except ActorError as exc:
            if answered is None and now - started > START_TIMEOUT_S:
                _say(placement, f"no answer from the coordinator at {context.join} ({placement.launch.sources}) "
                                f"after {START_TIMEOUT_S:.0f} s ({exc}); stopping")
                stop.set()
                return 1
            if answered is not None and now - answered > LOST_AFTER_S:
                _say(placement, f"lost the coordinator at {following} ({exc}); stopping")
                stop.set()
                return 1
        else:
            answered = now
            if status.state in ("finished", "failed"):
                _say(placement, f"job {status.state}; stopping")
                stop.set()
                return 0
        if await _stopped_within(stop, POLL_S):
            break
    _say(placement, "stopping on a signal")
    return 0
