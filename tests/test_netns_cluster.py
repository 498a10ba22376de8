"""Jobs across hosts: network namespaces joined by a bridge, each a host with its own address and name.

Four namespaces (``h1`` ... ``h4``, 10.78.0.1-4/24) hang off a bridge in a fifth (the hub) by veth
pairs, each end shaped with ``tc tbf`` (100 Mbit/s); each node runs in its host's namespace and in
a UTS namespace of its own with the host's name (two processes of one host name and boot id would
move tensors through shared memory, around the network). Nodes listen on their host's address,
so the cluster token is required (``--token-file``). h1 runs the coordinator and a real Prometheus
that scrapes every node through its token-protected listener; h2 the PS nodes; h3 and h4 a worker
each. The namespaces carry a random suffix per run and are deleted by the fixture's finalizer,
every node process stopped before.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _observability import need

ROOT = Path(__file__).resolve().parent.parent
SUBNET = "10.78.0"
RATE = ["tbf", "rate", "100mbit", "burst", "32kbit", "latency", "50ms"]
COORDINATOR_PORT = 7000


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"'{tool}' not installed (iproute2, util-linux)"
    probe = f"dn19-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' does not work here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


_WHY = _missing()
pytestmark = [
    pytest.mark.skipif(_WHY is not None, reason=_WHY or ""),
    # above the summary's own wait (Cluster.summary: 420 s): on a loaded machine that wait, not pytest-timeout's
    # default 300 s, is the limit (a loaded CI run hit the 300 s one mid-wait)
    pytest.mark.timeout(600),
]


def sh(*args: str) -> str:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


class Net:
    """The namespaces of one test: ``hosts[i]`` is namespace ``h{i+1}`` at ``addr(i)``; every process started here."""

    def __init__(self, n_hosts: int) -> None:
        sfx = secrets.token_hex(3)
        self.hub = f"dn19-{sfx}-hub"
        self.hosts = [f"dn19-{sfx}-h{i + 1}" for i in range(n_hosts)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self._sfx = sfx
        sh("ip", "netns", "add", self.hub)
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i, ns in enumerate(self.hosts):
            sh("ip", "netns", "add", ns)
            host_end, hub_end = f"d{sfx}h{i + 1}", f"d{sfx}b{i + 1}"  # at most 15 characters
            sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", hub_end)
            sh("ip", "link", "set", host_end, "netns", ns)
            sh("ip", "link", "set", hub_end, "netns", self.hub)
            sh("ip", "-n", self.hub, "link", "set", hub_end, "master", "br0")
            sh("ip", "-n", self.hub, "link", "set", hub_end, "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", host_end)
            sh("ip", "-n", ns, "link", "set", host_end, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", host_end, "root", *RATE)
            sh("ip", "netns", "exec", self.hub, "tc", "qdisc", "add", "dev", hub_end, "root", *RATE)

    @staticmethod
    def addr(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def start(self, i: int, args: list[str], log: Path) -> subprocess.Popen[bytes]:
        """``args`` run in host ``i``'s namespace, under a host name of its own."""
        with log.open("wb") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.hosts[i], "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                 f"host{i + 1}", *args],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env(), cwd=ROOT,
            )
        self.procs.append(proc)
        return proc

    def python(self, i: int, code: str, *args: str, timeout: float = 60) -> str:
        """Run ``code`` in host ``i``'s namespace; its stdout."""
        return sh("timeout", str(timeout), "ip", "netns", "exec", self.hosts[i], sys.executable, "-c", code, *args)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def delete(self) -> None:
        for ns in [*self.hosts, self.hub]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def net() -> Iterator[Net]:
    made = Net(4)
    try:
        yield made
    finally:
        made.stop_all()
        made.delete()
        left = sh("ip", "netns", "list")
        assert made._sfx not in left, left


HTTP_GET = r"""
import json, sys, urllib.request, urllib.error
request = urllib.request.Request(sys.argv[1], headers=json.loads(sys.argv[2]))
try:
    with urllib.request.urlopen(request, timeout=10) as resp:
        print(json.dumps({"status": resp.status, "body": resp.read().decode(errors="replace")}))
except urllib.error.HTTPError as err:
    print(json.dumps({"status": err.code, "body": err.read().decode(errors="replace")}))
"""


def http_get(net: Net, i: int, url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """GET ``url`` from host ``i``: {"status", "body"}."""
    doc: dict[str, Any] = json.loads(net.python(i, HTTP_GET, url, json.dumps(headers or {})))
    return doc


def wait_for(what: str, check: Any, timeout: float, detail: Any = lambda: "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout:.0f} s\n{detail()}")


JOB_HEAD = """
[job]
name = "{name}"
mode = "{mode}"
seed = 3
output_dir = "{out}"

[model]
factory = "dniasync.train.models:mlp"

[model.kwargs]
sizes = {sizes}

[data]
dataset = "digits"
n_train = 1400
n_test = 397
batch_size = 32

[stop]
max_epochs = {epochs}
max_seconds = 300

[eval]
every_seconds = 1.0
"""

DOWNPOUR = """
[optimizer]
name = "adagrad"
lr = 0.05

[downpour]
n_replicas = 2
n_ps_shards = 2
codec = "threshold"
tau = 0.01
resync_every = 20
"""

DNI_DOWNPOUR = """
[optimizer]
name = "adam"
lr = 1e-3

[pipeline]
groups = [[0, 1], [2]]
method = "cdni"
max_in_flight = 4
replicas = 2
placement = [0, 0]
"""


class Cluster:
    """A job's nodes by hand, as on real machines: h1 coordinator, h2 the PS nodes, h3 and h4 a worker each."""

    def __init__(self, net: Net, tmp: Path, name: str, mode: str, sizes: str, section: str, n_ps: int,
                 epochs: int) -> None:
        self.net = net
        self.out = tmp / name
        self.logs = tmp / f"{name}-logs"
        self.logs.mkdir()
        self.config = tmp / f"{name}.toml"
        self.config.write_text(JOB_HEAD.format(name=name, mode=mode, out=self.out, sizes=sizes, epochs=epochs)
                               + section)
        self.token = tmp / "cluster.token"
        if not self.token.exists():
            self.token.write_text(secrets.token_hex(32) + "\n")
            self.token.chmod(0o600)
        self.coordinator = f"{net.addr(0)}:{COORDINATOR_PORT}"
        self.nodes: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        self.targets = [self.coordinator]
        self._node(0, "coordinator", self.coordinator, ["--config", str(self.config)])
        wait_for("the coordinator listens", lambda: "listening on" in self.log("coordinator"), 120,
                 lambda: self.log("coordinator"))
        for k in range(n_ps):
            self._node(1, f"ps{k}", f"{net.addr(1)}:{7001 + k}", ["--join", self.coordinator])
        for k, host in enumerate((2, 3)):
            self._node(host, f"worker{k}", f"{net.addr(host)}:{7010 + k}", ["--join", self.coordinator])

    def _node(self, host: int, name: str, listen: str, args: list[str]) -> None:
        role = name.rstrip("0123456789")
        log = self.logs / f"{name}.log"
        proc = self.net.start(host, [sys.executable, "-m", "dniasync.node", "--role", role, "--listen", listen,
                                     "--token-file", str(self.token), *args], log)
        self.nodes.append((name, proc, log))
        if name != "coordinator":
            self.targets.append(listen)

    def log(self, name: str) -> str:
        return next(log for n, _, log in self.nodes if n == name).read_text(errors="replace")

    def all_logs(self) -> str:
        return "\n".join(f"--- {n}\n{log.read_text(errors='replace')[-3000:]}" for n, _, log in self.nodes)

    def summary(self, timeout: float = 420) -> dict[str, Any]:
        path = self.out / "summary.json"

        def done() -> bool:
            dead = [(n, p.returncode) for n, p, _ in self.nodes if p.poll() is not None and not path.exists()]
            assert not dead, f"{dead} exited before the summary\n{self.all_logs()}"
            return path.exists()

        wait_for("the job wrote its summary", done, timeout, self.all_logs)
        doc: dict[str, Any] = wait_for("a complete summary", lambda: _read_json(path), 30)
        return doc

    def stop(self) -> list[tuple[str, int | None]]:
        """SIGTERM every node; (name, exit status) of each."""
        for _, proc, _ in reversed(self.nodes):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = []
        for name, proc, _ in self.nodes:
            try:
                codes.append((name, proc.wait(timeout=60)))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append((name, proc.wait()))
        return codes


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
        return doc
    except (OSError, ValueError):
        return None


class Prometheus:
    """A real Prometheus in host h1's namespace, scraping ``targets`` with the cluster token every second."""

    def __init__(self, net: Net, tmp: Path, token: Path, targets: list[str]) -> None:
        binary = need("prometheus", "prometheus")
        self.net = net
        config = tmp / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "scrape_configs": [{
                "job_name": "dniasync",
                "authorization": {"type": "Bearer", "credentials_file": str(token)},
                "static_configs": [{"targets": targets}],
            }],
        }))
        self.log = tmp / "prometheus.log"
        self.proc = net.start(0, [binary, f"--config.file={config}", "--web.listen-address=127.0.0.1:9090",
                                  f"--storage.tsdb.path={tmp / 'prometheus-data'}", "--log.level=warn"], self.log)

    def query(self, expr: str) -> list[dict[str, Any]]:
        reply = http_get(self.net, 0, "http://127.0.0.1:9090/api/v1/query?query=" + _quote(expr))
        if reply["status"] != 200:
            return []
        result: list[dict[str, Any]] = json.loads(reply["body"])["data"]["result"]
        return result

    def instances_up(self) -> set[str]:
        return {r["metric"]["instance"] for r in self.query("up == 1")}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _quote(expr: str) -> str:
    import urllib.parse

    return urllib.parse.quote(expr)


def check_scraped_every_host(prom: Prometheus, cluster: Cluster) -> None:
    """Prometheus scrapes every node, on every host, through the token-protected listener."""
    wanted = set(cluster.targets)
    wait_for("Prometheus scraped every node", lambda: prom.instances_up() >= wanted, 120,
             lambda: f"up: {prom.query('up')}\n{prom.log.read_text(errors='replace')[-2000:]}")
    series = prom.query('count by (instance) ({__name__=~"dniasync_.+"})')
    assert {s["metric"]["instance"] for s in series} >= wanted, series
    assert {t.split(":")[0] for t in wanted} == {Net.addr(i) for i in range(4)}  # every host


def check_token_required(net: Net, cluster: Cluster) -> None:
    """From another host, the coordinator's listener serves nothing without the token."""
    token = cluster.token.read_text().strip()
    url = f"http://{cluster.coordinator}"
    probes = {
        "metrics, no token": http_get(net, 2, f"{url}/metrics"),
        "metrics, wrong token": http_get(net, 2, f"{url}/metrics", {"Authorization": f"Bearer {'0' * len(token)}"}),
        "status, no token": http_get(net, 2, f"{url}/api/status"),
        "websocket, no proof": http_get(net, 2, f"{url}/dniasync/ws", {"Connection": "Upgrade",
                                                                         "Upgrade": "websocket"}),
        "metrics, token": http_get(net, 2, f"{url}/metrics", {"Authorization": f"Bearer {token}"}),
    }
    statuses = {what: reply["status"] for what, reply in probes.items()}
    assert statuses == {"metrics, no token": 401, "metrics, wrong token": 401, "status, no token": 401,
                        "websocket, no proof": 403, "metrics, token": 200}, probes
    assert "dniasync_" in probes["metrics, token"]["body"]


def test_downpour_across_four_hosts_with_token_auth_shaped_links_and_prometheus(net: Net, tmp_path: Path) -> None:
    cluster = Cluster(net, tmp_path, "dp", "downpour", "[64, 64, 10]", DOWNPOUR, n_ps=2, epochs=6)
    prom = Prometheus(net, tmp_path, cluster.token, cluster.targets)
    try:
        doc = cluster.summary()
        check_scraped_every_host(prom, cluster)
        check_token_required(net, cluster)
    finally:
        prom.stop()
        codes = cluster.stop()
    assert doc["stop_reason"] == "trained 6 epochs", doc["stop_reason"]
    assert doc["final_accuracy"] >= 0.85, doc["history"]
    metrics = doc["metrics"]
    # compressed both ways: the shards answered most pulls with deltas, and resynced densely now and then
    assert metrics["ps0_delta_pulls"] > metrics["ps0_dense_pulls"] >= 2, metrics
    assert metrics["ps1_applied"] > 0
    # the replicas lived on h3 and h4, the shards on h2: every byte crossed the bridge
    assert doc["bytes_pulled"] > 0 and doc["bytes_pushed"] > 0
    assert all(code == 0 for _, code in codes), (codes, cluster.all_logs())


def test_dni_times_downpour_across_four_hosts(net: Net, tmp_path: Path) -> None:
    cluster = Cluster(net, tmp_path, "dnidp", "pipeline", "[64, 64, 10]", DNI_DOWNPOUR, n_ps=2, epochs=4)
    prom = Prometheus(net, tmp_path, cluster.token, cluster.targets)
    try:
        doc = cluster.summary()
        check_scraped_every_host(prom, cluster)
    finally:
        prom.stop()
        codes = cluster.stop()
    assert doc["stop_reason"] == "trained 4 epochs", doc["stop_reason"]
    assert doc["final_accuracy"] >= 0.8, doc["history"]
    metrics = doc["metrics"]
    # each group's two replicas (one on h3, one on h4) shared its weights through its PS shard on h2
    assert metrics["ps0_applied"] > 0 and metrics["ps1_applied"] > 0, metrics
    hosts = {metrics[key].split("@")[1].split(":")[0] for key in metrics if key.endswith("_address")}
    assert hosts == {Net.addr(2), Net.addr(3)}, hosts
    assert all(code == 0 for _, code in codes), (codes, cluster.all_logs())
