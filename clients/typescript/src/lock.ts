/**
 * A held lock: its identity (name, lockId, fencing token), its validity as
 * this process's clock judges it, and the lost signal, all read from the
 * grant's shared state, which every {@link Lock} of one grant shares with
 * the client's renewal loop. A grant has more than one `Lock` only through
 * re-entrant acquires; it is released at the router once, with the last.
 */

import { LockLostError, type LostReason } from "./errors.js";
import type { Keeper } from "./keeper.js";
import type { Grant } from "./state.js";
import { now, validUntil } from "./validity.js";

/**
 * A lock held through a {@link Client}. The client's renewal loop renews it
 * until it is released or lost. Release it with `await using` or
 * `try { … } finally { await lock.release() }`; a `Lock` left unreleased is
 * renewed until `client.close()`.
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

  /** @internal */
  constructor(
    private readonly grant: Grant,
    private readonly keeper: Keeper,
  ) {
    const follow = (): void => this.controller.abort(grant.signal.reason);
    if (grant.signal.aborted) follow();
    else grant.signal.addEventListener("abort", follow, { once: true });
  }

  /** The lock's name. */
  get name(): string {
    return this.grant.name;
  }

  /** The router's opaque id of this grant. */
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

  /** The TTL the lock was acquired with, in milliseconds. */
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
   * that long; any other error ends it at once. If validity runs out first,
   * it rejects with the last error and the client keeps retrying in the
   * background while it is open. Calling it again returns the same outcome.
   * Rejects with {@link LockLostError} if the lock was lost and this client
   * has since acquired the same grant through a newer `Lock`. A re-entrant
   * hold that is not the grant's last only gives its hold back.
   */
  release(): Promise<void> {
    if (this.holding) {
      this.holding = false;
      this.last = this.keeper.holds.letGo(this.grant);
      if (!this.last) this.controller.abort(new LockLostError(this.name, "released"));
    }
    return this.last ? this.keeper.release(this.grant) : Promise.resolve();
  }

  /**
   * Renews the lock now, instead of at its next scheduled renewal, and
   * resolves with the milliseconds of validity it has from that renewal (a
   * little under its TTL). Like redis-py's or node-redlock's `extend`, but
   * with the TTL the lock was acquired with: the router fixes a lock's TTL
   * at its acquire (a renew naming another TTL is refused), so a longer
   * lease means acquiring with a longer `ttlMs`. Rejects with
   * {@link LockLostError} if the router says the lock is gone (it is then
   * lost) or it was lost already; other errors as they come.
   */
  async extend(): Promise<number> {
    const lost = this.lostReason;
    if (lost !== undefined) throw new LockLostError(this.name, lost);
    const g = this.grant;
    const sentAt = now();
    const r = await this.keeper.transport.renew(g.ref, this.keeper.requestTimeoutMs, g.ttlMs);
    if (r.renewed && r.expiresInMs !== undefined) g.confirm(validUntil(sentAt, r.expiresInMs, g.marginMs));
    else g.markLost(r.reason === "stolen" ? "stolen" : "expired");
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
   */
  async [Symbol.asyncDispose](): Promise<void> {
    const lostBefore = this.lostReason;
    let failure: unknown = undefined;
    try {
      await this.release();
    } catch (e) {
      failure = e;
    }
    if (lostBefore !== undefined && lostBefore !== "released") throw new LockLostError(this.name, lostBefore);
    if (failure !== undefined) throw failure;
  }

  toString(): string {
    return `Lock(${JSON.stringify(this.name)}, token ${this.fencingToken}, ${this.lostReason ?? "held"})`;
  }
}
