"""A worker that writes to a fenced SQLite table under a lockrouter lock:
the fencing story end to end, runnable by hand and used by the tests.

    python examples/fenced_worker.py --router http://127.0.0.1:8080 \\
        --db /tmp/orders.db --name order:42 --ttl 2 --writes 20

Every write carries the lock's fencing token, and the table (``FencedStore``)
rejects a write whose token is lower than the highest it has accepted. To
show that this, not the client's vigilance, keeps the data right, the worker
does not check ``is_held()`` before writing: it behaves like a process that
checked and was then paused. A real worker stops writing when ``lock.lost``
is set; this one tries ``--writes-after-lost`` more times so the rejections
can be seen. Each event is a JSON line on stdout. Exit status: 0 when done,
75 when someone else holds the lock, 79 when the lock was lost.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import time
from typing import Any

import lockrouter
from lockrouter.fencing import sqlite_admit, sqlite_create_fences

EX_TEMPFAIL = 75
EX_LOST = 79


class FencedStore:
    """An SQLite database that appends to ``writes`` only under a token not
    older than every token the resource has accepted. The check and the
    write are one ``IMMEDIATE`` transaction; several processes may share
    the file."""

    def __init__(self, path: str) -> None:
        # Writers from several processes queue on SQLite's file lock.
        self.conn = sqlite3.connect(path, timeout=10, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        sqlite_create_fences(self.conn)
        self.conn.execute(
            "CREATE TABLE IF NOT EXISTS writes ("
            " seq INTEGER PRIMARY KEY AUTOINCREMENT, resource TEXT NOT NULL,"
            " token INTEGER NOT NULL, payload TEXT NOT NULL)"
        )

    def write(self, resource: str, token: int, payload: str) -> int | None:
        """Appends ``payload``; None if accepted, else the highest token the
        resource had accepted (and nothing was changed)."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            highest = sqlite_admit(self.conn, resource, token)
            if highest is not None:
                self.conn.execute("ROLLBACK")
                return highest
            self.conn.execute(
                "INSERT INTO writes (resource, token, payload) VALUES (?, ?, ?)",
                (resource, token, payload),
            )
            self.conn.execute("COMMIT")
            return None
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise


def emit(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--router", required=True)
    p.add_argument("--db", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--ttl", type=float, default=2.0, help="seconds")
    p.add_argument("--wait", type=float, default=0.0, help="seconds to queue for the lock")
    p.add_argument("--client-id")
    p.add_argument("--interval", type=float, default=0.2, help="seconds between writes")
    p.add_argument("--writes", type=int, help="stop and release after this many (default: until lost)")
    p.add_argument("--writes-after-lost", type=int, default=3)
    args = p.parse_args(argv)

    store = FencedStore(args.db)
    with lockrouter.Client(args.router, client_id=args.client_id) as client:
        lock = client.try_acquire(args.name, ttl=args.ttl, wait=args.wait)
        if lock is None:
            emit({"event": "busy", "name": args.name})
            return EX_TEMPFAIL
        emit({"event": "acquired", "name": args.name, "token": lock.fencing_token})
        seq, after_lost = 0, 0
        while args.writes is None or seq < args.writes:
            seq += 1
            token = lock.fencing_token
            highest = store.write(args.name, token, f"{lock.client_id}:{seq}")
            event: dict[str, Any] = {"event": "write", "seq": seq, "token": token}
            event["accepted"] = highest is None
            if highest is not None:
                event["highest"] = highest
            emit(event)
            if lock.lost.is_set():
                after_lost += 1
                if after_lost > args.writes_after_lost:
                    reason = lock.lost_reason
                    emit({"event": "lost", "reason": reason.describe() if reason else None})
                    return EX_LOST
            time.sleep(args.interval)
        lock.release()
        emit({"event": "released"})
        return 0


if __name__ == "__main__":
    sys.exit(main())
