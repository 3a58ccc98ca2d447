"""The paused-process story end to end: a worker subprocess
(``examples/fenced_worker.py``) holding a lock is SIGSTOPped past its TTL;
another client acquires the name and writes with a higher token; when the
worker resumes, its writes are rejected by the SQLite fencing table, and it
learns it lost the lock."""

from __future__ import annotations

import json
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lockrouter
from harness import Router, _die_with_parent

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
from fenced_worker import EX_LOST, FencedStore  # noqa: E402


class Worker:
    """The example worker as a child process, its JSON events on a queue."""

    def __init__(self, router: Router, db: Path, name: str) -> None:
        argv = [sys.executable, str(EXAMPLES / "fenced_worker.py"), "--router", router.url,
                "--db", str(db), "--name", name, "--ttl", "2", "--interval", "0.2",
                "--writes-after-lost", "3"]  # fmt: skip
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.put(json.loads(line))

    def next_event(self, within: float = 10) -> dict[str, Any]:
        return self.events.get(timeout=within)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


def db_is_free(db: Path) -> bool:
    conn = sqlite3.connect(db, timeout=0, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        conn.close()


def pause_between_writes(w: Worker, db: Path) -> None:
    """SIGSTOPs the worker while it holds no SQLite write lock, so the next
    holder's write is judged by the fence, not stuck behind a paused one."""
    for _ in range(20):
        assert w.next_event()["event"] == "write"
        os.kill(w.proc.pid, signal.SIGSTOP)
        time.sleep(0.05)
        if db_is_free(db):
            return
        os.kill(w.proc.pid, signal.SIGCONT)
    raise AssertionError("never caught the worker between writes")


def test_a_paused_worker_is_fenced_out_by_the_table_and_learns_it_lost_the_lock(
    router: Router, tmp_path: Path
) -> None:
    db = tmp_path / "orders.db"
    worker = Worker(router, db, "order:42")
    try:
        acquired = worker.next_event()
        assert acquired["event"] == "acquired", acquired
        token_a = acquired["token"]
        first = worker.next_event()
        assert first["accepted"] is True and first["token"] == token_a
        pause_between_writes(worker, db)

        with lockrouter.Client(router.url) as b:
            # B waits out A's lease (A is stopped: nothing renews it).
            lock = b.acquire("order:42", ttl=2, wait=15)
            token_b = lock.fencing_token
            assert token_b > token_a
            store = FencedStore(str(db))
            assert store.write("order:42", token_b, "B:1") is None
            assert store.write("order:42", token_a, "stale") == token_b, "the table fences A"

            os.kill(worker.proc.pid, signal.SIGCONT)
            after: list[dict[str, Any]] = []
            while True:
                e = worker.next_event()
                after.append(e)
                if e["event"] == "lost":
                    break
            assert worker.proc.wait(10) == EX_LOST
            writes = [e for e in after if e["event"] == "write"]
            assert writes, "A tried to write after resuming"
            assert all(not w["accepted"] and w["highest"] == token_b for w in writes), writes
            assert after[-1]["reason"] == "validity ran out without a confirmed renewal"
            lock.release()

        rows = sqlite3.connect(db).execute(
            "SELECT token, payload FROM writes WHERE resource = 'order:42' ORDER BY seq"
        ).fetchall()
        b_at = rows.index((token_b, "B:1"))
        assert all(t == token_a for t, _ in rows[:b_at]), rows
        assert rows[b_at:] == [(token_b, "B:1")], "nothing from A after B's write"
    finally:
        worker.stop()
