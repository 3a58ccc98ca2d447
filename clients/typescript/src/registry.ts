/**
 * One state per grant (lockId) in a client. The router answers an acquire
 * of a name the client already holds with the same grant, so two
 * {@link Lock}s can stand for one lock; they must never disagree (one
 * released, the other still "held" and renewed). An acquire therefore looks
 * its grant up here and shares the state it finds.
 *
 * A grant released with a confirmation is remembered for a while after:
 * an acquire answered just before the release reached the router may name
 * it, and must ask again rather than hand out a lock the router has
 * already freed. Uses only the grant state (`state`) and the clock.
 */

import type { Grant } from "./state.js";
import { now } from "./validity.js";

/** How long a released grant is remembered: far longer than any acquire answer can be in flight. */
const REMEMBER_RELEASED_MS = 300_000;
/** Most released grants remembered. */
const MAX_RELEASED = 10_000;

/** What an acquire's answer means for the client's state. */
export type Claim =
  /** The client holds this grant already: the same state, its validity moved forward by the answer. */
  | { kind: "held"; grant: Grant }
  /** The client is releasing this grant; the answer raced the release. */
  | { kind: "releasing"; grant: Grant }
  /** The client released this grant already; the answer raced the release. Ask again. */
  | { kind: "released" }
  /**
   * New state, now the grant's entry. Replaces the state of a grant the
   * client had given up as lost without releasing it: the router's answer
   * says it still stands, but a lost lock is never revived.
   */
  | { kind: "new"; grant: Grant };

export class Registry {
  private readonly grants = new Map<string, Grant>();
  /** Grants released (confirmed) and when. */
  private readonly released = new Map<string, number>();

  /** What the grant `lockId`, confirmed valid until `validUntil` by an acquire, is to this client. */
  claim(lockId: string, validUntil: number, make: () => Grant): Claim {
    const existing = this.grants.get(lockId);
    if (existing === undefined && this.wasReleased(lockId)) return { kind: "released" };
    if (existing !== undefined) {
      if (existing.release === "pending") return { kind: "releasing", grant: existing };
      // Confirmed released, its entry not yet forgotten: the answer is stale.
      if (existing.release === "done") return { kind: "released" };
      existing.confirm(validUntil);
      if (existing.lostNow() === undefined) return { kind: "held", grant: existing };
    }
    const grant = make();
    this.grants.set(lockId, grant);
    return { kind: "new", grant };
  }

  /** False when a newer state has taken `grant`'s lockId over: the grant is not this one's to release. */
  owns(grant: Grant): boolean {
    const current = this.grants.get(grant.ref.lockId);
    return current === undefined || current === grant;
  }

  /**
   * Moves `grant` to the lockId an extend answered (see {@link Grant.switch})
   * and its entry with it, in one step: a release or an acquire answer
   * looking the grant up finds it under one lockId or the other, never
   * neither. True if the lock is still held (its renewals must follow).
   */
  switch(grant: Grant, lockId: string, ttlMs: number, marginMs: number, validUntil: number): boolean {
    const old = grant.switch(lockId, ttlMs, marginMs, validUntil);
    if (old !== lockId) {
      if (this.grants.get(old) === grant) this.grants.delete(old);
      this.grants.set(lockId, grant);
    }
    return grant.lostNow() === undefined;
  }

  /** Grants whose release has not started: what closing the client must release. */
  unreleased(): Grant[] {
    return [...this.grants.values()].filter((g) => g.release === "none");
  }

  /** The release of `grant` has ended: drop its entry, remembering it if the router confirmed. */
  /** The grants of `name` whose release is under way and not yet answered: an acquire of `name` waits for their answers first. */
  releasing(name: string): Grant[] {
    return [...this.grants.values()].filter((g) => g.name === name && g.release === "pending");
  }

  forget(grant: Grant): void {
    const id = grant.ref.lockId;
    if (this.grants.get(id) !== grant) return;
    this.grants.delete(id);
    if (grant.release !== "done") return;
    const t = now();
    for (const [k, at] of this.released) if (t - at >= REMEMBER_RELEASED_MS) this.released.delete(k);
    if (this.released.size >= MAX_RELEASED) this.released.clear();
    this.released.set(id, t);
  }

  private wasReleased(lockId: string): boolean {
    const at = this.released.get(lockId);
    return at !== undefined && now() - at < REMEMBER_RELEASED_MS;
  }
}
