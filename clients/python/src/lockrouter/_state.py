"""The state every ``Lock`` of one grant shares, and the registry that keeps
one state per grant in a client.

A grant's state holds its identity (name, lockId, fencing token), its
validity as this process's monotonic clock judges it, why it was lost, and
where its release stands. The renewal loop moves validity forward and
records losses; readers also compare validity with the clock themselves, so
a lock is lost on time even when the loop is starved or the router is
unreachable. Validity only moves forward, the first loss reason is the one
that stays, and a lost lock is never revived.

The router answers an acquire of a name this client already holds with the
same grant, so two ``Lock`` objects can stand for one lock: the registry
hands them one shared state, so they can never disagree (one released, the
other still "held"). Every method is safe to call from any thread (the sync
client's renewal thread, garbage-collector finalizers, the caller's).
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
import weakref
from typing import Callable

from . import validity
from ._transport import LockRef
from .errors import LostReason


class Release(enum.Enum):
    """Where a grant's release at the router stands."""

    NOT_STARTED = "not_started"
    PENDING = "pending"  # under way, in release() or in the renewal loop
    DONE = "done"  # the router confirmed (204)
    GAVE_UP = "gave_up"  # the router refused it; retrying cannot help


class LockState:
    """What every view of one grant shares."""

    def __init__(
        self,
        key: int,
        name: str,
        ref: LockRef,
        ttl: float,
        margin: float,
        valid_until: float,
        client_id: str,
    ) -> None:
        #: Identifies the lock within its client's renewal loop.
        self.key = key
        self.name = name
        #: lockId and token; ``ttl`` and ``margin`` go with it. An extend to
        #: another TTL replaces all three (under ``_mu``) and bumps
        #: ``generation``: a renewal answer is applied only under the
        #: generation it was sent with, since the replaced lockId answers
        #: ``stolen`` once the lock has moved.
        self.ref = ref
        self.ttl = ttl
        self.margin = margin
        self.generation = 0
        self.client_id = client_id
        # A plain lock: held only for a read or an update, never across I/O.
        self._mu = threading.Lock()
        #: Held by an extend for its whole request and by each release
        #: attempt, so the two never cross on the wire (a release sent with
        #: the lockId an extend replaces frees nothing). The sync client's
        #: is a thread lock, the async client's an asyncio one.
        self.moving = threading.Lock()
        self._moving_async: asyncio.Lock | None = None
        self._valid_until = valid_until
        self._lost: LostReason | None = None
        self._release = Release.NOT_STARTED
        self._listeners: list[Callable[[LostReason], None]] = []

    @property
    def moving_async(self) -> asyncio.Lock:
        if self._moving_async is None:
            self._moving_async = asyncio.Lock()
        return self._moving_async

    def grant(self) -> tuple[LockRef, int]:
        """The lockId and token to send now, and their generation."""
        with self._mu:
            return self.ref, self.generation

    def switch(self, ref: LockRef, ttl: float, margin: float, valid_until: float) -> tuple[str, bool]:
        """Moves the lock to the lockId and TTL an extend answered, valid
        until ``valid_until`` (set, not only moved forward: the lock now
        rides the new TTL's lease, which may end before the old one). A
        lock lost meanwhile (released, or its validity out) moves too but
        stays lost, with no new validity: the router holds it under the new
        lockId now, and its release must name that one (the old one frees
        nothing). Returns the replaced lockId and whether the lock is still
        live. Only the registry calls it, so its entry moves in the same
        step."""
        live = self.lost_now() is None
        with self._mu:
            live = live and self._lost is None
            old = self.ref.lock_id
            self.ref, self.ttl, self.margin = ref, ttl, margin
            self.generation += 1
            if live:
                self._valid_until = valid_until
            return old, live

    def apply_renewal(self, generation: int, valid_until: float | None, lost: LostReason | None) -> bool | None:
        """A renewal answer, applied only if the lock is still the
        ``generation`` it was sent under (checked and applied in one step,
        so that a switch cannot come between): True when it confirmed
        ``valid_until``, False when it marked the lock lost with ``lost``,
        None for a stale answer (nothing applied)."""
        listeners: list[Callable[[LostReason], None]] = []
        with self._mu:
            if self.generation != generation:
                return None
            if valid_until is not None:
                if self._lost is None and validity.now() < self._valid_until < valid_until:
                    self._valid_until = valid_until
                return True
            if self._lost is None and lost is not None:
                self._lost = lost
                listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener(lost)  # type: ignore[arg-type]
        return False

    @property
    def valid_until(self) -> float:
        with self._mu:
            return self._valid_until

    @property
    def release(self) -> Release:
        with self._mu:
            return self._release

    def on_lost(self, listener: Callable[[LostReason], None]) -> None:
        """Calls ``listener(reason)`` once the lock is lost (at once if it
        is already). Listeners must not block."""
        with self._mu:
            reason = self._lost
            if reason is None:
                self._listeners.append(listener)
        if reason is not None:
            listener(reason)

    def mark_lost(self, reason: LostReason) -> bool:
        """Records that the lock is lost; the first reason wins."""
        with self._mu:
            if self._lost is not None:
                return False
            self._lost = reason
            listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener(reason)
        return True

    def lost_now(self, now: float | None = None) -> LostReason | None:
        """Lost by a recorded reason, or by the clock."""
        with self._mu:
            lost, until = self._lost, self._valid_until
        if lost is not None:
            return lost
        if (validity.now() if now is None else now) >= until:
            self.mark_lost(LostReason.UNCONFIRMED)
            with self._mu:
                return self._lost
        return None

    def confirm(self, valid_until: float) -> None:
        """Moves validity forward (never back) after a confirmed renewal. A
        lock lost already, even by the clock with nobody looking (a paused
        process), stays lost: a late answer cannot revive it."""
        if self.lost_now() is not None:
            return
        with self._mu:
            if self._lost is None and valid_until > self._valid_until:
                self._valid_until = valid_until

    def begin_release(self) -> bool:
        """Marks the lock lost (``RELEASED``, unless it was lost already) and
        its release pending; True for the one call that started it."""
        self.mark_lost(LostReason.RELEASED)
        with self._mu:
            if self._release is Release.NOT_STARTED:
                self._release = Release.PENDING
                return True
            return False

    def end_release(self, outcome: Release) -> None:
        """Records how the release ended. A 204 counts whoever got it."""
        with self._mu:
            if outcome is Release.DONE or self._release is Release.PENDING:
                self._release = outcome

    def time_left(self) -> float:
        if self.lost_now() is not None:
            return 0.0
        return max(self.valid_until - validity.now(), 0.0)


class Claim(enum.Enum):
    """What an acquire's answer means for this client."""

    NEW = "new"  # a grant this client did not hold: a fresh state
    HELD = "held"  # held already: the same state, validity moved forward
    RELEASING = "releasing"  # the answer raced this client's release of it
    RELEASED = "released"  # released already (204): ask again


# How long a released grant is remembered: far longer than any acquire
# answer can be in flight.
REMEMBER_RELEASED = 300.0


class Registry:
    """A client's grants by lockId: one state per grant."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        # Weak: a state lives as long as a Lock or a pending release needs it.
        self._grants: weakref.WeakValueDictionary[str, LockState] = (
            weakref.WeakValueDictionary()
        )
        self._released: dict[str, float] = {}

    def claim(
        self, lock_id: str, valid_until: float, make: Callable[[], LockState]
    ) -> tuple[Claim, LockState | None]:
        with self._mu:
            state = self._grants.get(lock_id)
            if state is not None:
                release = state.release
                if release is Release.PENDING:
                    return Claim.RELEASING, state
                if release is Release.DONE:
                    return Claim.RELEASED, None
                if state.lost_now() is None:
                    state.confirm(valid_until)
                    return Claim.HELD, state
                # Given up as lost without a release, yet the router still
                # grants it: a new state owns the grant from now on.
            elif self._recently_released(lock_id):
                return Claim.RELEASED, None
            fresh = make()
            self._grants[lock_id] = fresh
            return Claim.NEW, fresh

    def releasing(self, name: str) -> list[LockState]:
        """The grants of ``name`` whose release is under way and not yet
        answered: an acquire of ``name`` waits for their answers first."""
        with self._mu:
            states = list(self._grants.values())
        return [s for s in states if s.name == name and s.release is Release.PENDING]

    def switch(self, state: LockState, ref: LockRef, ttl: float, margin: float, valid_until: float) -> bool:
        """Moves ``state`` to the lockId an extend answered, and its entry
        with it, in one step: a release or an acquire answer looking it up
        meanwhile finds it under one lockId or the other, never neither.
        False if the lock was lost meanwhile (it moves all the same, so that
        its release names the lockId the router holds it under)."""
        with self._mu:
            old, live = state.switch(ref, ttl, margin, valid_until)
            if old != ref.lock_id:
                if self._grants.get(old) is state:
                    del self._grants[old]
                self._grants[ref.lock_id] = state
            return live

    def begin_release(self, state: LockState) -> bool | None:
        """Starts releasing ``state``: None if a newer state owns its grant
        (leave it alone), else whether this call started the release."""
        with self._mu:
            if self._grants.get(state.ref.lock_id) is not state:
                return None
        return state.begin_release()

    def end_release(self, state: LockState, outcome: Release) -> None:
        state.end_release(outcome)
        if outcome is Release.DONE:
            with self._mu:
                self._released[state.ref.lock_id] = time.monotonic()

    def _recently_released(self, lock_id: str) -> bool:
        cutoff = time.monotonic() - REMEMBER_RELEASED
        for old in [k for k, t in self._released.items() if t < cutoff]:
            del self._released[old]
        return lock_id in self._released
