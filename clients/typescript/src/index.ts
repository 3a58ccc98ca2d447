/**
 * TypeScript client for lockrouter, the HTTP lock router over sharded etcd.
 *
 * A lock from lockrouter is a lease with a fencing token. This package holds
 * such leases for you: each {@link Client} renews all its locks in the
 * background with one `renew-batch` request per interval, judges each
 * lock's validity with this process's own monotonic clock (never the
 * router's wall-clock `expiresAt`), and aborts `lock.signal` the moment a
 * lock can no longer be trusted. The fencing token (`lock.fencingToken`, an
 * exact `bigint`) is what makes the lock safe: send it with every write and
 * let the resource reject stale ones (`fencing`).
 *
 * ```ts
 * import { Client } from "lockrouter";
 *
 * await using client = new Client({ url: "http://127.0.0.1:8080" });
 * await using lock = await client.acquire("process_order:42", { ttlMs: 30_000 });
 * await writeOrder(42, { fencingToken: lock.fencingToken, signal: lock.signal });
 * ```
 *
 * Layout, top to bottom (a module imports only from those below it):
 *
 * - `client`: {@link Client}: the client id, acquiring (at once or
 *   waiting, past the router's cap, cancellable), `using`, `inspect`,
 *   closing.
 * - `lock`: {@link Lock}: a held lock, its validity and lost signal.
 * - `keeper`: what a client's locks need of it (transport, timeout,
 *   renewal loop, registry, holds), and releasing a grant.
 * - `renewal`: the one loop per client that renews all its locks (up to
 *   {@link MAX_BATCH} a request) and keeps delivering unconfirmed releases.
 * - `registry`: the client's grants by lockId, so every `Lock` of one grant
 *   shares one state; beside it `release`: retrying a release until the
 *   router confirms it, and `holds`: one hold of a name at a time within a
 *   client, or counted re-entrant holds when asked for.
 * - `state`: that state: validity, why the lock was lost, its release.
 * - `transport`: the v1 HTTP API over `fetch`.
 * - Leaves: `errors` (typed failures, {@link LostReason}), `validity` (the
 *   clock rules), `json` (exact 64-bit integers), `info` ({@link LockInfo}:
 *   the router's inspect answer) and `fencing` (what the protected resource
 *   must do, with helpers).
 */

export { Client, type AcquireOptions, type ClientOptions } from "./client.js";
export { LockInfo } from "./info.js";
export { Lock } from "./lock.js";
export {
  ConfigError,
  describeLostReason,
  isRetryable,
  LockLostError,
  LockrouterError,
  NotAcquiredError,
  RouterError,
  TransportError,
  type LostReason,
} from "./errors.js";
export * as fencing from "./fencing.js";
export { parseJson, stringifyJson, JsonSyntaxError, type Json } from "./json.js";
export { MAX_BATCH, MIN_MARGIN_MS } from "./validity.js";
