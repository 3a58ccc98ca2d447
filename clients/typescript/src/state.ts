/**
 * The state every {@link Lock} of one grant shares: its identity (name,
 * lockId, fencing token), its validity as this process's clock judges it,
 * why it was lost, and where its release stands.
 *
 * The renewal loop moves `validUntil` forward on each confirmed renewal and
 * records why a lock was lost; readers compare `validUntil` with the clock
 * themselves (`lostNow`), and a timer of the grant's own fires at
 * `validUntil`, so the lost signal aborts on time even if the router is
 * unreachable or a request hangs. Validity only moves forward (but for an
 * extend to another TTL, which sets it), the first reason a lock was lost
 * is the one that stays, and a lost grant is never revived.
 *
 * An extend to another TTL moves the grant to a new lockId (the fencing
 * token stays), and the old lockId answers `stolen` from then on. So the
 * identity an extend moves (lockId, TTL, margin) is switchable, with a
 * generation count: a renewal answer is applied only under the generation
 * it was sent with. {@link Grant.exclusive} serializes an extend with the
 * release attempts of the grant: a release sent with the lockId an extend
 * is replacing would free nothing. Imports only the leaves (errors,
 * validity) and the transport's types.
 */

import { LockLostError, type LostReason } from "./errors.js";
import type { LockRef } from "./transport.js";
import { now } from "./validity.js";

/** Where a grant's release at the router stands. */
export type ReleaseState =
  | "none"
  /** Under way, in `release()` or in the renewal loop. */
  | "pending"
  /** The router confirmed (204, or 409: gone). */
  | "done"
  /** The router refused it (a 4xx other than 409 and 429): retrying cannot help. */
  | "gave-up";

export class Grant {
  /** Fires once, with a {@link LockLostError}, when the lock can no longer be trusted. */
  private readonly controller = new AbortController();
  /** Aborts the lock at `validUntil`; unref'd: reporting a loss is no reason to keep a process alive. */
  private clockTimer: NodeJS.Timeout | undefined;
  private lost: LostReason | undefined;
  private until: number;
  private releaseState: ReleaseState = "none";
  /** Resolves when a pending release ends, however it ends. */
  private settled: { promise: Promise<void>; resolve: () => void } | undefined;
  /** The first `release()`'s outcome; later calls share it. */
  releasing: Promise<void> | undefined;
  /**
   * Wakes a release from its backoff (but not before the router's
   * `Retry-After`): an acquire that raced it wants it settled now. Returns
   * when the next attempt goes out, by the monotonic clock.
   */
  retryNow: (() => number) | undefined;
  /** lockId and token; `ttl` and `margin` go with it, and an extend to another TTL replaces all three. */
  private current: LockRef;
  private ttl: number;
  private margin: number;
  private gen = 0;
  /** The last extend or release attempt of this grant, queued behind each other (see {@link exclusive}). */
  private moving: Promise<unknown> = Promise.resolve();

  constructor(
    /** Numbers the grant within its client's renewal loop. */
    readonly key: number,
    readonly name: string,
    ref: LockRef,
    ttlMs: number,
    marginMs: number,
    readonly clientId: string,
    validUntil: number,
  ) {
    this.current = ref;
    this.ttl = ttlMs;
    this.margin = marginMs;
    this.until = validUntil;
    this.armClock();
  }

  /** The lockId and fencing token to send now (an extend to another TTL changes the lockId). */
  get ref(): LockRef {
    return this.current;
  }

  /** The TTL the lock was acquired with, or the last one an extend gave it. */
  get ttlMs(): number {
    return this.ttl;
  }

  /** The safety margin for {@link ttlMs}. */
  get marginMs(): number {
    return this.margin;
  }

  /** Counts extends that moved the grant: a renewal answer is applied only under the generation it was sent with. */
  get generation(): number {
    return this.gen;
  }

  /**
   * Runs `step` once every extend or release attempt of this grant queued
   * before it has ended, and before any queued after it: an extend and a
   * release never cross on the wire.
   */
  exclusive<T>(step: () => Promise<T>): Promise<T> {
    const run = this.moving.then(step);
    this.moving = run.catch(() => {});
    return run;
  }

  /**
   * Moves the grant to the lockId and TTL an extend answered, valid until
   * `validUntil` (set, not only moved forward: the lock now rides the new
   * TTL's lease, which may end before the old one), and returns the lockId
   * it replaced. A lock lost meanwhile (a release begun while the extend
   * was on the wire) stays lost, but takes the new lockId all the same:
   * the router holds it under that one now, and a release sent with the
   * old one would free nothing. Only the registry calls this, so its entry
   * moves in the same step.
   */
  switch(lockId: string, ttlMs: number, marginMs: number, validUntil: number): string {
    const old = this.current.lockId;
    this.current = { lockId, fencingToken: this.current.fencingToken };
    this.ttl = ttlMs;
    this.margin = marginMs;
    this.gen++;
    if (this.lostNow() === undefined) {
      this.until = validUntil;
      this.armClock();
    }
    return old;
  }

  /**
   * A renewal answer, applied only if the grant is still the `generation`
   * it was sent under: true when it confirmed `validUntil`, false when it
   * marked the lock lost with `lost`, `undefined` for a stale answer
   * (nothing applied: the lockId it was sent with has been replaced).
   */
  applyRenewal(generation: number, answer: { validUntil: number } | { lost: LostReason }): boolean | undefined {
    if (generation !== this.gen) return undefined;
    if ("validUntil" in answer) {
      this.confirm(answer.validUntil);
      return true;
    }
    this.markLost(answer.lost);
    return false;
  }

  get signal(): AbortSignal {
    return this.controller.signal;
  }

  get validUntil(): number {
    return this.until;
  }

  get release(): ReleaseState {
    return this.releaseState;
  }

  /** The recorded reason, without consulting the clock. */
  get recordedLoss(): LostReason | undefined {
    return this.lost;
  }

  /** Lost by a recorded reason, or by the clock. */
  lostNow(): LostReason | undefined {
    if (this.lost === undefined && now() >= this.until) this.markLost("unconfirmed");
    return this.lost;
  }

  /** Records that the lock is lost; the first reason wins. */
  markLost(reason: LostReason): void {
    if (this.lost !== undefined) return;
    this.lost = reason;
    clearTimeout(this.clockTimer);
    this.clockTimer = undefined;
    this.controller.abort(new LockLostError(this.name, reason));
  }

  /** Moves validity forward (never back) after a confirmed renewal; a lock already lost stays lost. */
  confirm(validUntil: number): void {
    if (this.lostNow() !== undefined || validUntil <= this.until) return;
    this.until = validUntil;
    this.armClock();
  }

  /**
   * Marks the lock lost (`released`, unless it was lost already) and its
   * release pending; true for the one call that started the release.
   */
  beginRelease(): boolean {
    this.markLost("released");
    if (this.releaseState !== "none") return false;
    this.releaseState = "pending";
    let resolve!: () => void;
    const promise = new Promise<void>((r) => (resolve = r));
    this.settled = { promise, resolve };
    return true;
  }

  /** Records how the release ended. A confirmation counts whoever got it. */
  endRelease(outcome: "done" | "gave-up"): void {
    if (this.releaseState === "done") return;
    if (outcome === "gave-up" && this.releaseState !== "pending") return;
    this.releaseState = outcome;
    this.settled?.resolve();
  }

  /** Resolves when a pending release has ended (at once if none is pending), or after `withinMs`. */
  async releaseSettled(withinMs: number): Promise<void> {
    if (this.releaseState !== "pending" || this.settled === undefined) return;
    let timer: NodeJS.Timeout | undefined;
    const timeout = new Promise<void>((r) => (timer = setTimeout(r, withinMs)));
    try {
      await Promise.race([this.settled.promise, timeout]);
    } finally {
      clearTimeout(timer);
    }
  }

  private armClock(): void {
    clearTimeout(this.clockTimer);
    const fire = (): void => {
      // Timers may fire a little early by this clock: look again then.
      if (this.lostNow() === undefined) this.clockTimer = setTimeout(fire, Math.max(1, this.until - now())).unref();
    };
    this.clockTimer = setTimeout(fire, Math.max(0, this.until - now())).unref();
  }
}
