/**
 * A held lock: its identity (name, lockId, fencing token), its validity as
 * this process's clock judges it, and the lost signal, all read from the
 * grant's shared state, which every {@link Lock} of one grant shares with
 * the client's renewal loop. A grant has more than one `Lock` only through
 * re-entrant acquires; it is released at the router once, with the last.
 */

import { ConfigError, LockLostError, type LostReason } from "./errors.js";
import type { Keeper } from "./keeper.js";
import type { Grant } from "./state.js";
import { margin, now, validUntil } from "./validity.js";

/**
 * A lock held through a {@link Client}. The client's renewal loop renews it
 * until it is released or lost. Release it with `await using` or
 * `try { … } finally { await lock.release() }`; a `Lock` left unreleased is
 * renewed until `client.close()`, or until its client, never closed, and
 * every `Lock` of that client are garbage-collected (then the client winds
 * down as `close()` would: see {@link Client}).
 *
 * ```ts
 * await using lock = await client.acquire("process_order:42", { ttlMs: 30_000 });
 * await writeOrder(42, { fencingToken: lock.fencingToken, signal: lock.signal });
 * ```
 */
export class Lock implements AsyncDisposable {
  /** This hold's own signal: follows the grant's, and aborts when this hold is released while others keep the grant. */
  private readonly controller = new AbortController();
  /** Whether this object still has its hold of the name, and whether giving it back was the grant's last. */
  private holding = true;
  private last = true;
  /**
   * The client that made this lock, kept reachable while this lock holds
   * its name: a client is wound down when garbage-collected, and must not
   * be while a `Lock` of it is in use. Never read.
   */
  private owner: object | undefined;

  /** @internal */
  constructor(
    private readonly grant: Grant,
    private readonly keeper: Keeper,
    owner: object,
  ) {
    this.owner = owner;
    // The grant (which the renewal loop keeps) reaches this lock's
    // controller, never the lock itself: an unreleased lock nobody can use
    // any more stays collectable, and its client with it.
    const controller = this.controller;
    const follow = (): void => controller.abort(grant.signal.reason);
    if (grant.signal.aborted) follow();
    else grant.signal.addEventListener("abort", follow, { once: true });
  }

  /** The lock's name. */
  get name(): string {
    return this.grant.name;
  }

  /** The router's opaque id of this grant. An {@link extend} to another TTL changes it. */
  get lockId(): string {
    return this.grant.ref.lockId;
  }

  /**
   * The fencing token of this grant, exact (a `bigint`: tokens go up to
   * 2^63 − 1): larger than every earlier grant's of the same name. Send it
   * with every write to the protected resource (see `fencing`).
   */
  get fencingToken(): bigint {
    return this.grant.ref.fencingToken;
  }

  /** The lock's TTL in milliseconds: the one it was acquired with, or the last one {@link extend} gave it. */
  get ttlMs(): number {
    return this.grant.ttlMs;
  }

  /** The client id the router knows the holder by. */
  get clientId(): string {
    return this.grant.clientId;
  }

  /**
   * Aborts once the lock can no longer be trusted, at the latest when its
   * validity runs out by this process's monotonic clock, even with the
   * router unreachable. `signal.reason` is a {@link LockLostError}. Pass it
   * to `fetch` and other cancellable work, or listen for `"abort"`.
   */
  get signal(): AbortSignal {
    return this.controller.signal;
  }

  /** Why the lock is lost, or `undefined` while it is held. */
  get lostReason(): LostReason | undefined {
    return this.gaveBack() ? "released" : this.grant.lostNow();
  }

  /**
   * True while the client can prove the lock is held: not lost, and its
   * validity (by this process's monotonic clock) has not run out. A process
   * can pause right after this returns true; only the resource's fencing
   * check is safe against that.
   */
  isHeld(): boolean {
    return this.lostReason === undefined;
  }

  /** Milliseconds of validity left as of the last confirmed renewal (0 once lost). */
  timeLeftMs(): number {
    return this.isHeld() ? Math.max(0, this.grant.validUntil - now()) : 0;
  }

  /** Resolves with the reason once the lock is lost (see {@link signal}). */
  whenLost(): Promise<LostReason> {
    const signal = this.signal;
    const reason = (): LostReason => (signal.reason instanceof LockLostError ? signal.reason.reason : "released");
    if (signal.aborted) return Promise.resolve(reason());
    return new Promise((resolve) => signal.addEventListener("abort", () => resolve(reason()), { once: true }));
  }

  /**
   * Stops renewing and releases the lock at the router. The lock counts as
   * lost (`released`) from the start, here and in every other `Lock` of the
   * same grant. Resolves only after the router confirmed: the name is then
   * not held under this lock's id. Transport errors, 429 and 5xx answers are
   * retried with backoff while the lock's validity lasts, so this can take
   * that long; any other error ends it at once. A refusal with
   * `Retry-After` (`RouterError.retryAfterMs`) is not sent again
   * before that time has passed, even if the backoff is shorter. If
   * validity runs out first, or that time would end after it, it rejects
   * with the last error and the client keeps retrying in the background
   * (no sooner than the router asked) while it is open. Calling it again
   * returns the same outcome. Once the client is closed (or closing), it
   * resolves if the release was confirmed, by `close()` or before; if no
   * answer confirmed it, it rejects with a {@link ConfigError} (its `cause`
   * the last, retryable, error) instead: nothing sends the release any
   * more, and the lock expires at its TTL.
   * Rejects with {@link LockLostError} if the lock was lost and this client
   * has since acquired the same grant through a newer `Lock`. A re-entrant
   * hold that is not the grant's last only gives its hold back.
   */
  release(): Promise<void> {
    if (this.holding) {
      this.holding = false;
      this.owner = undefined;
      this.last = this.keeper.holds.letGo(this.grant);
      if (!this.last) this.controller.abort(new LockLostError(this.name, "released"));
    }
    return this.last ? this.keeper.release(this.grant) : Promise.resolve();
  }

  /**
   * Renews the lock now, instead of at its next scheduled renewal, and
   * resolves with the milliseconds of validity it has from that answer (a
   * little under its TTL), like redis-py's or node-redlock's `extend`.
   *
   * Without `ttlMs` (or with the lock's own), a renewal with the lock's TTL.
   * With another `ttlMs` (longer or shorter), the router moves the lock to
   * this client's session lease of that TTL: the same {@link fencingToken},
   * a new {@link lockId}. From the answer on, this lock and every `Lock` of
   * its grant have the new lockId and TTL, validity counts from this
   * request's send, and the renewal loop renews it under the new lockId at
   * the new TTL's pace (a renewal it sent under the old lockId and got back
   * `stolen` after the move is not a loss). A release of the lock waits for
   * an extend on the wire, and an extend for a release attempt, so the two
   * never cross.
   *
   * Rejects with {@link LockLostError} if the router says the lock is gone
   * (it is then lost, as with a renewal) or it was lost already. Other
   * errors as they come, the lock keeping its old lockId; after a transport
   * error, timeout, 503 or 504 of an extend to another TTL the move may have
   * happened at the router, and then the next renewal finds the old lockId
   * `stolen` and the lock is lost (`stolen`): the client cannot learn the
   * new lockId (docs/client.md, "Extend to another TTL").
   */
  extend(ttlMs?: number): Promise<number> {
    if (ttlMs !== undefined && (!Number.isSafeInteger(ttlMs) || ttlMs <= 0)) {
      return Promise.reject(new ConfigError(`ttlMs must be a positive integer, not ${ttlMs}`));
    }
    return this.grant.exclusive(() => this.extendNow(ttlMs ?? this.grant.ttlMs));
  }

  /** {@link extend}, once no release attempt of the grant is on the wire. */
  private async extendNow(ttlMs: number): Promise<number> {
    const lost = this.lostReason;
    if (lost !== undefined) throw new LockLostError(this.name, lost);
    const { grant: g, keeper: k } = this;
    const [ref, generation] = [g.ref, g.generation];
    const sentAt = now();
    if (ttlMs === g.ttlMs) {
      const r = await k.transport.renew(ref, k.requestTimeoutMs, ttlMs);
      if (r.renewed && r.expiresInMs !== undefined) g.applyRenewal(generation, { validUntil: validUntil(sentAt, r.expiresInMs, g.marginMs) });
      else g.applyRenewal(generation, { lost: lostReason(r.reason) });
    } else {
      const r = await k.transport.extend(ref, k.requestTimeoutMs, ttlMs);
      if (r.renewed) {
        // The lock, its registry entry and its renewals move to the new lockId and TTL together.
        const m = margin(ttlMs, k.marginMs);
        if (k.registry.switch(g, r.lockId, ttlMs, m, validUntil(sentAt, r.expiresInMs, m))) k.renewer.extended(g.key);
      } else {
        g.applyRenewal(generation, { lost: lostReason(r.reason) });
      }
    }
    const reason = this.lostReason;
    if (reason !== undefined) throw new LockLostError(this.name, reason);
    return this.timeLeftMs();
  }

  private gaveBack(): boolean {
    return !this.holding && !this.last;
  }

  /**
   * `await using` support: releases the lock (as {@link release}). If the
   * lock had been lost before the block ended, throws {@link LockLostError}
   * after releasing: the block's work was not protected to the end.
   *
   * A release that fails is not thrown. A disposer cannot see whether its
   * block threw, and an error it throws would reach the caller in place of
   * the block's own (wrapped in a `SuppressedError`). The failure is not
   * lost: while the client is open the renewal loop keeps retrying a
   * retryable one; otherwise the lock, renewed no more, expires at its TTL.
   * `await lock.release()` in the block, or after it (it returns the same
   * outcome), reports it.
   */
  async [Symbol.asyncDispose](): Promise<void> {
    const lostBefore = this.lostReason;
    await this.release().catch(() => {});
    if (lostBefore !== undefined && lostBefore !== "released") throw new LockLostError(this.name, lostBefore);
  }

  toString(): string {
    return `Lock(${JSON.stringify(this.name)}, token ${this.fencingToken}, ${this.lostReason ?? "held"})`;
  }
}

/** Why a lock the router answered `renewed: false` for is lost. */
function lostReason(reason: string | undefined): "expired" | "stolen" {
  return reason === "stolen" ? "stolen" : "expired";
}
