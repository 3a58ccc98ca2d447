/**
 * A protected resource that keeps fencing honest: a tiny HTTP service that
 * stores writes per resource and rejects any write whose fencing token is
 * lower than the highest it has accepted for that resource. Node 20 has no
 * built-in SQLite, so the store is in memory, optionally mirrored to a JSON
 * file after every accepted write; the check and the write happen in one
 * synchronous step of this single-threaded process, which is what makes
 * them atomic (the same job `UPDATE ... WHERE fence <= $token` does in SQL).
 *
 *   node dist/examples/fenced-resource.js --port 8090 [--file /tmp/orders.json]
 *
 *   POST /resources/{name}/writes   header Lockrouter-Fencing-Token: <token>, body: payload text
 *        200 {"accepted": true, "seq": 3}   |   409 {"accepted": false, "highest": 4711}
 *   GET  /resources/{name}/writes   200 {"highest": 4711, "writes": [{"seq", "token", "payload"}]}
 */

import { readFileSync, writeFileSync, renameSync } from "node:fs";
import { createServer, type IncomingMessage, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { parseArgs } from "node:util";

import { fencing, parseJson, stringifyJson, type Json } from "../src/index.js";

export interface StoredWrite {
  seq: number;
  token: bigint;
  payload: string;
}

/** Writes per resource behind a fence per resource; optionally persisted to `file`. */
export class FencedStore {
  private readonly fences = new Map<string, fencing.Fence>();
  private readonly writes = new Map<string, StoredWrite[]>();
  private seq = 0;

  constructor(private readonly file?: string) {
    if (file === undefined) return;
    let text: string;
    try {
      text = readFileSync(file, "utf8");
    } catch {
      return; // a new store
    }
    const saved = parseJson(text, new Set(["token"])) as { [resource: string]: Json };
    for (const [resource, list] of Object.entries(saved)) {
      for (const w of list as { seq: number; token: bigint; payload: string }[]) this.apply(resource, w.token, w.payload, w.seq);
    }
  }

  /** Appends `payload` under `token`: `undefined` if accepted, else the highest token accepted so far. */
  write(resource: string, token: bigint, payload: string): bigint | undefined {
    const fence = this.fences.get(resource) ?? new fencing.Fence();
    if (!fencing.admits(fence.highest, token)) return fence.highest;
    this.apply(resource, token, payload, ++this.seq);
    this.persist();
    return undefined;
  }

  list(resource: string): { highest: bigint | undefined; writes: StoredWrite[] } {
    return { highest: this.fences.get(resource)?.highest, writes: [...(this.writes.get(resource) ?? [])] };
  }

  private apply(resource: string, token: bigint, payload: string, seq: number): void {
    const fence = this.fences.get(resource) ?? new fencing.Fence();
    fence.admit(token);
    this.fences.set(resource, fence);
    const list = this.writes.get(resource) ?? [];
    list.push({ seq, token, payload });
    this.writes.set(resource, list);
    this.seq = Math.max(this.seq, seq);
  }

  private persist(): void {
    if (this.file === undefined) return;
    const out: { [resource: string]: Json } = {};
    for (const [r, list] of this.writes) out[r] = list.map((w) => ({ seq: w.seq, token: w.token, payload: w.payload }));
    // Write then rename: a crash leaves the old file or the new one, never half of one.
    writeFileSync(`${this.file}.tmp`, stringifyJson(out));
    renameSync(`${this.file}.tmp`, this.file);
  }
}

/** Serves `store` on 127.0.0.1:`port` (0: any free port); resolves once listening. */
export async function serveFencedResource(store: FencedStore, port = 0): Promise<{ url: string; server: Server }> {
  const server = createServer((req, res) => {
    const reply = (status: number, body: Json): void => {
      res.writeHead(status, { "content-type": "application/json" }).end(stringifyJson(body));
    };
    const m = /^\/resources\/([^/]+)\/writes$/.exec(req.url ?? "");
    if (m === null) return reply(404, { error: { code: "not_found", message: "no such route" } });
    const resource = decodeURIComponent(m[1]!);
    if (req.method === "GET") {
      const { highest, writes } = store.list(resource);
      return reply(200, { highest: highest ?? null, writes: writes.map((w) => ({ ...w })) });
    }
    if (req.method !== "POST") return reply(405, { error: { code: "method_not_allowed", message: "GET or POST" } });
    readBody(req).then((payload) => {
      let token: bigint;
      try {
        token = fencing.parseToken(String(req.headers[fencing.HEADER.toLowerCase()] ?? ""));
      } catch (e) {
        return reply(400, { error: { code: "invalid_argument", message: String(e) } });
      }
      // Check and write in one synchronous step: nothing can interleave.
      const highest = store.write(resource, token, payload);
      if (highest === undefined) return reply(200, { accepted: true, seq: store.list(resource).writes.at(-1)!.seq });
      return reply(409, { accepted: false, highest });
    }, () => reply(400, { error: { code: "invalid_argument", message: "unreadable body" } }));
  });
  server.keepAliveTimeout = 1_000;
  await new Promise<void>((resolve, reject) => {
    server.once("error", reject);
    server.listen(port, "127.0.0.1", resolve);
  });
  const { port: bound } = server.address() as AddressInfo;
  return { url: `http://127.0.0.1:${bound}`, server };
}

function readBody(req: IncomingMessage): Promise<string> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    req.on("data", (c: Buffer) => chunks.push(c));
    req.on("end", () => resolve(Buffer.concat(chunks).toString("utf8")));
    req.on("error", reject);
  });
}

if (import.meta.url === `file://${process.argv[1]}`) {
  const { values } = parseArgs({ options: { port: { type: "string", default: "8090" }, file: { type: "string" } } });
  const { url } = await serveFencedResource(new FencedStore(values.file), Number(values.port));
  console.log(`fenced resource on ${url}${values.file ? `, stored in ${values.file}` : " (in memory)"}`);
}
