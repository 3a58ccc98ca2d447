/**
 * The validity clock: how long the client may trust a lock, judged only by
 * this process's monotonic clock (`performance.now()`, milliseconds).
 *
 * `validUntil = instant taken just before sending + expiresInMs − margin`.
 * The router's `expiresInMs` never overstates the lease (it counts from when
 * the router asked etcd), and the instant is taken before the request left,
 * so network and queueing delays only make the estimate earlier. The margin
 * absorbs clock-rate differences between machines and the time the caller
 * needs to act on a lost lock. The wall-clock `expiresAt` is never used:
 * wall clocks jump. The numbers are the Rust SDK's. A leaf: pure functions.
 */

import { performance } from "node:perf_hooks";

/** The smallest margin ever used, whatever the TTL or configuration. */
export const MIN_MARGIN_MS = 100;

/** Longest pause between retries of a failed renewal, or of a release while the lock is valid. */
export const MAX_BACKOFF_MS = 2_000;

/** The most locks one `renew-batch` call may carry (the API's limit, `limits.max_batch`). */
export const MAX_BATCH = 1_000;

/** This process's monotonic clock, in milliseconds. */
export function now(): number {
  return performance.now();
}

/** The safety margin for a lock of `ttlMs`: the configured one, else ttl/10, never below {@link MIN_MARGIN_MS}. */
export function margin(ttlMs: number, configuredMs?: number): number {
  return Math.max(configuredMs ?? ttlMs / 10, MIN_MARGIN_MS);
}

/** Until when a lock confirmed by an answer to a request sent at `sentAt` may be trusted. */
export function validUntil(sentAt: number, expiresInMs: number, marginMs: number): number {
  return sentAt + Math.max(expiresInMs - marginMs, 0);
}

/** How often held locks are renewed: a third of the TTL, so two renewals can fail before validity runs out. */
export function renewInterval(ttlMs: number): number {
  return Math.max(ttlMs / 3, 50);
}

/**
 * When to renew a lock confirmed at `confirmedAt`: an interval later, or
 * earlier if less than an interval of validity would be left by then (a
 * grant after a long wait, or a router reporting a short lease).
 */
export function nextRenewal(confirmedAt: number, until: number, interval: number): number {
  const early = until - interval;
  if (early < 0) return confirmedAt;
  return Math.min(confirmedAt + interval, Math.max(early, confirmedAt));
}

/**
 * The pause before retry number `failures` (1-based) of a failed renewal or
 * release: exponential from 100 ms, capped at `capMs`, with jitter in the
 * upper half so many clients of a recovering router do not retry in step.
 */
export function backoff(failures: number, capMs: number, random: () => number = Math.random): number {
  const exp = 100 * 2 ** Math.min(Math.max(failures - 1, 0), 16);
  const top = Math.max(Math.min(exp, capMs), 10);
  return top / 2 + random() * (top / 2);
}

/**
 * The pause before retry number `failures` of a failed renewal whose answer
 * asked for `retryAfterMs` (the router's `Retry-After`): the
 * {@link backoff}, or the router's wait when that is longer and fits the
 * schedule: no longer than `capMs` (the longest pause the backoff takes
 * anyway) and over before the lock's validity, `leftMs`, runs out. A wait
 * that does not fit is not taken at all: the plain backoff keeps the
 * renewals a lock's validity was planned around.
 */
export function renewalPause(
  failures: number,
  capMs: number,
  retryAfterMs: number | undefined,
  leftMs: number,
  random: () => number = Math.random,
): number {
  const pause = backoff(failures, capMs, random);
  const fits = retryAfterMs !== undefined && retryAfterMs <= capMs && retryAfterMs < leftMs;
  return fits ? Math.max(pause, retryAfterMs) : pause;
}
