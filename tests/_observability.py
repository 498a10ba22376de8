"""Helpers for the observability tests: a real local cluster, a DNI node, a real Prometheus."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

JOB = """
[job]
name = "{name}"
mode = "downpour"
seed = 3
output_dir = "{out}"

[model]
factory = "dniasync.train.models:mlp"

[model.kwargs]
sizes = [64, 64, 10]

[data]
dataset = "digits"
n_train = 1400
n_test = 397
batch_size = 32

[optimizer]
name = "adagrad"
lr = 0.05

[downpour]
n_replicas = 2
n_ps_shards = 2
codec = "threshold"
tau = 0.001

[stop]
max_epochs = 1000000
max_seconds = {max_seconds}

[eval]
every_seconds = 0.5
"""

DNI_JOB = """
[job]
name = "{name}"
mode = "pipeline"
seed = 3
output_dir = "{out}"

[model]
factory = "dniasync.train.models:mlp"

[model.kwargs]
sizes = [64, 64, 64, 10]

[data]
dataset = "digits"
n_train = 1400
n_test = 397
batch_size = 32

[optimizer]
name = "adam"
lr = 0.001

[pipeline]
groups = [[0, 1], [2, 3, 4]]
method = "cdni"

[stop]
max_epochs = 1000000
max_seconds = {max_seconds}

[eval]
every_seconds = 0.5
"""

DNI_NODE = r"""
import asyncio, sys
import torch
from sklearn.datasets import load_digits
from torch import nn
from dniasync import ActorSystem
from dniasync.metrics import NodeMetrics
from dniasync.node import mount_metrics
from dniasync.remote import WebSocketTransport
from dniasync.runtime import run
from dniasync.train.pipeline import PipelineDriver, Schedule, StageSettings, spawn_stages

async def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.int64)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    async with ActorSystem() as system:
        transport = WebSocketTransport(system)
        mount_metrics(transport.app, NodeMetrics(system, "dni", transport))
        async with transport:
            groups = await spawn_stages(system, model, [[0, 1], [2, 3], [4]], StageSettings(rule="dni"), 64,
                                        mailbox_size=40)
            print("dni node listening on", transport.address, flush=True)
            async with PipelineDriver(system, groups, Schedule(max_in_flight=8)) as driver:
                while True:
                    await driver.train(x, y, epochs=1, batch_size=32)

run(main())
"""


def need(binary: str, package: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} not installed (Debian package '{package}'; .ci/run installs it)")
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


class LocalCluster:
    """``python -m dniasync.node --role local`` on a digits job, stopped (SIGTERM) on exit.

    ``job``: the config template (:data:`JOB`, Downpour; :data:`DNI_JOB`, two DNI stages).
    """

    def __init__(self, tmp: Path, name: str, max_seconds: float = 120, job: str = JOB) -> None:
        self.out = tmp / name
        config = tmp / f"{name}.toml"
        config.write_text(job.format(name=name, out=self.out, max_seconds=max_seconds))
        self.log = open(tmp / f"{name}.launcher.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "dniasync.node", "--role", "local", "--config",
                                      str(config)], stdout=self.log, stderr=subprocess.STDOUT, env=env())
        self.targets_file = self.out / "prometheus_targets.json"

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def state(self, tail: int = 40) -> str:
        """Whether the launcher still runs, its output, and the last lines of each node's log: what a test that
        finds a node gone prints, so the failure names the node and why it went."""
        status = "running" if self.proc.poll() is None else f"exited {self.proc.returncode}"
        text = f"== {self.out.name}: launcher {status}\n{self.output()[-3000:]}"
        for log in sorted((self.out / "logs").glob("*.log")):
            text += f"\n-- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-tail:])
        return text

    def wait_targets(self, n: int, timeout: float = 60) -> list[str]:
        """The addresses in the launcher's targets file, once it lists ``n`` nodes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"launcher exited:\n{self.output()}"
            if self.targets_file.exists():
                groups = json.loads(self.targets_file.read_text())
                targets = [t for g in groups for t in g["targets"]]
                if len(targets) == n:
                    return targets
            time.sleep(0.2)
        raise AssertionError(f"the targets file never listed {n} nodes:\n{self.output()}")

    def page_address(self, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(r"live page: http://(\S+)/", self.output())
            if match:
                return match.group(1)
            time.sleep(0.2)
        raise AssertionError(f"the launcher printed no live page address:\n{self.output()}")

    def terminate(self) -> None:
        """SIGTERM to the launcher without waiting for it (:meth:`stop` waits): several clusters stop side by side."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        self.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class DNINode:
    """A node hosting three DNI stages and a driver training them on digits, forever."""

    def __init__(self, tmp: Path) -> None:
        self.log = open(tmp / "dni-node.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-c", DNI_NODE], stdout=subprocess.PIPE,
                                     stderr=self.log, env=env(), text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        match = re.search(r"listening on (\S+)", line)
        if match is None:
            self.log.seek(0)
            raise AssertionError(f"the DNI node did not start: {line!r}\n{self.log.read()}")
        self.address = match.group(1)

    def state(self) -> str:
        status = "running" if self.proc.poll() is None else f"exited {self.proc.returncode}"
        self.log.seek(0)
        return f"== DNI node {self.address}: {status}\n{self.log.read()[-3000:]}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class Prometheus:
    """A real Prometheus on loopback scraping the given file-SD target files every second."""

    def __init__(self, tmp: Path, sd_files: list[Path]) -> None:
        binary = need("prometheus", "prometheus")
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "scrape_configs": [{"job_name": "dniasync", "file_sd_configs": [
                {"files": [str(p) for p in sd_files], "refresh_interval": "1s"}]}],
        }))
        self.log = open(tmp / "prometheus.log", "w+")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{self.port}",
             f"--storage.tsdb.path={tmp / 'prometheus-data'}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read())

    def query(self, expr: str) -> list[dict[str, Any]]:
        doc = self.api("query", query=expr)
        assert doc["status"] == "success", (expr, doc)
        result: list[dict[str, Any]] = doc["data"]["result"]
        return result

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus never became ready:\n{self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def fetch(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body: bytes = resp.read()
        return body.decode()
