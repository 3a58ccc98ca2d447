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
 * Each attempt names the grant as it stands then, and waits for an extend
 * of it on the wire: a release sent with a lockId an extend is replacing
 * would free nothing ({@link attempt}). Touches only the grant's state, the
 * transport, the clock rules and the error types.
 */

import { isRetryable, TransportError } from "./errors.js";
import type { Grant } from "./state.js";
import type { Transport } from "./transport.js";
import { backoff, MAX_BACKOFF_MS, now, renewInterval } from "./validity.js";

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
 * error not worth retrying, or `until` says stop. `progress.failures`
 * counts failed attempts and may start above zero when the release was
 * handed over. Returns at once when another caller got the confirmation.
 */
export async function retryRelease(
  grant: Grant,
  attempt: () => Promise<void>,
  progress: { failures: number },
  until: Until,
): Promise<void> {
  const interval = renewInterval(grant.ttlMs);
  const fast = Math.min(MAX_BACKOFF_MS, interval);
  const slow = Math.max(interval, fast);
  let last: unknown = undefined;
  for (;;) {
    if (progress.failures > 0) {
      if (until.kind === "validity-ends") {
        const left = grant.validUntil - now();
        if (left <= 0) throw last ?? unconfirmed(grant);
        await pause(Math.min(backoff(progress.failures, fast), left), grant, true, undefined);
      } else {
        if (until.stop.aborted) throw last ?? unconfirmed(grant);
        const valid = now() < grant.validUntil;
        await pause(backoff(progress.failures, valid || until.hurry() ? fast : slow), grant, false, until.stop);
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
      last = e;
    }
  }
}

/** Sleeps `ms`, or less if an acquire wants the release settled now, or `stop` aborts. */
function pause(ms: number, grant: Grant, keepAlive: boolean, stop: AbortSignal | undefined): Promise<void> {
  return new Promise((resolve) => {
    const done = (): void => {
      clearTimeout(timer);
      grant.retryNow = undefined;
      stop?.removeEventListener("abort", done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    if (!keepAlive) timer.unref();
    grant.retryNow = done;
    stop?.addEventListener("abort", done, { once: true });
  });
}

function unconfirmed(grant: Grant): TransportError {
  return new TransportError(`the release of ${JSON.stringify(grant.name)} was not confirmed within its validity`);
}
