"""The sync client against a real router on real etcd: renewal past the
TTL, release at the end of a ``with`` block, FIFO waits, one renew-batch
per interval for many locks, a lock lost by the client's own clock when the
router is killed (while the lease still stands), a release retried until
the router is back, a name acquired again only once its unanswered release
is answered, a shard outage that loses only that shard's locks,
re-entrant holds of one grant and threads of one client excluding each
other (a waiting thread never handed the grant being released), waits longer than the router's cap, a waiting acquire cancelled
from another thread (at the router and in its client's turn, and over
TLS), metadata, inspect, extend and the on-lost callback, calls on a
closed client raising ``ClientClosed``, a ``with`` block's exception
surviving its exit, and a client never closed winding down once it and
its locks are gone.
"""

from __future__ import annotations

import gc
import json
import threading
import time
from typing import Callable

import httpx
import pytest

import lockrouter
from harness import Etcd, Router, Tls
from lockrouter import LostReason


def test_a_lock_is_renewed_past_its_ttl_and_released_for_the_next_holder(router: Router) -> None:
    with lockrouter.Client(router.url) as a, lockrouter.Client(router.url) as b:
        lock = a.acquire("py:basic", ttl=2)
        assert lock.is_held() and lock.name == "py:basic"
        assert b.try_acquire("py:basic", ttl=2) is None
        with pytest.raises(lockrouter.NotAcquired):
            b.acquire("py:basic", ttl=2)

        # Two and a half TTLs later it is still held, by the router's account too.
        time.sleep(5)
        assert lock.is_held()
        assert not lock.lost.is_set()
        seen = router.inspect("py:basic")
        assert seen["held"] is True and seen["fencingToken"] == lock.fencing_token

        lock.release()
        assert lock.lost.is_set() and lock.lost_reason is LostReason.RELEASED
        assert not lock.is_held()
        nxt = b.acquire("py:basic", ttl=2)
        assert nxt.fencing_token > lock.fencing_token
        nxt.release()


def test_leaving_the_with_block_releases_the_lock_for_the_next_holder_at_once(router: Router) -> None:
    with lockrouter.Client(router.url) as a, lockrouter.Client(router.url) as b:
        with a.lock("py:with", ttl=60) as lock:
            token = lock.fencing_token
            assert router.inspect("py:with")["held"] is True
        assert lock.lost_reason is LostReason.RELEASED
        # Far less than the 60 s TTL, and without waiting: the exit released it.
        start = time.monotonic()
        nxt = b.acquire("py:with", ttl=60)
        assert time.monotonic() - start < 1.0
        assert nxt.fencing_token > token
        # The same when the block raises; the error is not masked.
        with pytest.raises(ZeroDivisionError):
            with b.lock("py:with-raise", ttl=60):
                1 / 0
        assert a.acquire("py:with-raise", ttl=60).is_held()


def test_waiters_are_granted_in_arrival_order(router: Router) -> None:
    clients = [lockrouter.Client(router.url) for _ in range(3)]
    holder, b, c = clients
    try:
        first = holder.acquire("py:queue", ttl=30)
        granted: list[tuple[str, lockrouter.Lock]] = []
        done = threading.Condition()

        def wait_for(label: str, client: lockrouter.Client) -> None:
            lock = client.acquire("py:queue", ttl=2, wait=20)
            with done:
                granted.append((label, lock))
                done.notify_all()

        tb = threading.Thread(target=wait_for, args=("B", b), daemon=True)
        tc = threading.Thread(target=wait_for, args=("C", c), daemon=True)
        tb.start()
        time.sleep(0.5)  # B is queued before C
        tc.start()
        # Longer than the waiters' 2 s TTL: validity counted from B's request
        # would be gone by the grant; the client confirms the grant instead.
        time.sleep(2.5)
        assert not granted
        first.release()
        with done:
            assert done.wait_for(lambda: len(granted) >= 1, timeout=10)
        label, lock_b = granted[0]
        assert label == "B", "B queued first"
        assert lock_b.is_held() and lock_b.fencing_token > first.fencing_token
        # B keeps it past its TTL while C waits behind it.
        time.sleep(2.5)
        assert lock_b.is_held()
        assert len(granted) == 1, "C must not be granted while B holds"
        lock_b.release()
        with done:
            assert done.wait_for(lambda: len(granted) == 2, timeout=10)
        label, lock_c = granted[1]
        assert label == "C" and lock_c.fencing_token > lock_b.fencing_token
        lock_c.release()
        tb.join(5)
        tc.join(5)
    finally:
        for cl in clients:
            cl.close()


def test_many_locks_are_renewed_with_one_request_per_interval(
    start_etcd: Callable[[], Etcd], start_router: Callable[..., Router]
) -> None:
    # A router of its own, so its metrics count only this client's requests.
    router = start_router([start_etcd(), start_etcd()])
    with lockrouter.Client(router.url) as client:
        locks = [client.acquire(f"py:batch-{i}", ttl=3) for i in range(40)]

        def batches() -> float:
            return router.metric("lockrouter_requests_total", 'op="renew_batch"')

        def singles() -> float:
            return router.metric("lockrouter_requests_total", 'op="renew"')

        b0, s0 = batches(), singles()
        time.sleep(6)  # six 1 s intervals
        sent = batches() - b0
        # One per interval is 6; renewing each lock alone would be 240.
        assert 3 <= sent <= 12, f"{sent} renew-batch requests for 40 locks over 6 intervals"
        assert singles() - s0 == 0, "no single renewals"
        assert all(lock.is_held() for lock in locks)


def test_without_a_router_a_lock_is_lost_by_the_client_clock_before_its_lease_ends(
    etcd: Etcd, start_router: Callable[..., Router]
) -> None:
    doomed = start_router([etcd])
    witness = start_router([etcd])
    with lockrouter.Client(doomed.url, safety_margin=2) as client:
        lock = client.acquire("py:orphan", ttl=6)
        time.sleep(2.5)  # at least one renewal confirmed
        doomed.kill()
        # The client's own clock is the judge: renewals now fail, and the lock
        # is trusted exactly until the validity its last confirmation proved.
        deadline = time.monotonic() + lock.time_left()
        assert lock.is_held()
        assert lock.lost.wait(timeout=20), "lost fires once validity runs out"
        fired = time.monotonic()
        assert fired <= deadline + 0.1, f"lost fired {fired - deadline:.3f} s after validity ended"
        assert fired >= deadline - 0.1, f"lost fired {deadline - fired:.3f} s before validity ended"
        assert lock.lost_reason is LostReason.UNCONFIRMED
        assert not lock.is_held() and lock.time_left() == 0
        # The client gave up while the lease still stood (the 2 s margin): it
        # never trusts a lock longer than the router could vouch for.
        seen = witness.inspect("py:orphan")
        assert seen["held"] is True and seen["fencingToken"] == lock.fencing_token


def test_a_release_sent_while_the_router_is_down_is_retried_until_it_frees_the_name(
    router: Router,
) -> None:
    with lockrouter.Client(router.url) as a, lockrouter.Client(router.url) as b:
        lock = a.acquire("py:release-retry", ttl=8)
        router.kill()
        outcome: list[BaseException | None] = []

        def release() -> None:
            try:
                lock.release()
                outcome.append(None)
            except BaseException as e:  # reported below
                outcome.append(e)

        t = threading.Thread(target=release, daemon=True)
        t.start()
        time.sleep(1.5)
        assert t.is_alive(), "release keeps retrying while the router is away"
        router.start()  # the same port
        t.join(10)
        assert outcome == [None], outcome
        # Released, not expired: the next holder gets it at once.
        assert b.acquire("py:release-retry", ttl=8).fencing_token > lock.fencing_token


class Recording(httpx.HTTPTransport):
    """The real transport, noting each request's operation, the name it
    acquires, and its status (None when it got no answer). While
    ``cut_releases`` is set, releases fail as if the router were still
    unreachable, so a test decides when a retried release can get through."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str | None, int | None]] = []
        self.cut_releases = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        op = request.url.path.rsplit("/", 1)[-1]
        name = json.loads(request.content).get("name") if op == "acquire" else None
        try:
            if op == "release" and self.cut_releases:
                raise httpx.ConnectError("release cut off", request=request)
            resp = super().handle_request(request)
        except Exception:
            self.seen.append((op, name, None))
            raise
        self.seen.append((op, name, resp.status_code))
        return resp


def test_a_name_is_acquired_again_only_after_its_unanswered_release_is_answered(
    router: Router,
) -> None:
    # docs/client.md, "A release that was not answered": a release whose
    # answer never came may land later, and would end the grant an
    # idempotent re-acquire hands back (the same one). The acquire first
    # drives the release to an answer, so the router grants anew.
    rec = Recording()
    with lockrouter.Client(router.url, transport=rec, request_timeout=1) as a:
        keep = a.acquire("py:late-keep", ttl=8)  # keeps the session lease alive
        lock = a.acquire("py:late", ttl=8)
        old_id, old_token = lock.lock_id, lock.fencing_token
        router.kill()
        del lock  # released in the background, unanswered while the router is away
        gc.collect()
        deadline = time.monotonic() + 5
        while ("release", None, None) not in rec.seen:
            assert time.monotonic() < deadline, rec.seen
            time.sleep(0.02)
        # Back on the same port, the old grant still standing; the retried
        # release gets through only from the acquire on, so that the test
        # sees what the SDK sends first.
        rec.cut_releases = True
        router.start()
        rec.cut_releases = False
        again = a.acquire("py:late", ttl=8)
        assert again.fencing_token > old_token, "a new grant"
        # No acquire of the name went out before its release was answered.
        cut = rec.seen.index(("release", None, None))
        first = next(i for i in range(cut, len(rec.seen)) if rec.seen[i][:2] == ("acquire", "py:late"))
        assert ("release", None, 204) in rec.seen[cut:first], rec.seen
        # The old grant is gone: it no longer renews.
        r = httpx.post(
            f"{router.url}/api/v1/locks/renew",
            json={"lockId": old_id, "fencingToken": old_token},
            timeout=5,
            trust_env=False,
        )
        assert r.status_code == 409, r.text
        assert again.is_held() and keep.is_held()


def test_a_shard_outage_loses_only_the_locks_on_that_shard(
    start_etcd: Callable[[], Etcd], start_router: Callable[..., Router]
) -> None:
    shards = [start_etcd(), start_etcd()]
    router = start_router(shards)
    by_shard: dict[str, str] = {}
    for i in range(200):
        name = f"py:shard-{i}"
        by_shard.setdefault(router.inspect(name)["shard"], name)
        if len(by_shard) == 2:
            break
    assert set(by_shard) == {"a", "b"}, by_shard
    with lockrouter.Client(router.url) as client:
        lock_a = client.acquire(by_shard["a"], ttl=3)
        lock_b = client.acquire(by_shard["b"], ttl=3)
        shards[1].kill()
        # b's renewals now answer shard_unavailable (retried) until its
        # validity runs out; a's go on.
        assert lock_b.lost.wait(timeout=10)
        assert lock_b.lost_reason is LostReason.UNCONFIRMED
        time.sleep(2)
        assert lock_a.is_held() and not lock_a.lost.is_set()


def test_a_lock_released_behind_the_clients_back_is_lost_at_once_as_expired(router: Router) -> None:
    import httpx

    with lockrouter.Client(router.url) as client:
        lock = client.acquire("py:gone", ttl=30)
        # Someone else releases the grant: the next renewal (10 s on) would
        # say "expired"; the client must not wait for its validity (27 s).
        r = httpx.post(f"{router.url}/api/v1/locks/release", trust_env=False,
                       json={"lockId": lock.lock_id, "fencingToken": lock.fencing_token})  # fmt: skip
        assert r.status_code == 204
        assert lock.lost.wait(timeout=15), "lost at the first renewal"
        assert lock.lost_reason is LostReason.EXPIRED
        assert lock.time_left() == 0


class _Recording(httpx.BaseTransport):
    """httpx's real transport, with every request's path and body written down."""

    def __init__(self) -> None:
        self._inner = httpx.HTTPTransport()
        self._mutex = threading.Lock()
        self._sent: list[tuple[str, dict]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with self._mutex:
            self._sent.append((request.url.path, json.loads(request.content) if request.content else {}))
        return self._inner.handle_request(request)

    def close(self) -> None:
        self._inner.close()

    def sent(self, suffix: str) -> list[dict]:
        with self._mutex:
            return [body for path, body in self._sent if path.endswith(suffix)]


def test_re_entrant_holds_are_one_lock_renewed_once_and_released_with_the_last(router: Router) -> None:
    rec = _Recording()
    with lockrouter.Client(router.url, client_id="py-twice-A", transport=rec) as a, \
            lockrouter.Client(router.url) as b:  # fmt: skip
        first = a.acquire("py:twice", ttl=3)
        second = a.acquire("py:twice", ttl=3, reentrant=True)
        assert second.lock_id == first.lock_id and second.fencing_token == first.fencing_token
        assert len(rec.sent("/acquire")) == 1, "joined without asking the router"
        # Past the TTL: both held, renewed as the one lock they are.
        time.sleep(4)
        assert first.is_held() and second.is_held()
        assert abs(first.time_left() - second.time_left()) < 0.05, "one validity"
        batches = rec.sent("/renew-batch")
        assert 2 <= len(batches) <= 8, f"{len(batches)} renew-batch requests over 4 intervals"
        assert all(len(batch["locks"]) == 1 for batch in batches), batches
        assert rec.sent("/renew") == []

        second.release()
        assert second.lost.is_set() and second.lost_reason is LostReason.RELEASED
        assert first.is_held(), "the outer hold keeps the grant"
        assert rec.sent("/release") == [] and b.try_acquire("py:twice", ttl=3) is None
        first.release()
        assert len(rec.sent("/release")) == 1, "released once, with the last hold"
        nxt = b.try_acquire("py:twice", ttl=3)
        assert nxt is not None and nxt.fencing_token > first.fencing_token
        nxt.release()


def test_one_client_excludes_its_own_threads_from_a_name_unless_reentrant_is_asked(router: Router) -> None:
    with lockrouter.Client(router.url) as a:
        first = a.acquire("py:mine", ttl=5)
        assert a.try_acquire("py:mine", ttl=5) is None, "held by another thread of this client"
        got: list[lockrouter.Lock | None] = []
        waiter = threading.Thread(target=lambda: got.append(a.try_acquire("py:mine", ttl=5, wait=5)))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive(), "the second thread waits its turn"
        first.release()
        waiter.join(5)
        second = got[0]
        assert second is not None and second.fencing_token > first.fencing_token, "a new grant"
        assert router.inspect("py:mine")["fencingToken"] == second.fencing_token
        second.release()


def test_a_thread_waiting_on_its_own_clients_release_gets_a_new_grant_every_time(router: Router) -> None:
    # If the name's turn passed on before the release began, the waiting
    # thread would ask the router while the grant still stands and be
    # handed that very grant as it is released.
    with lockrouter.Client(router.url) as a:
        held = a.acquire("py:handoff", ttl=10)
        for round in range(60):
            got: list[lockrouter.Lock | None] = []
            waiter = threading.Thread(target=lambda: got.append(a.try_acquire("py:handoff", ttl=10, wait=5)))
            waiter.start()
            time.sleep(0.002)
            token = held.fencing_token
            held.release()
            waiter.join(10)
            nxt = got[0]
            assert nxt is not None and nxt.fencing_token > token, f"round {round}: a new grant, never the old"
            assert nxt.is_held(), f"round {round}"
            held = nxt
        held.release()


def test_a_wait_longer_than_the_routers_cap_queues_again_until_granted(
    etcd: Etcd, start_router: Callable[..., Router]
) -> None:
    router = start_router([etcd], extra="\n[limits]\nmax_wait_ms = 1000\n")
    with lockrouter.Client(router.url) as a, lockrouter.Client(router.url) as b:
        held = a.acquire("py:long", ttl=10)
        got: list[lockrouter.Lock | None] = []
        waiter = threading.Thread(target=lambda: got.append(b.try_acquire("py:long", ttl=3, wait=None)))
        waiter.start()
        time.sleep(2.5)
        assert waiter.is_alive(), "still queued past the router's cap"
        held.release()
        waiter.join(3)
        assert got and got[0] is not None and got[0].fencing_token > held.fencing_token
        got[0].release()


def test_a_waiting_acquire_cancelled_from_another_thread_ends_at_once_and_leaves_the_queue(
    router: Router,
) -> None:
    with lockrouter.Client(router.url) as holder, lockrouter.Client(router.url) as a:
        held = holder.acquire("py:cancel", ttl=10)
        outcomes: dict[str, object] = {}

        def waiting(key: str, client: lockrouter.Client, cancel: threading.Event) -> threading.Thread:
            def run() -> None:
                try:
                    outcomes[key] = client.acquire("py:cancel", ttl=10, wait=30, cancel=cancel)
                except BaseException as e:  # judged below
                    outcomes[key] = e

            t = threading.Thread(target=run, daemon=True)
            t.start()
            return t

        def cancelled_within(t: threading.Thread, cancel: threading.Event, key: str) -> float:
            start = time.monotonic()
            cancel.set()
            t.join(5)
            took = time.monotonic() - start
            assert not t.is_alive(), f"{key}: still waiting after its cancel"
            e = outcomes[key]
            assert isinstance(e, lockrouter.Cancelled) and e.name == "py:cancel", e
            return took

        # Queued at the router, 30 s to go (a kept-alive connection of the
        # client's at hand: the wait must not be sent on it).
        assert a.inspect("py:cancel").held
        at_router = threading.Event()
        t = waiting("router", a, at_router)
        deadline = time.monotonic() + 5
        while router.inspect("py:cancel").get("waiters") != 1:
            assert time.monotonic() < deadline, "the acquire never queued at the router"
            time.sleep(0.05)
        took = cancelled_within(t, at_router, "router")
        assert took < 1.0, f"a cancelled wait took {took:.2f} s to end"
        deadline = time.monotonic() + 2
        while "waiters" in (seen := router.inspect("py:cancel")):
            assert time.monotonic() < deadline, f"the cancelled wait left its queue entry: {seen}"
            time.sleep(0.05)

        # Waiting its turn behind another thread of its own client.
        in_turn = threading.Event()
        t = waiting("turn", holder, in_turn)
        time.sleep(0.3)
        assert t.is_alive() and "waiters" not in router.inspect("py:cancel"), "it waits in its client"
        took = cancelled_within(t, in_turn, "turn")
        assert took < 1.0, f"a cancelled turn took {took:.2f} s to end"

        # The holder was never disturbed; nothing of the waits lingers.
        seen = router.inspect("py:cancel")
        assert seen["held"] is True and seen["fencingToken"] == held.fencing_token, seen
        assert "waiters" not in seen and held.is_held()
        assert not [th for th in threading.enumerate() if th.name == "lockrouter-cancel"]
        with pytest.raises(lockrouter.Cancelled):
            a.try_acquire("py:cancel", ttl=10, wait=30, cancel=at_router)  # set already
        # Both clients take the name again in turn once it is free.
        held.release()
        mine = a.acquire("py:cancel", ttl=10, wait=5)
        assert mine.fencing_token > held.fencing_token
        mine.release()
        again = holder.acquire("py:cancel", ttl=10, wait=5)
        again.release()


def test_over_tls_a_cancelled_waiting_acquire_ends_at_once_and_the_router_drops_its_waiter(
    etcd: Etcd, start_router: Callable[..., Router], tls: Tls
) -> None:
    # The cut shuts down the request's TLS connection under the thread
    # reading it: the read must fail at once, and the router must see the
    # connection go and drop the waiter.
    router = start_router([etcd], tls=tls)
    assert router.url.startswith("https://")
    https = {"verify": tls.trusting()}
    with (
        lockrouter.Client(router.url, **https) as holder,
        lockrouter.Client(router.url, **https) as waiter,
        lockrouter.Client(router.url, **https) as other,
    ):
        held = holder.acquire("py:tls-cancel", ttl=10)
        cancel = threading.Event()
        outcome: list[object] = []

        def wait() -> None:
            try:
                outcome.append(waiter.acquire("py:tls-cancel", ttl=10, wait=30, cancel=cancel))
            except BaseException as e:  # judged below
                outcome.append(e)

        t = threading.Thread(target=wait, daemon=True)
        t.start()
        deadline = time.monotonic() + 5
        while router.inspect("py:tls-cancel").get("waiters") != 1:
            assert time.monotonic() < deadline, "the acquire never queued at the router"
            time.sleep(0.05)
        start = time.monotonic()
        cancel.set()
        t.join(5)
        took = time.monotonic() - start
        assert not t.is_alive(), "still waiting after its cancel"
        assert len(outcome) == 1 and isinstance(outcome[0], lockrouter.Cancelled), outcome
        assert outcome[0].name == "py:tls-cancel"
        assert took < 1.0, f"a cancelled wait took {took:.2f} s to end"

        deadline = time.monotonic() + 2
        while "waiters" in (seen := router.inspect("py:tls-cancel")):
            assert time.monotonic() < deadline, f"the cancelled wait left its queue entry: {seen}"
            time.sleep(0.05)
        assert router.metric("lockrouter_waiters", 'shard="a"') == 0
        # Nobody queued: once released, the name goes to an acquire that
        # does not wait.
        held.release()
        mine = other.try_acquire("py:tls-cancel", ttl=10)
        assert mine is not None and mine.fencing_token > held.fencing_token
        mine.release()


def test_metadata_inspect_extend_and_the_on_lost_callback(router: Router) -> None:
    with lockrouter.Client(router.url, client_id="py-meta") as a, lockrouter.Client(router.url) as b:
        lock = a.acquire("py:meta", ttl=10, metadata={"job": "report"})
        losses: list[LostReason] = []
        lock.on_lost(losses.append)

        info = a.inspect("py:meta")
        assert info.held and info.mine and info.fencing_token == lock.fencing_token
        assert info.metadata == {"job": "report"} and info.holder == "py-meta", info
        assert info.waiters == 0 and 5 < info.time_left() <= 11
        theirs = b.inspect("py:meta")
        assert theirs.held and not theirs.mine
        assert not b.inspect("py:free").held

        time.sleep(1.5)
        before = lock.time_left()
        after = lock.extend()
        assert before + 0.5 < after <= 10, (before, after)
        assert losses == []
        httpx.post(f"{router.url}/api/v1/locks/release", json={"lockId": lock.lock_id, "fencingToken": lock.fencing_token})
        with pytest.raises(lockrouter.LockLost) as lost:
            lock.extend()
        assert lost.value.reason is LostReason.EXPIRED
        assert losses == [LostReason.EXPIRED], "the callback ran once, with the reason"


def test_extend_to_a_longer_ttl_keeps_the_token_and_renews_and_releases_under_the_new_lock_id(
    router: Router,
) -> None:
    with lockrouter.Client(router.url) as a, lockrouter.Client(router.url) as b:
        lock = a.acquire("py:extend-to", ttl=2)
        old_id, token = lock.lock_id, lock.fencing_token
        left = lock.extend(ttl=6)
        assert 4 < left <= 6, left
        assert lock.fencing_token == token, "the same grant"
        assert lock.lock_id != old_id, "on the new TTL's lease"
        assert lock.ttl == 6

        # Past the new TTL: only renewals under the new lockId keep it (the
        # old one answers `stolen`).
        time.sleep(7)
        assert lock.is_held() and not lock.lost.is_set()
        info = a.inspect("py:extend-to")
        assert info.held and info.mine and info.fencing_token == token
        assert b.try_acquire("py:extend-to", ttl=2) is None

        lock.release()
        nxt = b.try_acquire("py:extend-to", ttl=2)
        assert nxt is not None and nxt.fencing_token > token, "the release freed the name"
        nxt.release()


def test_an_extend_while_a_renewal_is_in_flight_is_not_taken_for_a_loss(router: Router) -> None:
    with lockrouter.Client(router.url) as a:
        lock = a.acquire("py:extend-race", ttl=2)
        transport = lock._keeper.transport
        real = transport.renew_batch
        sent, moved = threading.Event(), threading.Event()
        answers: list[list[bool]] = []

        def held_back(refs: list, timeout: float) -> list:
            # Sent under the old lockId, it reaches the router after the move.
            sent.set()
            moved.wait(5)
            results = real(refs, timeout)
            answers.append([r.reason == "stolen" for r in results])
            return results

        transport.renew_batch = held_back  # type: ignore[method-assign]
        assert sent.wait(3), "a background renewal left"
        lock.extend(ttl=6)
        moved.set()
        time.sleep(0.5)
        transport.renew_batch = real  # type: ignore[method-assign]
        assert answers and answers[0] == [True], "the old lockId answered stolen"
        assert lock.is_held() and lock.lost_reason is None
        time.sleep(4)
        assert lock.is_held(), "renewed under the new lockId since"
        lock.release()
        assert router.inspect("py:extend-race")["held"] is False


def test_calls_after_close_raise_the_sdks_typed_error_never_an_httpx_one(router: Router) -> None:
    # The router up at close: close() released the lock, so a release
    # afterwards has nothing left to do.
    up = lockrouter.Client(router.url)
    confirmed = up.acquire("py:closed-up", ttl=10)
    up.close()
    confirmed.release()
    assert router.inspect("py:closed-up")["held"] is False

    # The router down at close: the release close() sent never got through.
    down = lockrouter.Client(router.url, request_timeout=0.5)
    pending = down.acquire("py:closed-down", ttl=10)
    router.kill()
    down.close()
    with pytest.raises(lockrouter.ClientClosed) as e:
        pending.release()
    assert isinstance(e.value, lockrouter.LockrouterError) and not e.value.retryable
    assert "py:closed-down" in str(e.value)
    with pytest.raises(lockrouter.ClientClosed):
        down.acquire("py:closed-down", ttl=10)
    with pytest.raises(lockrouter.ClientClosed):
        up.try_acquire("py:closed-up", ttl=10)


def test_a_with_block_whose_exit_release_fails_still_raises_its_own_exception(
    router: Router, caplog: pytest.LogCaptureFixture
) -> None:
    client = lockrouter.Client(router.url, request_timeout=0.5)
    boom = ValueError("the block's own error")
    with pytest.raises(ValueError) as e:
        with client.lock("py:exit-down", ttl=10) as lock:
            router.kill()
            client.close()  # its release cannot get through: the exit's cannot either
            raise boom
    assert e.value is boom, f"the exit replaced the block's exception with {e.value!r}"
    assert lock.lost_reason is LostReason.RELEASED
    # The exit's failure is logged, not raised.
    assert any("py:exit-down" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_an_acquire_on_its_way_when_its_client_closes_raises_client_closed(router: Router) -> None:
    with lockrouter.Client(router.url) as holder:
        held = holder.acquire("py:closed-wait", ttl=10)
        waiter = lockrouter.Client(router.url)
        outcome: list[object] = []

        def wait() -> None:
            try:
                outcome.append(waiter.acquire("py:closed-wait", ttl=10, wait=20))
            except BaseException as e:  # reported below
                outcome.append(e)

        t = threading.Thread(target=wait, daemon=True)
        t.start()
        time.sleep(0.5)  # queued at the router
        waiter.close()
        held.release()  # the router grants it to the waiter now
        t.join(5)
        # Never a Lock that nothing renews any more.
        assert len(outcome) == 1 and isinstance(outcome[0], lockrouter.ClientClosed), outcome


def test_a_client_never_closed_stops_its_threads_once_it_and_its_locks_are_gone(router: Router) -> None:
    before = set(threading.enumerate())

    def new_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t not in before and t.name.startswith("lockrouter-")]

    client = lockrouter.Client(router.url, request_timeout=1)
    lock = client.acquire("py:unclosed", ttl=10)
    assert new_threads(), "the renewal thread runs"
    del client, lock  # never closed, never released
    gc.collect()
    deadline = time.monotonic() + 5
    while new_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not new_threads(), f"still running: {new_threads()}"
    # Released on the way out, not left to its TTL.
    assert router.inspect("py:unclosed")["held"] is False
