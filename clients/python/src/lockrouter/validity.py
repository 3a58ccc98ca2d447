"""The validity clock: how long the client may trust a lock, judged only by
this process's own monotonic clock (``time.monotonic()``).

``valid_until = instant taken just before sending + expiresInMs - margin``.
The router's ``expiresInMs`` never overstates the lease (it counts from when
the router asked etcd) and the instant is taken before the request left, so
network and queueing delays only make the estimate earlier. The margin
absorbs clock-rate differences between machines and the time the caller
needs to act on a lost lock. The wall-clock ``expiresAt`` is never used:
wall clocks jump. Pure functions; the same rules as the Rust SDK's
``validity.rs``.
"""

from __future__ import annotations

import random
import time

#: The smallest margin ever used, whatever the TTL or configuration.
MIN_MARGIN = 0.1
#: Longest pause between retries of a failed renewal, or of a release while
#: the lock is still valid.
MAX_BACKOFF = 2.0
#: The most locks one ``renew-batch`` call may carry (the API's limit).
MAX_BATCH = 1000


def now() -> float:
    """The clock every validity is judged by."""
    return time.monotonic()


def margin(ttl: float, configured: float | None = None) -> float:
    """The safety margin for a lock of ``ttl`` seconds: the configured one,
    else ttl/10, never below :data:`MIN_MARGIN`."""
    return max(ttl / 10 if configured is None else configured, MIN_MARGIN)


def valid_until(sent_at: float, expires_in: float, margin: float) -> float:
    """Until when a lock confirmed by an answer to a request sent at
    ``sent_at`` may be trusted."""
    return sent_at + max(expires_in - margin, 0.0)


def renew_interval(ttl: float) -> float:
    """How often held locks are renewed: a third of the TTL, so two renewals
    can fail before validity runs out."""
    return max(ttl / 3, 0.05)


def next_renewal(confirmed_at: float, valid_until: float, interval: float) -> float:
    """When to renew a lock confirmed at ``confirmed_at``: an interval later,
    or sooner if less than an interval of validity would be left by then."""
    return min(confirmed_at + interval, max(valid_until - interval, confirmed_at))


def backoff(failures: int, cap: float) -> float:
    """The pause before retry number ``failures`` (1-based): exponential from
    100 ms, capped at ``cap``, with jitter in the upper half so clients of a
    recovering router do not retry in step."""
    exp = 0.1 * (2 ** min(max(failures - 1, 0), 16))
    top = max(min(exp, cap), 0.01)
    return random.uniform(top / 2, top)


def retry_pause(failures: int, cap: float, retry_after: float | None) -> float:
    """The pause before retry number ``failures``: :func:`backoff`, or the
    wait the router asked for (its ``Retry-After``) when that is longer."""
    return max(backoff(failures, cap), retry_after or 0.0)


def renewal_pause(failures: int, cap: float, retry_after: float | None, left: float) -> float:
    """The pause before retry number ``failures`` of a failed renewal whose
    answer asked for ``retry_after`` (the router's ``Retry-After``): the
    :func:`backoff`, or the router's wait when that is longer and fits the
    schedule: no longer than ``cap`` (the longest pause the backoff takes
    anyway) and over before the lock's validity, ``left`` seconds away, runs
    out. A wait that does not fit is not taken at all: the plain backoff
    keeps the renewals a lock's validity was planned around, and the router
    keeps a share of its capacity for renewals, which no surge of acquires
    takes. (The Rust and TypeScript SDKs pause the same way.)"""
    pause = backoff(failures, cap)
    if retry_after is not None and retry_after <= cap and retry_after < left:
        return max(pause, retry_after)
    return pause
