"""Fencing for resource owners: how the protected resource makes a lock safe.

A lock alone is never safe. The holder can pause (GC, swap, VM migration,
``SIGSTOP``) after checking ``lock.is_held()`` and before its write lands;
meanwhile its lease expires and another worker gets the lock. When the first
one resumes, its write arrives late. The only defence is at the resource:
every grant of a name carries a fencing token larger than every earlier
grant's, each write carries the token it was made under, and the resource
remembers the highest token it has accepted and **atomically** rejects
writes with a lower one.

In SQL, keep the highest token next to the data and make the write itself
conditional, in one statement, so check and write cannot be separated::

    UPDATE orders SET status = :status, fence = :token
     WHERE id = :id AND fence <= :token;
    -- 1 row changed: accepted. 0 rows: a newer holder has written; stop.

``<=`` lets the current holder write many times under one grant and makes a
retried write succeed; use ``<`` only when each grant may write once. Either
way a lower token is always rejected, which is the safety part.

:func:`sqlite_admit` does this for SQLite with a ``fences`` table beside
your data; :class:`Fence` is the same for a resource inside one process;
:data:`HEADER` names the HTTP header for a service you own (check it where
the write commits, not at the door).
"""

from __future__ import annotations

import sqlite3
import threading

__all__ = [
    "HEADER",
    "Fence",
    "Stale",
    "admits",
    "as_i64",
    "fence_key_value",
    "sqlite_admit",
    "sqlite_create_fences",
]

#: The HTTP header this project uses to pass a fencing token to a service.
HEADER = "Lockrouter-Fencing-Token"

_I64_MAX = 2**63 - 1


class Stale(Exception):
    """A write carried a token lower than one the resource already accepted."""

    def __init__(self, token: int, highest: int) -> None:
        super().__init__(f"stale fencing token {token}: the resource has accepted {highest}")
        self.token = token
        self.highest = highest


def admits(highest: int | None, token: int) -> bool:
    """Whether a write with ``token`` may proceed when the resource has
    accepted ``highest`` so far (None: never written). Equal tokens are
    admitted: the same grant may write again."""
    return highest is None or token >= highest


def as_i64(token: int) -> int:
    """The token as a SQL ``BIGINT``; lockrouter's tokens always fit.
    Raises ValueError for a value that did not come from a router."""
    if not 0 <= token <= _I64_MAX:
        raise ValueError(f"fencing token {token} does not fit a signed 64-bit integer")
    return token


def fence_key_value(token: int) -> str:
    """20 zero-padded digits, so comparing bytes (as etcd's value compares
    do) orders tokens numerically."""
    return f"{as_i64(token):020d}"


class Fence:
    """An in-memory fence: the highest token accepted so far, advanced
    atomically. For resources that live in one process."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._highest = 0

    def admit(self, token: int) -> None:
        """Accepts ``token`` and raises the fence to it, or raises
        :class:`Stale`. Do the protected write only after it returned, under
        the same mutual exclusion if the write is not atomic with it."""
        with self._mu:
            if token < self._highest:
                raise Stale(token, self._highest)
            self._highest = token

    @property
    def highest(self) -> int:
        with self._mu:
            return self._highest


def sqlite_create_fences(conn: sqlite3.Connection, table: str = "fences") -> None:
    """Creates the table that keeps the highest token per resource."""
    conn.execute(
        f'CREATE TABLE IF NOT EXISTS "{table}" ('
        " resource TEXT PRIMARY KEY, fence INTEGER NOT NULL)"
    )


def sqlite_admit(
    conn: sqlite3.Connection, resource: str, token: int, table: str = "fences"
) -> int | None:
    """The fencing check of one write, inside the caller's write transaction
    (``BEGIN IMMEDIATE``): raises the resource's fence to ``token`` and
    returns None if no higher token was accepted before, else changes
    nothing and returns the highest accepted token. Commit the protected
    write in the same transaction only when this returned None; roll back
    otherwise. The check is the ``WHERE fence <= ?`` of the update itself,
    so no interleaving of writers can slip a stale write in."""
    t = as_i64(token)
    conn.execute(
        f'INSERT INTO "{table}" (resource, fence) VALUES (?, 0) ON CONFLICT (resource) DO NOTHING',
        (resource,),
    )
    cur = conn.execute(
        f'UPDATE "{table}" SET fence = ? WHERE resource = ? AND fence <= ?', (t, resource, t)
    )
    if cur.rowcount == 1:
        return None
    row = conn.execute(f'SELECT fence FROM "{table}" WHERE resource = ?', (resource,)).fetchone()
    return int(row[0]) if row else 0
