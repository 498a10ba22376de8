"""The launcher's fork server: node processes that start without importing anything.

Every node process of a job imports the same modules (torch alone costs seconds of CPU: 2.7-3.4 s here), and
the local launcher starts four or more of them at once, on a machine whose cores they share. The fork server
imports them once, then forks each node process from itself: a child starts in a fraction of a second, with
torch already in memory (its pages shared with its siblings until written), instead of each repeating the work
(Ray's prestarted workers and Python's ``forkserver`` start method answer the same cost the same way).

Started by the launcher with :meth:`ForkServer.start` (a process of its own, :func:`main`), it serves one
launcher over two Unix socket pairs:

- requests (launcher -> server, ``SOCK_SEQPACKET``): one JSON object per packet ``{"id", "argv", "env",
  "cwd", "stdin"}`` with the child's stdout (and, if ``stdin`` is ``"pipe"``, its stdin) as file descriptors
  (``SCM_RIGHTS``); no pickle;
- replies (server -> launcher, a stream of JSON lines): ``{"id", "pid"}`` once a child is forked,
  ``{"pid", "code"}`` once it has exited (``code`` as :attr:`subprocess.Popen.returncode` gives it: minus the
  signal's number for a child a signal ended).

A child runs ``python -m dniasync.node ARGV`` as a process of its own would: a session of its own (Ctrl-C
reaches the launcher, which stops it), the given environment and working directory, its output on the given
pipe, and ``SIGTERM`` if the fork server dies (which it does when the launcher dies: its request socket
closes). Fork safety: the server runs one thread (``OMP_NUM_THREADS=1`` keeps OpenBLAS from starting its
pool at import) and no event loop; each child makes its own. Processes that must start elsewhere (an emulated
node in its own namespaces and cgroup) are started by the launcher with ``exec`` as before.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from typing import Any, Final

PRELOAD = ("torch", "numpy", "aiohttp", "uvloop", "dniasync.node.cli", "dniasync.train.replica", "dniasync.cluster")
"""What the server imports before it forks: the modules every node role imports (the trainer's torch above all).
:meth:`ForkServer.start` can name more (``torch._dynamo``, which torch's optimizers import as they are made)."""

_MAX_REQUEST = 1 << 20


def _pdeathsig(sig: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG


# -- the server ---------------------------------------------------------------------------
def serve(requests: socket.socket, replies: socket.socket, preload: tuple[str, ...] = (),
          *, launcher_is_parent: bool = True) -> int:
    """Import :data:`PRELOAD` and ``preload``, then fork a child per request until the launcher closes
    ``requests``; report each child's pid and exit status. (A server the shared one forked for a launcher
    (:func:`serve_shared`) is not the launcher's child: it learns of the launcher's end from ``requests`` alone.)"""
    if launcher_is_parent:
        launcher = os.getppid()
        _pdeathsig(signal.SIGTERM)
        if os.getppid() != launcher:  # the launcher died before the line above
            return 0
    for module in (*PRELOAD, *preload):
        __import__(module)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wake-up fd hears of every exit
    replies.sendall(b'{"ready": true}\n')
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(requests, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    open_ = True
    while open_:
        for key, _ in sel.select():
            if key.fileobj is wake_r:
                os.read(wake_r, 4096)
                _reap(replies)
                continue
            try:
                data, fds, _, _ = socket.recv_fds(requests, _MAX_REQUEST, 2)
            except (ConnectionError, OSError):
                data, fds = b"", []
            if not data:
                open_ = False
                break
            try:
                request = json.loads(data)
                pid = os.fork()
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
            if pid == 0:
                sel.close()
                _child(request, fds, [requests.fileno(), replies.fileno(), wake_r, wake_w])
            for fd in fds:
                os.close(fd)
            replies.sendall(json.dumps({"id": request["id"], "pid": pid}).encode() + b"\n")
        _reap(replies)
    return 0


def _reap(replies: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        try:
            replies.sendall(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        except OSError:
            return  # the launcher is gone


def _child(request: dict[str, Any], fds: list[int], close: list[int]) -> None:
    """In the forked child: become ``python -m dniasync.node ARGV``; never returns."""
    status = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in close:
            os.close(fd)
        os.setsid()
        parent = os.getppid()
        _pdeathsig(signal.SIGTERM)  # the server goes with the launcher: so does the child
        if os.getppid() != parent:
            os._exit(1)
        stdout = fds[0]
        stdin = fds[1] if len(fds) > 1 else os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.dup2(stdout, 1)
        os.dup2(stdout, 2)
        for fd in {stdin, stdout}:
            if fd > 2:
                os.close(fd)
        _follow_pythonpath(os.environ.get("PYTHONPATH", ""), request["env"].get("PYTHONPATH", ""))
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        from .cli import exit_now, main

        sys.argv = [os.path.join(os.path.dirname(__file__), "__main__.py"), *request["argv"]]  # as -m sets it
        try:
            status = main(request["argv"])
        except SystemExit as exc:  # argparse's exit 2, a handler's sys.exit
            code = exc.code
            status = code if isinstance(code, int) else (0 if code is None else 1)
            if code is not None and not isinstance(code, int):
                print(code, file=sys.stderr)
        exit_now(status)
    except BaseException:
        import traceback

        traceback.print_exc()
        try:
            sys.stderr.flush()
        finally:
            os._exit(status or 1)


# -- the shared server -------------------------------------------------------------------------
FORK_ENV: Final = "DNIASYNC_FORK"
"""``0``: start each process of a job on loopback with exec, not from the launcher's fork server."""

SHARED_ENV: Final = "DNIASYNC_FORK_SERVER"
"""The socket of a running shared fork server (:func:`serve_shared`) the local launcher asks for its own server
instead of starting one; unset, empty, or not answering: the launcher starts its own."""

SHARED_PRELOAD: Final = ("torch._dynamo",)
"""What the shared server imports beyond :data:`PRELOAD`: what any mode asks for (:meth:`Mode.preload`)."""


def _identity() -> dict[str, str]:
    """What a launcher and a shared server must have in common for the server's imports to be the launcher's:
    the interpreter and the package's files."""
    import dniasync

    return {"executable": sys.executable, "package": os.path.dirname(os.path.abspath(dniasync.__file__))}


def serve_shared(path: str, preload: tuple[str, ...] = SHARED_PRELOAD, *, ready: Any = None) -> int:
    """The shared fork server: import everything once, listen on the Unix socket ``path``, and for each launcher
    that connects fork a server of its own (:func:`serve`, its imports already done) until SIGTERM or SIGINT.

    A launcher sends its request and reply sockets (``SCM_RIGHTS``) with a JSON hello ``{"executable",
    "package", "preload"}``; a launcher of another interpreter or another copy of the package is refused
    (``{"error"}``), and starts its own server. The socket is made readable by this user only.
    """
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # as the launcher's children
    for module in (*PRELOAD, *preload):
        __import__(module)
    if sys.path and sys.path[0] == os.getcwd():  # `-m` put the start's directory first: a child's is its own
        sys.path[0] = ""
    me = _identity()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the per-launcher servers are reaped by the kernel
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        if os.path.exists(path):
            os.unlink(path)  # a server that was killed left it; a live one would have answered the caller
        listener.bind(path)
    finally:
        os.umask(old_umask)
    listener.listen(64)
    if ready is not None:
        ready(path)
    try:
        while True:
            conn, _ = listener.accept()
            with conn:
                try:
                    data, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 2)
                    hello = json.loads(data)
                except (OSError, ValueError):
                    continue
                if len(fds) != 2 or {k: hello.get(k) for k in me} != me:
                    for fd in fds:
                        os.close(fd)
                    why = "needs two sockets" if len(fds) != 2 else f"this server runs {me}, not {hello}"
                    conn.sendall(json.dumps({"error": why}).encode() + b"\n")
                    continue
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        listener.close()
                        conn.close()
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        signal.signal(signal.SIGTERM, signal.SIG_DFL)
                        signal.signal(signal.SIGINT, signal.SIG_DFL)
                        os.setsid()  # out of the shared server's session: signals to it do not reach jobs
                        code = serve(socket.socket(fileno=fds[0]), socket.socket(fileno=fds[1]),
                                     tuple(m for m in hello.get("preload", ()) if isinstance(m, str)),
                                     launcher_is_parent=False)
                    finally:
                        os._exit(code)
                for fd in fds:
                    os.close(fd)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    except KeyboardInterrupt:
        if not stopping:
            raise
    finally:
        listener.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return 0


def _follow_pythonpath(server: str, child: str) -> None:
    """``sys.path`` as the child's ``PYTHONPATH`` would have made it, not the server's (a shared server started
    with another one): the server's entries it lacks out, its own in, where Python puts them (after the first)."""
    if server == child:
        return
    old = [p for p in server.split(os.pathsep) if p]
    new = [p for p in child.split(os.pathsep) if p]
    drop = {p for p in old if p not in new}
    sys.path[1:] = [p for p in sys.path[1:] if p not in drop]
    sys.path[1:1] = [p for p in new if p not in sys.path]


# -- the launcher's side ----------------------------------------------------------------------
class ForkedProcess:
    """A node process the fork server started: what the launcher uses of :class:`asyncio.subprocess.Process`."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader, stdin: asyncio.StreamWriter | None,
                 ended: asyncio.Future[int]) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stdin = stdin
        self._ended = ended

    @property
    def returncode(self) -> int | None:
        return self._ended.result() if self._ended.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._ended)

    def send_signal(self, sig: int) -> None:
        if self._ended.done():
            return
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


async def _ready(requests: socket.socket, replies: socket.socket,
                 timeout_s: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    """The reply stream of a fork server that says it is ready within ``timeout_s``; None, both sockets closed,
    if it does not."""
    reader, writer = await asyncio.open_unix_connection(sock=replies)
    try:
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    except TimeoutError:
        line = b""
    if line.startswith(b'{"ready"'):
        return reader, writer
    requests.close()
    writer.close()
    return None


class ForkServer:
    """The launcher's handle on its fork server (see the module's docstring)."""

    def __init__(self, proc: asyncio.subprocess.Process | None, requests: socket.socket,
                 replies: tuple[asyncio.StreamReader, asyncio.StreamWriter], pid: int | None = None) -> None:
        self.proc = proc
        """The server's process if this launcher started it; None for one a shared server forked (:meth:`connect`)."""
        self.pid = proc.pid if proc is not None else pid
        self._requests = requests
        self._replies, self._replies_end = replies  # (the writer kept: its collection would close the socket)
        self._ids = 0
        self._forked: dict[int, asyncio.Future[int]] = {}
        self._ended: dict[int, asyncio.Future[int]] = {}
        self._early: dict[int, int] = {}
        """Exit codes reported before the launcher saw the pid (a child that ended at once)."""
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, env: dict[str, str], preload: tuple[str, ...] = (),
                    timeout_s: float = 120.0) -> ForkServer | None:
        """A fork server with ``env`` (the children's environment as the launcher gives it) that imports
        ``preload`` too; None if it could not start (the launcher then starts its processes with ``exec``)."""
        req_a, req_b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        rep_a, rep_b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", "from dniasync.node._zygote import main; main()", str(req_b.fileno()),
                str(rep_b.fileno()), *preload,
                pass_fds=(req_b.fileno(), rep_b.fileno()), env=env, start_new_session=True,
                stdin=asyncio.subprocess.DEVNULL)
        finally:
            req_b.close()
            rep_b.close()
        replies = await _ready(req_a, rep_a, timeout_s)
        if replies is None:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
            return None
        return cls(proc, req_a, replies)

    @classmethod
    async def connect(cls, path: str, preload: tuple[str, ...] = (), timeout_s: float = 120.0) -> ForkServer | None:
        """A fork server of this launcher's own, forked by the shared server listening on ``path``
        (:func:`serve_shared`) with everything already imported; None if none answers there or it refused (another
        interpreter or another copy of the package): the launcher then starts its own (:meth:`start`)."""
        loop = asyncio.get_running_loop()
        req_a, req_b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        rep_a, rep_b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        hello = json.dumps({**_identity(), "preload": list(preload)}).encode()
        answer = b""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.setblocking(False)
                async with asyncio.timeout(timeout_s):
                    await loop.sock_connect(conn, path)
                    conn.setblocking(True)
                    socket.send_fds(conn, [hello], [req_b.fileno(), rep_b.fileno()])
                    conn.setblocking(False)
                    while not answer.endswith(b"\n"):
                        chunk = await loop.sock_recv(conn, 4096)
                        if not chunk:
                            break
                        answer += chunk
        except (OSError, TimeoutError):
            answer = b""
        finally:
            req_b.close()
            rep_b.close()
        try:
            pid = int(json.loads(answer)["pid"])
        except (ValueError, KeyError, TypeError):
            req_a.close()
            rep_a.close()
            return None
        replies = await _ready(req_a, rep_a, timeout_s)
        return None if replies is None else cls(None, req_a, replies, pid)

    async def _read(self) -> None:
        try:
            async for line in self._replies:
                reply = json.loads(line)
                if "id" in reply:
                    forked = self._forked.pop(reply["id"], None)
                    if forked is not None and not forked.done():
                        forked.set_result(reply["pid"])
                else:
                    ended = self._ended.pop(reply["pid"], None)
                    if ended is None:
                        self._early[reply["pid"]] = reply["code"]
                    elif not ended.done():
                        ended.set_result(reply["code"])
        finally:  # the server is gone: no more exits are reported; what it leaves ends by SIGTERM (its death signal)
            for forked in self._forked.values():
                if not forked.done():
                    forked.set_exception(ChildProcessError("the fork server exited"))
            for ended in self._ended.values():
                if not ended.done():
                    ended.set_result(-signal.SIGTERM)

    async def spawn(self, argv: list[str], env: dict[str, str], *, stdin_pipe: bool) -> ForkedProcess:
        """Start ``python -m dniasync.node ARGV`` with ``env``; its output (stdout and stderr) on one pipe."""
        loop = asyncio.get_running_loop()
        out_r, out_w = os.pipe()
        fds = [out_w]
        in_r = in_w = -1
        if stdin_pipe:
            in_r, in_w = os.pipe()
            fds.append(in_r)
        self._ids += 1
        rid = self._ids
        forked: asyncio.Future[int] = loop.create_future()
        self._forked[rid] = forked
        try:
            socket.send_fds(self._requests, [json.dumps(
                {"id": rid, "argv": argv, "env": env, "cwd": os.getcwd()}).encode()], fds)
        finally:
            for fd in fds:
                os.close(fd)
        try:
            pid = await forked
        except BaseException:
            os.close(out_r)
            if in_w >= 0:
                os.close(in_w)
            raise
        ended: asyncio.Future[int] = loop.create_future()
        if pid in self._early:
            ended.set_result(self._early.pop(pid))
        else:
            self._ended[pid] = ended
        stdout = asyncio.StreamReader(limit=2**20)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdout), os.fdopen(out_r, "rb", 0))
        stdin: asyncio.StreamWriter | None = None
        if in_w >= 0:
            transport, protocol = await loop.connect_write_pipe(
                lambda: asyncio.streams.FlowControlMixin(), os.fdopen(in_w, "wb", 0))
            stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        return ForkedProcess(pid, stdout, stdin, ended)

    async def close(self) -> None:
        """Stop serving: the server exits (children it started and that still run are the launcher's to stop)."""
        self._requests.close()
        if self.proc is not None:
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        else:  # forked by the shared server, not a child of this launcher: it has gone once its replies end
            try:
                await asyncio.wait_for(asyncio.shield(self._reader), 10)
            except TimeoutError:
                if self.pid is not None:
                    try:
                        os.kill(self.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        self._reader.cancel()
        self._replies_end.close()


def main() -> None:
    """The server process: ``python -c "from dniasync.node._zygote import main; main()" REQUESTS_FD REPLIES_FD
    [MODULE ...]`` (the shared server: ``python -m dniasync.node.fork_server``)."""
    requests = socket.socket(fileno=int(sys.argv[1]))
    replies = socket.socket(fileno=int(sys.argv[2]))
    sys.exit(serve(requests, replies, tuple(sys.argv[3:])))
