/**
 * The SDK against a real router on a real etcd, both started here: renewal
 * past the TTL, one renew-batch per interval, release at the end of
 * `await using` / `finally`, FIFO waits, a lock released behind the
 * client's back lost at once, a killed router judged by the client's own
 * clock, a release retried until the router is back, a name acquired again
 * only once its unanswered release is answered, a shard outage that
 * loses only that shard's locks, re-entrant holds and tasks of one client
 * excluding each other, waits past the router's cap and their cancellation,
 * extending to another TTL (with a renewal under the old lockId in flight),
 * metadata, inspect, extend and `using`; a closed client's calls (an
 * acquire queued at the router when it closes, a release it could not
 * confirm) and an `await using` block's own exception kept at its exit;
 * and a client never closed, winding down in a child process once it and
 * its lock are garbage-collected.
 */

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { createInterface } from "node:readline";
import { after, before, describe, test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";

import { Client, ConfigError, LockLostError, NotAcquiredError, type Lock } from "../src/index.js";
import { abortedAt, Cluster, Router, track, within } from "./harness.js";

/** The package as a program using it imports it (dist/src/index.js). */
const INDEX = new URL("../src/index.js", import.meta.url).href;

let cluster: Cluster;
let url: string;
let n = 0;
/** A lock name no other test uses. */
const fresh = (what: string): string => `ts-${what}-${process.pid}-${n++}`;

before(async () => {
  cluster = await Cluster.start();
  url = cluster.router.url;
}, { timeout: 60_000 });

after(async () => {
  await cluster?.stop();
});

describe("against a real router", () => {
  test("a 2 s lock is renewed past its TTL (held for 5 s) and released in finally for the next holder", { timeout: 20_000 }, async () => {
    const name = fresh("renew");
    const a = new Client({ url });
    const b = new Client({ url });
    try {
      const lock = await a.acquire(name, { ttlMs: 2_000 });
      try {
        const start = performance.now();
        while (performance.now() - start < 5_000) {
          assert.ok(lock.isHeld(), `held at ${Math.round(performance.now() - start)} ms`);
          await sleep(250);
        }
        assert.ok(!lock.signal.aborted);
        const seen = await cluster.router.inspect(name);
        assert.deepEqual(seen, { held: true, fencingToken: lock.fencingToken.toString() }, "the router agrees");
        assert.equal(await b.tryAcquire(name, { ttlMs: 2_000 }), null, "still held for others");
      } finally {
        await lock.release();
      }
      assert.ok(!lock.isHeld());
      assert.equal(lock.lostReason, "released");
      const next = await b.acquire(name, { ttlMs: 2_000 });
      assert.ok(next.fencingToken > lock.fencingToken);
      await next.release();
    } finally {
      await Promise.all([a.close(), b.close()]);
    }
  });

  test("leaving an `await using` block releases the lock: another client acquires at once", { timeout: 15_000 }, async () => {
    const name = fresh("using");
    await using other = new Client({ url });
    let token: bigint;
    {
      await using client = new Client({ url });
      {
        await using lock = await client.acquire(name, { ttlMs: 10_000 });
        token = lock.fencingToken;
        await assert.rejects(other.acquire(name, { ttlMs: 10_000 }), NotAcquiredError);
      }
      // The lock is released; the client is still open.
      const next = await other.acquire(name, { ttlMs: 10_000 });
      assert.ok(next.fencingToken > token);
      await next.release();
      // A lock still held when the client closes is released by close().
      await client.acquire(name, { ttlMs: 10_000 });
    }
    const last = await other.acquire(name, { ttlMs: 10_000 });
    await last.release();
  });

  test("waiters are granted in arrival order", { timeout: 20_000 }, async () => {
    const name = fresh("fifo");
    await using holder = new Client({ url });
    await using first = new Client({ url });
    await using second = new Client({ url });
    const held = await holder.acquire(name, { ttlMs: 10_000 });
    const order: string[] = [];
    const wait = (c: Client, who: string) =>
      c.acquire(name, { ttlMs: 10_000, waitMs: 10_000 }).then((lock) => {
        order.push(who);
        return lock;
      });
    const p1 = wait(first, "first");
    await sleep(300);
    const p2 = wait(second, "second");
    await sleep(300);
    assert.deepEqual(order, [], "both queue while the name is held");
    await held.release();
    const l1 = await within(5_000, "the first waiter's grant", p1);
    assert.ok(l1.fencingToken > held.fencingToken);
    await sleep(300);
    assert.deepEqual(order, ["first"], "the second keeps waiting while the first holds it");
    await l1.release();
    const l2 = await within(5_000, "the second waiter's grant", p2);
    assert.deepEqual(order, ["first", "second"]);
    assert.ok(l2.fencingToken > l1.fencingToken);
    await l2.release();
  });

  test("many locks are renewed with one renew-batch request per interval", { timeout: 20_000 }, async () => {
    await using client = new Client({ url });
    const locks = await Promise.all(Array.from({ length: 40 }, (_, i) => client.acquire(fresh(`batch${i}`), { ttlMs: 3_000 })));
    const before = await cluster.router.metric("lockrouter_requests_total", 'op="renew_batch"');
    await sleep(4_000); // four intervals of 1 s
    const sent = (await cluster.router.metric("lockrouter_requests_total", 'op="renew_batch"')) - before;
    assert.ok(locks.every((l) => l.isHeld()));
    assert.ok(sent >= 2 && sent <= 8, `${sent} renew-batch requests for 40 locks over 4 intervals (not 160)`);
    await Promise.all(locks.map((l) => l.release()));
  });

  test("a lock released behind the client's back is lost at once, as expired", { timeout: 15_000 }, async () => {
    const name = fresh("expired");
    await using client = new Client({ url });
    const lock = await client.acquire(name, { ttlMs: 6_000 });
    const start = performance.now();
    const r = await fetch(`${url}/api/v1/locks/release`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: `{"lockId":${JSON.stringify(lock.lockId)},"fencingToken":${lock.fencingToken}}`,
    });
    assert.equal(r.status, 204);
    const at = await within(5_000, "lost", abortedAt(lock.signal));
    // The next renewal (at 2 s) says so, long before validity (5.4 s) ends.
    assert.ok(at - start < 3_500, `lost after ${Math.round(at - start)} ms`);
    assert.equal(lock.lostReason, "expired");
    assert.ok(lock.signal.reason instanceof LockLostError);
    await lock.release();
  });

  test("with the router killed, a lock is lost by the client's clock no later than validity end, while its lease still stands", { timeout: 20_000 }, async () => {
    const name = fresh("killed");
    const doomed = await cluster.extraRouter();
    const client = new Client({ url: doomed.url, requestTimeoutMs: 1_000 });
    try {
      const lock = await client.acquire(name, { ttlMs: 3_000 });
      // No renewal has happened yet (the first comes at 1 s): validity ends here.
      const validityEnd = performance.now() + lock.timeLeftMs();
      await doomed.kill();
      const at = await within(5_000, "lost", abortedAt(lock.signal));
      assert.ok(at <= validityEnd + 25, `aborted ${Math.round(at - validityEnd)} ms after validity end`);
      assert.ok(at >= validityEnd - 1, `aborted ${Math.round(validityEnd - at)} ms early`);
      assert.ok(!lock.isHeld());
      assert.equal(lock.lostReason, "unconfirmed");
      assert.equal(lock.timeLeftMs(), 0);
      // The client gave up while the lease still stood (the margin): nobody
      // else can take the name yet. (An acquire is the witness, not GET
      // /locks/{name}: the router's inspect rounds the lease's time left down
      // to whole seconds and reports "held": false up to 1 s early.)
      await using witness = new Client({ url });
      assert.equal(await witness.tryAcquire(name, { ttlMs: 3_000 }), null, "the lease still stands in etcd");
    } finally {
      await client.close();
    }
  });

  test("a release sent while the router is down is retried until it frees the name", { timeout: 40_000 }, async () => {
    const keepName = fresh("keep");
    const goneName = fresh("gone");
    const doomed = await cluster.extraRouter();
    const client = new Client({ url: doomed.url, requestTimeoutMs: 1_000 });
    try {
      // Two locks of one TTL on one shard: one session lease, which `keep`'s
      // renewals keep alive, and with it `gone`'s key, TTL or not.
      const keep = await client.acquire(keepName, { ttlMs: 10_000 });
      const gone = await client.acquire(goneName, { ttlMs: 10_000 });
      await doomed.kill(); // connections refused from now on
      let settled = false;
      const releasing = gone.release().finally(() => (settled = true));
      releasing.catch(() => {}); // awaited below; not unhandled meanwhile
      assert.equal(gone.lostReason, "released", "lost as the release starts");
      assert.ok(gone.signal.aborted);
      await sleep(2_000);
      assert.ok(!settled, "still retrying while the router is away");
      const downFor = performance.now();
      await doomed.restart(); // the same port
      await within(8_000, "the release gets through within the lock's validity", releasing);
      // Freed at once (well within the 10 s TTL), though the session lease
      // stood all along.
      await using other = new Client({ url });
      const next = await other.tryAcquire(goneName, { ttlMs: 10_000 });
      assert.ok(next !== null, "the name is free once the release got through");
      assert.ok(performance.now() - downFor < 9_000);
      assert.ok(next.fencingToken > gone.fencingToken);
      assert.ok(keep.isHeld(), "the other lock rode out the outage");
      const seen = await cluster.router.inspect(keepName);
      assert.equal(seen.fencingToken, keep.fencingToken.toString());
      await next.release();
    } finally {
      await client.close();
      await doomed.kill();
    }
  });

  test("a name is acquired again only after its unanswered release is answered: a new grant", { timeout: 40_000 }, async () => {
    // docs/client.md, "A release that was not answered": a release whose
    // answer never came may land later, and would end the grant an
    // idempotent re-acquire hands back (the same one). The acquire first
    // drives the release to an answer, so the router grants anew.
    const keepName = fresh("late-keep");
    const name = fresh("late");
    const doomed = await cluster.extraRouter();
    type Seen = { op: string; name: string | undefined; status?: number };
    const seen: Seen[] = [];
    // While set, releases fail as if the router were still unreachable, so
    // the test decides when the retried release can get through.
    let cutReleases = false;
    const recording: typeof fetch = async (input, init) => {
      const op = String(input).split("/").pop() ?? "";
      const body = typeof init?.body === "string" ? (JSON.parse(init.body) as { name?: string }) : {};
      const entry: Seen = { op, name: body.name };
      seen.push(entry);
      if (op === "release" && cutReleases) throw new TypeError("fetch failed: release cut off");
      const resp = await fetch(input, init);
      entry.status = resp.status;
      return resp;
    };
    const client = new Client({ url: doomed.url, requestTimeoutMs: 1_000, fetch: recording });
    try {
      // One session lease, kept alive by `keep`: the old grant stands through the outage.
      const keep = await client.acquire(keepName, { ttlMs: 10_000 });
      const lock = await client.acquire(name, { ttlMs: 10_000 });
      await doomed.kill();
      const releasing = lock.release();
      releasing.catch(() => {}); // unanswered while the router is away
      const start = performance.now();
      while (!seen.some((s) => s.op === "release")) {
        assert.ok(performance.now() - start < 5_000, "a release was sent");
        await sleep(20);
      }
      // Back on the same port, the old grant still standing; the retried
      // release gets through only from the acquire on, so that the test
      // sees what the SDK sends first.
      cutReleases = true;
      await doomed.restart();
      cutReleases = false;
      const before = seen.length;
      const again = await client.acquire(name, { ttlMs: 10_000 });
      assert.ok(again.fencingToken > lock.fencingToken, "a new grant");
      await releasing;
      const after = seen.slice(before);
      const first = after.findIndex((s) => s.op === "acquire" && s.name === name);
      assert.ok(
        after.slice(0, first).some((s) => s.op === "release" && s.status === 204),
        `no acquire before the release was answered: ${JSON.stringify(after)}`,
      );
      // The old grant is gone: it no longer renews.
      const r = await fetch(`${doomed.url}/api/v1/locks/renew`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify({ lockId: lock.lockId, fencingToken: Number(lock.fencingToken) }),
      });
      assert.equal(r.status, 409, await r.text());
      assert.ok(again.isHeld() && keep.isHeld());
    } finally {
      await client.close();
      await doomed.kill();
    }
  });

  test("a shard outage loses only the locks on that shard", { timeout: 60_000 }, async () => {
    const shards = [await cluster.extraEtcd(), await cluster.extraEtcd()];
    const router = await Router.start(cluster.dir, shards);
    try {
      const onShard = new Map<string, string>();
      for (let i = 0; i < 200 && onShard.size < 2; i++) {
        const name = fresh(`shard${i}`);
        const shard = await router.shardOf(name);
        if (!onShard.has(shard)) onShard.set(shard, name);
      }
      const [nameA, nameB] = [onShard.get("a"), onShard.get("b")];
      assert.ok(nameA !== undefined && nameB !== undefined, `names on both shards: ${JSON.stringify([...onShard])}`);
      // A short request timeout only shortens close(): the release of the
      // lock on the dead shard gets one request timeout more, then is given up.
      await using client = new Client({ url: router.url, requestTimeoutMs: 1_000 });
      const lockA = await client.acquire(nameA, { ttlMs: 3_000 });
      const lockB = await client.acquire(nameB, { ttlMs: 3_000 });
      await shards[1]!.kill();
      // b's renewals now answer shard_unavailable (retried) until its
      // validity runs out; a's go on.
      await within(10_000, "the lock on the dead shard is lost", abortedAt(lockB.signal));
      assert.equal(lockB.lostReason, "unconfirmed", "retried, never refused");
      assert.ok(lockA.isHeld());
      // Well past lockB's loss (more than a TTL), lockA is still renewed.
      await sleep(4_000);
      assert.ok(lockA.isHeld() && !lockA.signal.aborted);
      const seen = await router.inspect(nameA);
      assert.deepEqual(seen, { held: true, fencingToken: lockA.fencingToken.toString() });
    } finally {
      await router.kill();
      await Promise.all(shards.map((s) => s.kill()));
    }
  });

  test("re-entrant holds are one lock: one validity, one renewal, released once with the last", { timeout: 20_000 }, async () => {
    const name = fresh("twice");
    // The real fetch, with every request written down.
    const sent: { path: string; body: string }[] = [];
    const recording: typeof fetch = (input, init) => {
      sent.push({ path: new URL(String(input)).pathname, body: String(init?.body) });
      return fetch(input, init);
    };
    await using a = new Client({ url, clientId: `ts-twice-${process.pid}`, fetch: recording });
    await using b = new Client({ url });
    const first = await a.acquire(name, { ttlMs: 3_000 });
    const second = await a.acquire(name, { ttlMs: 3_000, reentrant: true });
    assert.equal(second.lockId, first.lockId);
    assert.equal(second.fencingToken, first.fencingToken);
    assert.equal(sent.filter((s) => s.path.endsWith("/acquire")).length, 1, "joined without asking the router");
    // Past the TTL: both held, renewed as the one lock they are.
    await sleep(4_000);
    assert.ok(first.isHeld() && second.isHeld());
    assert.ok(Math.abs(first.timeLeftMs() - second.timeLeftMs()) < 50, "one validity");
    const batches = sent.filter((s) => s.path.endsWith("/renew-batch"));
    assert.ok(batches.length >= 2 && batches.length <= 8, `${batches.length} renew-batch requests over 4 intervals`);
    for (const r of batches) assert.equal(r.body.match(/"lockId"/g)?.length, 1, `one lock per renewal: ${r.body}`);

    await second.release();
    assert.ok(second.signal.aborted && second.lostReason === "released", "the inner hold is given back");
    assert.ok(first.isHeld() && !first.signal.aborted, "the outer hold keeps the grant");
    assert.equal(await b.tryAcquire(name, { ttlMs: 3_000 }), null);
    await first.release();
    assert.equal(sent.filter((s) => s.path.endsWith("/release")).length, 1, "released once, with the last hold");
    const next = await b.tryAcquire(name, { ttlMs: 3_000 });
    assert.ok(next !== null && next.fencingToken > first.fencingToken);
    await next.release();
  });

  test("one client excludes its own tasks from a name: the second waits its turn and gets a new grant", { timeout: 15_000 }, async () => {
    const name = fresh("mine");
    await using a = new Client({ url });
    const first = await a.acquire(name, { ttlMs: 5_000 });
    assert.equal(await a.tryAcquire(name, { ttlMs: 5_000 }), null, "held by another task of this client");
    let done = false;
    const waiting = a.acquire(name, { ttlMs: 5_000, waitMs: 5_000 }).finally(() => (done = true));
    await sleep(500);
    assert.ok(!done, "the second task waits its turn");
    await first.release();
    const second = await waiting;
    assert.ok(second.fencingToken > first.fencingToken, "a new grant, never the old");
    assert.deepEqual(await cluster.router.inspect(name), { held: true, fencingToken: second.fencingToken.toString() });
    await second.release();
  });

  test("a wait longer than the router's cap queues again; an AbortSignal cancels a wait without end, which leaves the queue", { timeout: 20_000 }, async () => {
    const name = fresh("long");
    const capped = await cluster.extraRouter("\n[limits]\nmax_wait_ms = 1000\n");
    try {
      await using a = new Client({ url: capped.url });
      await using b = new Client({ url: capped.url });
      await using c = new Client({ url: capped.url });
      const held = await a.acquire(name, { ttlMs: 10_000 });
      let bDone = false;
      const bWaits = b.acquire(name, { ttlMs: 3_000, waitMs: Infinity }).finally(() => (bDone = true));
      const stop = new AbortController();
      const cWaits = c.acquire(name, { ttlMs: 3_000, waitMs: Infinity, signal: stop.signal });
      cWaits.catch(() => {});
      await sleep(2_500);
      assert.ok(!bDone, "still queued past the router's cap");
      stop.abort(new Error("no longer needed"));
      await assert.rejects(cWaits, /no longer needed/);
      await held.release();
      const lockB = await within(3_000, "B granted after the release", bWaits);
      assert.ok(lockB.fencingToken > held.fencingToken);
      await sleep(300);
      const seen = (await (await fetch(`${capped.url}/api/v1/locks/${encodeURIComponent(name)}`)).json()) as { waiters?: number };
      assert.equal(seen.waiters, undefined, "the cancelled wait left the queue");
      await lockB.release();
      assert.ok(await c.tryAcquire(name, { ttlMs: 3_000 }), "no cancelled waiter is queued ahead");
    } finally {
      await capped.kill();
    }
  });

  test("extend to a longer TTL keeps the token, and renews and releases under the new lockId", { timeout: 30_000 }, async () => {
    const name = fresh("extend-to");
    await using a = new Client({ url });
    await using b = new Client({ url });
    const lock = await a.acquire(name, { ttlMs: 2_000 });
    const inner = await a.acquire(name, { ttlMs: 2_000, reentrant: true });
    const [oldId, token] = [lock.lockId, lock.fencingToken];

    const left = await lock.extend(6_000);
    assert.ok(left > 4_000 && left <= 6_000, `${left} ms of validity`);
    assert.equal(lock.fencingToken, token, "the same grant");
    assert.notEqual(lock.lockId, oldId, "on the new TTL's lease");
    assert.equal(lock.ttlMs, 6_000);
    assert.ok(inner.lockId === lock.lockId && inner.ttlMs === 6_000, "every Lock of the grant moved");
    const old = await fetch(`${url}/api/v1/locks/renew`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: `{"lockId":${JSON.stringify(oldId)},"fencingToken":${token}}`,
    });
    assert.deepEqual([old.status, ((await old.json()) as { reason?: string }).reason], [409, "stolen"], "the old lockId renews nothing");

    // Past the old TTL three times over and past the new one: only
    // renewals under the new lockId keep it.
    await sleep(7_000);
    assert.ok(lock.isHeld() && !lock.signal.aborted, `held (${lock.lostReason ?? "not lost"})`);
    const info = await a.inspect(name);
    assert.ok(info.held && info.mine && info.fencingToken === token, "the router agrees");
    assert.equal(await b.tryAcquire(name, { ttlMs: 2_000 }), null, "still held for others");

    await inner.release();
    await lock.release();
    const next = await b.tryAcquire(name, { ttlMs: 2_000 });
    assert.ok(next !== null && next.fencingToken > token, "the release under the new lockId freed the name");
    await next.release();
  });

  test("a renewal sent under the old lockId and answered `stolen` after an extend is no loss", { timeout: 20_000 }, async () => {
    const name = fresh("extend-race");
    // Every renew-batch exchange, in order: the lockIds sent, the router's answers.
    type Exchange = { lockIds: string[]; results: { renewed: boolean; reason?: string }[] };
    const batches: Exchange[] = [];
    let heldOne = false;
    let sentFirst!: () => void;
    const firstSent = new Promise<void>((r) => (sentFirst = r));
    let letGo!: () => void;
    const gate = new Promise<void>((r) => (letGo = r));
    // The first renew-batch leaves the SDK (its body names the old lockId)
    // but reaches the router only once the test lets it go.
    const holdingBack: typeof fetch = async (input, init) => {
      if (!String(input).endsWith("/renew-batch")) return fetch(input, init);
      const lockIds = (JSON.parse(String(init?.body)) as { locks: { lockId: string }[] }).locks.map((l) => l.lockId);
      if (!heldOne) {
        heldOne = true;
        sentFirst();
        await gate;
      }
      const resp = await fetch(input, init);
      const answer = (await resp.clone().json()) as { results: Exchange["results"] };
      batches.push({ lockIds, results: answer.results });
      return resp;
    };
    const answered = async (count: number, ms: number): Promise<Exchange> => {
      const start = performance.now();
      while (batches.length < count) {
        assert.ok(performance.now() - start < ms, `renew-batch answer ${count} within ${ms} ms`);
        await sleep(20);
      }
      return batches[count - 1]!;
    };
    // A 3 s TTL: the held-back batch may wait up to a 1 s interval for its answer.
    const client = new Client({ url, fetch: holdingBack });
    try {
      const lock = await client.acquire(name, { ttlMs: 3_000 });
      const oldId = lock.lockId;
      await within(3_000, "a background renewal left", firstSent);
      await lock.extend(6_000);
      assert.notEqual(lock.lockId, oldId);
      letGo();

      const late = await answered(1, 2_000);
      assert.deepEqual(late.lockIds, [oldId], "sent under the old lockId");
      assert.deepEqual([late.results[0]?.renewed, late.results[0]?.reason], [false, "stolen"], "reached the router after the move");
      assert.ok(lock.isHeld() && lock.lostReason === undefined && !lock.signal.aborted, `not lost (${lock.lostReason})`);

      // Renewed since under the new lockId, at the new TTL's pace.
      const next = await answered(2, 4_000);
      assert.deepEqual(next.lockIds, [lock.lockId]);
      assert.equal(next.results[0]?.renewed, true);
      assert.ok(lock.isHeld());
      await lock.release();
      assert.equal((await cluster.router.inspect(name)).held, false, "released under the new lockId");
    } finally {
      letGo();
      await client.close();
    }
  });

  test("metadata, inspect and extend; using(name, fn(signal)) releases after the work, and rejects when the lock is lost", { timeout: 20_000 }, async () => {
    const name = fresh("meta");
    await using a = new Client({ url, clientId: `ts-meta-${process.pid}` });
    await using b = new Client({ url });
    const lock = await a.acquire(name, { ttlMs: 10_000, metadata: { job: "report" } });
    const info = await a.inspect(name);
    assert.ok(info.held && info.mine && info.fencingToken === lock.fencingToken);
    assert.deepEqual(info.metadata, { job: "report" });
    assert.equal(info.holder, `ts-meta-${process.pid}`);
    assert.ok(info.waiters === 0 && info.timeLeftMs() > 5_000 && info.timeLeftMs() <= 11_000, `${info.timeLeftMs()}`);
    assert.ok(!(await b.inspect(name)).mine && !(await b.inspect(fresh("free"))).held);
    await sleep(1_500);
    const before = lock.timeLeftMs();
    const after = await lock.extend();
    assert.ok(after > before + 500 && after <= 10_000, `${before} -> ${after}`);
    await lock.release();

    const value = await a.using(name, { ttlMs: 3_000 }, async (signal, held) => {
      assert.ok(!signal.aborted && held.isHeld());
      return held.fencingToken;
    });
    assert.ok(value > lock.fencingToken);
    assert.equal((await a.inspect(name)).held, false, "released after the work");

    let seenSignal: AbortSignal | undefined;
    const cut = a.using(name, { ttlMs: 3_000 }, async (signal, held) => {
      seenSignal = signal;
      await fetch(`${url}/api/v1/locks/release`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: `{"lockId":"${held.lockId}","fencingToken":${held.fencingToken}}`,
      });
      await sleep(10_000, undefined, { signal }).catch(() => {});
      return "finished";
    });
    await assert.rejects(within(3_000, "using rejects on loss", cut), (e: unknown) => e instanceof LockLostError && e.reason === "expired");
    assert.ok(seenSignal?.aborted, "the work's signal aborted");
  });

  test("an acquire waiting at the router when its client closes rejects at once with the closed client's ConfigError, and leaves the router's queue", { timeout: 20_000 }, async () => {
    const name = fresh("closed-wait");
    await using holder = new Client({ url });
    const held = await holder.acquire(name, { ttlMs: 10_000 });
    const waiter = new Client({ url });
    const waiting = waiter.acquire(name, { ttlMs: 10_000, waitMs: 20_000 });
    waiting.catch(() => {});
    await sleep(500);
    assert.equal((await holder.inspect(name)).waiters, 1, "queued at the router");
    await waiter.close();
    await assert.rejects(within(1_000, "the waiting acquire ends with close()", waiting), (e: unknown) => {
      assert.ok(e instanceof ConfigError && !e.retryable, `not the closed client's ConfigError: ${String(e)}`);
      assert.match(e.message, /closed during the acquire/);
      return true;
    });
    await sleep(300);
    assert.equal((await holder.inspect(name)).waiters, 0, "the router dropped the waiter with its request");
    await held.release();
    const next = await holder.tryAcquire(name, { ttlMs: 10_000 });
    assert.ok(next !== null, "nothing was granted to the closed client");
    await next.release();
  });

  test("with the router gone, an `await using` block that closes its client ends with its own exception; the release close could not confirm, and any acquire, reject with the closed client's ConfigError", { timeout: 20_000 }, async () => {
    const name = fresh("closed-down");
    const doomed = await cluster.extraRouter();
    const client = new Client({ url: doomed.url, requestTimeoutMs: 500 });
    const boom = new Error("the block's own error");
    const closedClient = (e: unknown): boolean => {
      assert.ok(e instanceof ConfigError && !e.retryable, `not the closed client's ConfigError: ${String(e)}`);
      return true;
    };
    try {
      let disposed: Lock | undefined;
      let caught: unknown;
      try {
        await using lock = await client.acquire(name, { ttlMs: 2_000 });
        disposed = lock;
        await doomed.kill();
        // Its release cannot get through (retried while the lock is valid,
        // 1.8 s, then one request timeout more): the exit's cannot either.
        await client.close();
        throw boom;
      } catch (e) {
        caught = e;
      }
      assert.equal(caught, boom, `the exit replaced the block's exception with ${String(caught)}`);
      assert.equal(disposed?.lostReason, "released");
      await assert.rejects(disposed!.release(), (e: unknown) => closedClient(e) && (e as Error).message.includes(JSON.stringify(name)));
      await assert.rejects(client.acquire(name, { ttlMs: 2_000 }), closedClient);
    } finally {
      await client.close();
      await doomed.kill();
    }
  });

  test("a client never closed, once it and its lock are garbage-collected, releases what it held and ends its renewal loop: its process exits by itself", { timeout: 60_000 }, async () => {
    // A child process holds a 30 s lock through a client with a 1 s request
    // timeout, and when told drops both, unreleased and unclosed, and
    // collects garbage (--expose-gc: when V8 would do it is its own choice).
    // The renewal loop keeps a process alive while it renews; only the
    // client winding down lets the child exit before the lock's validity (27 s) ends.
    const orphan = async (routerUrl: string, name: string) => {
      // Acquired in a function: a top-level await keeps the last value it
      // awaited reachable (from the module's own generator).
      const script = [
        `import { Client } from ${JSON.stringify(INDEX)};`,
        `let held;`,
        `async function hold() {`,
        `  const client = new Client({ url: ${JSON.stringify(routerUrl)}, requestTimeoutMs: 1000 });`,
        `  held = { client, lock: await client.acquire(${JSON.stringify(name)}, { ttlMs: 30000 }) };`,
        `  process.stdout.write(JSON.stringify({ token: String(held.lock.fencingToken) }) + "\\n");`,
        `}`,
        `await hold();`,
        `process.stdin.once("data", () => {`,
        `  process.stdin.destroy();`,
        `  held = undefined;`,
        `  globalThis.gc();`,
        `  setTimeout(() => globalThis.gc(), 200).unref();`,
        `});`,
      ].join("\n");
      const child = spawn(process.execPath, ["--expose-gc", "--input-type=module", "-e", script], { stdio: ["pipe", "pipe", "inherit"] });
      track(child);
      const exited = new Promise<number | null>((resolve) => child.once("exit", (code) => resolve(code)));
      const lines = createInterface({ input: child.stdout! });
      const line = await within(10_000, "the child's lock", new Promise<string>((resolve) => lines.once("line", resolve)));
      return { child, exited, token: (JSON.parse(line) as { token: string }).token, drop: () => child.stdin!.end("drop\n") };
    };

    // The router up: the lock is released on the way out, not left to its TTL.
    const name = fresh("orphan");
    const up = await orphan(url, name);
    try {
      assert.deepEqual(await cluster.router.inspect(name), { held: true, fencingToken: up.token });
      up.drop();
      assert.equal(await within(10_000, "the child exits by itself", up.exited), 0);
      assert.deepEqual(await cluster.router.inspect(name), { held: false }, "released, well within its 30 s TTL");
    } finally {
      up.child.kill("SIGKILL");
    }

    // The router gone: the release gets its last request timeout, then the child exits all the same.
    const doomed = await cluster.extraRouter();
    const down = await orphan(doomed.url, fresh("orphan-down"));
    try {
      await doomed.kill();
      const start = performance.now();
      down.drop();
      assert.equal(await within(8_000, "the child exits by itself", down.exited), 0);
      assert.ok(performance.now() - start < 8_000);
    } finally {
      down.child.kill("SIGKILL");
      await doomed.kill();
    }
  });
});
