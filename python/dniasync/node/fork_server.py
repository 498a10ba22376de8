"""``python -m dniasync.node.fork_server``: one fork server that many local launches share.

Each ``--role local`` launch starts a fork server that imports torch and the rest once for the job's processes
(:mod:`dniasync.node._zygote`); that import alone is seconds of CPU (6-7 s on a slow 2.5 GHz core). Whoever
launches many short jobs one after another (``dniasync.compare``, a benchmark's sweep, a test suite) pays it for
each. This server pays it once: it imports everything, listens on a Unix socket, and for each launch whose
environment names that socket in ``DNIASYNC_FORK_SERVER`` it forks a server of that launch's own, ready at once.

    python -m dniasync.node.fork_server --socket /tmp/forks.sock &
    DNIASYNC_FORK_SERVER=/tmp/forks.sock python -m dniasync.node --role local --config job.toml

A launch behaves as with a server of its own: its processes are in sessions of their own, end with it however it
ends, and its output and exit codes are its own; the shared server keeps running until SIGTERM or Ctrl-C. A
launcher of another interpreter or another copy of the package is refused and starts its own server, as it does
when nothing answers on the socket. The socket is readable and writable by this user only.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from ._zygote import FORK_ENV, SHARED_ENV, serve_shared

__all__ = ["FORK_ENV", "SHARED_ENV", "default_socket", "main", "running"]


def default_socket() -> str:
    """``$XDG_RUNTIME_DIR/dniasync-fork.sock``, else one per user in the temporary directory."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "dniasync-fork.sock")
    return os.path.join(tempfile.gettempdir(), f"dniasync-fork-{os.getuid()}.sock")


@contextmanager
def running(*, timeout_s: float = 300.0) -> Iterator[str]:
    """A shared fork server, a process of its own for the ``with`` block, listening in a new private directory:
    the socket's path (to put in ``DNIASYNC_FORK_SERVER``). ``RuntimeError`` if it does not start (its words)."""
    directory = tempfile.mkdtemp(prefix="dniasync-forks-")
    path = os.path.join(directory, "s.sock")
    server = subprocess.Popen([sys.executable, "-m", "dniasync.node.fork_server", "--socket", path],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    assert server.stdout is not None
    try:
        said = b""
        if select.select([server.stdout], [], [], timeout_s)[0]:  # a line once it listens, or its error as it ends
            said = server.stdout.readline()
        if not said.startswith(b"dniasync fork server on"):
            server.kill()
            raise RuntimeError(f"the shared fork server did not start: {(said + server.stdout.read()).decode()}")
        yield path
    finally:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        server.stdout.close()
        shutil.rmtree(directory, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dniasync.node.fork_server",
        description="Import torch and dniasync once and serve every local launch that names this server's socket "
                    f"in {SHARED_ENV}.")
    parser.add_argument("--socket", metavar="PATH", default=default_socket(),
                        help="the Unix socket to listen on (default: %(default)s)")
    args = parser.parse_args(argv)
    directory = os.path.dirname(os.path.abspath(args.socket))
    if not os.path.isdir(directory):
        parser.exit(2, f"{parser.prog}: error: --socket {args.socket}: no directory {directory}\n")
    if len(os.fsencode(os.path.abspath(args.socket))) > 100:
        parser.exit(2, f"{parser.prog}: error: --socket {args.socket}: a Unix socket's path must be shorter\n")

    def ready(path: str) -> None:
        print(f"dniasync fork server on {path}: export {SHARED_ENV}={path}", flush=True)

    return serve_shared(os.path.abspath(args.socket), ready=ready)


if __name__ == "__main__":
    sys.exit(main())
