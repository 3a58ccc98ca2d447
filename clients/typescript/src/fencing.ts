/**
 * Fencing for resource owners: how the protected resource (a database, a
 * service, a file store) makes a lock safe.
 *
 * A lock alone is never safe. The holder can pause (GC, swap, VM
 * migration, `SIGSTOP`) after checking `lock.isHeld()` and before its write
 * lands; meanwhile its lease expires and another worker gets the lock. When
 * the first one resumes, its write arrives late. The only defence is at the
 * resource: every grant of a name carries a fencing token larger than every
 * earlier grant's, each write carries the token it was made under, and the
 * resource remembers the highest token it has accepted and **atomically**
 * rejects writes with a lower one. In SQL, one statement does both:
 *
 * ```sql
 * UPDATE orders SET status = $status, fence = $token
 *  WHERE id = $id AND fence <= $token;
 * -- 1 row changed: accepted. 0 rows: a newer holder has written; stop.
 * ```
 *
 * `<=` lets the current holder write many times under one grant and makes a
 * retried write succeed; use `<` only when each grant may write once.
 * Either way a lower token is always rejected, which is the safety part.
 * For a service you own, send the token in {@link HEADER} and check it where
 * the write commits, not at the door. {@link Fence} is the check for a
 * resource that lives in one process. A leaf: imports nothing of the package.
 */

/** The HTTP header this project uses to pass a fencing token to a service. */
export const HEADER = "Lockrouter-Fencing-Token";

const I64_MAX = (1n << 63n) - 1n;

/** A write carried a token lower than one the resource already accepted. */
export class StaleTokenError extends Error {
  override name = "StaleTokenError";

  constructor(
    /** The token the write carried. */
    readonly token: bigint,
    /** The highest token the resource had accepted. */
    readonly highest: bigint,
  ) {
    super(`stale fencing token ${token}: the resource has accepted ${highest}`);
  }
}

/**
 * Whether a write with `token` may proceed when the resource has accepted
 * `highest` so far (`undefined`: never written). Equal tokens are admitted:
 * the same grant may write again.
 */
export function admits(highest: bigint | undefined, token: bigint): boolean {
  return highest === undefined || token >= highest;
}

/**
 * The token checked to fit a SQL `BIGINT` (signed 64-bit), as lockrouter's
 * tokens always do. Bind it as a `bigint` (or `String(token)`), never as a
 * `number`: above 2^53 a `number` loses digits. Throws `RangeError` for a
 * value that did not come from a router.
 */
export function asI64(token: bigint): bigint {
  if (token < 0n || token > I64_MAX) throw new RangeError(`fencing token ${token} does not fit a signed 64-bit integer`);
  return token;
}

/** 20 zero-padded digits, so comparing bytes (as etcd's value compares do) orders tokens numerically. */
export function fenceKeyValue(token: bigint): string {
  return asI64(token).toString().padStart(20, "0");
}

/** Parses a token sent as text (e.g. in {@link HEADER}); throws `RangeError` if it is not a decimal i64. */
export function parseToken(text: string): bigint {
  if (!/^(0|[1-9]\d{0,18})$/.test(text.trim())) throw new RangeError(`not a fencing token: ${JSON.stringify(text)}`);
  return asI64(BigInt(text.trim()));
}

/**
 * An in-memory fence: the highest token accepted so far. JavaScript runs
 * one callback at a time, so `admit` followed by a synchronous write (no
 * `await` in between) is atomic; put any `await` after both.
 */
export class Fence {
  private top: bigint | undefined;

  /** Accepts `token` and raises the fence to it, or throws {@link StaleTokenError}. */
  admit(token: bigint): void {
    if (!admits(this.top, token)) throw new StaleTokenError(token, this.top ?? 0n);
    this.top = token;
  }

  /** The highest token accepted so far (`undefined`: none yet). */
  get highest(): bigint | undefined {
    return this.top;
  }
}
