/**
 * Real processes for the tests: etcd members and lockrouter routers on free
 * 127.0.0.1 ports, data and configs in a temp dir. Each value owns its
 * process: `stop()` kills and reaps it, and every process still running
 * when the test process exits is SIGKILLed by an exit hook. Readiness is
 * polled within a deadline; a server that does not come up fails the test
 * with the tail of its log. Nothing here is a mock: etcd is /usr/bin/etcd
 * (or /usr/local/bin/etcd), the router is the binary cargo built
 * (`LOCKROUTER_BIN`, default `target/debug/lockrouter`). A missing binary
 * fails loudly; nothing is skipped.
 */

import { spawn, type ChildProcess } from "node:child_process";
import { accessSync, constants, existsSync, mkdirSync, mkdtempSync, openSync, closeSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { setTimeout as sleep } from "node:timers/promises";
import { fileURLToPath } from "node:url";

/** The repository root, from dist/test/harness.js. */
export const REPO = fileURLToPath(new URL("../../../../", import.meta.url));
const ETCD_CANDIDATES = ["/usr/bin/etcd", "/usr/local/bin/etcd"];

/** Every process started here and not yet reaped, killed when this process exits. */
const live = new Set<ChildProcess>();
process.on("exit", () => {
  for (const child of live) child.kill("SIGKILL");
});

/** Kills `child` with the others when this process exits; reaped children leave the set. */
export function track(child: ChildProcess): void {
  live.add(child);
  child.once("exit", () => live.delete(child));
}

function executable(path: string): boolean {
  try {
    accessSync(path, constants.X_OK);
    return true;
  } catch {
    return false;
  }
}

export function etcdBinary(): string {
  const found = ETCD_CANDIDATES.find(executable);
  if (found === undefined) {
    throw new Error(
      `etcd missing: neither of ${ETCD_CANDIDATES.join(", ")} is an executable; these tests run a real etcd ` +
        "(Debian: etcd-server; deploy/local/prereqs.sh test installs it)",
    );
  }
  return found;
}

export function routerBinary(): string {
  const path = process.env["LOCKROUTER_BIN"] || join(REPO, "target", "debug", "lockrouter");
  if (!executable(path)) {
    throw new Error(
      `router binary missing: ${path} is not an executable (build it with \`cargo build --bin lockrouter\` ` +
        "at the repository root, or set LOCKROUTER_BIN)",
    );
  }
  return path;
}

/** A fresh temp dir, on tmpfs when there is one (etcd's fsyncs are cheap there). */
export function tempDir(prefix: string): string {
  return mkdtempSync(join(existsSync("/dev/shm") ? "/dev/shm" : tmpdir(), prefix));
}

/** `[first port, count]` of up to 20,000 ports just below the kernel's
 * ephemeral range (as the Rust test kit, testkit/src/loopback.rs). */
function portWindow(): [number, number] {
  let first = 32768;
  try {
    const parsed = Number.parseInt(readFileSync("/proc/sys/net/ipv4/ip_local_port_range", "utf8").trim().split(/\s+/)[0] ?? "", 10);
    if (Number.isInteger(parsed)) first = parsed;
  } catch {
    // no procfs: the default range's start
  }
  const low = Math.max(first - 20_000, 1024);
  return [low, Math.max(first - low, 1)];
}

const [portsFrom, portCount] = portWindow();
let nextPort = Math.floor(Math.random() * portCount);

function tryListen(port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const srv = createServer();
    srv.once("error", () => resolve(false));
    srv.listen(port, "127.0.0.1", () => srv.close(() => resolve(true)));
  });
}

/** A loopback port that was free a moment ago, picked below the ephemeral
 * range, in turn from a random start: no connection going out (the
 * router's to etcd, a client's to the router) can take it before the
 * process it is for binds it, and two picks in a row never give the same
 * port (listening on port 0 and letting go could). */
export async function freePort(): Promise<number> {
  for (let i = 0; i < portCount; i++) {
    const port = portsFrom + (nextPort++ % portCount);
    if (await tryListen(port)) return port;
  }
  throw new Error(`no free loopback port in ${portsFrom}..${portsFrom + portCount - 1}`);
}

function tail(path: string, lines = 30): string {
  try {
    return readFileSync(path, "utf8").split("\n").slice(-lines).join("\n");
  } catch (e) {
    return `(no log: ${String(e)})`;
  }
}

/** GET `url` within 1 s: the status and body, or undefined if nothing answered. */
export async function get(url: string): Promise<{ status: number; text: string } | undefined> {
  try {
    const r = await fetch(url, { signal: AbortSignal.timeout(1_000) });
    return { status: r.status, text: await r.text() };
  } catch {
    return undefined;
  }
}

/** One child process with its log file. */
export class Process {
  child: ChildProcess | undefined;
  private exit: Promise<void> = Promise.resolve();

  constructor(
    readonly argv: string[],
    readonly log: string,
    readonly what: string,
  ) {}

  spawn(): void {
    const fd = openSync(this.log, "a");
    const child = spawn(this.argv[0]!, this.argv.slice(1), { stdio: ["ignore", fd, fd] });
    closeSync(fd);
    live.add(child);
    this.child = child;
    this.exit = new Promise((resolve) =>
      child.once("exit", () => {
        live.delete(child);
        resolve();
      }),
    );
  }

  get running(): boolean {
    return this.child !== undefined && this.child.exitCode === null && this.child.signalCode === null;
  }

  /** Polls `ready` every 50 ms for `withinMs`; fails with the log's tail if the process exits or time runs out. */
  async waitUntil(ready: () => Promise<boolean>, withinMs: number): Promise<void> {
    const deadline = performance.now() + withinMs;
    while (performance.now() < deadline) {
      if (!this.running) throw new Error(`${this.what} exited (${this.child?.exitCode ?? this.child?.signalCode}):\n${tail(this.log)}`);
      if (await ready()) return;
      await sleep(50);
    }
    await this.kill();
    throw new Error(`${this.what} not ready within ${withinMs} ms:\n${tail(this.log)}`);
  }

  /** SIGKILL, and reap: no drain, no goodbye. */
  async kill(): Promise<void> {
    if (this.running) this.child!.kill("SIGKILL");
    await this.exit;
  }
}

/** A one-member etcd cluster. */
export class Etcd extends Process {
  readonly endpoint: string;

  private constructor(argv: string[], log: string, endpoint: string) {
    super(argv, log, `etcd on ${endpoint}`);
    this.endpoint = endpoint;
  }

  static async start(dir: string): Promise<Etcd> {
    const [clientPort, peerPort] = [await freePort(), await freePort()];
    const client = `http://127.0.0.1:${clientPort}`;
    const peer = `http://127.0.0.1:${peerPort}`;
    const data = join(dir, `etcd-${clientPort}`);
    mkdirSync(data, { recursive: true });
    const argv = [
      etcdBinary(),
      ...["--name", "m0", "--data-dir", join(data, "data")],
      ...["--listen-client-urls", client, "--advertise-client-urls", client],
      ...["--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer],
      ...["--initial-cluster", `m0=${peer}`, "--initial-cluster-token", "lockrouter-ts-test"],
      ...["--heartbeat-interval", "50", "--election-timeout", "500"],
    ];
    const etcd = new Etcd(argv, join(data, "etcd.log"), client);
    etcd.spawn();
    await etcd.waitUntil(async () => {
      const r = await get(`${client}/health`);
      return r?.status === 200 && r.text.includes("true");
    }, 20_000);
    return etcd;
  }
}

/**
 * `lockrouter serve` over the given etcd shards (named a, b, ...), with short
 * etcd deadlines so failures show fast (as the Rust test kit's config does).
 */
export class Router extends Process {
  readonly url: string;

  private constructor(argv: string[], log: string, url: string) {
    super(argv, log, `router on ${url}`);
    this.url = url;
  }

  /** Starts a router on `port` (default: a free one). */
  static async start(dir: string, shards: Etcd[], port?: number, extra = ""): Promise<Router> {
    port ??= await freePort();
    const url = `http://127.0.0.1:${port}`;
    const d = join(dir, `router-${port}`);
    mkdirSync(d, { recursive: true });
    let toml =
      `[server]\nlisten = "127.0.0.1:${port}"\n\n` +
      `[etcd]\nprefix = "/lockrouter"\nrequest_timeout_ms = 1000\nconnect_timeout_ms = 500\nhealth_interval_ms = 200\n` +
      extra;
    shards.forEach((s, i) => {
      toml += `\n[[shards]]\nname = "${String.fromCharCode(97 + i)}"\nendpoints = ["${s.endpoint}"]\n`;
    });
    const config = join(d, "router.toml");
    writeFileSync(config, toml);
    const router = new Router([routerBinary(), "serve", "--config", config], join(d, "router.log"), url);
    await router.restart();
    return router;
  }

  /** Starts the router (again, after `kill()`: on the same port) and waits for /readyz. */
  async restart(): Promise<void> {
    this.spawn();
    await this.waitUntil(async () => (await get(`${this.url}/readyz`))?.status === 200, 30_000);
  }

  /** The shard (a, b, ...) a name maps to, by the router's account. */
  async shardOf(name: string): Promise<string> {
    const r = await fetch(`${this.url}/api/v1/locks/${encodeURIComponent(name)}`, { signal: AbortSignal.timeout(5_000) });
    const text = await r.text();
    if (r.status !== 200) throw new Error(`inspect ${name}: ${r.status} ${text}`);
    return JSON.parse(text).shard as string;
  }

  /** The router's view of a lock (`GET /api/v1/locks/{name}`), token as text to keep it exact. */
  async inspect(name: string): Promise<{ held: boolean; fencingToken?: string }> {
    const r = await fetch(`${this.url}/api/v1/locks/${encodeURIComponent(name)}`, { signal: AbortSignal.timeout(5_000) });
    const text = await r.text();
    if (r.status !== 200) throw new Error(`inspect ${name}: ${r.status} ${text}`);
    const held = JSON.parse(text).held as boolean;
    const token = /"fencingToken":(\d+)/.exec(text)?.[1];
    return token === undefined ? { held } : { held, fencingToken: token };
  }

  /** Sum of one metric's series whose labels contain `labels`. */
  async metric(name: string, labels: string): Promise<number> {
    const text = await (await fetch(`${this.url}/metrics`, { signal: AbortSignal.timeout(5_000) })).text();
    let total = 0;
    for (const line of text.split("\n")) {
      if (line.startsWith(name) && line.includes(labels)) total += Number(line.slice(line.lastIndexOf(" ") + 1));
    }
    return total;
  }
}

/** One etcd and one router in a temp dir, for a test file; `stop()` kills both and removes the dir. */
export class Cluster {
  private constructor(
    readonly dir: string,
    readonly etcd: Etcd,
    readonly router: Router,
  ) {}

  static async start(): Promise<Cluster> {
    // Fail on missing binaries before starting anything.
    etcdBinary();
    routerBinary();
    const dir = tempDir("lockrouter-ts-");
    const etcd = await Etcd.start(dir);
    try {
      return new Cluster(dir, etcd, await Router.start(dir, [etcd]));
    } catch (e) {
      await etcd.kill();
      rmSync(dir, { recursive: true, force: true });
      throw e;
    }
  }

  /** Another router over the same etcd (to kill without disturbing the others), with `extra` TOML after its `[etcd]` table. */
  extraRouter(extra = ""): Promise<Router> {
    return Router.start(this.dir, [this.etcd], undefined, extra);
  }

  /** Another etcd, in this cluster's dir (a shard of its own for a router of its own). */
  extraEtcd(): Promise<Etcd> {
    return Etcd.start(this.dir);
  }

  async stop(): Promise<void> {
    await Promise.all([...live].map((c) => new Promise<void>((resolve) => {
      if (c.exitCode !== null || c.signalCode !== null) return resolve();
      c.once("exit", () => resolve());
      c.kill("SIGKILL");
    })));
    rmSync(this.dir, { recursive: true, force: true });
  }
}

/** Resolves when `signal` aborts, with the monotonic time it did. */
export function abortedAt(signal: AbortSignal): Promise<number> {
  if (signal.aborted) return Promise.resolve(performance.now());
  return new Promise((resolve) => signal.addEventListener("abort", () => resolve(performance.now()), { once: true }));
}

/** Rejects after `ms` with `what`: bounds a wait inside a test. */
export async function within<T>(ms: number, what: string, p: Promise<T>): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const timeout = new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error(`${what}: not within ${ms} ms`)), ms)));
  try {
    return await Promise.race([p, timeout]);
  } finally {
    clearTimeout(timer);
  }
}
