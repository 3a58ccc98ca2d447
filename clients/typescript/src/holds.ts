/**
 * Who in this client holds each name. The router knows one holder per
 * client id, so it would hand two tasks of one {@link Client} the same grant
 * and both would "hold" the name. Users of other lock libraries (redis-py,
 * Redisson, kazoo, node-redlock) expect a lock to exclude every other
 * caller, their own included; so a client lets one hold of a name at a
 * time: another acquire of it waits its turn (first come, first served) for
 * as long as its wait allows, or gets nothing.
 *
 * A name's turn is taken before the acquire is sent and kept by the
 * grant's `Lock` until it is released, so no two acquires of one name by
 * one client are on the wire at once. A lost lock keeps its turn until its
 * `Lock` is released: the next holder then gets a new grant with a larger
 * token, never the lost one's.
 *
 * Re-entrance is asked for explicitly: a re-entrant acquire of a name this
 * client holds (and has not lost) joins the hold, counted; the grant is
 * released when the last of its holds lets go. Uses only the grant state.
 */

import type { Grant } from "./state.js";

/** The longest `setTimeout` Node takes; longer ones fire at once. */
const MAX_TIMER_MS = 2 ** 31 - 1;

interface Waiter {
  /** Hands the turn to this waiter. */
  grant(): void;
  /** Ends the wait with `reason` (the client is closing). */
  fail(reason: Error): void;
}

interface Entry {
  taken: boolean;
  holder: Grant | undefined;
  count: number;
  queue: Waiter[];
}

export class Holds {
  private readonly names = new Map<string, Entry>();
  /** Set by {@link close}: every wait, present and future, fails with it. */
  private closed: Error | undefined;

  /** The client is closing: waits for a turn end now with `reason`, as will any later. */
  close(reason: Error): void {
    this.closed = reason;
    for (const e of this.names.values()) for (const w of e.queue.splice(0)) w.fail(reason);
  }

  /**
   * Waits up to `waitMs` (`Infinity`: no end) for `name`'s turn: true once
   * it is this caller's, false if the time ran out first. Rejects with
   * `signal.reason` if `signal` aborts first.
   */
  take(name: string, waitMs: number, signal: AbortSignal | undefined): Promise<boolean> {
    signal?.throwIfAborted();
    if (this.closed !== undefined) return Promise.reject(this.closed);
    const e = this.entry(name);
    if (!e.taken) {
      e.taken = true;
      return Promise.resolve(true);
    }
    return new Promise<boolean>((resolve, reject) => {
      let timer: NodeJS.Timeout | undefined;
      const leave = (): void => {
        clearTimeout(timer);
        signal?.removeEventListener("abort", onAbort);
        const i = e.queue.indexOf(waiter);
        if (i >= 0) e.queue.splice(i, 1);
        this.tidy(name, e);
      };
      const waiter: Waiter = {
        grant: () => {
          clearTimeout(timer);
          signal?.removeEventListener("abort", onAbort);
          resolve(true);
        },
        fail: (reason) => {
          leave();
          reject(reason);
        },
      };
      const onAbort = (): void => {
        leave();
        reject(signal?.reason);
      };
      e.queue.push(waiter);
      signal?.addEventListener("abort", onAbort, { once: true });
      if (waitMs !== Infinity) {
        const expire = (left: number): void => {
          timer = setTimeout(() => {
            if (left > MAX_TIMER_MS) return expire(left - MAX_TIMER_MS);
            leave();
            resolve(false);
          }, Math.min(left, MAX_TIMER_MS));
        };
        expire(Math.max(0, waitMs));
      }
    });
  }

  /** The turn's acquire got `grant`: its first hold. */
  hold(name: string, grant: Grant): void {
    const e = this.entry(name);
    e.taken = true;
    e.holder = grant;
    e.count = 1;
  }

  /** A re-entrant acquire: one more hold of the grant holding `name`, if it is not lost and not being released. */
  join(name: string): Grant | undefined {
    const e = this.names.get(name);
    const g = e?.holder;
    if (e === undefined || g === undefined || g.lostNow() !== undefined || g.release !== "none") return undefined;
    e.count += 1;
    return g;
  }

  /** The fencing token of the grant holding `name`, if it is not lost. */
  holding(name: string): bigint | undefined {
    const g = this.names.get(name)?.holder;
    return g !== undefined && g.lostNow() === undefined ? g.ref.fencingToken : undefined;
  }

  /** One hold of `grant` lets go: true if it was the last (release the grant now) or `grant` holds no turn here. */
  letGo(grant: Grant): boolean {
    const e = this.names.get(grant.name);
    if (e === undefined || e.holder !== grant) return true;
    e.count -= 1;
    if (e.count > 0) return false;
    this.passTurn(grant.name);
    return true;
  }

  /** The turn's owner is done: the first waiter gets it. */
  passTurn(name: string): void {
    const e = this.names.get(name);
    if (e === undefined) return;
    e.holder = undefined;
    e.count = 0;
    const next = e.queue.shift();
    if (next === undefined) {
      e.taken = false;
      this.tidy(name, e);
    } else {
      next.grant();
    }
  }

  get size(): number {
    return this.names.size;
  }

  private entry(name: string): Entry {
    let e = this.names.get(name);
    if (e === undefined) {
      e = { taken: false, holder: undefined, count: 0, queue: [] };
      this.names.set(name, e);
    }
    return e;
  }

  private tidy(name: string, e: Entry): void {
    if (!e.taken && e.queue.length === 0) this.names.delete(name);
  }
}
