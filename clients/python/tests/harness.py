"""Real processes for the tests: etcd members and lockrouter routers on free
127.0.0.1 ports, data and configs in temp dirs. Each value owns its process:
``stop()`` kills and reaps it, and the kernel kills it too if the test run
dies (``PR_SET_PDEATHSIG``). Readiness is polled within a deadline; a
server that does not come up fails the test with the tail of its log.
Nothing here is a mock: etcd is ``/usr/bin/etcd`` (or
``/usr/local/bin/etcd``), the router is the binary cargo built. A router
may serve TLS (:class:`Tls`: a CA and a certificate made for the test).
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

ETCD_CANDIDATES = ("/usr/bin/etcd", "/usr/local/bin/etcd")
REPO = Path(__file__).resolve().parents[3]
DEFAULT_ROUTER = REPO / "target" / "debug" / "lockrouter"


def etcd_binary() -> str:
    for p in ETCD_CANDIDATES:
        if os.access(p, os.X_OK):
            return p
    pytest.fail(
        f"etcd missing: neither of {', '.join(ETCD_CANDIDATES)} exists; these tests run a real "
        "etcd (Debian: etcd-server; deploy/local/prereqs.sh test installs it)",
        pytrace=False,
    )


def router_binary() -> str:
    path = os.environ.get("LOCKROUTER_BIN") or str(DEFAULT_ROUTER)
    if not os.access(path, os.X_OK):
        pytest.fail(
            f"router binary missing: {path} is not an executable (build it with "
            "`cargo build --bin lockrouter`, as `make test-python` does, or set LOCKROUTER_BIN)",
            pytrace=False,
        )
    return path


def _port_window() -> tuple[int, int]:
    """(first port, count) of up to 20,000 ports just below the kernel's
    ephemeral range (as the Rust test kit, testkit/src/loopback.rs); under
    pytest-xdist, this worker's share of them, so that workers never pick
    the same port."""
    try:
        first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768
    low = max(first - 20_000, 1024)
    size = first - low
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker.startswith("gw") and workers > 1:
        share = size // workers
        return low + int(worker[2:]) * share, share
    return low, size


_PORTS = _port_window()
_next_port = itertools.count(random.randrange(max(_PORTS[1], 1)))


def free_port() -> int:
    """A loopback port that was free a moment ago, picked below the
    ephemeral range, in turn from a random start: no connection going out
    (the router's to etcd, a client's to the router) can take it before
    the process it is for binds it, and two picks in a row never give the
    same port (binding port 0 and letting go could)."""
    low, size = _PORTS
    for _ in range(size):
        port = low + next(_next_port) % size
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG = 1: a SIGKILL of the test run kills the child too.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"(no log: {e})"


class Process:
    """One child process with its log file."""

    def __init__(self, argv: list[str], log: Path, what: str) -> None:
        self.argv, self.log, self.what = argv, log, what
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )

    def wait_until(self, ready: "callable[[], bool]", within: float) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                pytest.fail(f"{self.what} exited with {self.proc.returncode}:\n{_tail(self.log)}")
            if ready():
                return
            time.sleep(0.05)
        self.stop()
        pytest.fail(f"{self.what} not ready within {within} s:\n{_tail(self.log)}")

    def kill(self) -> None:
        """SIGKILL, and reap: no drain, no goodbye."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)

    def stop(self) -> None:
        self.kill()


def _get(url: str, verify: Any = True) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=1.0, trust_env=False, verify=verify)
    except httpx.HTTPError:
        return None


@dataclasses.dataclass(frozen=True)
class Tls:
    """A CA made for one test, and the certificate it signed for the
    router's address (127.0.0.1); PEM files in the test's temp dir."""

    ca_file: Path
    cert_file: Path
    key_file: Path

    @classmethod
    def make(cls, workdir: Path) -> "Tls":
        ca = trustme.CA()
        leaf = ca.issue_cert("127.0.0.1")
        d = workdir / "tls"
        d.mkdir(parents=True, exist_ok=True)
        tls = cls(d / "ca.pem", d / "cert.pem", d / "key.pem")
        ca.cert_pem.write_to_path(str(tls.ca_file))
        for i, pem in enumerate(leaf.cert_chain_pems):
            pem.write_to_path(str(tls.cert_file), append=i > 0)
        leaf.private_key_pem.write_to_path(str(tls.key_file))
        return tls

    def trusting(self) -> ssl.SSLContext:
        """What a client passes as ``verify``: trust this CA only."""
        return ssl.create_default_context(cafile=str(self.ca_file))


class Etcd(Process):
    """A one-member etcd cluster."""

    def __init__(self, workdir: Path, name: str = "m0") -> None:
        self.client_port, peer_port = free_port(), free_port()
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{peer_port}"
        data = workdir / f"etcd-{name}-{self.client_port}"
        data.mkdir(parents=True)
        argv = [
            etcd_binary(),
            "--name", name,
            "--data-dir", str(data / "data"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{name}={peer}",
            "--initial-cluster-token", "lockrouter-python-test",
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
        ]  # fmt: skip
        super().__init__(argv, data / "etcd.log", f"etcd on {client}")
        self.data_dir = data / "data"
        self.endpoint = client
        self.spawn()

        def healthy() -> bool:
            r = _get(f"{client}/health")
            return r is not None and r.status_code == 200 and "true" in r.text

        self.wait_until(healthy, 20)

    def stop(self) -> None:
        """Kill, and remove the data dir: etcd preallocates 64 MB of WAL per
        member, and a run starts over a hundred members. The log stays for
        a failed test's report."""
        super().stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)


class Router(Process):
    """``lockrouter serve`` over the given etcd shards (named a, b, ...),
    with short etcd deadlines so failures show fast (as the Rust test kit's
    config does); with ``tls``, serving https with its certificate."""

    def __init__(
        self, workdir: Path, shards: list[Etcd], port: int | None = None, extra: str = "", tls: Tls | None = None
    ) -> None:
        self.port = port or free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        #: What this harness's own requests to the router trust.
        self.verify: Any = tls.trusting() if tls else True
        d = workdir / f"router-{self.port}"
        d.mkdir(parents=True, exist_ok=True)
        server = f'[server]\nlisten = "127.0.0.1:{self.port}"\n'
        if tls:
            server += f'tls_cert_file = "{tls.cert_file}"\ntls_key_file = "{tls.key_file}"\n'
        toml = (
            server + "\n"
            '[etcd]\nprefix = "/lockrouter"\nrequest_timeout_ms = 1000\n'
            "connect_timeout_ms = 500\nhealth_interval_ms = 200\n"
        ) + extra
        for i, s in enumerate(shards):
            toml += f'\n[[shards]]\nname = "{chr(ord("a") + i)}"\nendpoints = ["{s.endpoint}"]\n'
        self.config = d / "router.toml"
        self.config.write_text(toml)
        argv = [router_binary(), "serve", "--config", str(self.config)]
        super().__init__(argv, d / "router.log", f"router on {self.url}")
        self.start()

    def start(self) -> None:
        """Starts (or restarts, on the same port) and waits for /readyz."""
        self.spawn()

        def ready() -> bool:
            r = _get(f"{self.url}/readyz", self.verify)
            return r is not None and r.status_code == 200

        self.wait_until(ready, 30)

    def inspect(self, name: str) -> dict:
        from urllib.parse import quote

        path = f"/api/v1/locks/{quote(name, safe='')}"
        r = httpx.get(self.url + path, timeout=5, trust_env=False, verify=self.verify)
        r.raise_for_status()
        return r.json()

    def metric(self, name: str, labels: str) -> float:
        """Sum of one metric's series whose labels contain ``labels``."""
        text = httpx.get(f"{self.url}/metrics", timeout=5, trust_env=False, verify=self.verify).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and labels in line:
                total += float(line.rsplit(" ", 1)[1])
        return total
