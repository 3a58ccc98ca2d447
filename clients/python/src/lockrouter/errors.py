"""Typed failures: one exception class per thing a caller does differently.

Everything the SDK raises derives from :class:`LockrouterError`, so callers
can tell "someone else holds it" (:class:`NotAcquired`) from "the lock was
lost" (:class:`LockLost`) from "the router said no" (:class:`RouterError`)
from "the router could not be reached" (:class:`TransportError`) from "the
client is closed" (:class:`ClientClosed`) from "the caller cancelled the
wait" (:class:`Cancelled`). No exception of httpx, the HTTP library
underneath, leaves the SDK. This module imports nothing else of the
package.
"""

from __future__ import annotations

import enum


class LostReason(str, enum.Enum):
    """Why a lock can no longer be trusted."""

    #: The router reported the lock gone: its lease ran out, or it was
    #: released (by another client under the same client id, say).
    EXPIRED = "expired"
    #: The router reported that another holder has the name now.
    STOLEN = "stolen"
    #: This process's monotonic clock passed the lock's validity without a
    #: confirmed renewal (router unreachable, shard unavailable, or the
    #: process was paused). The lease may still exist; nobody can prove it.
    UNCONFIRMED = "unconfirmed"
    #: The router refused to renew the lock (a 4xx on the lock itself).
    REFUSED = "refused"
    #: This client released it (``release()``, the end of a ``with`` block,
    #: or the ``Lock`` was garbage-collected).
    RELEASED = "released"

    def describe(self) -> str:
        return {
            LostReason.EXPIRED: "expired",
            LostReason.STOLEN: "stolen by another holder",
            LostReason.UNCONFIRMED: "validity ran out without a confirmed renewal",
            LostReason.REFUSED: "the router refused to renew it",
            LostReason.RELEASED: "released",
        }[self]


class LockrouterError(Exception):
    """Base class of every error this SDK raises."""

    @property
    def retryable(self) -> bool:
        """True when the same request may succeed later (transport
        failures, 408, 429 and 5xx answers)."""
        return False


class ConfigError(LockrouterError, ValueError):
    """The client was set up or called wrongly (bad URL, TTL out of range,
    a closed client)."""


class ClientClosed(ConfigError):
    """The client is closed: it sends nothing more, and retrying cannot
    help. Raised by an acquire after ``close()`` (or on its way when the
    client closed), and by ``release()`` of a lock whose release ``close()``
    could not confirm (the router was unreachable, say). Nothing renews
    such a lock any more: it expires at its TTL."""


class NotAcquired(LockrouterError):
    """Another client holds the lock (or others are queued for it), and the
    wait, if any, ran out."""

    def __init__(self, name: str) -> None:
        super().__init__(f"lock {name!r} is held by another client")
        self.name = name


class Cancelled(LockrouterError):
    """A sync acquire's ``cancel`` event was set before the router granted
    the name: nothing was acquired, and the router dropped the waiter with
    the request. (An ``AsyncClient`` wait is cancelled with its task and
    raises ``asyncio.CancelledError`` instead.)"""

    def __init__(self, name: str) -> None:
        super().__init__(f"the acquire of {name!r} was cancelled")
        self.name = name


class LockLost(LockrouterError):
    """The lock was lost while work ran under it, or (from ``release()``)
    its grant has passed to a newer ``Lock`` of this client."""

    def __init__(self, name: str, reason: LostReason) -> None:
        super().__init__(f"lock {name!r} was lost: {reason.describe()}")
        self.name = name
        self.reason = reason


class RouterError(LockrouterError):
    """The router answered with an error: ``status`` and the API's stable
    ``code`` (``invalid_argument``, ``shard_unavailable``, ...).

    ``retry_after`` is how many seconds the router asked the caller to wait
    before trying again: its ``Retry-After`` header, which it sends with
    503 ``overloaded`` and ``shard_unavailable`` and 429 ``rate_limited``,
    among others. None when the answer named no wait, or one in a form
    other than whole seconds (an HTTP-date, say)."""

    def __init__(self, status: int, code: str, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(f"router answered {status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after

    @property
    def retryable(self) -> bool:
        # 408: the router gave up reading the request, so it did nothing.
        return self.status in (408, 429) or self.status >= 500


class TransportError(LockrouterError):
    """No answer: connection refused or reset, TLS failure, timeout."""

    @property
    def retryable(self) -> bool:
        return True
