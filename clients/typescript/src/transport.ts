/**
 * The v1 HTTP API on the wire: JSON bodies over `fetch` (Node's global one,
 * whose undici pool keeps connections alive across calls, or one the caller
 * passes in), each call bounded by a timeout. TLS comes from an `https://`
 * URL; a bearer token, if given, goes in `Authorization` on every call (for
 * a gateway in front of the router). Fencing tokens cross the wire as exact
 * integers (`json`). An error answer becomes a {@link RouterError} here,
 * with its `Retry-After` parsed once ({@link parseRetryAfter}). Nothing here
 * knows about validity, renewal or retry policy.
 */

import { ConfigError, RouterError, TransportError } from "./errors.js";
import { parseJson, stringifyJson, type Json } from "./json.js";

/** The longest `Retry-After` believed: a larger one is taken as this. */
export const MAX_RETRY_AFTER_MS = 3_600_000;

/** One answer: its status, its body (parsed, or the start of an error page), and its `Retry-After`. */
interface Answer {
  status: number;
  value: Json | undefined;
  retryAfterMs: number | undefined;
}

/** What identifies a grant at the router. */
export interface LockRef {
  readonly lockId: string;
  readonly fencingToken: bigint;
}

/** The router's inspect answer, as the wire has it. */
export interface Inspected {
  name: string;
  held: boolean;
  shard: string;
  fencingToken?: bigint;
  expiresAt?: string;
  acquiredAt?: string;
  metadata?: Json;
  waiters: number;
  holder?: string;
  principal?: string;
}

/** The router's answer to an acquire. */
export interface Acquired {
  acquired: boolean;
  lockId?: string;
  fencingToken?: bigint;
  expiresInMs?: number;
}

/** One renewal result, from `renew` or one item of `renew-batch`. */
export interface Renewed {
  renewed: boolean;
  expiresInMs?: number;
  /** `expired`, `stolen`, or (per item of a batch) `shard_unavailable`. */
  reason?: string;
}

/** An extend's answer: moved to `lockId`, or (a 409) not held under the lockId sent. */
export type Extended = { renewed: true; lockId: string; expiresInMs: number } | { renewed: false; reason?: string };

export class Transport {
  /** `scheme://authority[/prefix]` without a trailing slash. */
  private readonly base: string;

  constructor(
    url: string,
    private readonly token: string | undefined,
    private readonly fetchFn: typeof fetch,
  ) {
    let parsed: URL;
    try {
      parsed = new URL(url);
    } catch {
      throw new ConfigError(`router URL ${JSON.stringify(url)} must look like http://host:port`);
    }
    if ((parsed.protocol !== "http:" && parsed.protocol !== "https:") || parsed.host === "") {
      throw new ConfigError(`router URL ${JSON.stringify(url)} must be http:// or https://`);
    }
    if (parsed.search !== "" || parsed.hash !== "") {
      throw new ConfigError(`router URL ${JSON.stringify(url)} must not have a query or fragment`);
    }
    this.base = parsed.href.replace(/\/+$/, "");
  }

  async acquire(
    name: string,
    ttlMs: number,
    clientId: string,
    waitMs: number,
    timeoutMs: number,
    extra: { metadata?: Json; signal?: AbortSignal } = {},
  ): Promise<Acquired> {
    const body: Json = { name, ttlMs, clientId };
    if (waitMs > 0) body["waitMs"] = waitMs;
    if (extra.metadata !== undefined && extra.metadata !== null) body["metadata"] = extra.metadata;
    const { status, value, retryAfterMs } = await this.send("POST", "/api/v1/locks/acquire", body, timeoutMs, extra.signal);
    expectOk(status, value, retryAfterMs);
    const a = asObject(status, value);
    if (typeof a["acquired"] !== "boolean") throw malformed(status, "no 'acquired' in the answer");
    const out: Acquired = { acquired: a["acquired"] };
    if (typeof a["lockId"] === "string") out.lockId = a["lockId"];
    if (typeof a["fencingToken"] === "bigint") out.fencingToken = a["fencingToken"];
    if (typeof a["expiresInMs"] === "number") out.expiresInMs = a["expiresInMs"];
    return out;
  }

  /** Renews one lock: a 409 is an answer (`renewed: false`), not an error. */
  async renew(lock: LockRef, timeoutMs: number, ttlMs?: number): Promise<Renewed> {
    const body: Json = { lockId: lock.lockId, fencingToken: lock.fencingToken };
    if (ttlMs !== undefined) body["ttlMs"] = ttlMs;
    const { status, value, retryAfterMs } = await this.post("/api/v1/locks/renew", body, timeoutMs);
    if (status !== 409) expectOk(status, value, retryAfterMs);
    return renewed(status, value);
  }

  /** Renews up to 1,000 locks; results come back in request order. */
  async renewBatch(locks: readonly LockRef[], timeoutMs: number): Promise<Renewed[]> {
    const body: Json = { locks: locks.map((l) => ({ lockId: l.lockId, fencingToken: l.fencingToken })) };
    const { status, value, retryAfterMs } = await this.post("/api/v1/locks/renew-batch", body, timeoutMs);
    expectOk(status, value, retryAfterMs);
    const results = asObject(status, value)["results"];
    if (!Array.isArray(results) || results.length !== locks.length) {
      throw malformed(status, "renew-batch answered a different number of results");
    }
    return results.map((r) => renewed(status, r));
  }

  /**
   * Moves a lock to this client's session lease of `ttlMs`: the same token,
   * a new lockId. A 409 is an answer (`renewed: false`), not an error.
   */
  async extend(lock: LockRef, timeoutMs: number, ttlMs: number): Promise<Extended> {
    const body: Json = { lockId: lock.lockId, fencingToken: lock.fencingToken, ttlMs };
    const { status, value, retryAfterMs } = await this.post("/api/v1/locks/extend", body, timeoutMs);
    if (status !== 409) expectOk(status, value, retryAfterMs);
    const r = renewed(status, value);
    if (!r.renewed) return r.reason === undefined ? { renewed: false } : { renewed: false, reason: r.reason };
    const lockId = asObject(status, value)["lockId"];
    if (typeof lockId !== "string" || lockId === "" || r.expiresInMs === undefined) {
      throw malformed(status, "extended without lockId or expiresInMs");
    }
    return { renewed: true, lockId, expiresInMs: r.expiresInMs };
  }

  /** Resolves once the router confirmed (204; a 409 also means the lock is gone). */
  async release(lock: LockRef, timeoutMs: number): Promise<void> {
    const body: Json = { lockId: lock.lockId, fencingToken: lock.fencingToken };
    const { status, value, retryAfterMs } = await this.post("/api/v1/locks/release", body, timeoutMs);
    if (status !== 409) expectOk(status, value, retryAfterMs);
  }

  /** What the router tells anyone about `name` (`GET /api/v1/locks/{name}`). */
  async inspect(name: string, timeoutMs: number): Promise<Inspected> {
    const { status, value, retryAfterMs } = await this.send("GET", `/api/v1/locks/${encodeURIComponent(name)}`, undefined, timeoutMs);
    expectOk(status, value, retryAfterMs);
    const b = asObject(status, value);
    if (typeof b["held"] !== "boolean" || typeof b["shard"] !== "string") throw malformed(status, "inspect answer without held or shard");
    const str = (k: string): string | undefined => (typeof b[k] === "string" ? (b[k] as string) : undefined);
    const out: Inspected = { name: str("name") ?? name, held: b["held"], shard: b["shard"], waiters: 0 };
    if (typeof b["fencingToken"] === "bigint") out.fencingToken = b["fencingToken"];
    if (typeof b["waiters"] === "number") out.waiters = b["waiters"];
    if (b["metadata"] !== undefined && b["metadata"] !== null) out.metadata = b["metadata"];
    for (const [from, to] of [["expiresAt", "expiresAt"], ["acquiredAt", "acquiredAt"], ["clientId", "holder"], ["principal", "principal"]] as const) {
      const v = str(from);
      if (v !== undefined) out[to] = v;
    }
    return out;
  }

  private post(path: string, body: Json, timeoutMs: number): Promise<Answer> {
    return this.send("POST", path, body, timeoutMs);
  }

  /** One exchange, bounded by `timeoutMs`; `cancel` aborts it, rejecting with its reason. */
  private async send(
    method: "GET" | "POST",
    path: string,
    body: Json | undefined,
    timeoutMs: number,
    cancel?: AbortSignal,
  ): Promise<Answer> {
    const headers: Record<string, string> = { accept: "application/json" };
    if (body !== undefined) headers["content-type"] = "application/json";
    if (this.token !== undefined) headers["authorization"] = `Bearer ${this.token}`;
    // One deadline for the whole exchange, body included.
    const deadline = AbortSignal.timeout(Math.max(1, Math.ceil(Math.min(timeoutMs, 2 ** 31 - 1))));
    const signal = cancel === undefined ? deadline : AbortSignal.any([deadline, cancel]);
    let status: number;
    let retryAfterMs: number | undefined;
    let text: string;
    try {
      const init: RequestInit = { method, headers, signal };
      if (body !== undefined) init.body = stringifyJson(body);
      const resp = await this.fetchFn(this.base + path, init);
      status = resp.status;
      retryAfterMs = parseRetryAfter(resp.headers.get("retry-after"));
      text = await resp.text();
    } catch (e) {
      if (cancel?.aborted) throw cancel.reason;
      if (deadline.aborted) throw new TransportError(`no answer from ${path} within ${Math.ceil(timeoutMs)} ms`);
      throw new TransportError(`${method} ${path}: ${errorChain(e)}`);
    }
    if (text.trim() === "") return { status, value: undefined, retryAfterMs };
    try {
      return { status, value: parseJson(text), retryAfterMs };
    } catch (e) {
      // An error page from a proxy is still an error answer; a 2xx must parse.
      if (status >= 200 && status < 300) throw malformed(status, String(e));
      return { status, value: text.slice(0, 200), retryAfterMs };
    }
  }
}

/**
 * Turns any non-2xx answer into a {@link RouterError}, reading the API's
 * `{"error": {"code", "message"}}` body; `retryAfterMs` is the answer's
 * parsed `Retry-After`.
 */
export function expectOk(status: number, value: Json | undefined, retryAfterMs?: number): void {
  if (status >= 200 && status < 300) return;
  const err = value !== null && typeof value === "object" && !Array.isArray(value) ? value["error"] : undefined;
  if (err !== null && typeof err === "object" && !Array.isArray(err) && typeof err["code"] === "string") {
    throw new RouterError(status, err["code"], typeof err["message"] === "string" ? err["message"] : "", retryAfterMs);
  }
  throw new RouterError(status, "unexpected_answer", typeof value === "string" ? value : JSON.stringify(value ?? ""), retryAfterMs);
}

/**
 * A `Retry-After` header in milliseconds. Only the delta-seconds form the
 * router sends counts: a non-negative whole number of seconds, capped at
 * {@link MAX_RETRY_AFTER_MS}. Anything else (absent, empty, negative,
 * fractional, an HTTP-date) is `undefined`: a date would be judged by the
 * wall clock, which this client never trusts for time.
 */
export function parseRetryAfter(header: string | null): number | undefined {
  if (header === null || !/^[0-9]+$/.test(header)) return undefined;
  return Math.min(Number(header) * 1000, MAX_RETRY_AFTER_MS);
}

function renewed(status: number, value: Json | undefined): Renewed {
  const r = asObject(status, value);
  if (typeof r["renewed"] !== "boolean") throw malformed(status, "no 'renewed' in the answer");
  const out: Renewed = { renewed: r["renewed"] };
  if (typeof r["expiresInMs"] === "number") out.expiresInMs = r["expiresInMs"];
  if (typeof r["reason"] === "string") out.reason = r["reason"];
  return out;
}

function asObject(status: number, value: Json | undefined): { [key: string]: Json } {
  if (value === null || value === undefined || typeof value !== "object" || Array.isArray(value)) {
    throw malformed(status, "the answer is not a JSON object");
  }
  return value;
}

function malformed(status: number, detail: string): RouterError {
  return new RouterError(status, "malformed_answer", detail);
}

/** undici says only "fetch failed"; the cause chain says what happened. */
function errorChain(e: unknown): string {
  const parts: string[] = [];
  let cur: unknown = e;
  for (let depth = 0; cur !== undefined && cur !== null && depth < 5; depth++) {
    parts.push(cur instanceof Error ? cur.message : String(cur));
    cur = cur instanceof Error ? cur.cause : undefined;
  }
  return parts.join(": ");
}
