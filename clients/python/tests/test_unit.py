"""The client's rules without a router: the validity clock, the renewal
schedule (batching, splitting at the API's limit, what answers mean), the
shared grant state, the fencing helpers, and what goes on the wire
(bearer token, bodies, error mapping, ``Retry-After`` read and waited
out, a refused release not retried, a refused batch renewed lock by lock,
a failing release at a ``with`` exit never replacing the block's
exception) through httpx's mock transport."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time

import httpx
import pytest

import lockrouter
from lockrouter import LostReason, fencing, validity
from lockrouter._schedule import Batch, Confirmed, Lost, Retry, Schedule, outcome
from lockrouter._state import LockState, Registry
from lockrouter._transport import MAX_RETRY_AFTER, LockRef, Renewed, Settings, SyncTransport, error_from, retry_after
from lockrouter.client import renew


def state(key: int, ttl: float = 30.0, valid_for: float = 27.0, now: float | None = None) -> LockState:
    now = validity.now() if now is None else now
    return LockState(key, f"lock-{key}", LockRef(f"id-{key}", key + 1), ttl, 0.1, now + valid_for, "c")


def test_validity_counts_from_before_sending_minus_the_margin() -> None:
    assert validity.valid_until(100.0, 10.0, 1.0) == 109.0
    assert validity.valid_until(100.0, 0.05, validity.MIN_MARGIN) == 100.0
    assert validity.margin(30) == 3.0
    assert validity.margin(0.5) == validity.MIN_MARGIN
    assert validity.margin(30, 0) == validity.MIN_MARGIN
    assert validity.renew_interval(3) == 1.0
    # Renew a third of the TTL on, sooner when validity is short.
    assert validity.next_renewal(0, 27, 10) == 10
    assert validity.next_renewal(0, 12, 10) == 2
    assert validity.next_renewal(0, 3, 10) == 0


def test_backoff_grows_and_stays_under_its_cap() -> None:
    for failures in range(1, 40):
        assert validity.backoff(failures, 1.0) <= 1.0
    assert validity.backoff(1, 1.0) <= 0.1
    assert validity.backoff(10, 1.0) >= 0.5


def test_locks_due_close_together_share_one_batch_split_at_the_limit() -> None:
    s = Schedule(Registry(), 5.0)
    t0 = 1000.0
    for key in range(2500):
        # Acquired over 2.5 s: all within half an interval (5 s) of the first.
        s.track(state(key, now=t0 + key / 1000), t0 + key / 1000)
    assert s.due(t0 + 3) == ([], [])
    batches, _ = s.due(t0 + 10)
    assert [len(b.refs) for b in batches] == [1000, 1000, 500]
    assert s.due(t0 + 10.5) == ([], []), "nothing is sent twice"


def test_a_lock_due_much_later_waits_for_its_own_turn() -> None:
    s = Schedule(Registry(), 5.0)
    s.track(state(1, now=0), 0)
    s.track(state(2, now=8), 8)
    batches, _ = s.due(10)
    assert [b.keys for b in batches] == [[1]]


def test_answers_confirm_lose_at_once_or_retry() -> None:
    assert outcome(Renewed(True, 5.0)) == Confirmed(5.0)
    assert outcome(Renewed(False, reason="expired")) == Lost(LostReason.EXPIRED)
    assert outcome(Renewed(False, reason="stolen")) == Lost(LostReason.STOLEN)
    assert outcome(Renewed(False, reason="shard_unavailable")) == Retry()
    now = validity.now()
    s = Schedule(Registry(), 5.0)
    states = [state(k, now=now) for k in range(3)]
    for st in states:
        s.track(st, now)
    s.due(now + 10)
    s.renewed(now, [(0, Confirmed(60.0)), (1, Lost(LostReason.EXPIRED)), (2, Retry())], now)
    assert states[0].valid_until == pytest.approx(now + 60 - 0.1)
    assert states[1].lost_now() is LostReason.EXPIRED
    assert s.next_wake() is not None and s.next_wake() <= now + 0.1, "the retry comes soon"


def test_lost_by_the_clock_and_never_revived() -> None:
    now = validity.now()
    st = state(1, valid_for=-0.001, now=now)
    seen: list[LostReason] = []
    st.on_lost(seen.append)
    assert st.lost_now() is LostReason.UNCONFIRMED and seen == [LostReason.UNCONFIRMED]
    st.confirm(now + 100)
    assert st.lost_now() is LostReason.UNCONFIRMED, "a late answer cannot revive it"
    assert not st.mark_lost(LostReason.STOLEN), "the first reason stays"


def test_one_grant_acquired_twice_is_one_state() -> None:
    reg = Registry()
    a = state(1)
    claim, got = reg.claim("id-1", a.valid_until, lambda: a)
    assert claim.value == "new" and got is a
    claim, got = reg.claim("id-1", a.valid_until + 1, lambda: state(1))
    assert claim.value == "held" and got is a
    assert reg.begin_release(a) is True
    assert a.lost_now() is LostReason.RELEASED
    claim, _ = reg.claim("id-1", a.valid_until, lambda: state(1))
    assert claim.value == "releasing"


def test_a_lock_released_during_an_extend_moves_to_the_new_lock_id_and_stays_lost() -> None:
    # The release was asked for while the extend was on the wire: the
    # extend's answer still moves the grant (the router holds it under the
    # new lockId), so the release names the new one; no new validity.
    reg = Registry()
    a = state(1, ttl=2.0, valid_for=1.8)
    reg.claim("id-1", a.valid_until, lambda: a)
    before = a.valid_until
    assert reg.begin_release(a) is True
    moved = reg.switch(a, LockRef("id-1-moved", 2), 6.0, 0.6, validity.now() + 5.0)
    assert moved is False, "not live"
    assert a.ref.lock_id == "id-1-moved", "released under the lockId the router holds it under"
    assert a.lost_now() is LostReason.RELEASED and a.valid_until == before
    b = state(2, ttl=2.0, valid_for=1.8)
    reg.claim("id-2", b.valid_until, lambda: b)
    until = validity.now() + 5.0
    assert reg.switch(b, LockRef("id-2-moved", 3), 6.0, 0.6, until) is True
    assert b.valid_until == until and b.lost_now() is None


def test_the_bearer_token_and_bodies_go_on_the_wire() -> None:
    seen: list[httpx.Request] = []

    def router(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        body = json.loads(request.content)
        if request.url.path.endswith("/acquire"):
            return httpx.Response(200, json={"acquired": True, "lockId": "L1",
                                             "fencingToken": 7, "expiresAt": "x",
                                             "expiresInMs": 29990})  # fmt: skip
        if request.url.path.endswith("/release"):
            assert body == {"lockId": "L1", "fencingToken": 7}
            return httpx.Response(204)
        return httpx.Response(503, json={"error": {"code": "shard_unavailable", "message": "m"}})

    client = lockrouter.Client(
        "https://router.example:8443", token="s3cret", client_id="w-7",
        transport=httpx.MockTransport(router),
    )  # fmt: skip
    with client:
        with client.lock("job:42", ttl=30) as lock:
            assert lock.fencing_token == 7 and lock.client_id == "w-7"
    acquire = json.loads(seen[0].content)
    assert acquire == {"name": "job:42", "ttlMs": 30000, "clientId": "w-7"}
    assert all(r.headers["Authorization"] == "Bearer s3cret" for r in seen)
    assert seen[-1].url.path == "/api/v1/locks/release"


def test_errors_are_typed() -> None:
    def router(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"code": "invalid_argument", "message": "ttl"}})

    with lockrouter.Client("http://r:1", transport=httpx.MockTransport(router)) as client:
        with pytest.raises(lockrouter.RouterError) as e:
            client.acquire("x", ttl=1)
    assert e.value.status == 400 and e.value.code == "invalid_argument"
    assert not e.value.retryable
    assert lockrouter.RouterError(503, "shard_unavailable", "").retryable
    assert lockrouter.TransportError("refused").retryable
    with pytest.raises(lockrouter.ConfigError):
        lockrouter.Client("router:8080")
    with pytest.raises(lockrouter.TransportError):
        with lockrouter.Client(f"http://127.0.0.1:{_closed_port()}", request_timeout=1) as c:
            c.acquire("x", ttl=2)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # httpx 0.28 prefers an SSLContext
def test_setup_errors_are_config_errors_never_httpx_or_os_errors(tmp_path) -> None:
    with pytest.raises(lockrouter.ConfigError):
        lockrouter.Client("http://127.0.0.1:99999")
    with pytest.raises(lockrouter.ConfigError):
        lockrouter.Client("http://[::1")
    with pytest.raises(lockrouter.ConfigError):
        lockrouter.Client("https://127.0.0.1:8443", verify=str(tmp_path / "missing-ca.pem"))
    with pytest.raises(lockrouter.ConfigError):
        lockrouter.AsyncClient("https://127.0.0.1:8443", cert=str(tmp_path / "missing-cert.pem"))


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_fencing_helpers() -> None:
    assert fencing.admits(None, 7) and fencing.admits(7, 7) and not fencing.admits(9, 7)
    assert fencing.fence_key_value(42) == "00000000000000000042"
    with pytest.raises(ValueError):
        fencing.as_i64(2**64 - 1)
    fence = fencing.Fence()
    threads = [
        threading.Thread(target=lambda t=t: [_try(fence, t * 1000 + i) for i in range(1000)])
        for t in range(1, 9)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert fence.highest == 8999
    with pytest.raises(fencing.Stale):
        fence.admit(8998)


def _try(fence: fencing.Fence, token: int) -> None:
    try:
        fence.admit(token)
    except fencing.Stale:
        pass


def test_the_sqlite_fence_rejects_lower_tokens() -> None:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    fencing.sqlite_create_fences(conn)
    assert fencing.sqlite_admit(conn, "order:1", 5) is None
    assert fencing.sqlite_admit(conn, "order:1", 5) is None, "the same grant writes again"
    assert fencing.sqlite_admit(conn, "order:1", 9) is None
    assert fencing.sqlite_admit(conn, "order:1", 5) == 9
    assert fencing.sqlite_admit(conn, "order:2", 1) is None, "per resource"


def test_a_refused_release_is_not_retried() -> None:
    calls: list[str] = []

    def router(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path.endswith("/acquire"):
            return httpx.Response(200, json={"acquired": True, "lockId": "L1",
                                             "fencingToken": 7, "expiresInMs": 29990})  # fmt: skip
        return httpx.Response(400, json={"error": {"code": "invalid_argument", "message": "bad"}})

    with lockrouter.Client("http://r:1", transport=httpx.MockTransport(router)) as client:
        lock = client.acquire("x", ttl=30)
        with pytest.raises(lockrouter.RouterError):
            lock.release()
    assert calls.count("/api/v1/locks/release") == 1


def test_a_408_is_retried_as_the_request_never_ran() -> None:
    calls: list[str] = []

    def router(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path.endswith("/acquire"):
            return httpx.Response(200, json={"acquired": True, "lockId": "L1",
                                             "fencingToken": 7, "expiresInMs": 29990})  # fmt: skip
        if calls.count("/api/v1/locks/release") == 1:
            return httpx.Response(408, json={"error": {"code": "timeout", "message": "body too slow"}})
        return httpx.Response(204)

    assert lockrouter.RouterError(408, "timeout", "").retryable
    with lockrouter.Client("http://r:1", transport=httpx.MockTransport(router)) as client:
        client.acquire("x", ttl=30).release()
    assert calls.count("/api/v1/locks/release") == 2, "the 408 was retried"


def _refusal(status: int, code: str, after: str | None = None) -> httpx.Response:
    headers = {} if after is None else {"Retry-After": after}
    return httpx.Response(status, headers=headers, json={"error": {"code": code, "message": "m"}})


def test_retry_after_is_whole_seconds_or_nothing() -> None:
    assert retry_after("1") == 1.0 and isinstance(retry_after("1"), float)
    assert retry_after(" 2 ") == 2.0 and retry_after("0") == 0.0 and retry_after("007") == 7.0
    http_date = "Wed, 21 Oct 2015 07:28:00 GMT"
    for garbage in (None, "", " ", "-1", "+1", "1.5", "1s", "soon", "1, 2", "\u00b2", http_date):
        assert retry_after(garbage) is None, garbage
    assert retry_after("86400") == MAX_RETRY_AFTER == 3600
    assert retry_after("9" * 5000) == MAX_RETRY_AFTER, "too long for int(): the cap, not a crash"
    assert error_from(_refusal(503, "overloaded", "1")).retry_after == 1.0
    assert error_from(_refusal(503, "overloaded")).retry_after is None
    assert error_from(_refusal(503, "overloaded", http_date)).retry_after is None
    assert error_from(_refusal(429, "rate_limited", "-3")).retry_after is None
    proxy = httpx.Response(502, text="<html>bad gateway</html>", headers={"Retry-After": "3"})
    assert error_from(proxy).retry_after == 3.0, "read whatever the body"


def test_refusals_carry_the_routers_retry_after() -> None:
    answers = {
        "overloaded": lambda: _refusal(503, "overloaded", "1"),
        "unavailable": lambda: _refusal(503, "shard_unavailable", "1"),
        "limited": lambda: _refusal(429, "rate_limited", "2"),
        "invalid": lambda: _refusal(400, "invalid_argument"),
    }

    def router(request: httpx.Request) -> httpx.Response:
        return answers[json.loads(request.content)["name"]]()

    with lockrouter.Client("http://r:1", transport=httpx.MockTransport(router)) as client:
        for name, status, wait in (
            ("overloaded", 503, 1.0),
            ("unavailable", 503, 1.0),
            ("limited", 429, 2.0),
            ("invalid", 400, None),
        ):
            with pytest.raises(lockrouter.RouterError) as e:
                client.acquire(name, ttl=30)
            assert (e.value.status, e.value.retry_after) == (status, wait), name

    async def run() -> None:
        async with lockrouter.AsyncClient("http://r:1", transport=httpx.MockTransport(router)) as client:
            with pytest.raises(lockrouter.RouterError) as e:
                await client.acquire("limited", ttl=30)
            assert e.value.status == 429 and e.value.retry_after == 2.0

    asyncio.run(run())
    plain = lockrouter.RouterError(503, "overloaded", "busy")
    assert plain.retry_after is None and str(plain) == "router answered 503 overloaded: busy"
    assert lockrouter.RouterError(503, "overloaded", "busy", retry_after=1.0).retry_after == 1.0


class _Busy:
    """A router that grants every acquire (``L1``, valid for ``expires_ms``)
    and answers the first ``busy`` releases 503 ``overloaded`` with
    ``Retry-After: after``, then 204; it notes when each release came."""

    def __init__(self, after: str, busy: int = 1, expires_ms: int = 29990) -> None:
        self.after, self.busy, self.expires_ms = after, busy, expires_ms
        self.releases: list[float] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/acquire"):
            return httpx.Response(200, json={"acquired": True, "lockId": "L1",
                                             "fencingToken": 7, "expiresInMs": self.expires_ms})  # fmt: skip
        if request.url.path.endswith("/release"):
            self.releases.append(time.monotonic())
            if len(self.releases) <= self.busy:
                return _refusal(503, "overloaded", self.after)
        return httpx.Response(204)


def test_a_release_is_retried_no_sooner_than_retry_after() -> None:
    router = _Busy("1")
    with lockrouter.Client("http://r:1", transport=httpx.MockTransport(router)) as client:
        client.acquire("x", ttl=30).release()
    assert len(router.releases) == 2, "retried once, then confirmed"
    assert router.releases[1] - router.releases[0] >= 1.0, "the backoff alone is a tenth of a second"


def test_async_a_release_is_retried_no_sooner_than_retry_after() -> None:
    router = _Busy("1")

    async def run() -> None:
        async with lockrouter.AsyncClient("http://r:1", transport=httpx.MockTransport(router)) as client:
            await (await client.acquire("x", ttl=30)).release()

    asyncio.run(run())
    assert len(router.releases) == 2, "retried once, then confirmed"
    assert router.releases[1] - router.releases[0] >= 1.0, "the backoff alone is a tenth of a second"


def test_a_release_whose_retry_after_outlasts_validity_stops_at_once() -> None:
    router = _Busy("5", busy=100, expires_ms=2000)  # valid for 1.8 s
    with lockrouter.Client("http://r:1", transport=httpx.MockTransport(router), request_timeout=0.5) as client:
        lock = client.acquire("x", ttl=2)
        with pytest.raises(lockrouter.RouterError) as e:
            lock.release()
        assert e.value.retry_after == 5.0
        assert len(router.releases) == 1, "no retry within validity: the router asked for more"
    # Closing gave the release one request timeout more, all within the wait.
    assert len(router.releases) == 1, "nor from the renewal thread before the wait is over"


def test_a_background_release_waits_out_retry_after_even_when_hurried() -> None:
    s = Schedule(Registry(), 5.0)
    st = state(1, now=0.0)
    s.release(st, 0, 0.0)
    assert s.due(0.0)[1] == [st]
    s.released(st, lockrouter.RouterError(503, "overloaded", "m", retry_after=3.0), 0.1)
    s.hurry(st.key, 0.5)  # an acquire of the name wants it settled
    assert s.due(3.0) == ([], []), "not before the router's wait is over"
    assert s.next_wake() == pytest.approx(3.1)
    assert s.due(3.1)[1] == [st]
    # Handed over by release(), with the wait its last answer asked for.
    other = state(2, now=0.0)
    s.release(other, 2, 0.0, retry_after=4.0)
    assert s.due(3.9)[1] == [] and s.due(4.0)[1] == [other]
    # A closing client's deadline comes first: the release is never sent.
    s.released(other, lockrouter.RouterError(503, "overloaded", "m", retry_after=10.0), 4.0)
    s.close(4.0)
    assert s.due(8.9)[1] == [] and s.finished(9.0)


def test_a_renewal_honours_retry_after_only_where_it_fits_its_schedule() -> None:
    def refuses_batches(request: httpx.Request) -> httpx.Response:
        return _refusal(503, "overloaded", "1")

    transport = SyncTransport(Settings("http://r:1", transport=httpx.MockTransport(refuses_batches)))
    try:
        batch = Batch([1], [LockRef("L1", 2)], 1.0)
        assert renew(transport, batch) == [(1, Retry(1.0))], "the wait reaches the schedule"
    finally:
        transport.close()
    s = Schedule(Registry(), 5.0)
    long, short = state(1, ttl=30.0, now=0.0), state(2, ttl=3.0, valid_for=2.7, now=9.0)
    s.track(long, 0.0)  # renewed every 10 s; retries at most 2 s apart
    s.due(10.0)
    s.renewed(10.0, [(1, Retry(1.0))], 10.0)
    assert s.due(10.9) == ([], []) and s.next_wake() == pytest.approx(11.0), "waits the router's second"
    s.due(11.0)
    s.renewed(11.0, [(1, Retry(60.0))], 11.0)
    wake = s.next_wake()
    assert wake is not None and wake <= 11.0 + 0.2, "past its own cap: the plain backoff"
    s.forget(1)
    s.track(short, 9.0)  # renewed every second, valid until 11.7
    s.due(10.0)
    s.renewed(10.0, [(2, Retry(1.0))], 10.0)
    assert s.next_wake() == pytest.approx(11.0), "a second fits: waited"
    s.due(11.0)
    s.renewed(11.0, [(2, Retry(1.0))], 11.0)
    wake = s.next_wake()
    assert wake is not None and wake <= 11.0 + 0.2, "past validity: the plain backoff"
    for failures in range(1, 6):
        assert 1.0 <= validity.renewal_pause(failures, 2.0, 1.0, 20.0) <= 2.0
    assert validity.renewal_pause(1, 2.0, 5.0, 20.0) <= 0.1
    assert validity.renewal_pause(1, 2.0, 1.0, 0.9) <= 0.1
    assert validity.renewal_pause(1, 2.0, None, 20.0) <= 0.1


def test_an_acquire_waiting_its_turn_when_its_client_closes_raises_client_closed() -> None:
    def router(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/acquire"):
            return httpx.Response(200, json={"acquired": True, "lockId": "L1",
                                             "fencingToken": 7, "expiresInMs": 29990})  # fmt: skip
        return httpx.Response(204)

    client = lockrouter.Client("http://r:1", transport=httpx.MockTransport(router))
    held = client.acquire("x", ttl=30)
    errors: list[BaseException] = []

    def wait_forever() -> None:
        try:
            client.acquire("x", ttl=30, wait=None)
        except BaseException as e:
            errors.append(e)

    waiter = threading.Thread(target=wait_forever)
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive(), "waits its turn behind the held lock"
    client.close()
    waiter.join(5)
    assert not waiter.is_alive() and isinstance(errors[0], lockrouter.ClientClosed), errors
    assert not held.is_held()


class _RefusesBatches:
    """A router that refuses every ``renew-batch`` (400, as one over its
    ``max_batch``) but renews single locks, except ``L2``, refused on its
    own too. Grants are ``L0``, ``L1``, ... with a 2 s TTL."""

    INVALID = {"error": {"code": "invalid_argument", "message": "too many locks in one batch"}}

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self._acquired = 0
        self._mutex = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path, body = request.url.path, json.loads(request.content)
        with self._mutex:
            self.calls.append((path, body))
            if path.endswith("/acquire"):
                n, self._acquired = self._acquired, self._acquired + 1
                return httpx.Response(200, json={"acquired": True, "lockId": f"L{n}",
                                                 "fencingToken": n + 1, "expiresInMs": 2000})  # fmt: skip
        if path.endswith("/renew-batch"):
            return httpx.Response(400, json=self.INVALID)
        if path.endswith("/renew"):
            if body["lockId"] == "L2":
                return httpx.Response(400, json=self.INVALID)
            return httpx.Response(200, json={"renewed": True, "expiresInMs": 2000})
        return httpx.Response(204)

    def check(self, locks: list) -> None:
        """After 3 s (one and a half TTLs; validity is 1.8 s): without the
        fallback every lock would be lost by now."""
        assert locks[0].is_held() and locks[1].is_held(), "renewed one by one"
        assert locks[2].lost_reason is LostReason.REFUSED, "refused on its own: lost at once"
        with self._mutex:
            calls = list(self.calls)
        batches = [b for p, b in calls if p.endswith("/renew-batch")]
        assert len(batches) >= 3, f"{len(batches)} renew-batch requests: each interval tries the batch first"
        assert [lock["lockId"] for lock in batches[0]["locks"]] == ["L0", "L1", "L2"]
        assert "L2" not in [lock["lockId"] for lock in batches[-1]["locks"]]

        def singles(lock_id: str) -> int:
            return sum(1 for p, b in calls if p.endswith("/renew") and b["lockId"] == lock_id)

        assert singles("L0") >= 3 and singles("L1") >= 3, (singles("L0"), singles("L1"))
        assert singles("L2") == 1, "a lost lock is not renewed again"


def test_a_refused_batch_is_renewed_lock_by_lock() -> None:
    router = _RefusesBatches()
    with lockrouter.Client("http://r:1", transport=httpx.MockTransport(router)) as client:
        locks = [client.acquire(f"refused-{i}", ttl=2) for i in range(3)]
        time.sleep(3)
        router.check(locks)


def test_async_a_refused_batch_is_renewed_lock_by_lock() -> None:
    router = _RefusesBatches()

    async def run() -> None:
        async with lockrouter.AsyncClient("http://r:1", transport=httpx.MockTransport(router)) as client:
            locks = [await client.acquire(f"refused-{i}", ttl=2) for i in range(3)]
            await asyncio.sleep(3)
            router.check(locks)

    asyncio.run(run())


def _grants_then_breaks(request: httpx.Request) -> httpx.Response:
    """A router whose every call but an acquire fails with an exception
    that is neither the SDK's nor httpx's (a broken transport)."""
    if request.url.path.endswith("/acquire"):
        lock_id = "L-" + json.loads(request.content)["name"]
        return httpx.Response(200, json={"acquired": True, "lockId": lock_id,
                                         "fencingToken": 7, "expiresInMs": 29990})  # fmt: skip
    raise RuntimeError("broken transport")


def test_a_failing_exit_release_never_replaces_the_blocks_exception() -> None:
    boom = ValueError("the block's own error")
    transport = httpx.MockTransport(_grants_then_breaks)
    with lockrouter.Client("http://r:1", transport=transport, request_timeout=0.5) as client:
        with pytest.raises(ValueError) as e:
            with client.lock("x", ttl=30):
                raise boom
        assert e.value is boom, f"the exit replaced the block's exception with {e.value!r}"
        with pytest.raises(ValueError) as e:
            with client.acquire("y", ttl=30):
                raise boom
        assert e.value is boom, f"the exit replaced the block's exception with {e.value!r}"


def test_async_a_failing_exit_release_never_replaces_the_blocks_exception() -> None:
    boom = ValueError("the block's own error")

    async def run() -> None:
        transport = httpx.MockTransport(_grants_then_breaks)
        async with lockrouter.AsyncClient("http://r:1", transport=transport, request_timeout=0.5) as client:
            with pytest.raises(ValueError) as e:
                async with client.lock("x", ttl=30):
                    raise boom
            assert e.value is boom, f"the exit replaced the block's exception with {e.value!r}"
            with pytest.raises(ValueError) as e:
                async with await client.acquire("y", ttl=30):
                    raise boom
            assert e.value is boom, f"the exit replaced the block's exception with {e.value!r}"

    asyncio.run(run())


def test_the_last_hold_keeps_the_name_s_turn_until_its_release_has_begun() -> None:
    from lockrouter._holds import Holds, Ticket

    holds = Holds()
    s = state(1)
    key = ("c", s.name)
    assert holds.enter(key, Ticket(lambda: None))
    holds.hold(key, s)
    woken = threading.Event()
    waiter = Ticket(woken.set)
    assert not holds.enter(key, waiter), "held: the waiter queues"
    assert holds.let_go(s), "the last hold"
    assert holds.join(key) is None, "no re-entrant acquire joins a grant on its way out"
    assert not woken.is_set(), "the turn is kept until the release has begun"
    holds.pass_on(s)
    assert woken.is_set() and waiter.granted, "then it passes on"
    holds.pass_on(s)  # once only
    holds.pass_turn(key)
    assert len(holds) == 0, "nothing left behind"
