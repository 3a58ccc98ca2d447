"""What the sync and async clients share besides the schedule: argument
checks, client ids, and the pieces of an acquire and a release that do no
I/O, so both clients follow one set of rules.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import math
import secrets
from typing import Any, Callable, Union

from . import validity
from ._holds import Holds
from ._state import Claim, LockState, Registry
from ._transport import Acquired, LockRef, Renewed
from .errors import ClientClosed, ConfigError, LockLost, LostReason, RouterError, TransportError

log = logging.getLogger("lockrouter")

Seconds = Union[float, int, datetime.timedelta]

#: How many times an acquire asks again when its answer is a grant this
#: client is still releasing (it waits for the release in between).
ACQUIRE_ROUNDS = 3
#: How often a waiting acquire polls a racing release.
SETTLE_POLL = 0.02


def seconds(value: Seconds, what: str) -> float:
    s = value.total_seconds() if isinstance(value, datetime.timedelta) else float(value)
    if not math.isfinite(s) or s < 0:
        raise ConfigError(f"{what} {value!r} out of range")
    return s


#: The longest wait asked of the router at once, until it refuses one as too
#: long: its default ``limits.max_wait_ms``. A longer wait queues again.
WAIT_CHUNK = 60.0
#: The shortest: a router whose cap is below it refuses every wait.
MIN_WAIT_CHUNK = 0.5


def wait_seconds(wait: Seconds | None) -> float:
    """``wait`` in seconds; ``None`` waits for as long as it takes."""
    return math.inf if wait is None else seconds(wait, "wait")


def smaller_chunk(e: RouterError, asked: float) -> float | None:
    """The next wait to ask for when the router refused ``asked`` as longer
    than its ``limits.max_wait_ms``, or None if ``e`` is another refusal."""
    if e.status == 400 and "waitMs" in e.message and asked > MIN_WAIT_CHUNK:
        return max(asked / 2, MIN_WAIT_CHUNK)
    return None


def calling_safely(name: str, callback: Callable[[LostReason], Any]) -> Callable[[LostReason], None]:
    """``callback`` as a loss listener: what it raises is logged, never let
    into the renewal loop that calls it."""

    def call(reason: LostReason) -> None:
        try:
            callback(reason)
        except Exception:
            log.exception("the on_lost callback of %r raised", name)

    return call


def extended(state: LockState, r: Renewed, sent_at: float) -> float:
    """Applies an ``extend``'s renewal to ``state``: seconds of validity it
    has now, or :class:`LockLost` (marking it lost)."""
    try:
        state.confirm(confirmation(state.name, r, sent_at, state.margin))
    except LockLost as e:
        state.mark_lost(e.reason)
        raise
    reason = state.lost_now()
    if reason is not None:
        raise LockLost(state.name, reason)
    return state.time_left()


def moved(grants: Grants, state: LockState, r: Renewed, ttl: float, sent_at: float, generation: int) -> bool:
    """Applies the answer to an extend to another TTL: True if the lock
    moved to its new lockId and TTL (its renewals must follow), False if
    not (a 409 marks it lost, as a renewal's would)."""
    if r.renewed and r.expires_in is not None and r.lock_id:
        margin = validity.margin(ttl, grants.margin)
        ref = LockRef(r.lock_id, state.ref.fencing_token)
        until = validity.valid_until(sent_at, r.expires_in, margin)
        return grants.registry.switch(state, ref, ttl, margin, until)
    reason = LostReason.STOLEN if r.reason == "stolen" else LostReason.EXPIRED
    state.apply_renewal(generation, None, reason)
    return False


def still_held(state: LockState) -> float:
    """Seconds of validity ``state`` has, or :class:`LockLost`."""
    reason = state.lost_now()
    if reason is not None:
        raise LockLost(state.name, reason)
    return state.time_left()


def ttl_ms(ttl: float) -> int:
    ms = math.ceil(ttl * 1000)
    if ms <= 0:
        raise ConfigError(f"ttl {ttl!r} out of range (the router takes 2 s to 1 h)")
    return ms


def random_id() -> str:
    """128 random bits: two processes sharing a client id would share locks,
    so a guessable or colliding id is not acceptable."""
    return secrets.token_hex(16)


def check_client_id(client_id: str | None) -> str:
    if client_id is None:
        return random_id()
    if not client_id:
        raise ConfigError("empty client id")
    return client_id


class Grants:
    """A client's registry, its holds, and the numbering of its locks."""

    def __init__(self, margin: float | None) -> None:
        self.registry = Registry()
        self.holds = Holds()
        #: The longest wait the router accepts at once, as far as this
        #: client knows (it shrinks when the router refuses one).
        self.wait_chunk = WAIT_CHUNK
        self.margin = margin
        self._keys = itertools.count()

    def first_validity(self, sent_at: float, got: Acquired, ttl: float) -> tuple[float, float]:
        """The margin and validity of a fresh grant."""
        m = validity.margin(ttl, self.margin)
        return m, validity.valid_until(sent_at, got.expires_in, m)

    def claim(
        self, name: str, ttl: float, margin: float, got: Acquired, until: float, client_id: str
    ) -> tuple[Claim, LockState | None]:
        def make() -> LockState:
            return LockState(next(self._keys), name, got.ref, ttl, margin, until, client_id)

        return self.registry.claim(got.ref.lock_id, until, make)


def confirmation(name: str, r: Renewed, sent_at: float, margin: float) -> float:
    """The validity a confirming renewal proves, or :class:`LockLost`."""
    if r.renewed and r.expires_in is not None:
        return validity.valid_until(sent_at, r.expires_in, margin)
    reason = LostReason.STOLEN if r.reason == "stolen" else LostReason.EXPIRED
    raise LockLost(name, reason)


def not_settled(name: str) -> TransportError:
    return TransportError(f"this client's earlier release of {name!r} has not got through yet")


def unconfirmed_release(name: str) -> TransportError:
    return TransportError(f"the release of {name!r} was not confirmed within its validity")


def closed_before_release(name: str) -> ClientClosed:
    return ClientClosed(
        f"the client is closed and its release of {name!r} was not confirmed; "
        "nothing renews the lock any more, so it expires at its TTL"
    )


def closed_during_acquire(name: str) -> ClientClosed:
    return ClientClosed(f"the client was closed during the acquire of {name!r}")


def release_pace(state: LockState) -> float:
    return min(validity.MAX_BACKOFF, validity.renew_interval(state.ttl))
