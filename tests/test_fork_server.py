"""The local launcher's fork server (dniasync.node._zygote), driven as the launcher drives it: real processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from pathlib import Path

from dniasync.node._zygote import ForkServer


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


async def test_forked_nodes_say_what_they_say_exit_as_they_exit_and_the_server_goes_when_closed() -> None:
    env = _env()
    server = await ForkServer.start(env)
    assert server is not None
    try:
        refused = await server.spawn(["--role", "nosuch"], env, stdin_pipe=False)  # argparse: exit 2, on stderr
        said = (await asyncio.wait_for(refused.stdout.read(), 60)).decode()
        assert await asyncio.wait_for(refused.wait(), 60) == 2 and refused.returncode == 2
        assert "invalid choice: 'nosuch'" in said, said
        # a worker with --join - reads the coordinator's address from its stdin: a pipe the launcher writes
        waiting = await server.spawn(["--role", "worker", "--join", "-"], env, stdin_pipe=True)
        assert waiting.stdin is not None and waiting.returncode is None
        # a session of its own (Ctrl-C reaches only the launcher), made as the child starts
        async with asyncio.timeout(60):
            while os.getsid(waiting.pid) != waiting.pid:
                await asyncio.sleep(0.01)
        waiting.kill()
        assert await asyncio.wait_for(waiting.wait(), 60) == -signal.SIGKILL
        ended = await server.spawn(["--role", "worker", "--join", "-"], env, stdin_pipe=True)
        assert ended.stdin is not None
        ended.stdin.close()  # the end of its input before an address: the launcher gave up on the job
        assert await asyncio.wait_for(ended.wait(), 60) == 0
    finally:
        await server.close()
    assert server.proc.returncode == 0


async def test_a_server_that_cannot_start_is_none_and_the_launcher_falls_back_to_exec() -> None:
    # (a None server: _run starts every process with exec, as with DNIASYNC_FORK=0)
    env = _env()
    server = await ForkServer.start(env, preload=("dniasync_no_such_module",))
    assert server is None


async def test_the_shared_server_forks_a_server_per_launcher_that_goes_when_closed(shared_fork_server: str) -> None:
    env = _env()
    server = await ForkServer.connect(shared_fork_server)
    assert server is not None and server.proc is None and server.pid is not None
    try:
        refused = await server.spawn(["--role", "nosuch"], env, stdin_pipe=False)
        said = (await asyncio.wait_for(refused.stdout.read(), 60)).decode()
        assert await asyncio.wait_for(refused.wait(), 60) == 2, said
        assert "invalid choice: 'nosuch'" in said, said
        # the child runs where the launcher runs, with the launcher's environment (not the shared server's)
        here = await server.spawn(["--role", "worker", "--join", "-"], dict(env, DNIASYNC_TEST_MARK="1"),
                                  stdin_pipe=True)
        async with asyncio.timeout(60):
            while os.getsid(here.pid) != here.pid:
                await asyncio.sleep(0.01)
        assert os.readlink(f"/proc/{here.pid}/cwd") == os.getcwd()
        here.kill()
        assert await asyncio.wait_for(here.wait(), 60) == -signal.SIGKILL
    finally:
        await server.close()
    async with asyncio.timeout(60):  # not this process's child: it has gone once /proc no longer lists it
        while os.path.exists(f"/proc/{server.pid}"):
            await asyncio.sleep(0.05)
    again = await ForkServer.connect(shared_fork_server)  # the shared one serves the next launcher
    assert again is not None
    await again.close()


async def test_a_launcher_of_another_package_is_refused_by_the_shared_server_and_nothing_listening_is_none(
        shared_fork_server: str, tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(shared_fork_server)
        a, b = socket.socketpair()
        with a, b:
            socket.send_fds(conn, [json.dumps({"executable": sys.executable, "package": "/elsewhere"}).encode()],
                            [a.fileno(), b.fileno()])
            answer = json.loads(conn.makefile().readline())
    assert "/elsewhere" in answer["error"], answer
    assert await ForkServer.connect(str(tmp_path / "nobody.sock")) is None
