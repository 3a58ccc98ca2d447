"""Python client for lockrouter, the HTTP lock router over sharded etcd.

A lock from lockrouter is a lease with a fencing token. This package holds
such leases for you: each client renews all its locks in the background
with one ``renew-batch`` request per interval, judges each lock's validity
with this process's own monotonic clock (never the router's wall-clock
``expiresAt``), and tells your code the moment a lock can no longer be
trusted (``lock.lost``). The fencing token (``lock.fencing_token``) is what
makes the lock safe: send it with every write and let the resource reject
stale ones (:mod:`lockrouter.fencing`)::

    import lockrouter

    with lockrouter.Client("http://127.0.0.1:8080") as client:
        with client.lock("process_order:42", ttl=30) as lock:
            write_order(42, fencing_token=lock.fencing_token)

Layout, top to bottom (a module imports only from those below it):

- ``client`` / ``aio``: :class:`Client`, :class:`Lock` (threads) and
  :class:`AsyncClient`, :class:`AsyncLock` (asyncio): acquiring, releasing,
  and the one renewal loop per client that drives the schedule.
- ``_common``: what both clients share: argument checks, client ids, the
  I/O-free parts of acquiring and releasing.
- ``_schedule``: the renewal loop's decisions without I/O: what is due, in
  batches of at most 1,000, what each answer means, backoff.
- ``_holds``: one hold of a name at a time within a client (its threads
  and tasks exclude each other), or counted re-entrant holds when asked.
- ``_state``: one shared state per grant (validity, loss, release) and the
  registry that keeps it.
- ``_transport``: the v1 HTTP API over httpx (sync and async).
- Leaves: ``errors`` (typed exceptions, :class:`LostReason`), ``validity``
  (the clock rules) and ``fencing`` (what the protected resource must do).
"""

from .aio import AsyncClient, AsyncLock, AsyncLockContext
from .client import Client, Lock, LockContext
from .errors import (
    Cancelled,
    ClientClosed,
    ConfigError,
    LockLost,
    LockrouterError,
    LostReason,
    NotAcquired,
    RouterError,
    TransportError,
)
from ._transport import LockInfo
from .validity import MAX_BATCH, MIN_MARGIN

__all__ = [
    "MAX_BATCH",
    "MIN_MARGIN",
    "AsyncClient",
    "AsyncLock",
    "AsyncLockContext",
    "Cancelled",
    "Client",
    "ClientClosed",
    "ConfigError",
    "Lock",
    "LockContext",
    "LockInfo",
    "LockLost",
    "LockrouterError",
    "LostReason",
    "NotAcquired",
    "RouterError",
    "TransportError",
]

__version__ = "0.1.0"
