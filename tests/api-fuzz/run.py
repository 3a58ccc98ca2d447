#!/usr/bin/env python3
"""OpenAPI-driven fuzzing of a real router on real etcd (`make test-api-fuzz`).

Starts three single-member etcd clusters, shards a, b and c (the layout of
`make run`, whose shards the lockIds in docs/openapi.yaml's examples name),
and the router binary (`lockrouter serve --config ...`), each on free
127.0.0.1 ports with its data and log in one temporary directory; waits
until /readyz answers 200; runs schemathesis (`st run`, the version pinned
in requirements.txt) against docs/openapi.yaml at that router; and stops
every process and removes the directory, whatever happened (SIGTERM and
Ctrl-C included; the children die with this script if it is killed).

What it sends, for every operation of the spec: the spec's own examples;
boundary, missing, mistyped and malformed values of every field, path
parameter and body, and other methods on every path (coverage phase);
bodies and path parameters generated from the schemas, valid and invalid
(fuzzing phase); and sequences that feed an acquire's lockId and
fencingToken into renew, renew-batch, release, inspect and force-release
(stateful phase, links inferred from the schemas).

What it asserts of every answer (schemathesis checks):
  not_a_server_error            no 5xx at all: the shards are healthy, so
                                not even a 503
  status_code_conformance       the status is one the spec documents for
                                the operation
  content_type_conformance      the Content-Type is the documented one
  response_schema_conformance   the body matches the documented schema
  response_headers_conformance  required headers (Retry-After, Allow) are
                                present and valid
  unsupported_method            a method the path does not list gets 405
  allow_header_conformance      ... whose Allow names the listed methods
A request that gets no answer (a dropped or reset connection, or nothing
within REQUEST_TIMEOUT_S) fails its operation as a network error, and the
router must still be running, with no panic in its log, at the end.

Checks not run, because they judge what the spec documents otherwise:
negative_data_rejection (the schemas count characters, the server bytes:
longer names and clientIds that fit in the byte limits are accepted, as
the LockName schema says), positive_data_acceptance (schema-valid bodies
still get the documented 400 for an undecodable lockId, a fencingToken
that does not belong to it, or a waitMs above the router's max_wait_ms),
missing_required_header and ignored_auth (without `admin.token`, admin
routes answer loopback callers with no token, by design).

Admin routes are included, with the loopback access they have when
`admin.token` is unset (so no Authorization header is generated: a
bearer token sent where none is configured is refused with 403, and the
admin handlers would never run). None of them can change the shard set:
reload re-reads a config file that never changes (200,
`placementChanged: false`); bump-epoch raises the ring epoch of these
throwaway shards (generated `minEpoch` values take it to its maximum,
65535, after which a bump answers the documented 409) and refuses to
initialise a shard that is not empty or not configured (409);
force-release takes generated names from whoever the fuzzer made hold
them. Leaving them in tests the admin answers against the spec too.

The router runs with `limits.max_wait_ms = 1000`: the spec allows waitMs
up to 60000, and a generated acquire that waits for a name the fuzzer
holds would otherwise take a minute. Larger values get the documented
400, so each waiting acquire is bounded to a second.

Bounds and determinism: one worker; at most MAX_EXAMPLES generated
cases per operation in the fuzzing phase and as many stateful scenarios
(the coverage phase adds a fixed, finite set), about 1,700 requests in
all; a fixed seed (printed; API_FUZZ_SEED changes it) and no example
database, so a run repeats the last one's requests; each request given
REQUEST_TIMEOUT_S, and the whole schemathesis run killed after TIMEOUT_S
(it takes about 40 s on two cores, the whole script under a minute). Exclusions of specific checks
or operations, each to be removed once the router bug it names is fixed,
would be listed in EXCLUSIONS below; there are none.

The last line printed is `N passed, N failed`, N counting operations:
one per operation of the spec and one for the stateful run, an operation
failing when any check failed or any request errored for it. Setup
failures (no etcd, a router that does not start) print `0 passed,
1 failed`. The exit status is 0 only when nothing failed.

Environment: LOCKROUTER_BIN (the router binary; default
target/debug/lockrouter), API_FUZZ_SEED, API_FUZZ_MAX_EXAMPLES,
API_FUZZ_TIMEOUT (seconds), API_FUZZ_KEEP=1 (keep the temporary
directory, with the logs, and print where it is).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "docs" / "openapi.yaml"
ETCD_CANDIDATES = ("/usr/bin/etcd", "/usr/local/bin/etcd")
SHARDS = ("a", "b", "c")

SEED = int(os.environ.get("API_FUZZ_SEED", "20261130"))
MAX_EXAMPLES = int(os.environ.get("API_FUZZ_MAX_EXAMPLES", "100"))
TIMEOUT_S = float(os.environ.get("API_FUZZ_TIMEOUT", "150"))
REQUEST_TIMEOUT_S = 10
KEEP = os.environ.get("API_FUZZ_KEEP") == "1"

CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
    "unsupported_method",
    "allow_header_conformance",
)

# Specific exclusions for router bugs not fixed yet: st run arguments
# (`--exclude-operation-id ID`, `--exclude-checks NAME`), each with the bug
# it waits for. Remove an entry when its bug is fixed. None now.
EXCLUSIONS: tuple[tuple[str, ...], ...] = ()

STATEFUL = "Stateful tests"  # schemathesis's JUnit name for the stateful run


class SetupError(Exception):
    """etcd or the router could not be started: the run fails."""


def say(msg: str) -> None:
    print(f"api-fuzz: {msg}", flush=True)


def _port_window() -> tuple[int, int]:
    """(first port, count) of up to 20,000 ports just below the kernel's
    ephemeral range (as the Rust test kit, testkit/src/loopback.rs)."""
    try:
        first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768
    low = max(first - 20_000, 1024)
    return low, max(first - low, 1)


_PORTS = _port_window()
_next_port = itertools.count(random.randrange(_PORTS[1]))


def free_ports(n: int) -> list[int]:
    """`n` loopback ports that were free a moment ago, picked as the Rust
    test kit picks them: below the ephemeral range, so that no connection
    going out (the router's to etcd, the fuzzer's to the router) takes one
    before the process it is for binds it, and in turn from a random
    start, so that no pick of this run repeats an earlier one."""
    low, size = _PORTS
    ports: list[int] = []
    for _ in range(size):
        port = low + next(_next_port) % size
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise SetupError(f"fewer than {n} free loopback ports in {low}..{low + size - 1}")


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG = 1: if this script dies, even by SIGKILL, the
    # child gets SIGKILL too.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


# Loopback only, never through a proxy the environment may name.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_status(url: str) -> tuple[int, bytes] | None:
    try:
        with _HTTP.open(url, timeout=1.0) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, ValueError):
        return None


def tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-n:]
    except OSError as e:
        return f"    (no log: {e})"
    return "\n".join(f"    {line}" for line in lines)


class Child:
    """One child process, its output in a log file."""

    def __init__(self, what: str, argv: list[str], log: Path) -> None:
        self.what, self.log = what, log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_until(self, ready, within: float) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if not self.alive():
                raise SetupError(
                    f"{self.what} exited with status {self.proc.returncode}:\n{tail(self.log)}"
                )
            if ready():
                return
            time.sleep(0.05)
        raise SetupError(f"{self.what} not ready within {within:.0f} s:\n{tail(self.log)}")

    def stop(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; reaps the process."""
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()


def etcd_binary() -> str:
    for p in ETCD_CANDIDATES:
        if os.access(p, os.X_OK):
            return p
    raise SetupError(
        f"etcd missing: neither of {', '.join(ETCD_CANDIDATES)} exists "
        "(Debian: etcd-server; `make prereqs` installs it)"
    )


def router_binary() -> str:
    path = os.environ.get("LOCKROUTER_BIN") or str(REPO / "target" / "debug" / "lockrouter")
    if not os.access(path, os.X_OK):
        raise SetupError(
            f"router binary missing: {path} is not an executable "
            "(`cargo build --bin lockrouter` builds it, as `make test-api-fuzz` does)"
        )
    return path


def start_etcd(workdir: Path, shard: str, ports: tuple[int, int], attempt: int) -> tuple[Child, str]:
    """A one-member etcd cluster for `shard` on the (client, peer) `ports`;
    returns it and its client URL. Each attempt has a data dir of its own."""
    client = f"http://127.0.0.1:{ports[0]}"
    peer = f"http://127.0.0.1:{ports[1]}"
    name = f"api-fuzz-{shard}"
    argv = [
        etcd_binary(),
        "--name", name,
        "--data-dir", str(workdir / f"etcd-{shard}-{attempt}"),
        "--listen-client-urls", client,
        "--advertise-client-urls", client,
        "--listen-peer-urls", peer,
        "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"{name}={peer}",
        "--initial-cluster-token", f"lockrouter-api-fuzz-{shard}",
        "--heartbeat-interval", "50",
        "--election-timeout", "500",
    ]  # fmt: skip
    return Child(f"etcd of shard {shard} on {client}", argv, workdir / f"etcd-{shard}-{attempt}.log"), client


def start_shards(workdir: Path, children: list[Child]) -> dict[str, str]:
    """Every shard's etcd, healthy; returns shard -> client URL. The ports
    are distinct among themselves, but another process on the machine may
    still take one before etcd binds it: an etcd that exits saying so is
    started again on fresh ports, up to three times."""
    ports = free_ports(2 * len(SHARDS))
    started = [
        start_etcd(workdir, shard, (ports[2 * i], ports[2 * i + 1]), 0)
        for i, shard in enumerate(SHARDS)
    ]
    endpoints: dict[str, str] = {}
    for shard, (etcd, url) in zip(SHARDS, started):
        children.append(etcd)
        for attempt in range(1, 4):
            try:
                etcd.wait_until(etcd_healthy(url), 20)
                break
            except SetupError:
                port_taken = b"address already in use" in etcd.log.read_bytes()
                if etcd.alive() or not port_taken or attempt == 3:
                    raise
                say(f"etcd of shard {shard}: its port was taken meanwhile; again on fresh ports")
                client, peer = free_ports(2)
                etcd, url = start_etcd(workdir, shard, (client, peer), attempt)
                children.append(etcd)
        endpoints[shard] = url
    return endpoints


def etcd_healthy(client: str):
    def check() -> bool:
        r = http_status(f"{client}/health")
        return r is not None and r[0] == 200 and b"true" in r[1]

    return check


def router_config(port: int, endpoints: dict[str, str]) -> str:
    text = (
        "# Written by tests/api-fuzz/run.py for one run.\n"
        f'[server]\nlisten = "127.0.0.1:{port}"\nshutdown_grace_ms = 2000\n\n'
        '[etcd]\nprefix = "/lockrouter"\n\n'
        # Bounds a generated waiting acquire (see the header comment).
        "[limits]\nmax_wait_ms = 1000\n"
    )
    for shard, url in endpoints.items():
        text += f'\n[[shards]]\nname = "{shard}"\nendpoints = ["{url}"]\n'
    return text


def spec_operations() -> list[str]:
    """Every operation of the spec, as schemathesis labels them."""
    doc = yaml.safe_load(SPEC.read_text())
    methods = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
    return [
        f"{method.upper()} {path}"
        for path, item in doc["paths"].items()
        for method in item
        if method in methods
    ]


def schemathesis_argv(base_url: str, workdir: Path, junit: Path) -> list[str]:
    st = Path(sys.executable).with_name("st")
    if not os.access(st, os.X_OK):
        raise SetupError(
            f"schemathesis missing: no {st} (run this with the python of the venv "
            "`make test-api-fuzz` makes, target/api-fuzz-venv)"
        )
    # An empty config file of our own: no schemathesis.toml found by
    # searching from the working directory changes what runs.
    config = workdir / "schemathesis.toml"
    config.write_text("")
    argv = [
        str(st), "--no-color", "--config-file", str(config),
        "run", str(SPEC),
        "--url", base_url,
        "--seed", str(SEED),
        "--max-examples", str(MAX_EXAMPLES),
        "--workers", "1",
        "--phases", "examples,coverage,fuzzing,stateful",
        "--checks", ",".join(CHECKS),
        "--continue-on-failure",
        "--request-timeout", str(REQUEST_TIMEOUT_S),
        "--request-retries", "0",
        "--generation-database", "none",
        # No generated Authorization headers: admin routes are fuzzed with
        # the loopback access they have without `admin.token` (a bearer
        # token, any token, is refused there when none is configured), and
        # no principals are configured for the lock routes.
        "--generation-with-security-parameters", "false",
        # Nothing secret is sent; keep fencingTokens readable in the
        # reproductions.
        "--output-sanitize", "false",
        "--report", "junit",
        "--report-junit-path", str(junit),
    ]  # fmt: skip
    for exclusion in EXCLUSIONS:
        argv += exclusion
    return argv


def junit_results(junit: Path) -> dict[str, bool]:
    """Operation label -> passed, from schemathesis's JUnit report."""
    results: dict[str, bool] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        results[case.get("name", "?")] = not failed
    return results


def run_schemathesis(base_url: str, workdir: Path, router: Child) -> tuple[int, int]:
    """Runs st against the router; returns (passed, failed)."""
    junit = workdir / "junit.xml"
    argv = schemathesis_argv(base_url, workdir, junit)
    env = {
        k: v
        for k, v in os.environ.items()
        if k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")
    }
    env["NO_PROXY"] = "127.0.0.1,localhost"
    say(f"schemathesis: seed {SEED}, at most {MAX_EXAMPLES} examples per operation, "
        f"checks {', '.join(CHECKS)}")
    say("$ " + " ".join(argv))
    sys.stdout.flush()
    st = subprocess.Popen(
        argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent
    )
    try:
        code: int | None = st.wait(TIMEOUT_S)
    except subprocess.TimeoutExpired:
        say(f"FAIL: schemathesis did not finish within {TIMEOUT_S:.0f} s (API_FUZZ_TIMEOUT)")
        code = None
    finally:
        if st.poll() is None:
            st.kill()
        st.wait()

    failures: list[str] = []
    results: dict[str, bool] = {}
    if code is not None:
        try:
            results = junit_results(junit)
        except (OSError, ET.ParseError) as e:
            failures.append(f"schemathesis (exit status {code}) left no readable report: {e}")
    excluded = {e[1] for e in EXCLUSIONS if e[0] == "--exclude-operation-id"}
    expected = [op for op in spec_operations() if op not in excluded] + [STATEFUL]
    for op, ok in results.items():
        if not ok:
            failures.append(f"{op}: failed (see above)")
    for op in expected:
        if op not in results and code is not None:
            failures.append(f"{op}: not tested")
            results[op] = False
    if code is None:
        failures.append("schemathesis timed out")
    elif code != 0 and all(results.values()):
        failures.append(f"schemathesis exited with status {code}")

    if not router.alive():
        status = router.proc.returncode
        failures.append(f"the router exited during the run, status {status}:\n{tail(router.log)}")
    else:
        health = http_status(f"{base_url}/healthz")
        if health is None or health[0] != 200:
            failures.append(f"the router no longer answers /healthz: {health}")
    panics = [
        line for line in router.log.read_text(errors="replace").splitlines() if "panicked" in line
    ]
    if panics:
        failures.append("the router panicked:\n" + "\n".join(f"    {p}" for p in panics[:20]))

    for f in failures:
        say(f"FAIL: {f}")
    if failures and router.log.exists():
        say(f"router log, last lines:\n{tail(router.log)}")
    passed = sum(1 for ok in results.values() if ok)
    # Failures that belong to no operation (a timeout, a dead router)
    # count once.
    failed = sum(1 for ok in results.values() if not ok)
    if failures and failed == 0:
        failed = 1
    return passed, failed


def main() -> int:
    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    workdir = Path(tempfile.mkdtemp(prefix="lockrouter-api-fuzz-"))
    children: list[Child] = []
    passed, failed = 0, 1
    try:
        started = time.monotonic()
        endpoints = start_shards(workdir, children)

        (port,) = free_ports(1)
        base_url = f"http://127.0.0.1:{port}"
        config = workdir / "router.toml"
        config.write_text(router_config(port, endpoints))
        router = Child(
            f"router on {base_url}",
            [router_binary(), "serve", "--config", str(config)],
            workdir / "router.log",
        )
        children.append(router)

        def ready() -> bool:
            r = http_status(f"{base_url}/readyz")
            return r is not None and r[0] == 200

        router.wait_until(ready, 30)
        say(f"etcd shards {', '.join(SHARDS)} and the router on {base_url} ready "
            f"in {time.monotonic() - started:.1f} s")
        passed, failed = run_schemathesis(base_url, workdir, router)
    except SetupError as e:
        say(f"FAIL: {e}")
    except Exception:  # a bug of this script fails the run, with its traceback
        traceback.print_exc()
        say("FAIL: the runner itself failed")
    finally:
        for child in reversed(children):
            child.stop(grace=5)
        if KEEP:
            say(f"kept {workdir} (logs, router config, junit.xml)")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        # Also when a signal ends the run: CI reads this line.
        print(f"{passed} passed, {failed} failed", flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
