"""The asyncio client: :class:`AsyncClient`, :class:`AsyncLock`, and the
one renewal task per client that renews all its locks.

The same rules as the sync client (``_schedule``, ``_state``, ``_common``),
driven by a task on the event loop the client is first used on: requests
run as tasks of their own, so a slow request never delays the moment a
lock's validity runs out. ``lock.lost`` is an :class:`asyncio.Event`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import types
import weakref
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
from ._transport import AcquireBody, AsyncTransport, LockInfo, Settings, acquire_body, check_url
from .errors import ClientClosed, LockLost, LockrouterError, LostReason, NotAcquired, RouterError

__all__ = ["AsyncClient", "AsyncLock", "AsyncLockContext"]


class _AsyncLoop:
    """The renewal task. Commands are closures in a deque (appended from
    any thread: a garbage-collected lock's finalizer may run anywhere)."""

    def __init__(self, transport: AsyncTransport, grants: Grants, request_timeout: float) -> None:
        self._transport = transport
        self._schedule = Schedule(grants.registry, request_timeout)
        self._inbox: collections.deque[Callable[[], None]] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._io: set[asyncio.Task[None]] = set()
        self._stopping = False

    def start(self) -> None:
        """Starts the task on the running loop, once."""
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._run(), name="lockrouter-renewal")

    def send(self, command: Callable[[], None]) -> None:
        self._inbox.append(command)
        loop = self._loop
        if loop is None:
            return
        try:
            if _running_loop() is loop:
                self._wake.set()
            else:
                loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the loop is closed: nothing runs any more
            pass

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
        """Winds the task down without waiting: every lock still renewed is
        released, pending releases get one request timeout more, then the
        task closes the transport and ends. Never blocks; safe from any
        thread, a garbage collector's finalizer included."""
        if self._task is None or self._stopping:
            return
        self._stopping = True

        def closing() -> None:
            now = validity.now()
            for state in self._schedule.close(now):
                if state.begin_release():
                    self._schedule.release(state, 0, now)

        self.send(closing)

    async def close(self, timeout: float) -> None:
        """:meth:`stop`, and waits for the task at most ``timeout``."""
        if self._task is None:
            return
        self.stop()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except asyncio.TimeoutError:
            self._task.cancel()
        for t in list(self._io):
            t.cancel()

    async def _run(self) -> None:
        s = self._schedule
        while True:
            self._wake.clear()
            while self._inbox:
                self._inbox.popleft()()
            now = validity.now()
            if s.finished(now):
                break
            batches, releases = s.due(now)
            for b in batches:
                self._spawn(self._renew(b))
            for state in releases:
                self._spawn(self._release(state))
            wake = s.next_wake()
            timeout = None if wake is None else max(wake - validity.now(), 0.0)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        if s.abandoned():
            log.warning("client closed with releases not confirmed; those locks expire at their TTL")
        for t in list(self._io):
            t.cancel()
        await self._transport.close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._io.add(task)
        task.add_done_callback(self._io.discard)

    async def _renew(self, batch: Batch) -> None:
        sent_at = validity.now()
        outcomes = await renew(self._transport, batch)
        self.send(lambda: self._schedule.renewed(sent_at, outcomes, validity.now(), batch.generations))

    async def _release(self, state: LockState) -> None:
        error: LockrouterError | None = None
        try:
            async with state.moving_async:  # never while an extend moves the lock
                await self._transport.release(state.ref, self._schedule.request_timeout)
        except LockrouterError as e:
            log.debug("background release of %r failed: %s", state.name, e)
            error = e
        self.send(lambda: self._schedule.released(state, error, validity.now()))


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def renew(transport: AsyncTransport, batch: Batch) -> list[tuple[int, Outcome]]:
    """One ``renew-batch`` call; if the router rejects the batch itself (a
    4xx), each lock on its own, so the batch's refusal never costs a lock."""
    try:
        results = await transport.renew_batch(batch.refs, batch.timeout)
        return [(k, outcome(r)) for k, r in zip(batch.keys, results)]
    except ClientClosed:
        # Closed under the request: close() took these locks over already.
        return [(k, Retry()) for k in batch.keys]
    except LockrouterError as e:
        if e.retryable:
            log.debug("renewal of %d locks failed; will retry: %s", len(batch.keys), e)
            return [(k, Retry(asked_wait(e))) for k in batch.keys]
        log.warning("renew-batch refused (%s); renewing one by one", e)

    async def one(ref: Any) -> Outcome:
        try:
            return outcome(await transport.renew(ref, batch.timeout))
        except LockrouterError as e:
            return refused(e)

    found = await asyncio.gather(*(one(ref) for ref in batch.refs))
    return list(zip(batch.keys, found))


class _AsyncKeeper:
    """What a client's locks need of it; see the sync ``_Keeper``."""

    def __init__(self, transport: AsyncTransport, grants: Grants, request_timeout: float) -> None:
        self.transport = transport
        self.grants = grants
        self.request_timeout = request_timeout
        self.loop = _AsyncLoop(transport, grants, request_timeout)
        # A client never closed: once it and every AsyncLock it made are
        # garbage, its renewal task winds down as aclose() would. The
        # callback must not hold this keeper, or it would never be garbage.
        self._finalizer = weakref.finalize(self, self.loop.stop)
        self._finalizer.atexit = False

    async def close(self) -> None:
        """Releases what is still held, giving pending releases one request
        timeout, and stops the renewal task and the transport."""
        self._finalizer.detach()
        await self.loop.close(self.request_timeout + 1.0)
        await self.transport.close()

    def release_in_background(self, state: LockState) -> None:
        if self.grants.registry.begin_release(state):
            self.loop.release(state, 0)

    def let_go_in_background(self, state: LockState) -> None:
        """An ``AsyncLock`` garbage-collected unreleased: gives its hold
        back, and releases the grant in the background if it was the last."""
        if self.grants.holds.let_go(state):
            try:
                self.release_in_background(state)
            finally:
                self.grants.holds.pass_on(state)

    async def release(self, state: LockState) -> None:
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
                    await asyncio.sleep(min(validity.retry_pause(failures, release_pace(state), wait), left))
                if state.release is Release.DONE:
                    finished = True
                    return
                try:
                    async with state.moving_async:  # never while an extend moves the lock
                        await self.transport.release(state.ref, self.request_timeout)
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
            # Validity ran out, or the call was cancelled: the task goes on.
            if owner and not finished:
                self.loop.release(state, failures, asked_wait(last))


class AsyncLock:
    """A lock held through an :class:`AsyncClient`; see :class:`lockrouter.Lock`.
    ``lost`` is an :class:`asyncio.Event`; ``await lock.wait_lost()`` returns
    the reason."""

    def __init__(self, state: LockState, keeper: _AsyncKeeper) -> None:
        self._state = state
        self._keeper = keeper
        # This object's hold of the name; see the sync Lock.
        self._holding = True
        self._last = True
        #: Set once the lock can no longer be trusted.
        self.lost = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        # The listener must not hold this lock (the state outlives it, and
        # a lock kept alive would never be released when dropped).
        event, loop = self.lost, self._loop
        state.on_lost(lambda _reason: _on_loop(loop, event.set))
        self._finalizer = weakref.finalize(self, keeper.let_go_in_background, state)
        self._finalizer.atexit = False

    def _let_go(self) -> bool:
        if self._holding:
            self._holding = False
            self._last = self._keeper.grants.holds.let_go(self._state)
            if not self._last:
                self.lost.set()
        return self._last

    def _gave_back(self) -> bool:
        return not self._holding and not self._last

    @property
    def name(self) -> str:
        return self._state.name

    @property
    def fencing_token(self) -> int:
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
        return LostReason.RELEASED if self._gave_back() else self._state.lost_now()

    def is_held(self) -> bool:
        return self.lost_reason is None

    def time_left(self) -> float:
        return 0.0 if self._gave_back() else self._state.time_left()

    def on_lost(self, callback: Callable[[LostReason], Any]) -> None:
        """Calls ``callback(reason)`` on the lock's event loop once the lock
        is lost, besides setting :attr:`lost` (soon, if it is lost already).
        Keep it short; to run async work, start a task from it. What it
        raises is logged, not propagated."""
        call, loop = calling_safely(self.name, callback), self._loop
        self._state.on_lost(lambda reason: _on_loop(loop, lambda: call(reason)))

    async def extend(self, ttl: Seconds | None = None) -> float:
        """As :meth:`lockrouter.Lock.extend`: renews now, with the lock's own
        TTL or, given another ``ttl``, moves the lock to that TTL (the same
        token, a new :attr:`lock_id`, renewed under it from then on), and
        returns the seconds of validity it has from that answer."""
        state, k = self._state, self._keeper
        new_ttl = state.ttl if ttl is None else seconds(ttl, "ttl")
        new_ms = ttl_ms(new_ttl)
        async with state.moving_async:
            reason = self.lost_reason
            if reason is not None:
                raise LockLost(self.name, reason)
            ref, generation = state.grant()
            sent_at = validity.now()
            if new_ms == ttl_ms(state.ttl):
                r = await k.transport.renew(ref, k.request_timeout, new_ms)
                return extended(state, r, sent_at)
            r = await k.transport.extend(ref, k.request_timeout, new_ms)
            if moved(k.grants, state, r, new_ms / 1000, sent_at, generation):
                k.loop.extended(state.key)
            return still_held(state)

    async def wait_lost(self) -> LostReason:
        """Returns once the lock is lost, with the reason."""
        await self.lost.wait()
        reason = self._state.lost_now()
        assert reason is not None
        return reason

    async def release(self) -> None:
        """As :meth:`lockrouter.Lock.release`. Cancelling it hands the
        release to the renewal task. A re-entrant hold that is not the
        grant's last only gives its hold back."""
        self._finalizer.detach()
        if self._let_go():
            await self._keeper.release(self._state)

    async def __aenter__(self) -> AsyncLock:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        await release_on_exit(self, exc_type is None)

    def __repr__(self) -> str:
        return f"AsyncLock(name={self.name!r}, fencing_token={self.fencing_token}, held={self.is_held()})"


def _on_loop(loop: asyncio.AbstractEventLoop, call: Callable[[], None]) -> None:
    """Runs ``call`` on ``loop``, from any thread."""
    try:
        if _running_loop() is loop:
            call()
        else:
            loop.call_soon_threadsafe(call)
    except RuntimeError:  # the loop is closed
        pass


async def release_on_exit(lock: AsyncLock, clean: bool) -> None:
    """As the sync client's ``release_on_exit``.

    A release that fails with an error of this SDK is logged (a warning on
    the ``lockrouter`` logger), not raised: while the client is open the
    renewal loop retries it; once it is closed the lock expires at its TTL.
    When the block raised, its exception reaches the caller unchanged,
    whatever the release ran into (anything else is logged with its
    traceback)."""
    reason = lock._state.lost_now()
    try:
        await lock.release()
    except LockrouterError as e:
        log.warning("release of %r at the end of its block not confirmed: %s", lock.name, e)
    except Exception:
        if clean:
            raise
        log.warning("release of %r at the end of its block failed", lock.name, exc_info=True)
    if clean and reason is not None and reason is not LostReason.RELEASED:
        raise LockLost(lock.name, reason)


class AsyncLockContext:
    """``async with client.lock(name, ...) as lock:``."""

    def __init__(self, client: AsyncClient, name: str, options: dict[str, Any]) -> None:
        self._args = (client, name, options)
        self._lock: AsyncLock | None = None

    async def __aenter__(self) -> AsyncLock:
        client, name, options = self._args
        self._lock = await client.acquire(name, **options)
        return self._lock

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        if self._lock is not None:
            lock, self._lock = self._lock, None
            await release_on_exit(lock, exc_type is None)


class AsyncClient:
    """The asyncio twin of :class:`lockrouter.Client` (same arguments). Its
    renewal task starts on the event loop of its first acquire; use the
    client from that loop only. Close it with ``await client.aclose()`` or
    ``async with AsyncClient(...) as client:``. A client never closed
    renews the locks of every live ``AsyncLock`` it made; once it and all of
    them are garbage-collected, its task winds down as :meth:`aclose` would
    (while its event loop runs)."""

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
        self._keeper = _AsyncKeeper(AsyncTransport(settings), Grants(margin), timeout)
        self._closed = False

    async def acquire(
        self,
        name: str,
        ttl: Seconds = 30.0,
        wait: Seconds | None = 0.0,
        client_id: str | None = None,
        *,
        metadata: Any = None,
        reentrant: bool = False,
    ) -> AsyncLock:
        """See :meth:`lockrouter.Client.acquire`. Cancelling the task that
        waits cancels the wait: the router drops the waiter with the
        request, and the next task waiting in this client gets its turn."""
        lock = await self.try_acquire(
            name, ttl=ttl, wait=wait, client_id=client_id, metadata=metadata, reentrant=reentrant
        )
        if lock is None:
            raise NotAcquired(name)
        return lock

    async def try_acquire(
        self,
        name: str,
        ttl: Seconds = 30.0,
        wait: Seconds | None = 0.0,
        client_id: str | None = None,
        *,
        metadata: Any = None,
        reentrant: bool = False,
    ) -> AsyncLock | None:
        """See :meth:`lockrouter.Client.try_acquire`."""
        if self._closed:
            raise ClientClosed("the client is closed")
        self._keeper.loop.start()
        ttl_s, wait_s = seconds(ttl, "ttl"), wait_seconds(wait)
        ms = ttl_ms(ttl_s)
        cid = self.client_id if client_id is None else check_client_id(client_id)
        start = validity.now()
        holds, key = self._keeper.grants.holds, (cid, name)
        if reentrant:
            joined = holds.join(key)
            if joined is not None:
                return AsyncLock(joined, self._keeper)
        if not await self._take_turn(key, start + wait_s):
            if self._closed:
                raise ClientClosed("the client was closed while this acquire waited its turn")
            return None
        try:
            lock = await self._acquire_in_turn(name, ttl_s, ms, cid, start, wait_s, metadata)
        except BaseException:
            holds.pass_turn(key)
            raise
        if lock is None:
            holds.pass_turn(key)
        else:
            holds.hold(key, lock._state)
        return lock

    async def _take_turn(self, key: Key, deadline: float) -> bool:
        """Waits until ``deadline`` for the name's turn in this client."""
        holds, arrived = self._keeper.grants.holds, asyncio.Event()
        loop = asyncio.get_running_loop()

        def wake() -> None:
            try:
                if _running_loop() is loop:
                    arrived.set()
                else:
                    loop.call_soon_threadsafe(arrived.set)
            except RuntimeError:  # the loop is closed
                pass

        ticket = Ticket(wake)
        if holds.enter(key, ticket):
            return True
        timeout = None if deadline == math.inf else max(deadline - validity.now(), 0.0)
        try:
            await asyncio.wait_for(arrived.wait(), timeout)
        except TimeoutError:
            pass
        except BaseException:
            if holds.leave(key, ticket):
                holds.pass_turn(key)
            raise
        return holds.leave(key, ticket)

    async def _acquire_in_turn(
        self, name: str, ttl_s: float, ms: int, cid: str, start: float, wait_s: float, metadata: Any
    ) -> AsyncLock | None:
        k = self._keeper
        # See the sync client: an unanswered release of this name first.
        limit = k.request_timeout + wait_s
        for pending in k.grants.registry.releasing(name):
            if not await self._settle(pending, limit - (validity.now() - start)):
                raise not_settled(name)
        rounds = 0
        while True:
            left = max(wait_s - (validity.now() - start), 0.0)
            ask = min(left, k.grants.wait_chunk)
            body = acquire_body(name, ms, cid, round(ask * 1000), metadata)
            try:
                claim, state = await self._acquire_once(name, ttl_s, body, ask, cid)
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
                return AsyncLock(state, k)
            if claim is Claim.RELEASING:
                assert state is not None
                await self._settle(state, k.request_timeout)
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
    ) -> AsyncLockContext:
        """``async with client.lock("job:42", ttl=30) as lock:``."""
        options = dict(ttl=ttl, wait=wait, client_id=client_id, metadata=metadata, reentrant=reentrant)
        return AsyncLockContext(self, name, options)

    async def inspect(self, name: str) -> LockInfo:
        """See :meth:`lockrouter.Client.inspect`."""
        if self._closed:
            raise ClientClosed("the client is closed")
        info = await self._keeper.transport.inspect(name, self._keeper.request_timeout)
        mine = self._keeper.grants.holds.holding((self.client_id, name))
        return dataclasses.replace(info, mine=info.held and mine == info.fencing_token)

    async def _acquire_once(
        self, name: str, ttl: float, body: AcquireBody, wait: float, cid: str
    ) -> tuple[Claim | None, LockState | None]:
        k = self._keeper
        sent_at = validity.now()
        got = await k.transport.acquire(body, k.request_timeout + wait)
        if got is None:
            return None, None
        margin, until = k.grants.first_validity(sent_at, got, ttl)
        if validity.now() - sent_at > margin:
            confirm_at = validity.now()
            try:
                r = await k.transport.renew(got.ref, k.request_timeout)
                until = max(until, confirmation(name, r, confirm_at, margin))
            except LockLost:
                raise
            except LockrouterError:
                if until <= validity.now():
                    claim, state = k.grants.claim(name, ttl, margin, got, until, cid)
                    if claim is Claim.NEW and state is not None:
                        k.release_in_background(state)
                    raise
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

    async def _settle(self, state: LockState, limit: float) -> bool:
        self._keeper.loop.hurry(state.key)
        deadline = validity.now() + limit
        while state.release is Release.PENDING and validity.now() < deadline:
            await asyncio.sleep(SETTLE_POLL)
        return state.release is not Release.PENDING

    async def aclose(self) -> None:
        """Releases every lock still held and stops the renewal task, giving
        pending releases one request timeout to get through."""
        if self._closed:
            return
        self._closed = True
        self._keeper.grants.holds.close()
        await self._keeper.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"AsyncClient(client_id={self.client_id!r})"
