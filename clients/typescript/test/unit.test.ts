/**
 * Unit tests without a router: exact token parsing, the clock rules, the
 * renewal schedule (batches split at the API's limit, locks due soon ride
 * along), what each answer means, typed errors and the fencing helpers;
 * a grant whose release was confirmed never handed out again; and, over an
 * injected fetch, a refused release not retried, a refused batch renewed
 * lock by lock, releases and extends never crossing, the router's
 * `Retry-After` read into errors and waited out by the client's own retries,
 * a closed client's calls ending with its `ConfigError`, and a block's own
 * exception never replaced by a release failing at its exit.
 */

import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";

import { Client, ConfigError, Lock, LockLostError, RouterError, TransportError, fencing, isRetryable, parseJson, stringifyJson } from "../src/index.js";
import { dueBatches, outcome, type Due } from "../src/renewal.js";
import { Registry } from "../src/registry.js";
import { Grant } from "../src/state.js";
import { expectOk, MAX_RETRY_AFTER_MS, parseRetryAfter, Transport } from "../src/transport.js";
import { backoff, margin, MAX_BATCH, MIN_MARGIN_MS, nextRenewal, now, renewalPause, renewInterval, validUntil } from "../src/validity.js";

describe("exact fencing tokens", () => {
  test("a token above 2^53 is parsed exactly, as a bigint", () => {
    const text = '{"acquired":true,"lockId":"a.b","fencingToken":9007199254740993,"expiresAt":"2026-11-30T03:38:50.123Z","expiresInMs":29990}';
    const v = parseJson(text) as { fencingToken: bigint; expiresInMs: number };
    assert.equal(v.fencingToken, 9007199254740993n);
    assert.notEqual(v.fencingToken, BigInt(JSON.parse(text).fencingToken), "JSON.parse rounds it");
    assert.equal(v.expiresInMs, 29990);
    const max = parseJson('{"fencingToken": 9223372036854775807}') as { fencingToken: bigint };
    assert.equal(max.fencingToken, 2n ** 63n - 1n);
  });

  test("tokens nested anywhere are exact; other numbers stay numbers; strings are not rewritten", () => {
    const text = String.raw`{"results":[{"fencingToken":18446744073709551615},{"renewed":false,"reason":"expired"}],` +
      String.raw`"note":"say \"fencingToken\":1 \u00e9","n":-1.5e3,"a":[true,false,null],"__proto__":{"x":1}}`;
    const v = parseJson(text) as { [k: string]: unknown };
    assert.deepEqual(v["results"], [{ fencingToken: 2n ** 64n - 1n }, { renewed: false, reason: "expired" }]);
    assert.equal(v["note"], 'say "fencingToken":1 é');
    assert.equal(v["n"], -1500);
    assert.deepEqual(v["a"], [true, false, null]);
    assert.equal(Object.getPrototypeOf(v), Object.prototype, "__proto__ is data");
    assert.deepEqual(Object.keys(v), ["results", "note", "n", "a", "__proto__"]);
  });

  test("malformed JSON and non-integer tokens are refused", () => {
    for (const bad of ["", "{", '{"a":1,}', '{"a":01}', '{"fencingToken":1.5}', '{"fencingToken":1e3}', "[1] x", '"\u0001"', "nul"]) {
      assert.throws(() => parseJson(bad), SyntaxError, bad);
    }
  });

  test("bigints are written as exact JSON numbers", () => {
    const body = stringifyJson({ lockId: "x", fencingToken: 2n ** 63n - 1n, locks: [{ fencingToken: 7n }], s: 'q"' });
    assert.equal(body, '{"lockId":"x","fencingToken":9223372036854775807,"locks":[{"fencingToken":7}],"s":"q\\""}');
    assert.equal((parseJson(body) as { fencingToken: bigint }).fencingToken, 2n ** 63n - 1n);
  });
});

describe("the clock rules", () => {
  test("validity counts from before sending, minus the margin", () => {
    const sentAt = 1_000;
    // The answer arrived 2 s later; that does not move validity.
    assert.equal(validUntil(sentAt, 10_000, 1_000), 10_000);
    assert.equal(validUntil(sentAt, 50, MIN_MARGIN_MS), sentAt, "shorter than the margin: already invalid");
  });

  test("the margin is a tenth of the TTL, never below 100 ms", () => {
    assert.equal(margin(30_000), 3_000);
    assert.equal(margin(500), MIN_MARGIN_MS);
    assert.equal(margin(30_000, 1_000), 1_000);
    assert.equal(margin(30_000, 0), MIN_MARGIN_MS);
  });

  test("renewals come every third of the TTL, or sooner when validity is short", () => {
    assert.equal(renewInterval(30_000), 10_000);
    assert.equal(nextRenewal(0, 27_000, 10_000), 10_000);
    assert.equal(nextRenewal(0, 12_000, 10_000), 2_000);
    assert.equal(nextRenewal(0, 3_000, 10_000), 0);
  });

  test("backoff grows from 100 ms, stays under its cap, with jitter in the upper half", () => {
    for (let f = 1; f < 40; f++) assert.ok(backoff(f, 1_000) <= 1_000);
    assert.ok(backoff(1, 2_000) <= 100);
    assert.ok(backoff(10, 1_000) >= 500);
    assert.equal(backoff(3, 2_000, () => 0), 200);
    assert.equal(backoff(3, 2_000, () => 1), 400);
  });

  test("an extend switches lockId, TTL and validity together; answers sent under the replaced lockId are not applied", () => {
    const g = new Grant(1, "n", { lockId: "old", fencingToken: 7n }, 10_000, 1_000, "c", now() + 9_000);
    const sent = g.generation;
    // A shorter TTL: validity is set, not only moved forward.
    const until = now() + 1_800;
    assert.equal(g.switch("new", 2_000, 200, until), "old");
    assert.deepEqual([g.ref, g.ttlMs, g.marginMs, g.validUntil], [{ lockId: "new", fencingToken: 7n }, 2_000, 200, until]);
    // The old lockId now answers `stolen`, or a late `renewed`: neither counts.
    assert.equal(g.applyRenewal(sent, { lost: "stolen" }), undefined);
    assert.equal(g.applyRenewal(sent, { validUntil: now() + 60_000 }), undefined);
    assert.deepEqual([g.lostNow(), g.validUntil], [undefined, until], "not lost, nor moved, by a stale answer");
    // The same answer under the lockId it has now counts.
    assert.equal(g.applyRenewal(g.generation, { lost: "stolen" }), false);
    assert.equal(g.lostNow(), "stolen");
    // A lost lock is not revived by a move, but takes the new lockId, so that its release frees the name.
    assert.equal(g.switch("newer", 4_000, 400, now() + 3_000), "new");
    assert.deepEqual([g.ref.lockId, g.lostNow(), g.validUntil], ["newer", "stolen", until]);
  });

  test("a lock is lost by the clock at validity end, and a late confirmation cannot revive it", async () => {
    const g = new Grant(1, "n", { lockId: "id", fencingToken: 1n }, 2_000, 100, "c", now() + 150);
    assert.equal(g.lostNow(), undefined);
    // The grant's own timer is unref'd (a client's renewal loop keeps the
    // process alive while it holds locks); this test keeps it alive itself.
    const keepAlive = setTimeout(() => {}, 5_000);
    const at = await new Promise<number>((r) => g.signal.addEventListener("abort", () => r(now())));
    clearTimeout(keepAlive);
    assert.ok(at >= g.validUntil, "not before validity end");
    assert.equal(g.lostNow(), "unconfirmed");
    assert.ok(g.signal.reason instanceof LockLostError);
    g.confirm(now() + 10_000);
    assert.equal(g.lostNow(), "unconfirmed");
    g.markLost("stolen");
    assert.equal(g.lostNow(), "unconfirmed", "the first reason stays");
  });
});

describe("the renewal schedule", () => {
  const entry = (key: number, nextDue: number, interval = 10_000): Due => ({ key, nextDue, interval, inFlight: false });

  test("locks due close together share one batch, split at the API's 1,000", () => {
    const entries = Array.from({ length: 2_500 }, (_, k) => entry(k, 10_000 + k));
    assert.deepEqual(dueBatches(entries, 9_999), [], "nothing is due yet");
    const batches = dueBatches(entries, 10_000);
    assert.equal(MAX_BATCH, 1_000);
    assert.deepEqual(batches.map((b) => b.length), [1_000, 1_000, 500]);
  });

  test("a lock due much later waits for its own turn; one in flight is not sent twice", () => {
    const entries = [entry(1, 10_000), entry(2, 18_000), { ...entry(3, 0), inFlight: true }];
    assert.deepEqual(dueBatches(entries, 10_000), [[1]]);
  });

  test("answers confirm, lose at once, or retry", () => {
    assert.deepEqual(outcome({ renewed: true, expiresInMs: 5 }), { kind: "renewed", expiresInMs: 5 });
    assert.deepEqual(outcome({ renewed: false, reason: "expired" }), { kind: "lost", reason: "expired" });
    assert.deepEqual(outcome({ renewed: false, reason: "stolen" }), { kind: "lost", reason: "stolen" });
    assert.deepEqual(outcome({ renewed: false, reason: "shard_unavailable" }), { kind: "retry" });
  });
});

describe("errors and configuration", () => {
  test("error answers keep the API's code and message; retryable ones say so", () => {
    const body = parseJson('{"error":{"code":"shard_unavailable","message":"shard b is unavailable"}}');
    assert.throws(() => expectOk(503, body), (e: unknown) => {
      assert.ok(e instanceof RouterError);
      assert.equal(e.code, "shard_unavailable");
      assert.equal(e.detail, "shard b is unavailable");
      return isRetryable(e);
    });
    assert.throws(() => expectOk(400, parseJson('{"error":{"code":"invalid_argument","message":"x"}}')), (e: unknown) => !isRetryable(e));
    assert.throws(() => expectOk(502, "<html>"), (e: unknown) => e instanceof RouterError && e.code === "unexpected_answer");
    assert.ok(new TransportError("refused").retryable);
    assert.doesNotThrow(() => expectOk(204, undefined));
  });

  test("a 408 from the router is retried: the router never ran the request", { timeout: 10_000 }, async () => {
    let releases = 0;
    const fake: typeof fetch = async (input) => {
      const path = new URL(String(input)).pathname;
      if (path.endsWith("/acquire")) {
        return new Response('{"acquired":true,"lockId":"L1","fencingToken":7,"expiresInMs":29990}', { status: 200 });
      }
      releases += 1;
      if (releases === 1) return new Response('{"error":{"code":"timeout","message":"slow body"}}', { status: 408 });
      return new Response(null, { status: 204 });
    };
    await using c = new Client({ url: "http://router.example:1", fetch: fake });
    await (await c.acquire("x", { ttlMs: 30_000 })).release();
    assert.equal(releases, 2, "the 408 was retried");
  });

  test("an acquire waiting its turn when its client closes rejects with the closed client's ConfigError", { timeout: 10_000 }, async () => {
    const fake: typeof fetch = async (input) => {
      if (new URL(String(input)).pathname.endsWith("/acquire")) {
        return new Response('{"acquired":true,"lockId":"L1","fencingToken":7,"expiresInMs":29990}', { status: 200 });
      }
      return new Response(null, { status: 204 });
    };
    const c = new Client({ url: "http://router.example:1", fetch: fake });
    const held = await c.acquire("x", { ttlMs: 30_000 });
    const waiting = c.acquire("x", { ttlMs: 30_000, waitMs: Infinity });
    waiting.catch(() => {});
    await sleep(100);
    await c.close();
    await assert.rejects(waiting, (e: unknown) => e instanceof ConfigError && /closed/.test(e.message));
    assert.ok(!held.isHeld());
  });

  test("only http(s) URLs are accepted", () => {
    for (const ok of ["http://127.0.0.1:8080/", "https://router.example:8443/lockrouter"]) new Transport(ok, undefined, fetch);
    for (const bad of ["127.0.0.1:8080", "ftp://x", "not a url", "http://h/?q=1"]) {
      assert.throws(() => new Transport(bad, undefined, fetch), ConfigError, bad);
    }
  });
});

describe("fencing helpers", () => {
  test("lower tokens are rejected, equal ones admitted", () => {
    assert.ok(fencing.admits(undefined, 7n));
    assert.ok(fencing.admits(7n, 7n));
    assert.ok(!fencing.admits(9n, 7n));
    const f = new fencing.Fence();
    f.admit(2n ** 60n);
    assert.throws(() => f.admit(2n ** 60n - 1n), fencing.StaleTokenError);
    assert.equal(f.highest, 2n ** 60n);
  });

  test("tokens fit a BIGINT and sort as fixed-width text", () => {
    assert.equal(fencing.fenceKeyValue(42n), "00000000000000000042");
    assert.ok(fencing.fenceKeyValue(10n) > fencing.fenceKeyValue(9n));
    assert.throws(() => fencing.asI64(2n ** 63n), RangeError);
    assert.equal(fencing.parseToken("9223372036854775807"), 2n ** 63n - 1n);
    assert.throws(() => fencing.parseToken("-1"), RangeError);
  });
});

describe("the client over an injected fetch", () => {
  test("sends the bearer token to an https URL and keeps a token above 2^53 exact end to end", async () => {
    const seen: { url: string; auth: string | null; body: string }[] = [];
    const fakeFetch: typeof fetch = async (input, init) => {
      const headers = new Headers(init?.headers);
      seen.push({ url: String(input), auth: headers.get("authorization"), body: String(init?.body) });
      if (String(input).endsWith("/acquire")) {
        return new Response('{"acquired":true,"lockId":"L1","fencingToken":9007199254740993,"expiresAt":"x","expiresInMs":30000}', { status: 200 });
      }
      return new Response(null, { status: 204 });
    };
    const client = new Client({ url: "https://gateway.example/lr/", token: "s3cret", clientId: "c1", fetch: fakeFetch });
    const lock = await client.acquire("job", { ttlMs: 30_000 });
    assert.equal(lock.fencingToken, 9007199254740993n);
    assert.ok(lock.isHeld());
    await client.close();
    assert.equal(lock.lostReason, "released");
    assert.deepEqual(seen.map((s) => [s.url, s.auth]), [
      ["https://gateway.example/lr/api/v1/locks/acquire", "Bearer s3cret"],
      ["https://gateway.example/lr/api/v1/locks/release", "Bearer s3cret"],
    ]);
    assert.equal(seen[1]!.body, '{"lockId":"L1","fencingToken":9007199254740993}', "the token goes back exactly");
  });

  test("a release the router refuses (4xx) is not retried", { timeout: 10_000 }, async () => {
    const calls: string[] = [];
    const fakeFetch: typeof fetch = async (input) => {
      const path = new URL(String(input)).pathname;
      calls.push(path);
      if (path.endsWith("/acquire")) {
        return new Response('{"acquired":true,"lockId":"L1","fencingToken":7,"expiresInMs":30000}', { status: 200 });
      }
      return new Response('{"error":{"code":"invalid_argument","message":"bad"}}', { status: 400 });
    };
    const client = new Client({ url: "http://router.example:1", fetch: fakeFetch });
    const lock = await client.acquire("x", { ttlMs: 30_000 });
    const refused = (e: unknown): boolean => e instanceof RouterError && e.status === 400 && e.code === "invalid_argument" && !isRetryable(e);
    await assert.rejects(lock.release(), refused);
    assert.equal(lock.lostReason, "released");
    // A retry would come within the first backoff (100 ms), or from the
    // renewal loop in the background, or at close.
    await sleep(500);
    await client.close();
    await assert.rejects(lock.release(), refused, "releasing again shares the outcome");
    assert.deepEqual(calls, ["/api/v1/locks/acquire", "/api/v1/locks/release"]);
  });

  test("a release waits for an extend on the wire and goes out with the new lockId; an extend after a release attempt finds the lock released", { timeout: 10_000 }, async () => {
    const calls: string[] = [];
    let answerExtend!: () => void;
    const extendHeld = new Promise<void>((r) => (answerExtend = r));
    const fakeFetch: typeof fetch = async (input, init) => {
      const path = new URL(String(input)).pathname.split("/").pop()!;
      const lockId = (JSON.parse(String(init?.body)) as { lockId?: string }).lockId;
      calls.push(`${path} ${lockId ?? ""}`.trim());
      const json = (body: string): Response => new Response(body, { status: 200, headers: { "content-type": "application/json" } });
      if (path === "acquire") return json('{"acquired":true,"lockId":"L1","fencingToken":7,"expiresInMs":30000}');
      if (path === "extend") {
        await extendHeld;
        return json('{"renewed":true,"lockId":"L2","fencingToken":7,"expiresInMs":60000}');
      }
      return new Response(null, { status: 204 });
    };
    await using client = new Client({ url: "http://router.example:1", fetch: fakeFetch });
    const lock = await client.acquire("x", { ttlMs: 30_000 });
    const extending = lock.extend(60_000);
    await sleep(20);
    const releasing = lock.release();
    await sleep(100);
    assert.deepEqual(calls, ["acquire", "extend L1"], "no release while the extend is on the wire");
    answerExtend();
    const lostAsReleased = (e: unknown): boolean => e instanceof LockLostError && e.reason === "released";
    await assert.rejects(extending, lostAsReleased, "released while it was on the wire");
    await releasing;
    assert.deepEqual(calls, ["acquire", "extend L1", "release L2"], "released under the lockId the extend answered");

    const other = await client.acquire("y", { ttlMs: 30_000 });
    const released = other.release();
    await assert.rejects(other.extend(60_000), lostAsReleased);
    await released;
    assert.ok(!calls.slice(3).some((c) => c.startsWith("extend")), `no extend after the release: ${JSON.stringify(calls)}`);
  });

  test("a batch the router refuses (4xx) is renewed lock by lock; a lock refused on its own is lost", { timeout: 15_000 }, async () => {
    const calls: { path: string; body: string }[] = [];
    let acquired = 0;
    const answer = (status: number, body: string): Response => new Response(body, { status, headers: { "content-type": "application/json" } });
    const invalid = '{"error":{"code":"invalid_argument","message":"too many locks in one batch"}}';
    const fakeFetch: typeof fetch = async (input, init) => {
      const path = new URL(String(input)).pathname;
      const body = String(init?.body);
      calls.push({ path, body });
      if (path.endsWith("/acquire")) {
        const n = acquired++;
        return answer(200, `{"acquired":true,"lockId":"L${n}","fencingToken":${n + 1},"expiresInMs":2000}`);
      }
      if (path.endsWith("/renew-batch")) return answer(400, invalid);
      if (path.endsWith("/renew")) return body.includes('"L2"') ? answer(400, invalid) : answer(200, '{"renewed":true,"expiresInMs":2000}');
      return new Response(null, { status: 204 });
    };
    const client = new Client({ url: "http://router.example:1", fetch: fakeFetch });
    try {
      const locks = await Promise.all([0, 1, 2].map((i) => client.acquire(`refused-${i}`, { ttlMs: 2_000 })));
      // One and a half TTLs: without the fallback, every lock would be lost
      // by its clock (validity 1.8 s).
      await sleep(3_000);
      assert.ok(locks[0]!.isHeld() && locks[1]!.isHeld(), "renewed one by one");
      assert.equal(locks[2]!.lostReason, "refused", "refused on its own: lost at once");
      const batches = calls.filter((c) => c.path.endsWith("/renew-batch"));
      const singles = (id: string) => calls.filter((c) => c.path.endsWith("/renew") && c.body.includes(`"${id}"`)).length;
      assert.ok(batches.length >= 3, `${batches.length} renew-batch requests: each interval tries the batch first`);
      assert.ok(batches[0]!.body.includes('"L0"') && batches[0]!.body.includes('"L2"'), "one batch for all three");
      assert.ok(singles("L0") >= 3 && singles("L1") >= 3, `${singles("L0")}, ${singles("L1")} single renewals`);
      assert.equal(singles("L2"), 1, "a lost lock is not renewed again");
      assert.ok(!batches.at(-1)!.body.includes('"L2"'));
    } finally {
      await client.close();
    }
  });
});

describe("a closed client, and the exit of a block", () => {
  const answer = (status: number, body: string): Response => new Response(body, { status, headers: { "content-type": "application/json" } });
  const granted = (lockId: string, token: number): Response =>
    answer(200, `{"acquired":true,"lockId":"${lockId}","fencingToken":${token},"expiresInMs":2000}`);
  /** What undici throws when the router is unreachable. */
  const unreachable = (): TypeError => new TypeError("fetch failed", { cause: new Error("connect ECONNREFUSED 127.0.0.1:1") });
  /** Every lock of a renew-batch renewed. */
  const renewedAll = (body: unknown): Response => {
    const n = (JSON.parse(String(body)) as { locks: unknown[] }).locks.length;
    return answer(200, JSON.stringify({ results: Array.from({ length: n }, () => ({ renewed: true, expiresInMs: 2000 })) }));
  };
  const closedClient = (what: RegExp) => (e: unknown): boolean => {
    assert.ok(e instanceof ConfigError, `not the closed client's ConfigError: ${String(e)}`);
    assert.ok(!isRetryable(e));
    assert.match(e.message, what);
    return true;
  };

  test("after close, calls reject with the closed client's ConfigError and send nothing: an acquire after close or on the wire during it, a release close could not confirm", { timeout: 15_000 }, async () => {
    const calls: string[] = [];
    let acquired = 0;
    const fake: typeof fetch = async (input, init) => {
      const path = new URL(String(input)).pathname.split("/").pop()!;
      const body = JSON.parse(String(init?.body)) as { name?: string; lockId?: string };
      calls.push(`${path} ${body.name ?? body.lockId}`);
      if (path === "acquire" && body.name === "queued") {
        // Queued at the router until the request is cut, which rejects the way fetch does.
        return new Promise<Response>((_, reject) =>
          init?.signal?.addEventListener("abort", () => reject(new DOMException("This operation was aborted", "AbortError"))),
        );
      }
      if (path === "acquire") return granted(`L${++acquired}`, acquired);
      if (path === "release" && body.lockId === "L1") return new Response(null, { status: 204 });
      if (path === "release") throw unreachable();
      return renewedAll(init?.body);
    };
    const c = new Client({ url: "http://router.example:1", fetch: fake, requestTimeoutMs: 300 });
    const up = await c.acquire("up", { ttlMs: 2_000 });
    const down = await c.acquire("down", { ttlMs: 2_000 });
    const queued = c.acquire("queued", { ttlMs: 2_000, waitMs: Infinity });
    queued.catch(() => {});
    await sleep(50);
    assert.deepEqual(calls, ["acquire up", "acquire down", "acquire queued"]);

    const closing = c.close();
    const start = now();
    // Ended at once, not once the router answers (it never would) nor when close() is done.
    const cut = Promise.race([queued, sleep(1_000).then(() => Promise.reject(new Error("still on the wire 1 s into close()")))]);
    await assert.rejects(cut, closedClient(/closed during the acquire of "queued"/));
    assert.ok(now() - start < 500, `the acquire on the wire ended ${Math.round(now() - start)} ms into close()`);
    // close() confirmed one release; the other it retried while the lock
    // was valid (1.8 s), then one request timeout more, in vain.
    await closing;
    assert.ok(calls.filter((x) => x === "release L2").length >= 2, JSON.stringify(calls));
    const sent = calls.length;

    await up.release();
    await assert.rejects(down.release(), (e: unknown) => {
      closedClient(/"down" was not confirmed/)(e);
      assert.ok((e as Error).cause instanceof TransportError, `caused by ${String((e as Error).cause)}`);
      return true;
    });
    assert.equal(down.lostReason, "released");
    await assert.rejects(c.acquire("up", { ttlMs: 2_000 }), closedClient(/closed/));
    await assert.rejects(c.tryAcquire("new", { ttlMs: 2_000 }), closedClient(/closed/));
    await assert.rejects(c.using("new", { ttlMs: 2_000 }, async () => 1), closedClient(/closed/));
    await assert.rejects(c.inspect("up"), closedClient(/closed/));
    await sleep(300);
    assert.deepEqual(calls.slice(sent), [], "a closed client sends nothing");
  });

  test("a block's own exception is never replaced by a failing release at its exit: `await using` and using(name, fn)", { timeout: 15_000 }, async () => {
    let refuse = true;
    let acquired = 0;
    const fake: typeof fetch = async (input, init) => {
      const path = new URL(String(input)).pathname;
      if (path.endsWith("/acquire")) return granted(`L${++acquired}`, acquired);
      if (path.endsWith("/release") && refuse) return answer(400, '{"error":{"code":"invalid_argument","message":"bad"}}');
      if (path.endsWith("/release")) throw unreachable();
      return renewedAll(init?.body);
    };
    await using c = new Client({ url: "http://router.example:1", fetch: fake, requestTimeoutMs: 300 });
    const boom = new Error("the block's own error");
    for (const how of ["refused", "unreachable"] as const) {
      refuse = how === "refused";
      // A refusal ends the release at once; an unreachable router, once the lock's validity (1.8 s) is over.
      const failed = (e: unknown): boolean => (how === "refused" ? e instanceof RouterError && e.status === 400 : e instanceof TransportError);

      let disposed: Lock | undefined;
      let caught: unknown;
      try {
        await using lock = await c.acquire(`exit-${how}`, { ttlMs: 2_000 });
        disposed = lock;
        throw boom;
      } catch (e) {
        caught = e;
      }
      assert.equal(caught, boom, `await using (${how}): the exit replaced the block's exception with ${String(caught)}`);
      await assert.rejects(disposed!.release(), failed, "the release at the exit did fail");

      let worked: Lock | undefined;
      const work = async (_signal: AbortSignal, lock: Lock): Promise<never> => {
        worked = lock;
        throw boom;
      };
      await assert.rejects(c.using(`using-${how}`, { ttlMs: 2_000 }, work), (e: unknown) => e === boom);
      await assert.rejects(worked!.release(), failed, "the release after the work did fail");
    }
  });
});

describe("the registry of grants", () => {
  test("an answer naming a grant whose release was confirmed is stale, before and after its entry goes", () => {
    const registry = new Registry();
    const make = () => new Grant(1, "lock-1", { lockId: "id-1", fencingToken: 2n }, 30_000, 3_000, "c", now() + 27_000);
    const first = registry.claim("id-1", now() + 27_000, make);
    assert.equal(first.kind, "new");
    const grant = (first as { grant: Grant }).grant;
    grant.beginRelease();
    assert.equal(registry.claim("id-1", now() + 27_000, make).kind, "releasing");
    grant.endRelease("done");
    assert.equal(registry.claim("id-1", now() + 27_000, make).kind, "released", "confirmed, not yet forgotten");
    registry.forget(grant);
    assert.equal(registry.claim("id-1", now() + 27_000, make).kind, "released", "forgotten, remembered as released");
  });
});

describe("the router's Retry-After", () => {
  const answer = (status: number, body: string, headers: Record<string, string> = {}): Response =>
    new Response(body, { status, headers: { "content-type": "application/json", ...headers } });
  const granted = (lockId: string, token: number, expiresInMs: number): Response =>
    answer(200, `{"acquired":true,"lockId":"${lockId}","fencingToken":${token},"expiresInMs":${expiresInMs}}`);
  const overloaded = (retryAfter: string): Response =>
    answer(503, '{"error":{"code":"overloaded","message":"shard a is overloaded"}}', { "retry-after": retryAfter });

  test("a whole number of seconds becomes milliseconds, capped at an hour; absent, empty, negative, fractional or an HTTP-date is undefined", () => {
    assert.equal(parseRetryAfter("1"), 1_000);
    assert.equal(parseRetryAfter("0"), 0);
    assert.equal(parseRetryAfter("120"), 120_000);
    assert.equal(MAX_RETRY_AFTER_MS, 3_600_000);
    assert.equal(parseRetryAfter("86400"), MAX_RETRY_AFTER_MS);
    assert.equal(parseRetryAfter("9".repeat(400)), MAX_RETRY_AFTER_MS);
    for (const bad of [null, "", "-1", "1.5", "+1", "1e3", "soon", "1, 2", "Wed, 21 Oct 2015 07:28:00 GMT"]) {
      assert.equal(parseRetryAfter(bad), undefined, String(bad));
    }
    assert.equal(new RouterError(503, "overloaded", "x").retryAfterMs, undefined, "the three-argument constructor still works");
    assert.equal(new RouterError(503, "overloaded", "x", 2_000).retryAfterMs, 2_000);
  });

  test("503 overloaded and 429 rate_limited throw a RouterError with retryAfterMs; without the header it is undefined", { timeout: 10_000 }, async () => {
    const answers = [
      overloaded("1"),
      answer(429, '{"error":{"code":"rate_limited","message":"too many acquires"}}', { "retry-after": "3" }),
      answer(503, '{"error":{"code":"shard_unavailable","message":"shard b is unavailable"}}'),
      overloaded("Wed, 21 Oct 2015 07:28:00 GMT"),
    ];
    const fake: typeof fetch = async () => answers.shift()!;
    await using c = new Client({ url: "http://router.example:1", fetch: fake });
    const refused = (status: number, code: string, retryAfterMs: number | undefined) => (e: unknown): boolean => {
      assert.ok(e instanceof RouterError);
      assert.deepEqual([e.status, e.code, e.retryAfterMs, e.retryable], [status, code, retryAfterMs, true]);
      return true;
    };
    await assert.rejects(c.acquire("x", { ttlMs: 30_000 }), refused(503, "overloaded", 1_000));
    await assert.rejects(c.acquire("x", { ttlMs: 30_000 }), refused(429, "rate_limited", 3_000));
    await assert.rejects(c.acquire("x", { ttlMs: 30_000 }), refused(503, "shard_unavailable", undefined));
    await assert.rejects(c.acquire("x", { ttlMs: 30_000 }), refused(503, "overloaded", undefined));
  });

  test("a release refused with Retry-After is not sent again before that time, though its backoff is shorter", { timeout: 10_000 }, async () => {
    const releases: number[] = [];
    let refusedAt = 0;
    const fake: typeof fetch = async (input) => {
      if (new URL(String(input)).pathname.endsWith("/acquire")) return granted("L1", 7, 30_000);
      releases.push(now());
      if (releases.length > 1) return new Response(null, { status: 204 });
      refusedAt = now();
      return overloaded("1");
    };
    await using c = new Client({ url: "http://router.example:1", fetch: fake });
    await (await c.acquire("x", { ttlMs: 30_000 })).release();
    assert.equal(releases.length, 2);
    assert.ok(releases[1]! - refusedAt >= 1_000, `sent again ${releases[1]! - refusedAt} ms after the refusal`);
  });

  test("an acquire driving this client's unanswered release does not send it before the router's Retry-After", { timeout: 10_000 }, async () => {
    const releases: number[] = [];
    let refusedAt = 0;
    let acquires = 0;
    const fake: typeof fetch = async (input) => {
      if (new URL(String(input)).pathname.endsWith("/acquire")) {
        acquires += 1;
        return granted(`L${acquires}`, acquires, 30_000);
      }
      releases.push(now());
      if (releases.length > 1) return new Response(null, { status: 204 });
      refusedAt = now();
      return overloaded("1");
    };
    await using c = new Client({ url: "http://router.example:1", fetch: fake });
    const first = await c.acquire("x", { ttlMs: 30_000 });
    const releasing = first.release();
    await sleep(100);
    assert.equal(releases.length, 1, "refused once, waiting for its Retry-After");
    // The acquire asks the pending release to go now: not before the router said.
    const next = await c.acquire("x", { ttlMs: 30_000 });
    await releasing;
    assert.equal(next.lockId, "L2");
    assert.equal(releases.length, 2);
    assert.ok(releases[1]! - refusedAt >= 1_000, `sent again ${releases[1]! - refusedAt} ms after the refusal`);
  });

  test("a release whose Retry-After ends past the lock's validity rejects with that refusal, and the background waits it out too", { timeout: 10_000 }, async () => {
    let releases = 0;
    const fake: typeof fetch = async (input) => {
      if (new URL(String(input)).pathname.endsWith("/acquire")) return granted("L1", 7, 2_000);
      releases += 1;
      return releases > 1 ? new Response(null, { status: 204 }) : overloaded("5");
    };
    const c = new Client({ url: "http://router.example:1", fetch: fake, requestTimeoutMs: 500 });
    const lock = await c.acquire("x", { ttlMs: 2_000 });
    // Validity is 1.8 s: no attempt could follow the router's 5 s within it.
    await assert.rejects(lock.release(), (e: unknown) => e instanceof RouterError && e.retryAfterMs === 5_000);
    assert.equal(releases, 1, "not sent again within validity");
    await sleep(300);
    // The background's fast pace at close, then its last request timeout, all within the 5 s.
    await c.close();
    assert.equal(releases, 1, "nor in the background, nor at close");
  });

  test("a renewal waits for Retry-After only within its backoff cap and its validity", () => {
    const first = (): number => 0; // backoff(1, …) is then 50 ms
    assert.equal(renewalPause(1, 2_000, undefined, 20_000, first), 50);
    assert.equal(renewalPause(1, 2_000, 1_000, 20_000, first), 1_000, "fits: waited for");
    assert.equal(renewalPause(1, 2_000, 2_000, 20_000, first), 2_000, "as long as the cap still fits");
    assert.equal(renewalPause(1, 2_000, 5_000, 20_000, first), 50, "longer than the cap: the plain backoff");
    assert.equal(renewalPause(1, 2_000, 1_000, 900, first), 50, "ends past validity: the plain backoff");
    assert.equal(renewalPause(1, 667, 1_000, 1_800, first), 50, "a 2 s lock's cap is below the router's second");
    assert.equal(renewalPause(6, 2_000, 1_000, 20_000, () => 1), 2_000, "a longer backoff stands");
  });

  test("a renewal refused with Retry-After is retried no sooner than it asks when the schedule has room", { timeout: 10_000 }, async () => {
    const batches: number[] = [];
    let refusedAt = 0;
    const fake: typeof fetch = async (input) => {
      const path = new URL(String(input)).pathname;
      if (path.endsWith("/acquire")) return granted("L1", 7, 3_000);
      if (path.endsWith("/renew-batch")) {
        batches.push(now());
        if (batches.length > 1) return answer(200, '{"results":[{"renewed":true,"expiresInMs":3000}]}');
        refusedAt = now();
        return overloaded("1");
      }
      return new Response(null, { status: 204 });
    };
    await using c = new Client({ url: "http://router.example:1", fetch: fake });
    // A 3 s lock: renewed every second, backoff capped at a second, valid 2.7 s.
    const lock = await c.acquire("x", { ttlMs: 3_000 });
    while (batches.length < 2) await sleep(50);
    assert.ok(batches[1]! - refusedAt >= 1_000, `retried ${batches[1]! - refusedAt} ms after the refusal`);
    await sleep(50);
    assert.ok(lock.isHeld());
  });
});
