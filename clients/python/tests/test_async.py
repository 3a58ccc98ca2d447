"""The asyncio client against a real router on real etcd: renewal past the
TTL inside ``async with``, release at its exit, FIFO waits, the lost
event on a router kill, judged by the client's clock, a name acquired
again only once its unanswered release is answered, calls on a closed
client, a client never closed winding down once it and its locks are
gone, and a wait without end that queues again past the router's cap and
is cancelled with its task, while another task of the same client waits
its turn; an extend to another TTL, with a renewal in flight under the
old lockId."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from typing import Callable

import httpx
import pytest

import lockrouter
from harness import Etcd, Router
from lockrouter import LostReason


@pytest.mark.asyncio
async def test_async_with_holds_past_the_ttl_and_releases_at_exit(router: Router) -> None:
    async with lockrouter.AsyncClient(router.url) as a, lockrouter.AsyncClient(router.url) as b:
        async with a.lock("py:async", ttl=2) as lock:
            assert isinstance(lock, lockrouter.AsyncLock)
            assert await b.try_acquire("py:async", ttl=2) is None
            await asyncio.sleep(5)
            assert lock.is_held() and not lock.lost.is_set()
            assert router.inspect("py:async")["fencingToken"] == lock.fencing_token
        assert lock.lost.is_set() and await lock.wait_lost() is LostReason.RELEASED
        start = time.monotonic()
        nxt = await b.acquire("py:async", ttl=2)
        assert time.monotonic() - start < 1.0
        assert nxt.fencing_token > lock.fencing_token
        await nxt.release()


@pytest.mark.asyncio
async def test_async_waiters_are_granted_in_arrival_order(router: Router) -> None:
    async with (
        lockrouter.AsyncClient(router.url) as holder,
        lockrouter.AsyncClient(router.url) as b,
        lockrouter.AsyncClient(router.url) as c,
    ):
        first = await holder.acquire("py:async-queue", ttl=30)
        order: list[str] = []

        async def wait_for(label: str, client: lockrouter.AsyncClient) -> lockrouter.AsyncLock:
            lock = await client.acquire("py:async-queue", ttl=2, wait=20)
            order.append(label)
            return lock

        wb = asyncio.create_task(wait_for("B", b))
        await asyncio.sleep(0.5)
        wc = asyncio.create_task(wait_for("C", c))
        await asyncio.sleep(0.5)
        await first.release()
        lock_b = await asyncio.wait_for(wb, 10)
        assert order == ["B"] and lock_b.is_held()
        await asyncio.sleep(2.5)  # past B's TTL: renewed, C still waits
        assert not wc.done() and lock_b.is_held()
        await lock_b.release()
        lock_c = await asyncio.wait_for(wc, 10)
        assert order == ["B", "C"] and lock_c.fencing_token > lock_b.fencing_token
        await lock_c.release()


@pytest.mark.asyncio
async def test_async_lost_fires_by_the_client_clock_when_the_router_is_killed(
    etcd: Etcd, start_router: Callable[..., Router]
) -> None:
    router = start_router([etcd])
    async with lockrouter.AsyncClient(router.url, safety_margin=1) as client:
        lock = await client.acquire("py:async-orphan", ttl=3)
        await asyncio.sleep(1.2)
        router.kill()
        deadline = time.monotonic() + lock.time_left()
        assert lock.is_held()
        reason = await asyncio.wait_for(lock.wait_lost(), 10)
        fired = time.monotonic()
        assert reason is LostReason.UNCONFIRMED
        assert deadline - 0.1 <= fired <= deadline + 0.1, fired - deadline
        assert not lock.is_held()
        # The with block ended after the loss: its work was not protected.
        with pytest.raises(lockrouter.LockLost):
            async with lock:
                pass


class Recording(httpx.AsyncHTTPTransport):
    """The real transport, noting each request's operation, the name it
    acquires, and its status (None when it got no answer). While
    ``cut_releases`` is set, releases fail as if the router were still
    unreachable, so a test decides when a retried release can get through."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str | None, int | None]] = []
        self.cut_releases = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        op = request.url.path.rsplit("/", 1)[-1]
        name = json.loads(request.content).get("name") if op == "acquire" else None
        try:
            if op == "release" and self.cut_releases:
                raise httpx.ConnectError("release cut off", request=request)
            resp = await super().handle_async_request(request)
        except Exception:
            self.seen.append((op, name, None))
            raise
        self.seen.append((op, name, resp.status_code))
        return resp


@pytest.mark.asyncio
async def test_async_a_name_is_acquired_again_only_after_its_unanswered_release_is_answered(
    router: Router,
) -> None:
    # As test_sync.py's test of the same name (docs/client.md, "A release
    # that was not answered").
    rec = Recording()
    async with lockrouter.AsyncClient(router.url, transport=rec, request_timeout=1) as a:
        keep = await a.acquire("py:async-late-keep", ttl=8)
        lock = await a.acquire("py:async-late", ttl=8)
        old_id, old_token = lock.lock_id, lock.fencing_token
        router.kill()
        del lock  # released in the background, unanswered while the router is away
        gc.collect()
        deadline = time.monotonic() + 5
        while ("release", None, None) not in rec.seen:
            assert time.monotonic() < deadline, rec.seen
            await asyncio.sleep(0.02)
        # Back on the same port, the old grant still standing; the retried
        # release gets through only from the acquire on, so that the test
        # sees what the SDK sends first.
        rec.cut_releases = True
        router.start()
        rec.cut_releases = False
        again = await a.acquire("py:async-late", ttl=8)
        assert again.fencing_token > old_token, "a new grant"
        cut = rec.seen.index(("release", None, None))
        first = next(
            i for i in range(cut, len(rec.seen)) if rec.seen[i][:2] == ("acquire", "py:async-late")
        )
        assert ("release", None, 204) in rec.seen[cut:first], rec.seen
        async with httpx.AsyncClient(trust_env=False) as h:
            r = await h.post(
                f"{router.url}/api/v1/locks/renew",
                json={"lockId": old_id, "fencingToken": old_token},
                timeout=5,
            )
        assert r.status_code == 409, r.text
        assert again.is_held() and keep.is_held()


@pytest.mark.asyncio
async def test_async_calls_after_aclose_raise_the_sdks_typed_error_and_exits_keep_the_blocks_error(
    router: Router,
) -> None:
    client = lockrouter.AsyncClient(router.url, request_timeout=0.5)
    lock = await client.acquire("py:async-closed", ttl=10)
    boom = ValueError("the block's own error")
    with pytest.raises(ValueError) as e:
        async with lock:
            router.kill()
            await client.aclose()  # its release cannot get through
            raise boom
    assert e.value is boom, f"the exit replaced the block's exception with {e.value!r}"
    with pytest.raises(lockrouter.ClientClosed) as closed:
        await lock.release()
    assert isinstance(closed.value, lockrouter.LockrouterError) and not closed.value.retryable
    with pytest.raises(lockrouter.ClientClosed):
        await client.acquire("py:async-closed", ttl=10)


@pytest.mark.asyncio
async def test_async_a_client_never_closed_ends_its_renewal_task_once_it_and_its_locks_are_gone(
    router: Router,
) -> None:
    before = asyncio.all_tasks()
    client = lockrouter.AsyncClient(router.url, request_timeout=1)
    lock = await client.acquire("py:async-unclosed", ttl=10)
    renewal = [t for t in asyncio.all_tasks() - before if t.get_name() == "lockrouter-renewal"]
    assert len(renewal) == 1, "the renewal task runs"
    del client, lock  # never closed, never released
    gc.collect()
    done, _ = await asyncio.wait(renewal, timeout=5)
    assert done, "the renewal task still runs"
    # Released on the way out, not left to its TTL.
    assert router.inspect("py:async-unclosed")["held"] is False


@pytest.mark.asyncio
async def test_async_a_wait_without_end_queues_again_and_is_cancelled_with_its_task(
    etcd: Etcd, start_router: Callable[..., Router]
) -> None:
    router = start_router([etcd], extra="\n[limits]\nmax_wait_ms = 1000\n")
    async with lockrouter.AsyncClient(router.url) as a, lockrouter.AsyncClient(router.url) as b:
        held = await a.acquire("py:async-long", ttl=10)
        first = asyncio.create_task(a.acquire("py:async-long", ttl=3, wait=None))
        forever = asyncio.create_task(b.acquire("py:async-long", ttl=3, wait=None))
        await asyncio.sleep(2.5)
        assert not first.done() and not forever.done(), "still waiting past the router's cap"
        assert router.inspect("py:async-long").get("waiters") == 1, "B queued; A's task waits its turn"
        forever.cancel()
        with pytest.raises(asyncio.CancelledError):
            await forever
        await asyncio.sleep(0.3)
        assert "waiters" not in router.inspect("py:async-long"), "the cancelled wait left the queue"
        await held.release()
        mine = await asyncio.wait_for(first, 3)
        assert mine.fencing_token > held.fencing_token, "a new grant for A's other task"
        await mine.release()


@pytest.mark.asyncio
async def test_async_extend_to_a_longer_ttl_with_a_renewal_in_flight_under_the_old_lock_id(
    router: Router,
) -> None:
    async with lockrouter.AsyncClient(router.url) as a, lockrouter.AsyncClient(router.url) as b:
        lock = await a.acquire("py:async-extend", ttl=2)
        old_id, token = lock.lock_id, lock.fencing_token
        transport = lock._keeper.transport
        real = transport.renew_batch
        sent, moved = asyncio.Event(), asyncio.Event()
        stolen: list[bool] = []

        async def held_back(refs: list, timeout: float) -> list:
            # Sent under the old lockId, it reaches the router after the move.
            sent.set()
            await asyncio.wait_for(moved.wait(), 5)
            results = await real(refs, timeout)
            stolen.extend(r.reason == "stolen" for r in results)
            return results

        transport.renew_batch = held_back  # type: ignore[method-assign]
        await asyncio.wait_for(sent.wait(), 3)
        left = await lock.extend(6)
        moved.set()
        await asyncio.sleep(0.5)
        transport.renew_batch = real  # type: ignore[method-assign]
        assert 4 < left <= 6, left
        assert stolen == [True], "the old lockId answered stolen"
        assert lock.fencing_token == token and lock.lock_id != old_id and lock.ttl == 6
        assert lock.is_held() and not lock.lost.is_set(), "a stale answer is no loss"

        await asyncio.sleep(6.5)
        assert lock.is_held(), "renewed under the new lockId, past the new TTL"
        info = await a.inspect("py:async-extend")
        assert info.held and info.mine and info.fencing_token == token
        await lock.release()
        nxt = await b.try_acquire("py:async-extend", ttl=2)
        assert nxt is not None and nxt.fencing_token > token
        await nxt.release()
