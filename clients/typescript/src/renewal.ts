/**
 * The one renewal loop per client. There is no timer per lock: a lock is
 * due a third of its TTL after its last confirmed renewal (or sooner when
 * less validity would be left), and when any lock is due, every lock due
 * within the next half interval rides along, so N locks cost one
 * `renew-batch` request per interval, split at {@link MAX_BATCH} locks.
 *
 * Each answer moves the lock's validity forward, counted from the instant
 * before the request was sent. An answer is applied only if the lock still
 * has the lockId it was sent with: after an extend to another TTL the old
 * lockId answers `stolen`, and that is the extend's doing, not a loss. `renewed: false` with `expired` or `stolen`
 * loses the lock at once. `shard_unavailable`, transport errors, timeouts,
 * 429 and 5xx are retried with backoff and jitter while the lock is valid;
 * the grant's own clock timer loses it when validity runs out. A batch the
 * router refuses (4xx) is renewed lock by lock, so the batch's refusal
 * never costs the other locks; a lock refused on its own is lost (`refused`).
 *
 * A failed renewal's `Retry-After` (`RouterError.retryAfterMs`) is kept
 * only where this validity-driven schedule has room for it
 * ({@link renewalPause}): the retry waits for it when it is no longer than
 * the backoff's cap (the smaller of 2 s and the interval) and ends before
 * the lock's validity does; otherwise the plain backoff decides, since a
 * renewal held back longer could cost a lock the router still holds. So
 * the router's usual 1 s is kept by locks of a 3 s TTL or more, never by
 * shorter ones (a 2 s lock, valid 1.8 s after a renewal, would get one
 * try where the backoff gives it several). The router keeps admission slots
 * for renewals, which no surge of acquires takes. Releases this loop
 * carries on honour `Retry-After` in full (`release`).
 *
 * The loop's timer keeps the process alive while the client is open and
 * holds locks (a held lock is work in progress); with no lock tracked there
 * is no timer at all. It also delivers releases handed to it (a `release()`
 * that ran out of validity), at up to a renewal interval apart, with
 * unref'd timers, until the client is closed and one last request timeout
 * has passed. Works on the grants' state through the transport, the clock
 * rules and `release`.
 */

import { isRetryable, RouterError } from "./errors.js";
import { attempt, retryRelease, type Progress } from "./release.js";
import type { Grant } from "./state.js";
import type { LockRef, Renewed, Transport } from "./transport.js";
import { MAX_BACKOFF_MS, MAX_BATCH, nextRenewal, now, renewalPause, renewInterval, validUntil } from "./validity.js";

/** One tracked lock, as the schedule sees it. */
export interface Due {
  readonly key: number;
  /** When the next renewal should be sent. */
  nextDue: number;
  /** A third of the TTL; an extend to another TTL changes it. */
  interval: number;
  /** A renewal for it is on the wire; do not send another. */
  inFlight: boolean;
}

interface Entry extends Due {
  readonly grant: Grant;
  /** Consecutive failed attempts, for backoff. */
  failures: number;
}

/** What became of one lock's renewal attempt; a retry carries the router's `Retry-After`, if its refusal had one. */
export type Outcome =
  | { kind: "renewed"; expiresInMs: number }
  | { kind: "lost"; reason: "expired" | "stolen" | "refused" }
  | { kind: "retry"; afterMs?: number };

/**
 * The batches to send at `at`: nothing unless some lock is due; then every
 * lock not in flight and due within half its interval, in key order, in
 * chunks of at most `max`.
 */
export function dueBatches(entries: Iterable<Due>, at: number, max: number = MAX_BATCH): number[][] {
  const all = [...entries];
  if (!all.some((e) => !e.inFlight && e.nextDue <= at)) return [];
  const keys = all
    .filter((e) => !e.inFlight && e.nextDue <= at + e.interval / 2)
    .map((e) => e.key)
    .sort((a, b) => a - b);
  const out: number[][] = [];
  for (let i = 0; i < keys.length; i += max) out.push(keys.slice(i, i + max));
  return out;
}

/** What one renewal answer means. */
export function outcome(r: Renewed): Outcome {
  if (r.renewed && r.expiresInMs !== undefined) return { kind: "renewed", expiresInMs: r.expiresInMs };
  if (!r.renewed && r.reason === "expired") return { kind: "lost", reason: "expired" };
  if (!r.renewed && r.reason === "stolen") return { kind: "lost", reason: "stolen" };
  // shard_unavailable, or anything this client does not know yet: nothing
  // proves the lock gone, so try again while it is valid.
  return { kind: "retry" };
}

export class Renewer {
  private readonly entries = new Map<number, Entry>();
  private timer: NodeJS.Timeout | undefined;
  private wakeAt = Infinity;
  /** Requests on the wire, so that closing can wait for them. */
  private readonly inFlight = new Set<Promise<void>>();
  /** Background releases under way. */
  private readonly releases = new Set<Promise<void>>();
  private closing = false;
  private readonly stop = new AbortController();

  constructor(
    private readonly transport: Transport,
    private readonly requestTimeoutMs: number,
    /** Told when a background release ended, so the registry can drop the grant. */
    private readonly onReleaseEnded: (grant: Grant) => void,
  ) {}

  /** Starts renewing a lock that was just acquired (once per grant). */
  track(grant: Grant): void {
    if (this.closing) return;
    const interval = renewInterval(grant.ttlMs);
    const nextDue = nextRenewal(now(), grant.validUntil, interval);
    this.entries.set(grant.key, { key: grant.key, grant, interval, nextDue, inFlight: false, failures: 0 });
    this.schedule();
  }

  /** An extend moved the lock to another TTL: its renewals follow it, from its new validity. */
  extended(key: number): void {
    const e = this.entries.get(key);
    if (e === undefined) return;
    e.interval = renewInterval(e.grant.ttlMs);
    e.nextDue = nextRenewal(now(), e.grant.validUntil, e.interval);
    e.failures = 0;
    this.schedule();
  }

  /** Stops renewing a lock: its release is under way. */
  forget(key: number): void {
    this.entries.delete(key);
    this.schedule();
  }

  /**
   * Keeps releasing `grant` while the client is open, from `progress` (the
   * failed attempts behind it, and the last one's `Retry-After`, which the
   * next attempt honours).
   */
  releaseInBackground(grant: Grant, progress: Progress): void {
    this.forget(grant.key);
    const until = { kind: "background" as const, hurry: () => this.closing, stop: this.stop.signal };
    const once = () => attempt(this.transport, grant, this.requestTimeoutMs);
    const p: Promise<void> = retryRelease(grant, once, progress, until)
      .catch(() => {
        // Refused, or given up at close: the lock expires at its TTL once
        // nothing of this client renews its session.
      })
      .finally(() => {
        this.releases.delete(p);
        this.onReleaseEnded(grant);
      });
    this.releases.add(p);
  }

  /**
   * Stops renewing; gives background releases one request timeout more, at
   * the fast pace, then abandons them. No timer of this loop is left after.
   */
  async close(): Promise<void> {
    this.closing = true;
    this.entries.clear();
    this.schedule();
    if (this.releases.size > 0) {
      let timer: NodeJS.Timeout | undefined;
      const grace = new Promise<void>((r) => (timer = setTimeout(r, this.requestTimeoutMs)));
      await Promise.race([Promise.allSettled([...this.releases]), grace]);
      clearTimeout(timer);
    }
    this.stop.abort();
    await Promise.allSettled([...this.releases, ...this.inFlight]);
  }

  /** Sets the one timer for the earliest due renewal or validity end. */
  private schedule(): void {
    let wake = Infinity;
    for (const e of this.entries.values()) {
      wake = Math.min(wake, e.inFlight ? e.grant.validUntil : Math.min(e.nextDue, e.grant.validUntil));
    }
    if (wake === this.wakeAt && this.timer !== undefined) return;
    clearTimeout(this.timer);
    this.timer = undefined;
    this.wakeAt = wake;
    if (wake === Infinity) return;
    this.timer = setTimeout(() => this.tick(), Math.max(0, wake - now()));
  }

  private tick(): void {
    this.timer = undefined;
    this.wakeAt = Infinity;
    for (const [key, e] of this.entries) if (e.grant.lostNow() !== undefined) this.entries.delete(key);
    for (const batch of dueBatches(this.entries.values(), now())) this.send(batch);
    this.schedule();
  }

  private send(keys: number[]): void {
    const locks: Sent[] = [];
    // No point waiting for an answer past the interval: a later attempt has a better chance.
    let timeout = this.requestTimeoutMs;
    for (const key of keys) {
      const e = this.entries.get(key);
      if (e === undefined) continue;
      e.inFlight = true;
      timeout = Math.min(timeout, Math.max(e.interval, 500));
      locks.push([key, e.grant.generation, e.grant.ref]);
    }
    const sentAt = now();
    const p: Promise<void> = renew(this.transport, locks, timeout)
      .catch((): Answered[] => locks.map(([key, generation]) => [key, generation, { kind: "retry" }]))
      .then((outcomes) => this.finished(sentAt, outcomes))
      .finally(() => this.inFlight.delete(p));
    this.inFlight.add(p);
  }

  private finished(sentAt: number, outcomes: Answered[]): void {
    const t = now();
    for (const [key, generation, o] of outcomes) {
      // A lock forgotten meanwhile (released) is no longer ours.
      const e = this.entries.get(key);
      if (e === undefined) continue;
      e.inFlight = false;
      if (o.kind === "renewed") {
        // An answer for the lockId an extend replaced says nothing of the
        // lock now: its next renewal asks anew.
        const until = validUntil(sentAt, o.expiresInMs, e.grant.marginMs);
        if (e.grant.applyRenewal(generation, { validUntil: until }) !== undefined) {
          e.failures = 0;
          e.nextDue = nextRenewal(sentAt, e.grant.validUntil, e.interval);
        }
      } else if (o.kind === "lost") {
        // `stolen` for a lockId an extend replaced is the extend's doing, not a loss.
        if (e.grant.applyRenewal(generation, { lost: o.reason }) === false) this.entries.delete(key);
      } else {
        e.failures++;
        e.nextDue = t + renewalPause(e.failures, Math.min(MAX_BACKOFF_MS, e.interval), o.afterMs, e.grant.validUntil - t);
      }
    }
    this.schedule();
  }
}

/** One lock of a batch: its key, the generation of its grant as sent, the lockId and token sent. */
type Sent = [key: number, generation: number, ref: LockRef];
/** What became of one lock of a batch, with the generation it was sent under. */
type Answered = [key: number, generation: number, outcome: Outcome];

/** Renews `locks` with one `renew-batch` call; if the router refuses the batch itself (4xx), renews each lock on its own. */
async function renew(transport: Transport, locks: Sent[], timeoutMs: number): Promise<Answered[]> {
  try {
    const results = await transport.renewBatch(
      locks.map(([, , ref]) => ref),
      timeoutMs,
    );
    return locks.map(([key, generation], i) => [key, generation, outcome(results[i]!)]);
  } catch (e) {
    if (isRetryable(e)) return locks.map(([key, generation]) => [key, generation, retry(e)]);
    return Promise.all(
      locks.map(async ([key, generation, ref]): Promise<Answered> => {
        try {
          return [key, generation, outcome(await transport.renew(ref, timeoutMs))];
        } catch (err) {
          return [key, generation, isRetryable(err) ? retry(err) : { kind: "lost", reason: "refused" }];
        }
      }),
    );
  }
}

/** A retry after `e`, with the wait the router asked for in its `Retry-After`, if any. */
function retry(e: unknown): Outcome {
  const afterMs = e instanceof RouterError ? e.retryAfterMs : undefined;
  return afterMs === undefined ? { kind: "retry" } : { kind: "retry", afterMs };
}
