/**
 * The paused-process fencing story with real processes: a worker child
 * (examples/fenced-worker) holds a lock and writes to a fenced resource
 * (examples/fenced-resource, served here); it is SIGSTOPped past its TTL,
 * another client acquires the name and writes with a higher token, and when
 * the worker resumes, the resource rejects its write and the worker learns
 * it lost the lock.
 */

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { createInterface } from "node:readline";
import { after, before, test } from "node:test";
import { fileURLToPath } from "node:url";

import { FencedStore, serveFencedResource } from "../examples/fenced-resource.js";
import { Client, parseJson } from "../src/index.js";
import { Cluster, track, within } from "./harness.js";

const WORKER = fileURLToPath(new URL("../examples/fenced-worker.js", import.meta.url));

let cluster: Cluster;

before(async () => {
  cluster = await Cluster.start();
}, { timeout: 60_000 });

after(async () => {
  await cluster?.stop();
});

type Event = { event: string; token?: bigint; accepted?: boolean; highest?: bigint; reason?: string; seq?: number };

test("a paused worker is fenced out by the resource and learns it lost the lock", { timeout: 40_000 }, async () => {
  const name = `ts-fence-${process.pid}`;
  const store = new FencedStore();
  const resource = await serveFencedResource(store);
  const argv = [WORKER, "--router", cluster.router.url, "--resource", resource.url, "--name", name];
  argv.push("--ttl-ms", "2000", "--interval-ms", "100", "--writes-after-lost", "1");
  const worker = spawn(process.execPath, argv, { stdio: ["ignore", "pipe", "inherit"] });
  track(worker);
  const exited = new Promise<number | null>((resolve) => worker.once("exit", (code) => resolve(code)));
  const events: Event[] = [];
  const waiters: { pred: (e: Event) => boolean; resolve: (e: Event) => void }[] = [];
  createInterface({ input: worker.stdout! }).on("line", (line) => {
    const e = parseJson(line, new Set(["token", "highest"])) as Event;
    events.push(e);
    for (const w of waiters.filter((w) => w.pred(e))) w.resolve(e);
  });
  const next = (what: string, pred: (e: Event) => boolean): Promise<Event> =>
    within(15_000, what, new Promise((resolve) => {
      const seen = events.find(pred);
      if (seen) resolve(seen);
      else waiters.push({ pred, resolve });
    }));
  const client = new Client({ url: cluster.router.url });
  try {
    const acquired = await next("the worker's acquire", (e) => e.event === "acquired");
    const oldToken = acquired.token!;
    await next("two accepted writes", (e) => e.event === "write" && e.accepted === true && (e.seq ?? 0) >= 2);

    // The worker is paused holding the lock; its lease runs out.
    worker.kill("SIGSTOP");
    const lock = await client.acquire(name, { ttlMs: 10_000, waitMs: 15_000 });
    assert.ok(lock.fencingToken > oldToken, "a later grant has a larger token");
    const mine = store.write(name, lock.fencingToken, "new holder");
    assert.equal(mine, undefined, "the new holder's write is accepted");
    const firstNewSeq = store.list(name).writes.at(-1)!.seq;

    // The worker wakes up and writes with its old token.
    worker.kill("SIGCONT");
    const rejected = await next("the worker's rejected write", (e) => e.event === "write" && e.accepted === false);
    assert.equal(rejected.token, oldToken);
    assert.equal(rejected.highest, lock.fencingToken);
    const lost = await next("the worker's lost event", (e) => e.event === "lost");
    assert.equal(lost.reason, "validity ran out without a confirmed renewal");
    assert.equal(await within(10_000, "the worker's exit", exited), 79);

    // Nothing of the old holder landed after the new holder's first write.
    const after = store.list(name).writes.filter((w) => w.seq > firstNewSeq);
    assert.deepEqual(after.filter((w) => w.token === oldToken), []);
    assert.equal(store.list(name).highest, lock.fencingToken);
    assert.ok(lock.isHeld(), "the new holder still holds it");
    await lock.release();
  } finally {
    worker.kill("SIGKILL");
    await client.close();
    resource.server.closeAllConnections();
    resource.server.close();
  }
});
