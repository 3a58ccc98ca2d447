"""The v1 HTTP API on the wire, over httpx: one pooled ``httpx.Client`` (or
``httpx.AsyncClient``) per SDK client, keep-alive, each call bounded by a
timeout, the bearer token and TLS options applied to every request.

Both transports share the request bodies and the answer parsing below, so
the sync and async SDKs cannot read the API differently. Nothing here knows
about validity or renewal policy; answers become typed values or the
errors of :mod:`lockrouter.errors`, and so does every exception of httpx:
no httpx exception leaves this module. A transport once closed raises
:class:`~lockrouter.errors.ClientClosed` for every call, including one
that was on its way when it closed. The sync transport's acquire takes a
``threading.Event`` that cancels it (:class:`_Cut`): the asyncio one is
cancelled with its task.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import socket
import threading
from typing import Any, Mapping
from urllib.parse import quote

import httpx

from .errors import Cancelled, ClientClosed, ConfigError, LockrouterError, RouterError, TransportError

ACQUIRE = "/api/v1/locks/acquire"
RENEW = "/api/v1/locks/renew"
RENEW_BATCH = "/api/v1/locks/renew-batch"
RELEASE = "/api/v1/locks/release"
EXTEND = "/api/v1/locks/extend"

# Below the router's idle close (server.header_read_timeout_ms, 10 s by
# default): a request sent on a connection the router is closing is reset.
KEEPALIVE_EXPIRY = 5.0

#: How often a cancellable request looks at its ``cancel`` event.
CANCEL_POLL = 0.02

#: The longest ``Retry-After`` taken at its word, in seconds: a larger one
#: (a router misconfigured, or a proxy's) counts as this.
MAX_RETRY_AFTER = 3600


AcquireBody = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class LockRef:
    """What the router needs to name one grant."""

    lock_id: str
    fencing_token: int

    def body(self) -> dict[str, Any]:
        return {"lockId": self.lock_id, "fencingToken": self.fencing_token}


@dataclasses.dataclass(frozen=True)
class Acquired:
    """A grant: its reference and how long the router vouches for it."""

    ref: LockRef
    expires_in: float


@dataclasses.dataclass(frozen=True)
class Renewed:
    """One renewal result, from ``renew`` or one item of ``renew-batch``."""

    renewed: bool
    expires_in: float | None = None
    reason: str | None = None
    #: An extend's answer: the lockId the lock has moved to.
    lock_id: str | None = None


@dataclasses.dataclass(frozen=True)
class Settings:
    """What both transports are built from."""

    base_url: str
    token: str | None = None
    verify: Any = True
    cert: Any = None
    transport: Any = None  # an httpx transport, for tests

    def client_kwargs(self) -> dict[str, Any]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        kwargs: dict[str, Any] = {
            "base_url": self.base_url,
            "headers": headers,
            "verify": self.verify,
            "limits": httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY),
            "follow_redirects": False,
            "trust_env": False,
        }
        if self.cert is not None:
            kwargs["cert"] = self.cert
        if self.transport is not None:
            kwargs["transport"] = self.transport
        return kwargs


def check_url(url: str) -> str:
    """The router URL without a trailing slash, or :class:`ConfigError`."""
    try:
        parsed = httpx.URL(url)
    except Exception as e:  # httpx raises several types for bad URLs
        raise ConfigError(f"router URL {url!r}: {e}") from e
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigError(f"router URL {url!r} must look like http://host:port")
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise ConfigError(f"router URL {url!r}: port out of range")
    return url.rstrip("/")


def acquire_body(
    name: str, ttl_ms: int, client_id: str, wait_ms: int, metadata: Any = None
) -> AcquireBody:
    body: AcquireBody = {"name": name, "ttlMs": ttl_ms, "clientId": client_id}
    if wait_ms > 0:
        body["waitMs"] = wait_ms
    if metadata is not None:
        body["metadata"] = metadata
    return body


def inspect_path(name: str) -> str:
    return "/api/v1/locks/" + quote(name, safe="")


@dataclasses.dataclass(frozen=True)
class LockInfo:
    """A name as ``client.inspect(name)`` found it: the router's inspect
    answer, plus whether this client holds it. Times are the router's wall
    clock, for people and planning; never judge a lock's safety by them
    (a ``Lock`` has its own validity, on this process's monotonic clock)."""

    name: str
    #: Whether a lock key exists (like redis-py's ``locked()``). A free
    #: name may still refuse an acquire while others are queued for it.
    held: bool
    shard: str
    fencing_token: int | None = None
    #: When the holder's lease ends unless renewed (router clock).
    expires_at: datetime.datetime | None = None
    #: When the lock was granted (granting router's clock).
    acquired_at: datetime.datetime | None = None
    #: What the holder attached at acquire, if anything.
    metadata: Any = None
    #: Acquires queued for the name.
    waiters: int = 0
    #: The holder's client id: shown only to admin callers (and to any
    #: caller on loopback of a router with no admin guard).
    holder: str | None = None
    principal: str | None = None
    #: True when a ``Lock`` of this client holds the name's grant and has
    #: not lost it (like redis-py's ``owned()``).
    mine: bool = False

    def time_left(self) -> float:
        """Seconds before the holder's lease ends unless renewed, by this
        machine's wall clock against the router's (0 when free or past).
        For display and planning only."""
        if self.expires_at is None:
            return 0.0
        now = datetime.datetime.now(datetime.timezone.utc)
        return max((self.expires_at - now).total_seconds(), 0.0)


def _time(v: Any) -> datetime.datetime | None:
    return datetime.datetime.fromisoformat(v) if isinstance(v, str) else None


def parse_inspect(resp: httpx.Response) -> LockInfo:
    if resp.status_code != 200:
        raise error_from(resp)
    b = _json(resp)
    try:
        token = b.get("fencingToken")
        return LockInfo(
            name=str(b["name"]),
            held=b["held"] is True,
            shard=str(b["shard"]),
            fencing_token=int(token) if token is not None else None,
            expires_at=_time(b.get("expiresAt")),
            acquired_at=_time(b.get("acquiredAt")),
            metadata=b.get("metadata"),
            waiters=int(b.get("waiters") or 0),
            holder=b.get("clientId"),
            principal=b.get("principal"),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise _malformed(resp, f"inspect answer: {e}") from e


def renew_body(ref: LockRef, ttl_ms: int | None) -> dict[str, Any]:
    """A renew's body; naming the lock's TTL asks the router to renew its
    session lease now (an ``extend``), not only once half its TTL is gone."""
    body = ref.body()
    if ttl_ms is not None:
        body["ttlMs"] = ttl_ms
    return body


def batch_body(refs: list[LockRef]) -> dict[str, Any]:
    return {"locks": [r.body() for r in refs]}


def error_from(resp: httpx.Response) -> RouterError:
    """Any non-2xx answer as :class:`RouterError`, with the API's
    ``{"error": {"code", "message"}}`` when the body has it, and the wait
    its ``Retry-After`` asks for."""
    try:
        err = resp.json()["error"]
        code, message = str(err["code"]), str(err["message"])
    except Exception:
        code, message = "unexpected_answer", resp.text[:200]
    wait = retry_after(resp.headers.get("Retry-After"))
    return RouterError(resp.status_code, code, message, retry_after=wait)


def retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` header in seconds: whole delta-seconds, the only
    form the router sends, capped at :data:`MAX_RETRY_AFTER`. None for
    anything else (absent, empty, negative, fractional, an HTTP-date):
    a wait the client cannot read is no wait."""
    if value is None:
        return None
    digits = value.strip()
    if not (digits.isascii() and digits.isdigit()):
        return None
    # A number too long for int() (or merely absurd) is the cap.
    if len(digits.lstrip("0")) > len(str(MAX_RETRY_AFTER)):
        return float(MAX_RETRY_AFTER)
    return float(min(int(digits), MAX_RETRY_AFTER))


def _json(resp: httpx.Response) -> Mapping[str, Any]:
    try:
        body = resp.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _malformed(resp, f"not JSON: {e}") from e
    if not isinstance(body, dict):
        raise _malformed(resp, "not a JSON object")
    return body


def _malformed(resp: httpx.Response, detail: str) -> RouterError:
    return RouterError(resp.status_code, "malformed_answer", detail)


def parse_acquire(resp: httpx.Response) -> Acquired | None:
    if resp.status_code != 200:
        raise error_from(resp)
    body = _json(resp)
    if body.get("acquired") is not True:
        return None
    try:
        ref = LockRef(str(body["lockId"]), int(body["fencingToken"]))
        return Acquired(ref, int(body["expiresInMs"]) / 1000)
    except (KeyError, TypeError, ValueError) as e:
        raise _malformed(resp, f"acquired without {e}") from e


def _renewed(item: Mapping[str, Any]) -> Renewed:
    if item.get("renewed") is True and isinstance(item.get("expiresInMs"), int):
        return Renewed(True, item["expiresInMs"] / 1000)
    reason = item.get("reason")
    return Renewed(False, reason=reason if isinstance(reason, str) else None)


def parse_renew(resp: httpx.Response) -> Renewed:
    """A 409 is an answer (``renewed: false``), not an error."""
    if resp.status_code not in (200, 409):
        raise error_from(resp)
    return _renewed(_json(resp))


def extend_body(ref: LockRef, ttl_ms: int) -> dict[str, Any]:
    body = ref.body()
    body["ttlMs"] = ttl_ms
    return body


def parse_extend(resp: httpx.Response) -> Renewed:
    """Like a renew's answer, with the lockId the lock moved to."""
    r = parse_renew(resp)
    if not r.renewed:
        return r
    lock_id = _json(resp).get("lockId")
    if not isinstance(lock_id, str) or not lock_id:
        raise _malformed(resp, "extended without a lockId")
    return dataclasses.replace(r, lock_id=lock_id)


def parse_batch(resp: httpx.Response, sent: int) -> list[Renewed]:
    if resp.status_code != 200:
        raise error_from(resp)
    results = _json(resp).get("results")
    if not isinstance(results, list) or len(results) != sent:
        raise _malformed(resp, "renew-batch answered a different number of results")
    return [_renewed(r if isinstance(r, dict) else {}) for r in results]


def parse_release(resp: httpx.Response) -> None:
    """204, or 409 (the lock is gone already), is done."""
    if resp.status_code not in (200, 204, 409):
        raise error_from(resp)


#: What httpx raises for a request that got no usable answer. (Its
#: ``StreamError`` family derives from ``RuntimeError``, its ``InvalidURL``
#: from ``Exception``: neither is an ``httpx.HTTPError``.)
HTTPX_ERRORS = (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError)


def closed() -> ClientClosed:
    return ClientClosed("the client is closed")


def request_error(e: Exception, timeout: float) -> LockrouterError:
    """An exception of httpx as the SDK's own."""
    if isinstance(e, httpx.TimeoutException):
        return TransportError(f"no answer within {timeout:.3g} s ({type(e).__name__})")
    if isinstance(e, httpx.InvalidURL):
        return ConfigError(f"router URL: {e}")
    return TransportError(f"{type(e).__name__}: {e}")


def http_client(cls: type, settings: Settings, **overrides: Any) -> Any:
    """``httpx.Client`` or ``httpx.AsyncClient`` (with ``overrides`` of
    its arguments); TLS settings it cannot use (a missing CA or
    certificate file, say) are a :class:`ConfigError`."""
    try:
        return cls(**{**settings.client_kwargs(), **overrides})
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"cannot set up the HTTP client (verify, cert): {e}") from e


class _Cut:
    """Cuts one request short from another thread: shuts down the
    connections it opened, so the blocked read fails at once and the
    router, seeing the connection go, drops what the request waited for.
    (Closing a socket from another thread does not wake a read blocked on
    it; shutting it down does.) It learns the request's connections from
    httpx's ``trace`` extension, so the request must open its own: one
    taken from a keep-alive pool is never seen."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._streams: list[Any] = []
        self._cut = False

    def trace(self, event: str, info: dict[str, Any]) -> None:
        if event not in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            return
        stream = info.get("return_value")
        with self._mu:
            self._streams.append(stream)
            cut = self._cut
        if cut:  # cancelled while it connected
            _shut_down(stream)

    def cut(self) -> None:
        with self._mu:
            self._cut = True
            streams = list(self._streams)
        for stream in streams:
            _shut_down(stream)


def _shut_down(stream: Any) -> None:
    sock = stream.get_extra_info("socket") if stream is not None else None
    if sock is None:
        return
    try:
        # The plain socket's shutdown, also under TLS: an SSLSocket's own
        # would drop its TLS state under the thread reading it.
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass  # closed already


class SyncTransport:
    """The API over a pooled ``httpx.Client``; safe to call from several
    threads at once (the renewal thread's workers and the caller's)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._http: httpx.Client = http_client(httpx.Client, settings)
        # Cancellable requests, each on a connection of its own (see _Cut):
        # made on first use. A transport given for tests serves them too.
        self._once: httpx.Client | None = self._http if settings.transport is not None else None
        self._mu = threading.Lock()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Idempotent, and safe from any thread."""
        with self._mu:
            if self._closed:
                return
            self._closed = True
            once = self._once
        self._http.close()
        if once is not None and once is not self._http:
            once.close()

    def _unpooled(self) -> httpx.Client:
        """The client of cancellable requests: one connection each, closed
        after its answer."""
        with self._mu:
            if self._once is None and not self._closed:
                # No connection kept alive: each request connects anew.
                unpooled = httpx.Limits(max_keepalive_connections=0)
                self._once = http_client(httpx.Client, self._settings, limits=unpooled)
            return self._once or self._http

    def _post(self, path: str, body: Any, timeout: float) -> httpx.Response:
        return self._send("POST", path, json.dumps(body), timeout)

    def _send(
        self,
        method: str,
        path: str,
        content: str | None,
        timeout: float,
        http: httpx.Client | None = None,
        extensions: dict[str, Any] | None = None,
    ) -> httpx.Response:
        if self._closed:
            raise closed()
        http = self._http if http is None else http
        try:
            return http.request(method, path, content=content, timeout=timeout, extensions=extensions)
        except HTTPX_ERRORS as e:
            if self._closed:  # closed under the request
                raise closed() from e
            raise request_error(e, timeout) from e
        except RuntimeError as e:
            # httpx's "the client has been closed": close() won the race.
            if self._closed or http.is_closed:
                raise closed() from e
            raise

    def _cancellable_post(
        self, path: str, body: AcquireBody, timeout: float, cancel: threading.Event
    ) -> httpx.Response:
        """``_post``, cut short when ``cancel`` is set: :class:`Cancelled`.
        An answer that came first is returned, whatever ``cancel`` says."""
        name = str(body.get("name"))
        if cancel.is_set():
            raise Cancelled(name)
        cut, answered = _Cut(), threading.Event()

        def watch() -> None:
            while not answered.wait(CANCEL_POLL):
                if cancel.is_set():
                    cut.cut()
                    return

        watcher = threading.Thread(target=watch, name="lockrouter-cancel", daemon=True)
        watcher.start()
        try:
            return self._send("POST", path, json.dumps(body), timeout, self._unpooled(), {"trace": cut.trace})
        except LockrouterError as e:
            if cancel.is_set() and not isinstance(e, ClientClosed):
                raise Cancelled(name) from e
            raise
        finally:
            answered.set()
            watcher.join()

    def acquire(self, body: AcquireBody, timeout: float, cancel: threading.Event | None = None) -> Acquired | None:
        """One acquire request; with ``cancel``, one that setting it cuts
        short (:class:`Cancelled`, the router's waiter dropped with the
        connection)."""
        if cancel is None:
            return parse_acquire(self._post(ACQUIRE, body, timeout))
        return parse_acquire(self._cancellable_post(ACQUIRE, body, timeout, cancel))

    def renew(self, ref: LockRef, timeout: float, ttl_ms: int | None = None) -> Renewed:
        return parse_renew(self._post(RENEW, renew_body(ref, ttl_ms), timeout))

    def renew_batch(self, refs: list[LockRef], timeout: float) -> list[Renewed]:
        return parse_batch(self._post(RENEW_BATCH, batch_body(refs), timeout), len(refs))

    def extend(self, ref: LockRef, timeout: float, ttl_ms: int) -> Renewed:
        return parse_extend(self._post(EXTEND, extend_body(ref, ttl_ms), timeout))

    def release(self, ref: LockRef, timeout: float) -> None:
        parse_release(self._post(RELEASE, ref.body(), timeout))

    def inspect(self, name: str, timeout: float) -> LockInfo:
        return parse_inspect(self._send("GET", inspect_path(name), None, timeout))


class AsyncTransport:
    """The API over a pooled ``httpx.AsyncClient``, used from one event loop."""

    def __init__(self, settings: Settings) -> None:
        self._http: httpx.AsyncClient = http_client(httpx.AsyncClient, settings)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        """Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._http.aclose()

    async def _post(self, path: str, body: Any, timeout: float) -> httpx.Response:
        return await self._send("POST", path, json.dumps(body), timeout)

    async def _send(self, method: str, path: str, content: str | None, timeout: float) -> httpx.Response:
        if self._closed:
            raise closed()
        try:
            return await self._http.request(method, path, content=content, timeout=timeout)
        except HTTPX_ERRORS as e:
            if self._closed:  # closed under the request
                raise closed() from e
            raise request_error(e, timeout) from e
        except RuntimeError as e:
            # httpx's "the client has been closed": aclose() won the race.
            if self._closed or self._http.is_closed:
                raise closed() from e
            raise

    async def acquire(self, body: AcquireBody, timeout: float) -> Acquired | None:
        return parse_acquire(await self._post(ACQUIRE, body, timeout))

    async def renew(self, ref: LockRef, timeout: float, ttl_ms: int | None = None) -> Renewed:
        return parse_renew(await self._post(RENEW, renew_body(ref, ttl_ms), timeout))

    async def renew_batch(self, refs: list[LockRef], timeout: float) -> list[Renewed]:
        resp = await self._post(RENEW_BATCH, batch_body(refs), timeout)
        return parse_batch(resp, len(refs))

    async def extend(self, ref: LockRef, timeout: float, ttl_ms: int) -> Renewed:
        return parse_extend(await self._post(EXTEND, extend_body(ref, ttl_ms), timeout))

    async def release(self, ref: LockRef, timeout: float) -> None:
        parse_release(await self._post(RELEASE, ref.body(), timeout))

    async def inspect(self, name: str, timeout: float) -> LockInfo:
        return parse_inspect(await self._send("GET", inspect_path(name), None, timeout))
