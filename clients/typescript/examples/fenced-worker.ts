/**
 * A worker that writes to a fenced resource (`fenced-resource.ts`) under a
 * lockrouter lock: the fencing story end to end, runnable by hand and used
 * by the tests. The TypeScript twin of the Rust and Python `fenced_worker`.
 *
 *   node dist/examples/fenced-worker.js --router http://127.0.0.1:8080 \
 *       --resource http://127.0.0.1:8090 --name order:42 --ttl-ms 2000 --writes 20
 *
 * Every write carries the lock's fencing token, and the resource rejects a
 * write whose token is lower than the highest it has accepted. To show
 * that this, not the client's vigilance, keeps the data right, the worker
 * does not check `isHeld()` before writing: it behaves like a process that
 * checked and was then paused. A real worker stops when `lock.signal`
 * aborts; this one tries `--writes-after-lost` more times so the rejections
 * can be seen. Each event is a JSON line on stdout. Exit status: 0 when
 * done, 75 when someone else holds the lock, 79 when the lock was lost.
 */

import { setTimeout as sleep } from "node:timers/promises";
import { parseArgs } from "node:util";

import { Client, describeLostReason, fencing, stringifyJson, type Json } from "../src/index.js";

const EX_TEMPFAIL = 75;
const EX_LOST = 79;

function emit(event: { [key: string]: Json }): void {
  process.stdout.write(stringifyJson(event) + "\n");
}

/** One write to the resource: `undefined` if accepted, else the highest token it had accepted. */
async function write(resource: string, name: string, token: bigint, payload: string): Promise<bigint | undefined> {
  const resp = await fetch(`${resource}/resources/${encodeURIComponent(name)}/writes`, {
    method: "POST",
    headers: { [fencing.HEADER]: token.toString(), "content-type": "text/plain" },
    body: payload,
    signal: AbortSignal.timeout(5_000),
  });
  const text = await resp.text();
  if (resp.status === 200) return undefined;
  if (resp.status === 409) return fencing.parseToken(/"highest":(\d+)/.exec(text)?.[1] ?? "");
  throw new Error(`resource answered ${resp.status}: ${text}`);
}

async function main(): Promise<number> {
  const { values: a } = parseArgs({
    options: {
      router: { type: "string" },
      resource: { type: "string" },
      name: { type: "string" },
      "ttl-ms": { type: "string", default: "2000" },
      "wait-ms": { type: "string", default: "0" },
      "client-id": { type: "string" },
      "interval-ms": { type: "string", default: "200" },
      writes: { type: "string" },
      "writes-after-lost": { type: "string", default: "3" },
    },
  });
  if (a.router === undefined || a.resource === undefined || a.name === undefined) {
    console.error("usage: fenced-worker --router URL --resource URL --name NAME [--ttl-ms 2000] [--wait-ms 0] [--writes N]");
    return 2;
  }
  const writes = a.writes === undefined ? Infinity : Number(a.writes);
  await using client = new Client({ url: a.router, ...(a["client-id"] !== undefined ? { clientId: a["client-id"] } : {}) });
  const lock = await client.tryAcquire(a.name, { ttlMs: Number(a["ttl-ms"]), waitMs: Number(a["wait-ms"]) });
  if (lock === null) {
    emit({ event: "busy", name: a.name });
    return EX_TEMPFAIL;
  }
  emit({ event: "acquired", name: a.name, token: lock.fencingToken });
  let afterLost = 0;
  for (let seq = 1; seq <= writes; seq++) {
    const token = lock.fencingToken;
    const highest = await write(a.resource, a.name, token, `${client.clientId}:${seq}`);
    emit({ event: "write", seq, token, accepted: highest === undefined, ...(highest !== undefined ? { highest } : {}) });
    if (lock.signal.aborted && ++afterLost > Number(a["writes-after-lost"])) {
      emit({ event: "lost", reason: describeLostReason(lock.lostReason ?? "unconfirmed") });
      return EX_LOST;
    }
    await sleep(Number(a["interval-ms"]));
  }
  await lock.release();
  emit({ event: "released" });
  return 0;
}

process.exitCode = await main();
