"""``python -m dniasync.node``: run one node of a dniasync cluster."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import tomllib
from typing import Any, NoReturn

from aiohttp import web

from ..actors import ActorError, ActorSystem
from ..cluster.config import ConfigError, load_config
from ..metrics import NodeMetrics
from ..remote import (
    RemoteSettings,
    WebSocketTransport,
    is_loopback,
    parse_hostport,
    read_token_file,
    serve_guarded,
)
from ..runtime import run
from ._membership import COORDINATOR, Join, Leave, join_cluster
from . import _training  # noqa: F401  (registers the training side of the roles)
from ._launchers import AutoStart, LauncherError, follow_job, resolve_auto
from ._live import LivePage
from ._loopwatch import LoopWatch
from ._local import PROG, run_local
from ._metrics import mount_metrics
from ._roles import NEEDS_JOIN, NODE_INFO, ROLES, NodeContext, NodeInfo, load_actor_class

__all__ = ["build_parser", "main"]

log = logging.getLogger("dniasync.node")

_DESCRIPTION = """\
Run one node of a dniasync cluster. Start the coordinator first, then the
other nodes with --join pointing at it. Every node prints
'dniasync node ROLE listening on HOST:PORT' once it serves, and leaves the
cluster cleanly on SIGTERM or SIGINT (exit status 0).
"""

_EPILOG = """\
config file (TOML): options may also come from a [node] table, e.g.

  [node]
  role = "worker"
  listen = "127.0.0.1:7001"
  join = "127.0.0.1:7000"
  token_file = "cluster.token"
  detect_s = 3.0
  spawn = ["dniasync.node.demo:Echo=echo"]

Options given on the command line win over the file. Other tables are left
to the training layer.

examples:
  python -m dniasync.node --role local --config examples/downpour_mnist.toml
  python -m dniasync.node --role local --config examples/downpour_mnist.toml --emulate 2:100mbit:5ms
  python -m dniasync.node --role coordinator --listen 127.0.0.1:7000
  python -m dniasync.node --role worker --join 127.0.0.1:7000 --spawn dniasync.node.demo:Echo=echo

exit status: 0 after a clean shutdown, 1 on a runtime failure (port in use,
...), 2 on bad arguments or configuration.
"""

_CONFIG_KEYS = {
    "role": str,
    "listen": str,
    "join": str,
    "advertise": str,
    "metrics_listen": str,
    "token_file": str,
    "heartbeat_s": float,
    "detect_s": float,
    "header_timeout_s": float,
    "max_connections": int,
    "max_connections_per_address": int,
    "spawn": list,
    "log_level": str,
}


class _UsageError(Exception):
    """Bad arguments or configuration: exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--role",
        choices=sorted([*ROLES, "auto", "local"]),
        help="what this node does: " + ", ".join(sorted(ROLES)) + "; or 'local': a whole training cluster "
        "on this machine from a job config (--config JOB.toml); or 'auto': the role and addresses from the "
        "launcher's environment (srun, torchrun, Kubeflow) and the job config (required)",
    )
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="address to serve on (default 127.0.0.1:0, an ephemeral port; the real one is printed). "
        "A non-loopback host requires --token-file",
    )
    parser.add_argument("--join", metavar="HOST:PORT",
                        help="the coordinator's address (required except for it); '-': read it from stdin once "
                             "the coordinator listens (the local launcher starts nodes beside it)")
    parser.add_argument(
        "--advertise", metavar="HOST:PORT", help="address other nodes reach this one at (default: --listen)"
    )
    parser.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="also serve /metrics (and the coordinator's live page) here, without the token; beyond loopback "
        "--listen serves them only to 'Authorization: Bearer <token>'",
    )
    parser.add_argument(
        "--token-file",
        metavar="F",
        help="file holding the shared cluster token (>= 16 bytes); every node of the cluster uses the same",
    )
    parser.add_argument("--config", metavar="F", help="TOML file with a [node] table of these options")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="coordinator and local: continue the job from its last checkpoint ([checkpoint] dir) instead of "
        "starting afresh; a config that differs outside [stop], [eval] and [checkpoint] is refused",
    )
    parser.add_argument(
        "--spares",
        type=_count,
        metavar="N",
        help="auto only: the launcher starts N ranks beyond the job's (its last N), which wait as spares and each "
        "take the place of a copy of a replicated PS shard (ps_replicas >= 2) whose process died; "
        "without a launcher start one with --role spare --join HOST:PORT",
    )
    parser.add_argument(
        "--spawn",
        action="append",
        metavar="MODULE:CLASS[=NAME]",
        help="also start this actor on the node (repeatable), e.g. dniasync.node.demo:Echo=echo",
    )
    parser.add_argument(
        "--heartbeat-s", type=float, metavar="S", help="heartbeat interval in seconds (default 0.5)"
    )
    parser.add_argument(
        "--detect-s",
        type=float,
        metavar="S",
        help="a peer silent for this many seconds is declared down (default 3.0)",
    )
    parser.add_argument(
        "--header-timeout-s",
        type=float,
        metavar="S",
        help="close a connection whose request headers are not complete this long after it opened or after "
        "its last response (default 10)",
    )
    parser.add_argument(
        "--max-connections", type=int, metavar="N", help="connections open on the listener at once (default 1024)"
    )
    parser.add_argument(
        "--max-connections-per-address",
        type=int,
        metavar="N",
        help="connections open from one peer address at once (default 64)",
    )
    parser.add_argument(
        "--emulate",
        metavar="NODES[:BANDWIDTH[:LATENCY]]",
        help="local only: run every process of the job on an emulated node of one core (network namespace, "
        "links shaped with tc tbf, a CPU quota), e.g. 4:100mbit:5ms (defaults 1gbit, 0.2ms). NODES is the job's "
        "count of worker processes; its PS shards and the coordinator get nodes too. With C cores and P processes "
        "each gets C/P of a core when P > C, links are slowed and delayed by the same factor d = P/C, and the "
        "summary's times are divided by d (its 'emulation' block says so). Needs root, iproute2, nftables and "
        "the cpu cgroup controller; everything made is removed at the end, also if the launcher is killed",
    )
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default info")
    return parser


def _count(text: str) -> int:
    """A count for --spares: an integer, 0 or more."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (an integer, 0 or more)")
    return int(text)


def _load_config(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            document = tomllib.load(fh)
    except OSError as exc:
        raise _UsageError(f"cannot read config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise _UsageError(f"config {path} is not valid TOML: {exc}") from None
    table = document.get("node", {})
    if not isinstance(table, dict):
        raise _UsageError(f"config {path}: [node] must be a table")
    for key, value in table.items():
        expected = _CONFIG_KEYS.get(key)
        if expected is None:
            raise _UsageError(f"config {path}: unknown key node.{key} (known: {', '.join(sorted(_CONFIG_KEYS))})")
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected):
            raise _UsageError(f"config {path}: node.{key} must be a {expected.__name__}")
        table[key] = value
    return table


def resolve_options(args: argparse.Namespace, *, token: bytes | None = None) -> dict[str, Any]:
    """Merge the config file and the command line; validate. Raises ``_UsageError``.

    ``token`` is the cluster token itself (``--role auto`` reads it from ``DNIASYNC_TOKEN``); a token file wins.
    """
    options: dict[str, Any] = _load_config(args.config) if args.config else {}
    if args.config:
        options["config"] = args.config
    for key in _CONFIG_KEYS:
        value = getattr(args, key, None)
        if value is not None:
            options[key] = value
    options.setdefault("listen", "127.0.0.1:0")
    options.setdefault("spawn", [])
    options.setdefault("log_level", "info")
    role = options.get("role")
    if role is None:
        raise _UsageError("--role is required (" + ", ".join(sorted(ROLES)) + ")")
    if role not in ROLES:
        raise _UsageError(f"unknown role {role!r} (choose from {', '.join(sorted(ROLES))})")
    for key in ("listen", "join", "advertise", "metrics_listen"):
        if key in options:
            try:
                parse_hostport(options[key])
            except ValueError as exc:
                raise _UsageError(f"--{key}: {exc}") from None
    if role in ("coordinator", "standby") and "config" in options:
        try:
            if _training.job_config_path(options["config"]) is not None:
                load_config(options["config"])  # a bad job config fails here, naming the key
        except ConfigError as exc:
            raise _UsageError(str(exc)) from None
    if role in NEEDS_JOIN and "join" not in options:
        raise _UsageError(f"role {role} needs --join HOST:PORT (the coordinator's address)")
    if "token_file" in options:
        try:
            token = read_token_file(options["token_file"])
        except OSError as exc:
            raise _UsageError(f"--token-file {options['token_file']}: {exc.strerror}") from None
        except ValueError as exc:
            raise _UsageError(str(exc)) from None
    host, _ = parse_hostport(options["listen"])
    if token is None and not is_loopback(host):
        raise _UsageError(
            f"refusing to listen on {host} without a cluster token: pass --token-file, or listen on 127.0.0.1"
        )
    options["token"] = token
    try:
        defaults = RemoteSettings()
        options["settings"] = RemoteSettings(
            heartbeat_s=options.get("heartbeat_s", defaults.heartbeat_s),
            detect_s=options.get("detect_s", defaults.detect_s),
            header_timeout_s=options.get("header_timeout_s", defaults.header_timeout_s),
            max_connections=options.get("max_connections", defaults.max_connections),
            max_connections_per_address=options.get(
                "max_connections_per_address", defaults.max_connections_per_address
            ),
        )
    except ValueError as exc:
        raise _UsageError(str(exc)) from None
    try:
        options["actors"] = [load_actor_class(spec) for spec in options["spawn"]]
    except ValueError as exc:
        raise _UsageError(str(exc)) from None
    return options


async def run_node(options: dict[str, Any]) -> int:
    """Run a node until SIGTERM/SIGINT; 0 after a clean shutdown."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    role: str = options["role"]
    status = 0
    follower: asyncio.Task[int] | None = None
    watch = LoopWatch(loop)  # a loop held up (its heartbeats stopping) logs where every thread is
    watch.start()
    try:
        async with ActorSystem() as system:
            transport = WebSocketTransport(
                system,
                options["listen"],
                token=options["token"],
                advertise=options.get("advertise"),
                settings=options["settings"],
                starting=True,  # peers allow startup_grace_s of silence until the roles run and the node joined
            )
            node_metrics = NodeMetrics(system, role, transport)
            mount_metrics(transport.app, node_metrics)
            live = LivePage(transport, node_metrics) if role in ("coordinator", "standby") else None
            if live is not None:
                live.mount(transport.app)
            try:
                await transport.start()
            except OSError as exc:
                print(f"error: cannot listen on {options['listen']}: {exc.strerror or exc}", file=sys.stderr)
                return 1
            operator: web.AppRunner | None = None
            try:
                if "metrics_listen" in options:
                    try:
                        operator = await _serve_operator(options, transport, node_metrics, live)
                    except OSError as exc:
                        print(f"error: cannot listen on {options['metrics_listen']}: {exc.strerror or exc}",
                              file=sys.stderr)
                        return 1
                context = NodeContext(system, transport, role, options.get("join"), stop, options)
                try:
                    await ROLES[role](context)
                except _training.ResumeError as exc:
                    print(f"error: {exc}", file=sys.stderr)
                    return 2
                if live is not None:
                    live.start(context)
                await system.spawn(NodeInfo, context, name=NODE_INFO)
                for cls, name in options["actors"]:
                    await system.spawn(cls, name=name)
                print(f"dniasync node {role} listening on {transport.address}", flush=True)
                if "launch" in options:  # started by a launcher: the node lives as long as its job
                    follower = asyncio.create_task(follow_job(context), name="follow-job")
                joined = await _join(context)
                if joined:
                    print(f"dniasync node {transport.address} joined the cluster via {context.join}", flush=True)
                transport.mark_ready()
                await stop.wait()
                log.info("shutting down")
                if joined:
                    await _leave(context)
            finally:
                if follower is not None:
                    stop.set()
                    status = await follower
                if operator is not None:
                    await operator.cleanup()
                await transport.close()
    finally:
        watch.stop()
    return status


async def _serve_operator(
    options: dict[str, Any], transport: WebSocketTransport, metrics: NodeMetrics, live: LivePage | None
) -> web.AppRunner:
    """``--metrics-listen``: /metrics (and the live page) on a listener of their own, without the token."""
    app = web.Application()
    mount_metrics(app, metrics)
    if live is not None:
        live.mount(app)
    host, port = parse_hostport(options["metrics_listen"])
    if not is_loopback(host):
        log.warning("--metrics-listen %s is beyond loopback: /metrics is open to anyone who reaches it", host)
    runner, port = await serve_guarded(app, (host, port), transport.settings, transport.counters)
    shown = f"[{host}]" if ":" in host else host
    print(f"dniasync node metrics on http://{shown}:{port}/metrics", flush=True)
    return runner


async def _join(context: NodeContext) -> bool:
    if context.join is None or context.membership is None or context.role == "standby":
        return False  # a standby keeps a coordinator's table of its own, joined once it takes over
    membership = context.membership
    coordinator = context.system.ref(f"{COORDINATOR}@{context.join}")
    join = Join(context.transport.address, context.role, context.transport.incarnation, membership)
    join_task = asyncio.ensure_future(join_cluster(membership, join, coordinator, context.stop))
    stop_task = asyncio.ensure_future(context.stop.wait())
    try:
        await asyncio.wait({join_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop_task.cancel()
    if not join_task.done():
        join_task.cancel()
    try:
        await join_task
    except (asyncio.CancelledError, ActorError):
        return False
    return True


async def _leave(context: NodeContext) -> None:
    assert context.join is not None
    try:
        await context.system.ref(f"{COORDINATOR}@{context.join}").ask(Leave(context.transport.address), timeout=2.0)
    except ActorError as exc:
        log.warning("could not tell the coordinator this node leaves: %s", exc)


def _apply_launcher(args: argparse.Namespace) -> AutoStart:
    """``--role auto``: take the role, the addresses and the token from the launcher's environment."""
    if not args.config:
        raise _UsageError("--role auto needs --config JOB.toml: the job decides how many ranks take each role")
    for flag in ("listen", "join", "advertise"):
        if getattr(args, flag) is not None:
            raise _UsageError(f"--role auto takes the addresses from the launcher's environment: drop --{flag}")
    try:
        auto = resolve_auto(args.config, os.environ, token_file=args.token_file, spares=args.spares or 0)
    except (LauncherError, ConfigError) as exc:
        raise _UsageError(str(exc)) from None
    placement = auto.placement
    args.role, args.listen, args.join, args.advertise = (
        placement.role, placement.listen, placement.join, placement.advertise)
    args.token_file = auto.token_file
    return auto


def _emulate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--role local --emulate``: the local launcher on emulated nodes."""
    from ._emulate import SpecError, parse_spec, run_emulated

    problem = None
    if args.role != "local":
        problem = "--emulate needs --role local"
    elif not args.config:
        problem = "--role local needs --config JOB.toml"
    else:
        try:
            spec = parse_spec(args.emulate)
            detect_s = args.detect_s or _load_config(args.config).get("detect_s", RemoteSettings().detect_s)
        except (SpecError, _UsageError) as exc:
            problem = str(exc)
    if problem is not None:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=(args.log_level or "error").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_emulated(args.config, spec, resume=args.resume, detect_s=detect_s)


def exit_now(status: int) -> NoReturn:
    """Leave with ``status`` once what an ordinary exit does for others is done: threads that are not daemons
    end (a thread pool's idle workers are told to), atexit handlers run (logging flushes its files), stdout and
    stderr flush. The interpreter's teardown, freeing every object one by one, is skipped: the system frees the
    memory at once. (For a node that imported torch it took 1.4-2 s after its last handler had run, and a
    launcher waits for its nodes at the end of every job: measured 2.0 s against 0.1 s for a 3-stage job.)"""
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter calls first as it exits
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe, a closed stream: nothing more to say anyway
            pass
    os._exit(status)


def _join_from_stdin(role: str | None) -> str | None:
    """``--join -``: the coordinator's address, one line on stdin (``None`` at its end). A worker imports what
    its roles train with meanwhile: seconds of start-up that overlap the coordinator's."""
    if role == "worker":
        from ..train import replica  # noqa: F401  (torch)
    line = sys.stdin.readline().strip()
    return line or None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m dniasync.node``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 with a message on bad arguments
    if args.spares is not None and args.role != "auto":
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: --spares is for --role auto (the launcher's last N ranks wait as spares); "
              "start a spare by hand with --role spare --join HOST:PORT", file=sys.stderr)
        return 2
    if args.emulate is not None:
        return _emulate(parser, args)
    if args.role == "local":
        if not args.config:
            parser.print_usage(sys.stderr)
            print(f"{parser.prog}: error: --role local needs --config JOB.toml", file=sys.stderr)
            return 2
        logging.basicConfig(level=(args.log_level or "error").upper(), stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return run_local(args.config, resume=args.resume)
    if args.join == "-":
        args.join = _join_from_stdin(args.role)
        if args.join is None:
            return 0  # the launcher gave up on the job (its coordinator refused the config): nothing to do
    auto: AutoStart | None = None
    try:
        if args.role == "auto":
            auto = _apply_launcher(args)
        options = resolve_options(args, token=None if auto is None else auto.token)
    except _UsageError as exc:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    options["resume"] = args.resume
    if auto is not None:
        options["launch"] = auto.placement
        print(auto.placement.describe(), flush=True)
    logging.basicConfig(
        level=options["log_level"].upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return run(run_node(options))
    except KeyboardInterrupt:
        return 0

