"""The renewal loop's decisions, without I/O: which locks to renew now (in
batches of at most :data:`~lockrouter.validity.MAX_BATCH`), what each answer
means, which background releases to attempt, and when to wake next.

Each lock is due a third of its TTL after its last confirmed renewal. When
any lock is due, every lock due within the next half interval rides along,
so locks taken at different moments fall into step and share one
``renew-batch`` request per interval. A refusal (``expired``, ``stolen``)
marks that lock lost at once; transport errors, 5xx answers and per-item
``shard_unavailable`` are retried with backoff and jitter until the lock's
validity runs out, and then it is lost. Background releases (locks
garbage-collected or closed with their client, and releases ``release()``
could not finish within validity) are retried at the fast pace while the
lock would have been valid, then at up to a renewal interval, for as long
as the client is open; once it closes they get one request timeout more.

A router's ``Retry-After`` is honoured in full by releases: a lock being
released already counts as lost, so waiting costs only the name's early
return to others, and none is sent before that wait is over (none at all
when it would end past a closing client's deadline). A renewal honours it
only where it fits its schedule (``validity.renewal_pause``): when it is
no longer than its own backoff cap (``min(MAX_BACKOFF, interval)``) and
ends before the lock's validity does; otherwise the plain backoff applies.
So its retries stay at most that far apart, as without one, and a lock
still gets retries until its validity runs out, whatever wait the router
asks for.

The sync client drives this from a thread and the async client from a task
(``_sync_loop`` and ``_async_loop``); both do only the I/O it asks for.
"""

from __future__ import annotations

import dataclasses
from typing import Union

from . import validity
from ._state import LockState, Registry, Release
from ._transport import LockRef, Renewed
from .errors import LockrouterError, LostReason, RouterError


@dataclasses.dataclass(frozen=True)
class Confirmed:
    expires_in: float


@dataclasses.dataclass(frozen=True)
class Lost:
    reason: LostReason


@dataclasses.dataclass(frozen=True)
class Retry:
    #: The wait the router asked for (its ``Retry-After``), if any.
    retry_after: float | None = None


Outcome = Union[Confirmed, Lost, Retry]


def outcome(r: Renewed) -> Outcome:
    """One renewal answer's meaning for its lock."""
    if r.renewed and r.expires_in is not None:
        return Confirmed(r.expires_in)
    if not r.renewed and r.reason == "expired":
        return Lost(LostReason.EXPIRED)
    if not r.renewed and r.reason == "stolen":
        return Lost(LostReason.STOLEN)
    # shard_unavailable, or a reason this client does not know yet: nothing
    # proves the lock gone, so try again while it is valid.
    return Retry()


def refused(e: LockrouterError) -> Outcome:
    """A single renewal that raised: retry what may pass later."""
    return Retry(asked_wait(e)) if e.retryable else Lost(LostReason.REFUSED)


def asked_wait(e: LockrouterError | None) -> float | None:
    """The seconds the router asked to be left alone after ``e`` (its
    ``Retry-After``); None when ``e`` is no answer of the router's or
    named no wait."""
    return e.retry_after if isinstance(e, RouterError) else None


@dataclasses.dataclass(frozen=True)
class Batch:
    """One ``renew-batch`` request to send."""

    keys: list[int]
    refs: list[LockRef]
    timeout: float
    #: The generation of each lock's grant as sent (see ``LockState``).
    generations: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Renewal:
    state: LockState
    interval: float
    next_due: float
    failures: int = 0
    in_flight: bool = False


@dataclasses.dataclass
class _Release:
    state: LockState
    failures: int
    next_attempt: float
    in_flight: bool = False
    #: Not before this, whatever hurries it: the router's ``Retry-After``.
    not_before: float = 0.0


class Schedule:
    """The renewal loop's bookkeeping; called from its one thread or task."""

    def __init__(self, registry: Registry, request_timeout: float) -> None:
        self._registry = registry
        self._request_timeout = request_timeout
        self._renewals: dict[int, _Renewal] = {}
        self._releases: dict[int, _Release] = {}
        #: Set by close(): pending releases are dropped after it.
        self._deadline: float | None = None

    @property
    def request_timeout(self) -> float:
        return self._request_timeout

    # Commands --------------------------------------------------------------

    def track(self, state: LockState, now: float) -> None:
        interval = validity.renew_interval(state.ttl)
        due = validity.next_renewal(now, state.valid_until, interval)
        self._renewals[state.key] = _Renewal(state, interval, due)

    def extended(self, key: int, now: float) -> None:
        """An extend moved the lock to another TTL: its renewals follow it."""
        e = self._renewals.get(key)
        if e is not None:
            e.interval = validity.renew_interval(e.state.ttl)
            e.next_due = validity.next_renewal(now, e.state.valid_until, e.interval)
            e.failures = 0

    def forget(self, key: int) -> None:
        self._renewals.pop(key, None)

    def release(self, state: LockState, failures: int, now: float, retry_after: float | None = None) -> None:
        """Stop renewing ``state`` and release it at the router, retrying.
        Sent even if the lock counts as lost already: lost by the clock
        alone, its key may still stand and block others. ``retry_after``:
        the wait the router asked for after the last failed attempt."""
        self._renewals.pop(state.key, None)
        first = now if failures == 0 else now + self._pause(state, failures, now, retry_after)
        self._releases[state.key] = _Release(state, failures, first, not_before=now + (retry_after or 0.0))

    def hurry(self, key: int, now: float) -> None:
        """An acquire raced this release: try it now, or once the router's
        ``Retry-After`` is over."""
        r = self._releases.get(key)
        if r is not None and not r.in_flight:
            r.next_attempt = max(now, r.not_before)

    def close(self, now: float) -> list[LockState]:
        """The client is closing: every lock still renewed is to be
        released, and releases get one request timeout more."""
        self._deadline = now + self._request_timeout
        held = [e.state for e in self._renewals.values()]
        self._renewals.clear()
        return held

    # Decisions -------------------------------------------------------------

    def due(self, now: float) -> tuple[list[Batch], list[LockState]]:
        """What to send now; marks it in flight."""
        for key in [k for k, e in self._renewals.items() if e.state.lost_now(now)]:
            del self._renewals[key]
        batches: list[Batch] = []
        if any(not e.in_flight and e.next_due <= now for e in self._renewals.values()):
            # Everything due soon rides along with what is due now.
            keys = sorted(
                k
                for k, e in self._renewals.items()
                if not e.in_flight and e.next_due <= now + e.interval / 2
            )
            for i in range(0, len(keys), validity.MAX_BATCH):
                batches.append(self._batch(keys[i : i + validity.MAX_BATCH]))
        releases = []
        for r in self._releases.values():
            if not r.in_flight and r.next_attempt <= now:
                r.in_flight = True
                releases.append(r.state)
        return batches, releases

    def _batch(self, keys: list[int]) -> Batch:
        # No point waiting for an answer past the interval: a later attempt
        # has a better chance.
        timeout = self._request_timeout
        refs, generations = [], []
        for k in keys:
            e = self._renewals[k]
            e.in_flight = True
            timeout = min(timeout, max(e.interval, 0.5))
            ref, generation = e.state.grant()
            refs.append(ref)
            generations.append(generation)
        return Batch(keys, refs, timeout, generations)

    def renewed(
        self,
        sent_at: float,
        outcomes: list[tuple[int, Outcome]],
        now: float,
        generations: list[int] | None = None,
    ) -> None:
        """The answers to one batch; ``generations``: the batch's, in the
        order of ``outcomes`` (None: the locks' current ones). An answer for
        a lockId an extend has replaced since is not applied: the old lockId
        answers ``stolen`` once the lock has moved, and that is no loss."""
        for i, (key, o) in enumerate(outcomes):
            e = self._renewals.get(key)
            if e is None:  # released meanwhile: no longer ours
                continue
            e.in_flight = False
            generation = e.state.generation if generations is None else generations[i]
            if isinstance(o, Confirmed):
                until = validity.valid_until(sent_at, o.expires_in, e.state.margin)
                if e.state.apply_renewal(generation, until, None) is not None:
                    e.failures = 0
                    e.next_due = validity.next_renewal(sent_at, e.state.valid_until, e.interval)
            elif isinstance(o, Lost):
                if e.state.apply_renewal(generation, None, o.reason) is False:
                    del self._renewals[key]
            else:
                e.failures += 1
                cap = min(validity.MAX_BACKOFF, e.interval)
                # The router's wait only where it fits: see the module doc.
                left = e.state.valid_until - now
                e.next_due = now + validity.renewal_pause(e.failures, cap, o.retry_after, left)

    def released(self, state: LockState, error: LockrouterError | None, now: float) -> None:
        """How one background release attempt ended (``None``: confirmed)."""
        r = self._releases.get(state.key)
        if r is None or r.state is not state:
            return
        r.in_flight = False
        if error is None or state.release is Release.DONE:
            self._registry.end_release(state, Release.DONE)
            del self._releases[state.key]
        elif not error.retryable:
            self._registry.end_release(state, Release.GAVE_UP)
            del self._releases[state.key]
        else:
            r.failures += 1
            wait = asked_wait(error)
            r.next_attempt = now + self._pause(state, r.failures, now, wait)
            r.not_before = now + (wait or 0.0)

    def _pause(self, state: LockState, failures: int, now: float, retry_after: float | None) -> float:
        interval = validity.renew_interval(state.ttl)
        fast = min(validity.MAX_BACKOFF, interval)
        valid = now < state.valid_until
        pace = fast if valid or self._deadline is not None else max(interval, fast)
        return validity.retry_pause(failures, pace, retry_after)

    def next_wake(self) -> float | None:
        """The earliest moment something is due: a renewal, a validity that
        runs out (so the lost signal fires on time), or a release."""
        times = [
            e.state.valid_until if e.in_flight else min(e.next_due, e.state.valid_until)
            for e in self._renewals.values()
        ]
        times += [r.next_attempt for r in self._releases.values() if not r.in_flight]
        if self._deadline is not None:
            times.append(self._deadline)
        return min(times, default=None)

    def finished(self, now: float) -> bool:
        """Closed, and no release left (or no time left for them)."""
        if self._deadline is None:
            return False
        return not self._releases or now >= self._deadline

    def abandoned(self) -> int:
        """Releases left unconfirmed when the loop stops."""
        return len(self._releases)
