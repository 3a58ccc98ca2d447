/**
 * Releasing a lock at the router until the router confirms.
 *
 * Why a release must get through: a lock's key lives on its client's
 * session lease for (client id, TTL, shard), and renewing any lock of that
 * session keeps the lease alive. A release the router never saw does not
 * end at the lock's TTL while this client renews other locks of that TTL on
 * that shard. The router's release is idempotent, so repeating it is safe.
 *
 * Transport errors, 429 and 5xx answers (503 `shard_unavailable` above all)
 * are retried with backoff and jitter; any other 4xx ends it, since the
 * same request cannot fare better. `release()` retries while the lock's
 * validity lasts; the renewal loop then carries on in the background at up
 * to a renewal interval apart while the client is open.
 *
 * A refusal with `Retry-After` (the router sends one with 503 `overloaded`
 * and `shard_unavailable`, 429 and 504) holds the next attempt back until
 * that much time has passed, even when the backoff is shorter or an
 * acquire asks for the release now: a router shedding load should not get
 * the same request again at once. A lock being released counts as lost
 * already, so the wait costs only the name's early return to others. If
 * it would end past the lock's validity, `release()` stops there, as it
 * does at validity end, and the background's next attempt still waits it
 * out.
 *
 * Each attempt names the grant as it stands then, and waits for an extend
 * of it on the wire: a release sent with a lockId an extend is replacing
 * would free nothing ({@link attempt}). Touches only the grant's state, the
 * transport, the clock rules and the error types.
 */

import { isRetryable, RouterError, TransportError } from "./errors.js";
import type { Grant } from "./state.js";
import type { Transport } from "./transport.js";
import { backoff, MAX_BACKOFF_MS, now, renewInterval } from "./validity.js";

/** How far a release has got; handed over with it from `release()` to the background. */
export interface Progress {
  /** Failed attempts so far, for backoff. */
  failures: number;
  /** The router's `Retry-After` from the last failed attempt: no attempt before this instant (monotonic clock). */
  notBefore: number;
}

/** A release not yet tried. */
export function unstarted(): Progress {
  return { failures: 0, notBefore: 0 };
}

/** When a release stops retrying. */
export type Until =
  /** When the lock's validity ends (`release()`, which then hands the release to the renewal loop). */
  | { kind: "validity-ends" }
  /**
   * When `stop` aborts (the client is closed and its last grace ran out).
   * `hurry()` turns true once the client is closing: attempts come at the
   * fast pace again. Its pauses never keep the process alive.
   */
  | { kind: "background"; hurry: () => boolean; stop: AbortSignal };

/**
 * One release request for `grant` under the lockId it has now, never while
 * an extend of it is on the wire: the extend moves the lock to a new
 * lockId, and the old one releases nothing.
 */
export function attempt(transport: Transport, grant: Grant, timeoutMs: number): Promise<void> {
  return grant.exclusive(() => transport.release(grant.ref, timeoutMs));
}

/**
 * Calls `attempt` (one release request) until it succeeds, fails with an
 * error not worth retrying, or `until` says stop. `progress` may start
 * with failed attempts and a `Retry-After` behind it when the release was
 * handed over. Between attempts it pauses for the backoff or the router's
 * `Retry-After`, whichever is longer. Returns at once when another caller
 * got the confirmation.
 */
export async function retryRelease(grant: Grant, attempt: () => Promise<void>, progress: Progress, until: Until): Promise<void> {
  const interval = renewInterval(grant.ttlMs);
  const fast = Math.min(MAX_BACKOFF_MS, interval);
  const slow = Math.max(interval, fast);
  let last: unknown = undefined;
  for (;;) {
    if (progress.failures > 0) {
      const asked = progress.notBefore - now();
      if (until.kind === "validity-ends") {
        const left = grant.validUntil - now();
        // No attempt could go out within validity: stop as at its end.
        if (left <= 0 || asked > left) throw last ?? unconfirmed(grant);
        const wait = Math.min(Math.max(backoff(progress.failures, fast), asked), left);
        await pause(wait, progress.notBefore, grant, true, undefined);
      } else {
        if (until.stop.aborted) throw last ?? unconfirmed(grant);
        const valid = now() < grant.validUntil;
        const wait = backoff(progress.failures, valid || until.hurry() ? fast : slow);
        await pause(Math.max(wait, asked), progress.notBefore, grant, false, until.stop);
        if (until.stop.aborted) throw last ?? unconfirmed(grant);
      }
    }
    if (grant.release === "done") return;
    try {
      await attempt();
      grant.endRelease("done");
      return;
    } catch (e) {
      if (!isRetryable(e)) {
        grant.endRelease("gave-up");
        throw e;
      }
      progress.failures++;
      progress.notBefore = now() + (e instanceof RouterError ? (e.retryAfterMs ?? 0) : 0);
      last = e;
    }
  }
}

/**
 * Sleeps `ms`, or less if an acquire wants the release settled now (never
 * less than until `notBefore`, the router's `Retry-After`), or until `stop`
 * aborts.
 */
function pause(ms: number, notBefore: number, grant: Grant, keepAlive: boolean, stop: AbortSignal | undefined): Promise<void> {
  return new Promise((resolve) => {
    let timer: NodeJS.Timeout | undefined;
    const done = (): void => {
      clearTimeout(timer);
      grant.retryNow = undefined;
      stop?.removeEventListener("abort", done);
      resolve();
    };
    const sleep = (wait: number): void => {
      clearTimeout(timer);
      timer = setTimeout(wake, Math.max(0, Math.ceil(wait)));
      if (!keepAlive) timer.unref();
    };
    // Timers may fire a little early by this clock: look again then.
    const wake = (): void => (now() < notBefore ? sleep(notBefore - now()) : done());
    sleep(ms);
    grant.retryNow = () => {
      wake();
      return Math.max(now(), notBefore);
    };
    stop?.addEventListener("abort", done, { once: true });
  });
}

function unconfirmed(grant: Grant): TransportError {
  return new TransportError(`the release of ${JSON.stringify(grant.name)} was not confirmed within its validity`);
}
