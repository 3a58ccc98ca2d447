/**
 * {@link LockInfo}: what the router tells anyone about a name (its inspect
 * endpoint), as a typed value. A leaf: it knows the answer's fields and
 * nothing of the client.
 */

import type { Json } from "./json.js";

/**
 * A name as `client.inspect(name)` found it: the router's inspect answer,
 * plus whether this client holds it. Times are the router's wall clock, for
 * people and planning; never judge a lock's safety by them (a `Lock` has its
 * own validity, on this process's monotonic clock).
 */
export class LockInfo {
  constructor(
    /** The name asked about. */
    readonly name: string,
    /** Whether a lock key exists. A free name may still refuse an acquire while others are queued for it. */
    readonly held: boolean,
    /** The shard that owns the name. */
    readonly shard: string,
    /** Acquires queued for the name. */
    readonly waiters: number,
    /** True when a `Lock` of this client holds the name's grant and has not lost it (like redis-py's `owned()`). */
    readonly mine: boolean,
    /** The holding grant's fencing token. */
    readonly fencingToken?: bigint,
    /** When the holder's lease ends unless renewed (router clock). */
    readonly expiresAt?: Date,
    /** When the lock was granted (granting router's clock). */
    readonly acquiredAt?: Date,
    /** What the holder attached at acquire, if anything. */
    readonly metadata?: Json,
    /** The holder's client id: shown only to admin callers (and to any caller on loopback of a router with no admin guard). */
    readonly holder?: string,
    /** The holder's principal, for admin callers, when it has one. */
    readonly principal?: string,
  ) {}

  /** Milliseconds before the holder's lease ends unless renewed, by this machine's wall clock against the router's (0 when free or past). For display and planning only. */
  timeLeftMs(): number {
    return this.expiresAt === undefined ? 0 : Math.max(0, this.expiresAt.getTime() - Date.now());
  }
}
