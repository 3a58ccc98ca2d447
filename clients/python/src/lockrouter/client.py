"""The sync client: :class:`Client`, :class:`Lock`, and the one renewal
thread per client that renews all its locks.

The renewal thread only decides (``_schedule``) and hands requests to a
small pool of I/O threads, so a slow request never delays the moment a
lock's validity runs out: the thread wakes at that moment, marks the lock
lost and sets its ``lost`` event, whatever the router is doing.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
import types
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from . import validity
from ._common import (
    ACQUIRE_ROUNDS,
    SETTLE_POLL,
    Grants,
    Seconds,
    calling_safely,
    check_client_id,
    closed_before_release,
    closed_during_acquire,
    confirmation,
    extended,
    log,
    moved,
    not_settled,
    release_pace,
    seconds,
    smaller_chunk,
    still_held,
    ttl_ms,
    unconfirmed_release,
    wait_seconds,
)
from ._holds import Key, Ticket
from ._schedule import Batch, Outcome, Retry, Schedule, asked_wait, outcome, refused
from ._state import Claim, LockState, Release
from ._transport import CANCEL_POLL, AcquireBody, LockInfo, Settings, SyncTransport, acquire_body, check_url
from .errors import Cancelled, ClientClosed, LockLost, LockrouterError, LostReason, NotAcquired, RouterError

__all__ = ["Client", "Lock", "LockContext"]


class _Loop:
    """The renewal thread: runs the schedule, sends what it says through a
    pool of I/O threads, and takes commands as closures on a queue."""

    def __init__(self, transport: SyncTransport, grants: Grants, request_timeout: float) -> None:
        self._transport = transport
        self._schedule = Schedule(grants.registry, request_timeout)
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lockrouter-io")
        self._stopping = False
        # A daemon: a process that forgets to close its client still exits;
        # its locks then expire at their TTL.
        self._thread = threading.Thread(target=self._run, name="lockrouter-renewal", daemon=True)
        self._thread.start()

    def send(self, command: Callable[[], None]) -> None:
        self._inbox.put(command)

    def track(self, state: LockState) -> None:
        self.send(lambda: self._schedule.track(state, validity.now()))

    def forget(self, key: int) -> None:
        self.send(lambda: self._schedule.forget(key))

    def extended(self, key: int) -> None:
        self.send(lambda: self._schedule.extended(key, validity.now()))

    def release(self, state: LockState, failures: int, retry_after: float | None = None) -> None:
        self.send(lambda: self._schedule.release(state, failures, validity.now(), retry_after))

    def hurry(self, key: int) -> None:
        self.send(lambda: self._schedule.hurry(key, validity.now()))

    def stop(self) -> None:
        """Winds the loop down without waiting: every lock still renewed is
        released, pending releases get one request timeout more, then the
        thread closes the transport and ends. Never blocks; safe from any
        thread, a garbage collector's finalizer included."""
        if self._stopping:
            return
        self._stopping = True

        def closing() -> None:
            now = validity.now()
            for state in self._schedule.close(now):
                if state.begin_release():
                    self._schedule.release(state, 0, now)

        self.send(closing)

    def close(self, timeout: float) -> None:
        """:meth:`stop`, and waits for the thread at most ``timeout``."""
        self.stop()
        self._thread.join(timeout)

    def _run(self) -> None:
        s = self._schedule
        while True:
            now = validity.now()
            if s.finished(now):
                break
            batches, releases = s.due(now)
            for b in batches:
                self._io.submit(self._renew, b)
            for state in releases:
                self._io.submit(self._release, state)
            wake = s.next_wake()
            try:
                timeout = None if wake is None else max(wake - validity.now(), 0.0)
                self._inbox.get(timeout=timeout)()
                while True:
                    self._inbox.get_nowait()()
            except queue.Empty:
                pass
        if s.abandoned():
            log.warning("client closed with releases not confirmed; those locks expire at their TTL")
        self._io.shutdown(wait=False, cancel_futures=True)
        self._transport.close()

    def _renew(self, batch: Batch) -> None:
        sent_at = validity.now()
        outcomes = renew(self._transport, batch)
        self.send(lambda: self._schedule.renewed(sent_at, outcomes, validity.now(), batch.generations))

    def _release(self, state: LockState) -> None:
        error: LockrouterError | None = None
        try:
            with state.moving:  # never while an extend moves the lock
                self._transport.release(state.ref, self._schedule.request_timeout)
        except LockrouterError as e:
            log.debug("background release of %r failed: %s", state.name, e)
            error = e
        self.send(lambda: self._schedule.released(state, error, validity.now()))


def renew(transport: SyncTransport, batch: Batch) -> list[tuple[int, Outcome]]:
    """One ``renew-batch`` call; if the router rejects the batch itself (a
    4xx), each lock on its own, so the batch's refusal never costs a lock."""
    try:
        results = transport.renew_batch(batch.refs, batch.timeout)
        return [(k, outcome(r)) for k, r in zip(batch.keys, results)]
    except ClientClosed:
        # Closed under the request: close() took these locks over already.
        return [(k, Retry()) for k in batch.keys]
    except LockrouterError as e:
        if e.retryable:
            log.debug("renewal of %d locks failed; will retry: %s", len(batch.keys), e)
            return [(k, Retry(asked_wait(e))) for k in batch.keys]
        log.warning("renew-batch refused (%s); renewing one by one", e)
    out: list[tuple[int, Outcome]] = []
    for k, ref in zip(batch.keys, batch.refs):
        try:
            out.append((k, outcome(transport.renew(ref, batch.timeout))))
        except LockrouterError as e:
            out.append((k, refused(e)))
    return out


class _Keeper:
    """What a client's locks need of it: transport, timeouts, renewal
    thread, grants. A ``Lock`` holds this, not its ``Client``."""

    def __init__(self, transport: SyncTransport, grants: Grants, request_timeout: float) -> None:
        self.transport = transport
        self.grants = grants
        self.request_timeout = request_timeout
        self.loop = _Loop(transport, grants, request_timeout)
        # A client never closed: once it and every Lock it made are garbage,
        # its renewal thread and I/O threads wind down as close() would
        # (without blocking whoever drops the last reference). The callback
        # must not hold this keeper, or it would never be garbage.
        self._finalizer = weakref.finalize(self, self.loop.stop)
        self._finalizer.atexit = False

    def close(self) -> None:
        """Releases what is still held, giving pending releases one request
        timeout, and stops the renewal thread and the transport."""
        self._finalizer.detach()
        self.loop.close(self.request_timeout + 1.0)
        self.transport.close()

    def release_in_background(self, state: LockState) -> None:
        """Hands the release to the renewal thread; never blocks."""
        if self.grants.registry.begin_release(state):
            self.loop.release(state, 0)

    def let_go_in_background(self, state: LockState) -> None:
        """A ``Lock`` garbage-collected unreleased: gives its hold back, and
        releases the grant in the background if it was the last."""
        if self.grants.holds.let_go(state):
            try:
                self.release_in_background(state)
            finally:
                self.grants.holds.pass_on(state)

    def release(self, state: LockState) -> None:
        """Releases at the router, retrying while the lock's validity lasts;
        past it (or if interrupted) the renewal thread carries on."""
        registry = self.grants.registry
        owner = registry.begin_release(state)
        self.grants.holds.pass_on(state)
        if owner is None:
            raise LockLost(state.name, state.lost_now() or LostReason.RELEASED)
        if owner:
            self.loop.forget(state.key)
        failures = 0
        last: LockrouterError | None = None
        finished = False
        try:
            while True:
                if failures:
                    left, wait = state.valid_until - validity.now(), asked_wait(last)
                    # A Retry-After past validity: the renewal loop waits it out.
                    if left <= 0 or (wait is not None and wait > left):
                        raise last or unconfirmed_release(state.name)
                    time.sleep(min(validity.retry_pause(failures, release_pace(state), wait), left))
                if state.release is Release.DONE:
                    finished = True
                    return
                try:
                    with state.moving:  # never while an extend moves the lock
                        self.transport.release(state.ref, self.request_timeout)
                except ClientClosed:
                    # Nothing sends it any more: the lock expires at its TTL.
                    finished = True
                    raise closed_before_release(state.name) from None
                except LockrouterError as e:
                    if not e.retryable:
                        log.warning("the router refused to release %r: %s", state.name, e)
                        registry.end_release(state, Release.GAVE_UP)
                        finished = True
                        raise
                    failures += 1
                    last = e
                    continue
                registry.end_release(state, Release.DONE)
                finished = True
                return
        finally:
            if owner and not finished:
                self.loop.release(state, failures, asked_wait(last))


class Lock:
    """A lock held through a :class:`Client`, renewed in the background
    until released or lost.

    ``with lock:`` releases it at the end of the block. A ``Lock`` that is
    garbage-collected without being released is released in the background.
    Two ``Lock`` objects for one grant (a re-entrant acquire of a name the
    client holds) are two holds of one lock: they share validity and loss,
    and the grant is released with the last of them.
    """

    def __init__(self, state: LockState, keeper: _Keeper) -> None:
        self._state = state
        self._keeper = keeper
        # This object's hold of the name: given back once, by release() or
        # the finalizer; ``_last``: it was the grant's last hold.
        self._holding = True
        self._last = True
        #: Set once the lock can no longer be trusted: the router said it
        #: expired or was taken, this process's clock passed its validity
        #: without a confirmed renewal, or it was released. Wait on it, or
        #: poll ``lost.is_set()`` between steps of the work.
        self.lost = threading.Event()
        event = self.lost
        state.on_lost(lambda _reason: event.set())
        self._finalizer = weakref.finalize(self, keeper.let_go_in_background, state)
        self._finalizer.atexit = False

    def _let_go(self) -> bool:
        """Gives this object's hold back (once): True if the grant is to be
        released, False if other re-entrant holds keep it."""
        if self._holding:
            self._holding = False
            self._last = self._keeper.grants.holds.let_go(self._state)
            if not self._last:
                self.lost.set()
        return self._last

    def _gave_back(self) -> bool:
        """True once this hold was released while others keep the grant."""
        return not self._holding and not self._last
    @property
    def name(self) -> str:
        return self._state.name

    @property
    def fencing_token(self) -> int:
        """Larger than every earlier grant's of this name: send it with every
        write to the protected resource (see :mod:`lockrouter.fencing`)."""
        return self._state.ref.fencing_token

    @property
    def lock_id(self) -> str:
        return self._state.ref.lock_id

    @property
    def ttl(self) -> float:
        return self._state.ttl

    @property
    def client_id(self) -> str:
        return self._state.client_id

    @property
    def lost_reason(self) -> LostReason | None:
        """Why the lock was lost, or None while it is held."""
        return LostReason.RELEASED if self._gave_back() else self._state.lost_now()

    def is_held(self) -> bool:
        """True while the client can prove the lock is held: not lost, and
        its validity (by this process's monotonic clock) has not run out. A
        process can pause right after this returns True; only the
        resource's fencing check is safe against that."""
        return self.lost_reason is None

    def time_left(self) -> float:
        """Seconds of validity left (0 once lost)."""
        return 0.0 if self._gave_back() else self._state.time_left()

    def on_lost(self, callback: Callable[[LostReason], Any]) -> None:
        """Calls ``callback(reason)`` once the lock is lost, besides setting
        :attr:`lost`; at once (in this thread) if it is lost already. It runs
        on the client's renewal thread (or the thread that released the
        lock) the moment the loss is known, at the latest when validity runs
        out by the clock: keep it short and non-blocking (set a flag, cancel
        work, signal a thread). What it raises is logged, not propagated.
        The lock's shared state keeps the callback: one that refers to this
        ``Lock`` keeps it from being garbage-collected (and so released)
        until it is released or lost."""
        self._state.on_lost(calling_safely(self.name, callback))

    def extend(self, ttl: Seconds | None = None) -> float:
        """Renews the lock now, instead of at its next scheduled renewal, and
        returns the seconds of validity it has from that renewal (a little
        under its TTL), like redis-py's ``extend``.

        Without ``ttl`` (or with the lock's own), a renewal with the lock's
        TTL. With another ``ttl`` (seconds or a ``timedelta``), the router
        moves the lock to this client's session lease of that TTL: the
        same :attr:`fencing_token`, a new :attr:`lock_id`. From the answer
        on, this lock and every ``Lock`` of its grant have the new lockId
        and TTL, validity counts from this request's send, and the renewal
        thread renews it under the new lockId at the new TTL's pace (a
        renewal it sent under the old lockId and got back ``stolen`` after
        the move is not a loss). A release of the lock waits for an extend
        on the wire, so the two never cross.

        Raises :class:`LockLost` if the router says the lock is gone (it is
        then lost) or it was lost already. Other errors as they come, the
        lock keeping its old lockId; after a transport error, 503 or 504 of
        an extend to another TTL the move may have happened at the router,
        and then the next renewal finds the old lockId ``stolen`` and the
        lock is lost (``STOLEN``): the client cannot learn the new lockId."""
        state, k = self._state, self._keeper
        new_ttl = state.ttl if ttl is None else seconds(ttl, "ttl")
        new_ms = ttl_ms(new_ttl)
        with state.moving:
            reason = self.lost_reason
            if reason is not None:
                raise LockLost(self.name, reason)
            ref, generation = state.grant()
            sent_at = validity.now()
            if new_ms == ttl_ms(state.ttl):
                return extended(state, k.transport.renew(ref, k.request_timeout, new_ms), sent_at)
            r = k.transport.extend(ref, k.request_timeout, new_ms)
            if moved(k.grants, state, r, new_ms / 1000, sent_at, generation):
                k.loop.extended(state.key)
            return still_held(state)

    def release(self) -> None:
        """Stops renewing and releases the lock; it counts as lost
        (``RELEASED``) from the start. Returns once the router confirmed.
        Transport errors, 408, 429 and 5xx are retried with backoff while
        the lock's validity lasts, never sooner than the answer's
        ``Retry-After`` (:attr:`RouterError.retry_after`); then, or at once
        if that wait would outlast validity, the error is raised and the
        renewal thread keeps retrying (after that wait) while the client is
        open. Raises :class:`LockLost` if the grant has passed to a newer
        ``Lock``, and :class:`ClientClosed` if the client is closed and its
        release of the lock was not confirmed (the lock then expires at its
        TTL); after a ``close()`` that released it, returns at once. A
        re-entrant hold that is not the grant's last only gives its hold
        back."""
        self._finalizer.detach()
        if self._let_go():
            self._keeper.release(self._state)

    def __enter__(self) -> Lock:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        release_on_exit(self, exc_type is None)

    def __repr__(self) -> str:
        return f"Lock(name={self.name!r}, fencing_token={self.fencing_token}, held={self.is_held()})"


def release_on_exit(lock: Lock, clean: bool) -> None:
    """The end of a ``with`` block: release; if the block finished but the
    lock was lost meanwhile, its work was not protected: raise
    :class:`LockLost`.

    A release that fails with an error of this SDK is logged (a warning on
    the ``lockrouter`` logger), not raised: while the client is open the
    renewal loop retries it; once it is closed the lock expires at its TTL.
    When the block raised, its exception reaches the caller unchanged,
    whatever the release ran into (anything else is logged with its
    traceback)."""
    reason = lock._state.lost_now()
    try:
        lock.release()
    except LockrouterError as e:
        log.warning("release of %r at the end of its block not confirmed: %s", lock.name, e)
    except Exception:
        if clean:
            raise
        log.warning("release of %r at the end of its block failed", lock.name, exc_info=True)
    if clean and reason is not None and reason is not LostReason.RELEASED:
        raise LockLost(lock.name, reason)


class LockContext:
    """``with client.lock(name, ...) as lock:`` acquires on entry (raising
    :class:`NotAcquired` if another client holds it after ``wait``) and
    releases on exit."""

    def __init__(self, client: Client, name: str, options: dict[str, Any]) -> None:
        self._args = (client, name, options)
        self._lock: Lock | None = None

    def __enter__(self) -> Lock:
        client, name, options = self._args
        self._lock = client.acquire(name, **options)
        return self._lock

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        if self._lock is not None:
            lock, self._lock = self._lock, None
            release_on_exit(lock, exc_type is None)


class Client:
    """A connection to a lockrouter under one client id, with one background
    renewal thread for all the locks it holds.

    ``url`` is the router's base URL. ``token`` is sent as
    ``Authorization: Bearer``; ``verify`` and ``cert`` are httpx's TLS
    options. ``client_id`` is the holder's identity at the router (default:
    128 random bits); use one per process or independent worker.
    ``safety_margin`` (seconds, default a tenth of each lock's TTL, never
    below 0.1) is how much earlier than the router's reported expiry a lock
    counts as lost. ``request_timeout`` bounds each request (default 5 s).
    Close it (or use ``with Client(...) as client:``) to release what it
    still holds and stop its threads. A client never closed renews the
    locks of every live ``Lock`` it made; once it and all of them are
    garbage-collected, it winds down as :meth:`close` would. Its renewal
    thread is a daemon: it never keeps the process from exiting.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        verify: Any = True,
        cert: Any = None,
        client_id: str | None = None,
        safety_margin: Seconds | None = None,
        request_timeout: Seconds = 5.0,
        transport: Any = None,
    ) -> None:
        settings = Settings(check_url(url), token, verify, cert, transport)
        margin = None if safety_margin is None else seconds(safety_margin, "safety_margin")
        self.client_id = check_client_id(client_id)
        timeout = seconds(request_timeout, "request_timeout")
        self._keeper = _Keeper(SyncTransport(settings), Grants(margin), timeout)
        self._closed = False

    def acquire(
        self,
        name: str,
        ttl: Seconds = 30.0,
        wait: Seconds | None = 0.0,
        client_id: str | None = None,
        *,
        metadata: Any = None,
        reentrant: bool = False,
        cancel: threading.Event | None = None,
    ) -> Lock:
        """Acquires ``name`` for ``ttl`` seconds (2 s to 1 h; etcd rounds up
        to whole seconds), waiting up to ``wait`` seconds in the router's
        first-come-first-served queue if it is held (``None``: for as long as
        it takes). Raises :class:`NotAcquired` if it is still held then (or
        others are queued ahead).

        A wait longer than the router's cap (``limits.max_wait_ms``, 60 s by
        default) is made of several, each queuing again at the end of the
        line. Setting ``cancel`` (a ``threading.Event``, from any thread)
        cancels the acquire while it waits, for its turn in this client or
        at the router: it raises :class:`Cancelled` within moments, and
        the router drops the waiter with the request (as with an exception
        raised in its thread, ``KeyboardInterrupt``). Once granted, the
        acquire returns its ``Lock`` whatever ``cancel`` says; an
        ``AsyncClient`` wait is cancelled with its task.

        One client, one holder per name (per client id): while a ``Lock`` of
        this client holds ``name`` (until it is released, even once lost),
        another acquire of it (another thread) waits its turn as it would
        for another client's, within ``wait``. Only with ``reentrant=True``
        does an acquire of a name this client holds (and has not lost) get
        it at once, without asking the router: a second ``Lock`` of the
        grant, counted, so the grant is released with the last of them.

        ``metadata`` (a small JSON-able dict or str, at most 1 KiB) is
        recorded with the lock and shown by :meth:`inspect` to whoever may
        see the lock: not a place for secrets.

        Idempotent for one client id: after a :class:`TransportError`,
        call it again. While this client's release of an earlier grant of
        ``name`` is unanswered, it first drives that release to an answer
        (within ``request_timeout`` plus ``wait``), and raises
        :class:`TransportError` if it cannot: never the old grant."""
        lock = self.try_acquire(
            name, ttl=ttl, wait=wait, client_id=client_id, metadata=metadata, reentrant=reentrant, cancel=cancel
        )
        if lock is None:
            raise NotAcquired(name)
        return lock

    def try_acquire(
        self,
        name: str,
        ttl: Seconds = 30.0,
        wait: Seconds | None = 0.0,
        client_id: str | None = None,
        *,
        metadata: Any = None,
        reentrant: bool = False,
        cancel: threading.Event | None = None,
    ) -> Lock | None:
        """As :meth:`acquire`, but None instead of :class:`NotAcquired`
        (a cancelled one still raises :class:`Cancelled`)."""
        self._check_open()
        ttl_s, wait_s = seconds(ttl, "ttl"), wait_seconds(wait)
        ms = ttl_ms(ttl_s)
        cid = self.client_id if client_id is None else check_client_id(client_id)
        if cancel is not None and cancel.is_set():
            raise Cancelled(name)
        start = validity.now()
        holds, key = self._keeper.grants.holds, (cid, name)
        if reentrant:
            joined = holds.join(key)
            if joined is not None:
                return Lock(joined, self._keeper)
        if not self._take_turn(key, start + wait_s, cancel):
            if self._closed:
                raise ClientClosed("the client was closed while this acquire waited its turn")
            return None
        try:
            lock = self._acquire_in_turn(name, ttl_s, ms, cid, start, wait_s, metadata, cancel)
        except BaseException:
            holds.pass_turn(key)
            raise
        if lock is None:
            holds.pass_turn(key)
        else:
            holds.hold(key, lock._state)
        return lock

    def _take_turn(self, key: Key, deadline: float, cancel: threading.Event | None) -> bool:
        """Waits until ``deadline`` for the name's turn in this client, or
        until ``cancel`` is set (:class:`Cancelled`)."""
        holds, arrived = self._keeper.grants.holds, threading.Event()
        ticket = Ticket(arrived.set)
        if holds.enter(key, ticket):
            return True
        try:
            while True:
                left = None if deadline == math.inf else max(deadline - validity.now(), 0.0)
                if cancel is not None:
                    left = CANCEL_POLL if left is None else min(left, CANCEL_POLL)
                if arrived.wait(left):
                    break
                if cancel is not None and cancel.is_set():
                    raise Cancelled(key[1])
                if validity.now() >= deadline:
                    break
        except BaseException:
            if holds.leave(key, ticket):
                holds.pass_turn(key)
            raise
        return holds.leave(key, ticket)

    def _acquire_in_turn(
        self,
        name: str,
        ttl_s: float,
        ms: int,
        cid: str,
        start: float,
        wait_s: float,
        metadata: Any,
        cancel: threading.Event | None,
    ) -> Lock | None:
        k = self._keeper
        # A release of an earlier grant of this name that the router has not
        # answered may still land later, and would end the very grant the
        # router answers this acquire with (the same one): drive it to an
        # answer first, within this call's own time.
        limit = k.request_timeout + wait_s
        for pending in k.grants.registry.releasing(name):
            if not self._settle(pending, limit - (validity.now() - start), cancel):
                raise not_settled(name)
        rounds = 0
        while True:
            left = max(wait_s - (validity.now() - start), 0.0)
            ask = min(left, k.grants.wait_chunk)
            body = acquire_body(name, ms, cid, round(ask * 1000), metadata)
            try:
                claim, state = self._acquire_once(name, ttl_s, body, ask, cid, cancel)
            except RouterError as e:
                smaller = smaller_chunk(e, ask)
                if smaller is None:
                    raise
                k.grants.wait_chunk = smaller
                continue
            if claim is None:
                if left > ask:
                    continue  # the router's cap ran out: queue again
                return None
            if claim in (Claim.NEW, Claim.HELD):
                assert state is not None
                return Lock(state, k)
            if claim is Claim.RELEASING:
                assert state is not None
                self._settle(state, k.request_timeout, cancel)
            # Claim.RELEASED: the release got through; the next answer is new.
            rounds += 1
            if rounds >= ACQUIRE_ROUNDS:
                raise not_settled(name)

    def lock(
        self,
        name: str,
        ttl: Seconds = 30.0,
        wait: Seconds | None = 0.0,
        client_id: str | None = None,
        *,
        metadata: Any = None,
        reentrant: bool = False,
        cancel: threading.Event | None = None,
    ) -> LockContext:
        """``with client.lock("job:42", ttl=30) as lock:`` — acquire (as
        :meth:`acquire`), run the block, release. If the lock was lost
        before the block ended, the exit raises :class:`LockLost`."""
        options = dict(
            ttl=ttl, wait=wait, client_id=client_id, metadata=metadata, reentrant=reentrant, cancel=cancel
        )
        return LockContext(self, name, options)

    def inspect(self, name: str) -> LockInfo:
        """What the router tells anyone about ``name``: held or free (like
        redis-py's ``locked()``), by which grant and, for an admin caller,
        which client, until when, its metadata and waiters, and whether it
        is this client's (``mine``, like redis-py's ``owned()``)."""
        self._check_open()
        info = self._keeper.transport.inspect(name, self._keeper.request_timeout)
        mine = self._keeper.grants.holds.holding((self.client_id, name))
        return dataclasses.replace(info, mine=info.held and mine == info.fencing_token)

    def _acquire_once(
        self, name: str, ttl: float, body: AcquireBody, wait: float, cid: str, cancel: threading.Event | None
    ) -> tuple[Claim | None, LockState | None]:
        k = self._keeper
        sent_at = validity.now()
        got = k.transport.acquire(body, k.request_timeout + wait, cancel)
        if got is None:
            return None, None
        margin, until = k.grants.first_validity(sent_at, got, ttl)
        if validity.now() - sent_at > margin:
            # Granted somewhere within a long request (a wait): validity
            # counts from its start. A renewal now measures afresh.
            confirm_at = validity.now()
            try:
                r = k.transport.renew(got.ref, k.request_timeout)
                until = max(until, confirmation(name, r, confirm_at, margin))
            except LockLost:
                raise
            except LockrouterError:
                if until <= validity.now():
                    claim, state = k.grants.claim(name, ttl, margin, got, until, cid)
                    if claim is Claim.NEW and state is not None:
                        k.release_in_background(state)
                    raise
                # Still valid: the renewal thread confirms it shortly.
        claim, state = k.grants.claim(name, ttl, margin, got, until, cid)
        if self._closed:
            # close() ran while this acquire was on the wire: nothing would
            # renew the lock. Release it if there is still time to.
            if claim is Claim.NEW and state is not None:
                k.release_in_background(state)
            raise closed_during_acquire(name)
        if claim is Claim.NEW and state is not None:
            k.loop.track(state)
        return claim, state

    def _settle(self, state: LockState, limit: float, cancel: threading.Event | None = None) -> bool:
        """Waits, at most ``limit`` seconds, for this client's release of
        the grant to be answered, hurrying it first; True once it was.
        :class:`Cancelled` once ``cancel`` is set."""
        self._keeper.loop.hurry(state.key)
        deadline = validity.now() + limit
        while state.release is Release.PENDING and validity.now() < deadline:
            if cancel is not None and cancel.is_set():
                raise Cancelled(state.name)
            time.sleep(SETTLE_POLL)
        return state.release is not Release.PENDING

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed("the client is closed")

    def close(self) -> None:
        """Releases every lock still held and stops the renewal thread,
        giving pending releases one request timeout to get through."""
        if self._closed:
            return
        self._closed = True
        self._keeper.grants.holds.close()
        self._keeper.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client(client_id={self.client_id!r})"
