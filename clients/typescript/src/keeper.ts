/**
 * {@link Keeper}: what a client's locks need of their client, and nothing
 * more: the transport (to release), the request timeout, the renewal loop,
 * the registry of grants and the holds of names. A `Lock` holds this instead of its `Client`,
 * so the lock layer sits below the client that makes locks.
 */

import { ConfigError, isRetryable, LockLostError } from "./errors.js";
import type { Holds } from "./holds.js";
import type { Registry } from "./registry.js";
import { attempt, retryRelease, unstarted } from "./release.js";
import type { Renewer } from "./renewal.js";
import type { Grant } from "./state.js";
import type { Transport } from "./transport.js";

export class Keeper {
  constructor(
    readonly transport: Transport,
    readonly requestTimeoutMs: number,
    readonly renewer: Renewer,
    readonly registry: Registry,
    /** Which grant holds each name's turn in this client, and how often. */
    readonly holds: Holds,
    /** The configured safety margin (`undefined`: a tenth of the TTL), for a lock an extend moves to another TTL. */
    readonly marginMs: number | undefined,
  ) {}

  /**
   * Set when the client's `close()` begins: from then on nothing sends a
   * release any more, so one not confirmed by the end of the attempts
   * under way never will be.
   */
  closed = false;

  /**
   * Releases `grant` at the router: marks it lost (`released`) at once,
   * stops renewing it, and resolves once the router confirmed. Retries while
   * the lock's validity lasts (never sooner than a refusal's `Retry-After`
   * asks), then rejects and leaves the renewal loop retrying from where it
   * stopped. Every caller for one grant shares the first call's outcome;
   * once the client is closing or closed, a release left unconfirmed for
   * want of an answer (a retryable error, which nothing will retry now)
   * rejects with the closed client's {@link ConfigError} instead. A refusal
   * stays the router's answer.
   */
  release(grant: Grant): Promise<void> {
    const outcome = this.releaseOnce(grant);
    if (!this.closed) return outcome;
    return outcome.catch((e: unknown) => {
      // Confirmed in the background after all (within close()'s last request timeout).
      if (grant.release === "done") return;
      if (!isRetryable(e)) throw e;
      throw new ConfigError(
        `the client is closed and its release of ${JSON.stringify(grant.name)} was not confirmed; ` +
          "nothing renews the lock any more, so it expires at its TTL",
        { cause: e },
      );
    });
  }

  private releaseOnce(grant: Grant): Promise<void> {
    if (grant.releasing !== undefined) return grant.releasing;
    if (!this.registry.owns(grant)) {
      // A newer Lock of this client owns the grant now: leave it alone.
      grant.markLost("released");
      return Promise.reject(new LockLostError(grant.name, grant.recordedLoss ?? "released"));
    }
    grant.beginRelease();
    this.renewer.forget(grant.key);
    const progress = unstarted();
    const once = () => attempt(this.transport, grant, this.requestTimeoutMs);
    grant.releasing = retryRelease(grant, once, progress, { kind: "validity-ends" }).then(
      () => this.registry.forget(grant),
      (e: unknown) => {
        if (isRetryable(e)) this.renewer.releaseInBackground(grant, progress);
        else this.registry.forget(grant);
        throw e;
      },
    );
    // The caller gets the error; nobody else must crash on it.
    grant.releasing.catch(() => {});
    return grant.releasing;
  }

  /** Releases `grant` without anyone waiting for the outcome (a grant never handed out). */
  releaseInBackground(grant: Grant): void {
    if (grant.releasing !== undefined || !this.registry.owns(grant)) return;
    grant.beginRelease();
    grant.releasing = Promise.resolve();
    this.renewer.releaseInBackground(grant, unstarted());
  }
}
