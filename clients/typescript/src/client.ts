/**
 * {@link Client}: one identity (client id) talking to a lockrouter, with
 * one background renewal loop for all the locks it holds. The top of the
 * package: it builds the transport, the renewal loop, the registry and the
 * {@link Keeper} its locks share; nothing imports it.
 */

import { randomBytes } from "node:crypto";

import { ConfigError, LockLostError, NotAcquiredError, RouterError, TransportError } from "./errors.js";
import { Holds } from "./holds.js";
import { LockInfo } from "./info.js";
import type { Json } from "./json.js";
import { Keeper } from "./keeper.js";
import { Lock } from "./lock.js";
import { Registry, type Claim } from "./registry.js";
import { Renewer } from "./renewal.js";
import { Grant } from "./state.js";
import { Transport, type Acquired, type LockRef } from "./transport.js";
import { margin, now, validUntil } from "./validity.js";

export interface ClientOptions {
  /** The router, `http://host:port` or `https://host[:port][/prefix]` (TLS comes from the URL). */
  url: string;
  /** Sent as `Authorization: Bearer <token>` on every call (for a gateway in front of the router). */
  token?: string;
  /** The id the router knows this client by (1 to 256 bytes). Default: 128 random bits. */
  clientId?: string;
  /** The `fetch` to use. Default: Node's global `fetch`. */
  fetch?: typeof fetch;
  /** How much earlier than the router's reported expiry a lock counts as lost. Default: a tenth of the TTL, never below 100 ms. */
  safetyMarginMs?: number;
  /** How long one request may take before it counts as failed. Default 5,000 ms; renewals also stop waiting after a third of the TTL. */
  requestTimeoutMs?: number;
}

export interface AcquireOptions {
  /** The lease's TTL (the router takes 2,000 to 3,600,000; etcd rounds up to whole seconds). */
  ttlMs: number;
  /**
   * How long to queue for a held name, first come first served; `Infinity`
   * waits for as long as it takes. A wait longer than the router's cap
   * (`limits.max_wait_ms`, 60 s by default) is made of several, each
   * queuing again at the end of the line. Default 0: do not wait.
   */
  waitMs?: number;
  /** Cancels a waiting acquire: it rejects with `signal.reason`, and the router drops the waiter with the request. */
  signal?: AbortSignal;
  /** A small JSON object or string recorded with the lock (at most 1 KiB) and shown by `inspect` to whoever may see the lock: not a place for secrets. */
  metadata?: Json;
  /**
   * If this client holds the name already (and has not lost it), returns
   * another `Lock` of that grant at once, counted: the grant is released
   * with the last of its `Lock`s. Without it, an acquire of a name this
   * client holds waits its turn like any other.
   */
  reentrant?: boolean;
}

/** How many times an acquire asks again when its answer is a grant this client is still releasing. */
const ACQUIRE_ROUNDS = 3;
/** The longest wait asked of the router at once until it refuses one as too long: its default `limits.max_wait_ms`. */
const WAIT_CHUNK_MS = 60_000;
/** The shortest: a router whose cap is below it refuses every wait. */
const MIN_WAIT_CHUNK_MS = 500;
/** The longest `setTimeout` Node takes. */
const MAX_TIMER_MS = 2 ** 31 - 1;

/**
 * Winds down a client that was never closed once it and every `Lock` it
 * made are garbage-collected (a `Lock` keeps its client reachable until it
 * is released), as `close()` would, with nobody waiting: what the client
 * still holds is released in the background, and its renewal loop gives
 * those releases one more request timeout, then stops. It renews nothing
 * from then on and leaves no timer behind.
 */
const abandoned = new FinalizationRegistry<Keeper>((keeper) => {
  keeper.closed = true;
  for (const g of keeper.registry.unreleased()) keeper.releaseInBackground(g);
  void keeper.renewer.close();
});

/**
 * A connection to a lockrouter under one client id. Every lock a client
 * holds rides on the router's session lease for (client id, TTL, shard).
 * Within one client a name has one holder at a time: another acquire of a
 * name it holds waits its turn (or, asked as `reentrant`, joins the hold,
 * counted). Use one client per process (or per independent worker); close
 * it when done. While it holds locks its renewal timer keeps the process
 * alive. A client never closed is wound down once it and every `Lock` it
 * made are garbage-collected: what it held is released and its renewal loop
 * ends within a request timeout (see {@link close}); when that happens is
 * the garbage collector's choice.
 *
 * ```ts
 * await using client = new Client({ url: "http://127.0.0.1:8080" });
 * await using lock = await client.acquire("nightly-report", { ttlMs: 30_000 });
 * await runReport({ fencingToken: lock.fencingToken, signal: lock.signal });
 * ```
 */
export class Client implements AsyncDisposable {
  /** The id the router knows this client by. */
  readonly clientId: string;
  private readonly keeper: Keeper;
  private nextKey = 0;
  private closing: Promise<void> | undefined;
  /** Aborted when `close()` begins: ends every acquire on the wire. */
  private readonly closed = new AbortController();
  /** The longest wait the router accepts at once, as far as this client knows (it shrinks when the router refuses one). */
  private waitChunkMs = WAIT_CHUNK_MS;

  constructor(options: ClientOptions) {
    const { url, token, clientId, safetyMarginMs, requestTimeoutMs = 5_000 } = options;
    const fetchFn = options.fetch ?? globalThis.fetch;
    if (typeof fetchFn !== "function") throw new ConfigError("no fetch: pass options.fetch or use Node 20+");
    if (clientId !== undefined && (clientId === "" || /[\u0000-\u001f\u007f]/.test(clientId))) {
      throw new ConfigError("clientId must be 1 to 256 bytes without control characters");
    }
    if (!(requestTimeoutMs > 0)) throw new ConfigError(`requestTimeoutMs must be positive, not ${requestTimeoutMs}`);
    if (safetyMarginMs !== undefined && !(safetyMarginMs >= 0)) throw new ConfigError("safetyMarginMs must be >= 0");
    const transport = new Transport(url, token, fetchFn);
    const registry = new Registry();
    const renewer = new Renewer(transport, requestTimeoutMs, (g) => registry.forget(g));
    this.keeper = new Keeper(transport, requestTimeoutMs, renewer, registry, new Holds(), safetyMarginMs);
    this.clientId = clientId ?? randomBytes(16).toString("hex");
    abandoned.register(this, this.keeper, this);
  }

  /**
   * Acquires `name` for `ttlMs`, queueing up to `waitMs` if it is held.
   * Throws {@link NotAcquiredError} if another client still holds it (or
   * others are queued: the router lets no one jump the queue). Idempotent
   * for one client id: after a {@link TransportError}, simply call it again
   * (after a retryable {@link RouterError}, once its `retryAfterMs`, if any,
   * has passed); if the first attempt was granted, the retry returns the
   * same grant. Failures of the acquire request itself are not retried for you.
   * While this client's release of an earlier grant of `name` is
   * unanswered, it first drives that release to an answer (within
   * `requestTimeoutMs` plus `waitMs`, and never sooner than a refusal's
   * `Retry-After` lets the release go again) and throws a retryable
   * {@link TransportError} if it cannot, at once when that `Retry-After`
   * ends past this time: never the old grant.
   * A grant after a wait longer than the safety margin is confirmed with
   * one renewal before it is returned.
   *
   * One client, one holder per name: while a `Lock` of this client holds
   * `name` (until it is released, even once lost), another acquire of it
   * waits its turn as it would for another client's, within `waitMs`. Only
   * a `reentrant` acquire of a name this client holds and has not lost gets
   * it at once, without asking the router.
   */
  async acquire(name: string, options: AcquireOptions): Promise<Lock> {
    const lock = await this.tryAcquire(name, options);
    if (lock === null) throw new NotAcquiredError(name);
    return lock;
  }

  /** As {@link acquire}, but resolves `null` instead of throwing when the name is held. */
  async tryAcquire(name: string, options: AcquireOptions): Promise<Lock | null> {
    const { ttlMs, waitMs = 0, signal, metadata, reentrant = false } = options;
    if (this.closing !== undefined) throw new ConfigError("the client is closed");
    if (typeof name !== "string" || name === "") throw new ConfigError("name must be a non-empty string");
    if (!Number.isSafeInteger(ttlMs) || ttlMs <= 0) throw new ConfigError(`ttlMs must be a positive integer, not ${ttlMs}`);
    if (waitMs !== Infinity && (!Number.isSafeInteger(waitMs) || waitMs < 0)) {
      throw new ConfigError(`waitMs must be a non-negative integer or Infinity, not ${waitMs}`);
    }
    signal?.throwIfAborted();
    const { holds } = this.keeper;
    if (reentrant) {
      const joined = holds.join(name);
      if (joined !== undefined) return new Lock(joined, this.keeper, this);
    }
    const start = now();
    if (!(await holds.take(name, waitMs, signal))) return null;
    let lock: Lock | null = null;
    try {
      lock = await this.acquireInTurn(name, ttlMs, start, waitMs, signal, metadata);
    } finally {
      if (lock === null) holds.passTurn(name);
    }
    return lock;
  }

  /**
   * Runs `work` while holding `name`, then releases the lock (as `release()`
   * does) and resolves with what `work` resolved with, like node-redlock's
   * `using`. `work` gets the lock's `signal`, which aborts if the lock is
   * lost: pass it on to `fetch` and other cancellable steps. If the lock is
   * lost before `work` settles, this rejects at once with
   * {@link LockLostError} (the lock is released in the background; `work`
   * is expected to stop on the signal). Throws {@link NotAcquiredError}
   * if another client holds the name (after `waitMs`, if given).
   *
   * ```ts
   * const rows = await client.using("process_order:42", { ttlMs: 30_000 }, async (signal, lock) =>
   *   writeOrder(42, { fencingToken: lock.fencingToken, signal }),
   * );
   * ```
   */
  async using<T>(name: string, options: AcquireOptions, work: (signal: AbortSignal, lock: Lock) => Promise<T>): Promise<T> {
    const lock = await this.acquire(name, options);
    const lost = new Promise<never>((_, reject) => {
      const fail = (): void => reject(lock.signal.reason instanceof LockLostError ? lock.signal.reason : new LockLostError(name, "released"));
      if (lock.signal.aborted) fail();
      else lock.signal.addEventListener("abort", fail, { once: true });
    });
    lost.catch(() => {});
    try {
      return await Promise.race([lost, Promise.resolve().then(() => work(lock.signal, lock))]);
    } finally {
      await lock.release().catch(() => {});
    }
  }

  /**
   * What the router tells anyone about `name`: held or free (like
   * redis-py's `locked()`), by which grant and, for an admin caller, which
   * client, until when, its metadata and waiters, and whether it is this
   * client's (`mine`, like redis-py's `owned()`).
   */
  async inspect(name: string): Promise<LockInfo> {
    if (this.closing !== undefined) throw new ConfigError("the client is closed");
    const i = await this.keeper.transport.inspect(name, this.keeper.requestTimeoutMs);
    const mine = i.held && i.fencingToken !== undefined && this.keeper.holds.holding(name) === i.fencingToken;
    const time = (t: string | undefined): Date | undefined => (t === undefined ? undefined : new Date(t));
    return new LockInfo(i.name, i.held, i.shard, i.waiters, mine, i.fencingToken, time(i.expiresAt), time(i.acquiredAt), i.metadata, i.holder, i.principal);
  }

  /** The rest of an acquire, once this client's turn for `name` is taken. */
  private async acquireInTurn(
    name: string,
    ttlMs: number,
    start: number,
    waitMs: number,
    signal: AbortSignal | undefined,
    metadata: Json | undefined,
  ): Promise<Lock | null> {
    // A release of an earlier grant of this name that the router has not
    // answered may still land later, and would end the very grant the
    // router answers this acquire with (the same one): drive it to an
    // answer first, within this call's own time.
    const limit = Math.min(this.keeper.requestTimeoutMs + waitMs, MAX_TIMER_MS);
    for (const pending of this.keeper.registry.releasing(name)) {
      // The router's Retry-After may hold the release's next attempt past this call's time.
      const retryAt = pending.retryNow?.() ?? now();
      if (retryAt - start >= limit) throw notSettled(name);
      await pending.releaseSettled(Math.max(0, limit - (now() - start)));
      if (pending.release === "pending") throw notSettled(name);
    }
    let rounds = 0;
    for (;;) {
      const left = Math.max(0, waitMs - (now() - start));
      const ask = Math.floor(Math.min(left, this.waitChunkMs));
      let claim: Claim | null;
      try {
        claim = await this.acquireOnce(name, ttlMs, ask, signal, metadata);
      } catch (e) {
        // The router's cap on one wait is below what was asked: learn it.
        if (e instanceof RouterError && e.status === 400 && e.detail.includes("waitMs") && ask > MIN_WAIT_CHUNK_MS) {
          this.waitChunkMs = Math.max(Math.floor(ask / 2), MIN_WAIT_CHUNK_MS);
          continue;
        }
        throw e;
      }
      if (claim === null) {
        if (left > ask) continue; // the router's cap ran out: queue again
        return null;
      }
      if (claim.kind === "held" || claim.kind === "new") {
        this.keeper.holds.hold(name, claim.grant);
        return new Lock(claim.grant, this.keeper, this);
      }
      if (claim.kind === "releasing") {
        // The answer overtook this client's release of the same grant,
        // which is about to free it: let the release finish, then ask again.
        claim.grant.retryNow?.();
        await claim.grant.releaseSettled(this.keeper.requestTimeoutMs);
      }
      // "released": that release got through already; the next answer is a new grant.
      if (++rounds >= ACQUIRE_ROUNDS) throw notSettled(name);
    }
  }

  /**
   * Stops renewing, ends every acquire on its way (waiting its turn or at
   * the router) with a {@link ConfigError}, releases every lock this client
   * still holds (each retried while its validity lasts), gives unconfirmed
   * releases one more request timeout, and stops every timer of the client.
   * Never rejects; a lock whose release got no answer expires at its
   * TTL, since nothing renews it any more, and its `release()` rejects
   * with a {@link ConfigError}. A closed client sends nothing more: its
   * `acquire`, `tryAcquire`, `using` and `inspect` reject with a
   * {@link ConfigError}. Calling it again returns the same promise.
   */
  close(): Promise<void> {
    this.closing ??= (async () => {
      const { registry, renewer, holds } = this.keeper;
      abandoned.unregister(this);
      this.keeper.closed = true;
      this.closed.abort();
      holds.close(new ConfigError("the client was closed while this acquire waited its turn"));
      await Promise.allSettled(registry.unreleased().map((g) => this.keeper.release(g)));
      await renewer.close();
    })();
    return this.closing;
  }

  /** `await using client = new Client(...)`: closes it. */
  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }

  /** One acquire request, and what its grant (if any) is to this client. */
  private async acquireOnce(
    name: string,
    ttlMs: number,
    waitMs: number,
    signal: AbortSignal | undefined,
    metadata: Json | undefined,
  ): Promise<Claim | null> {
    const { transport, requestTimeoutMs } = this.keeper;
    if (this.closing !== undefined) throw closedDuringAcquire(name);
    // close() ends the request at once, as `signal` does (the router drops
    // a waiter with its request). Listeners, not AbortSignal.any, which
    // leaks when one of its signals lives as long as the client.
    const cancel = new AbortController();
    const stop = (): void => cancel.abort(signal?.aborted ? signal.reason : closedDuringAcquire(name));
    const sources = signal === undefined ? [this.closed.signal] : [signal, this.closed.signal];
    for (const s of sources) s.addEventListener("abort", stop, { once: true });
    if (signal?.aborted) stop();
    const extra: { metadata?: Json; signal: AbortSignal } = { signal: cancel.signal };
    if (metadata !== undefined) extra.metadata = metadata;
    const sentAt = now();
    let a: Acquired;
    try {
      a = await transport.acquire(name, ttlMs, this.clientId, waitMs, requestTimeoutMs + waitMs, extra);
    } finally {
      for (const s of sources) s.removeEventListener("abort", stop);
    }
    if (!a.acquired) return null;
    if (a.lockId === undefined || a.fencingToken === undefined || a.expiresInMs === undefined) {
      throw new RouterError(200, "malformed_answer", "acquired without lockId, fencingToken or expiresInMs");
    }
    const m = margin(ttlMs, this.keeper.marginMs);
    let until = validUntil(sentAt, a.expiresInMs, m);
    const ref: LockRef = { lockId: a.lockId, fencingToken: a.fencingToken };
    if (now() - sentAt > m) {
      // The grant came somewhere within a long request (a wait): we cannot
      // tell when, so validity counts from the start. A renewal sent now
      // confirms the grant still stands and measures afresh.
      const confirmedAt = now();
      let answer;
      try {
        answer = await transport.renew(ref, requestTimeoutMs);
      } catch (e) {
        if (until <= now()) {
          // Perhaps held, but not usable: release it unless this client holds it through another Lock.
          const claim = this.claim(name, ttlMs, m, ref, until);
          if (claim.kind === "new") this.keeper.releaseInBackground(claim.grant);
          throw e;
        }
        // Still valid: the renewal loop confirms it shortly.
      }
      if (answer !== undefined) {
        if (!answer.renewed || answer.expiresInMs === undefined) {
          throw new LockLostError(name, answer.reason === "stolen" ? "stolen" : "expired");
        }
        until = Math.max(until, validUntil(confirmedAt, answer.expiresInMs, m));
      }
    }
    const claim = this.claim(name, ttlMs, m, ref, until);
    if (this.closing !== undefined) {
      // close() ran while this acquire was on the wire: nothing would renew the lock.
      if (claim.kind === "new") this.keeper.release(claim.grant).catch(() => {});
      throw closedDuringAcquire(name);
    }
    if (claim.kind === "new") this.keeper.renewer.track(claim.grant);
    return claim;
  }

  private claim(name: string, ttlMs: number, marginMs: number, ref: LockRef, until: number): Claim {
    return this.keeper.registry.claim(
      ref.lockId,
      until,
      () => new Grant(this.nextKey++, name, ref, ttlMs, marginMs, this.clientId, until),
    );
  }
}

/** An acquire of `name` that was on its way when its client closed: it never hands out a lock that nothing renews. */
function closedDuringAcquire(name: string): ConfigError {
  return new ConfigError(`the client was closed during the acquire of ${JSON.stringify(name)}`);
}

/** The retryable error of an acquire that found this client's release of an earlier grant of `name` still unanswered. */
function notSettled(name: string): TransportError {
  return new TransportError(`this client's earlier release of ${JSON.stringify(name)} has not got through yet`);
}
