/**
 * A held lock: its identity (name, lockId, fencing token), its validity as
 * this process's clock judges it, and the lost signal, all read from the
 * grant's shared state, which every {@link Lock} of one grant shares with
 * the client's renewal loop. Releasing any `Lock` of a grant marks them all
 * lost at once, and the grant is released at the router once.
 */

import { LockLostError, type LostReason } from "./errors.js";
import type { Keeper } from "./keeper.js";
import type { Grant } from "./state.js";
import { now } from "./validity.js";

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
  /** @internal */
  constructor(
    private readonly grant: Grant,
    private readonly keeper: Keeper,
  ) {}

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
    return this.grant.signal;
  }

  /** Why the lock is lost, or `undefined` while it is held. */
  get lostReason(): LostReason | undefined {
    return this.grant.lostNow();
  }

  /**
   * True while the client can prove the lock is held: not lost, and its
   * validity (by this process's monotonic clock) has not run out. A process
   * can pause right after this returns true; only the resource's fencing
   * check is safe against that.
   */
  isHeld(): boolean {
    return this.grant.lostNow() === undefined;
  }

  /** Milliseconds of validity left as of the last confirmed renewal (0 once lost). */
  timeLeftMs(): number {
    return this.isHeld() ? Math.max(0, this.grant.validUntil - now()) : 0;
  }

  /** Resolves with the reason once the lock is lost (see {@link signal}). */
  whenLost(): Promise<LostReason> {
    const signal = this.grant.signal;
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
   * has since acquired the same grant through a newer `Lock`.
   */
  release(): Promise<void> {
    return this.keeper.release(this.grant);
  }

  /**
   * `await using` support: releases the lock (as {@link release}). If the
   * lock had been lost before the block ended, throws {@link LockLostError}
   * after releasing: the block's work was not protected to the end.
   */
  async [Symbol.asyncDispose](): Promise<void> {
    const lostBefore = this.grant.lostNow();
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
