/**
 * Typed failures: one class per thing a caller does differently, all under
 * {@link LockrouterError}, so callers can tell "someone else holds it"
 * ({@link NotAcquiredError}) from "the lock was lost" ({@link LockLostError})
 * from "the router said no" ({@link RouterError}) from "the router could not
 * be reached" ({@link TransportError}). A leaf: imports nothing of the package.
 */

/** Why a lock can no longer be trusted (the same reasons as the Rust and Python SDKs). */
export type LostReason =
  /** The router reported the lock gone: its lease ran out, or it was released behind this client's back. */
  | "expired"
  /** The router reported that another holder has the name now. */
  | "stolen"
  /**
   * This process's monotonic clock passed the lock's validity without a
   * confirmed renewal (router unreachable, shard unavailable, or the process
   * was paused). The lease may still exist; nobody can prove it.
   */
  | "unconfirmed"
  /** The router refused to renew the lock (a 4xx on the lock itself). */
  | "refused"
  /** This client released it (`release()`, the end of an `await using` block, or `client.close()`). */
  | "released";

/** A human sentence for a {@link LostReason}. */
export function describeLostReason(reason: LostReason): string {
  switch (reason) {
    case "expired":
      return "expired";
    case "stolen":
      return "stolen by another holder";
    case "unconfirmed":
      return "validity ran out without a confirmed renewal";
    case "refused":
      return "the router refused to renew it";
    case "released":
      return "released";
  }
}

/** Base class of every error this SDK throws. */
export class LockrouterError extends Error {
  override name = "LockrouterError";

  /** True when the same request may succeed later (transport failures, 408, 429 and 5xx answers). */
  get retryable(): boolean {
    return false;
  }
}

/** The client was set up or called wrongly (bad URL, bad TTL, a closed client). */
export class ConfigError extends LockrouterError {
  override name = "ConfigError";
}

/** Another client holds the lock (or others are queued for it), and the wait, if any, ran out. */
export class NotAcquiredError extends LockrouterError {
  override name = "NotAcquiredError";

  constructor(readonly lockName: string) {
    super(`lock ${JSON.stringify(lockName)} is held by another client`);
  }
}

/**
 * The lock was lost while work ran under it (this is `lock.signal.reason`
 * once the signal aborts), or, from `release()`, its grant has passed to a
 * newer `Lock` of this client.
 */
export class LockLostError extends LockrouterError {
  override name = "LockLostError";

  constructor(
    readonly lockName: string,
    readonly reason: LostReason,
  ) {
    super(`lock ${JSON.stringify(lockName)} was lost: ${describeLostReason(reason)}`);
  }
}

/**
 * The router answered with an error: the HTTP `status`, the API's stable
 * `code`, and how long the router asked the caller to wait before trying
 * again (`retryAfterMs`, from its `Retry-After` header).
 */
export class RouterError extends LockrouterError {
  override name = "RouterError";
  /**
   * Milliseconds the router asked the caller to wait before sending the
   * request again: its `Retry-After` header (whole seconds) × 1000, at most
   * an hour. The router sends it with 503 `overloaded` and
   * `shard_unavailable`, 429 `rate_limited` and 504 `timeout`. `undefined`
   * when the answer had none, or one in another form (an HTTP-date, a
   * negative or fractional number): then the caller's own backoff decides.
   */
  readonly retryAfterMs: number | undefined;

  constructor(
    readonly status: number,
    readonly code: string,
    readonly detail: string,
    retryAfterMs?: number,
  ) {
    super(`router answered ${status} ${code}: ${detail}`);
    this.retryAfterMs = retryAfterMs;
  }

  override get retryable(): boolean {
    // 408: the router gave up reading the request, so it did nothing.
    return this.status === 408 || this.status === 429 || this.status >= 500;
  }
}

/** No answer: connection refused or reset, DNS or TLS failure, timeout. */
export class TransportError extends LockrouterError {
  override name = "TransportError";

  override get retryable(): boolean {
    return true;
  }
}

/** Whether `e` is worth retrying with the same request. */
export function isRetryable(e: unknown): boolean {
  return e instanceof LockrouterError && e.retryable;
}
