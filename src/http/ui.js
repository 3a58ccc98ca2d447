// The status page's script: polls the router's own routes (same origin) and
// renders their answers. Everything taken from an answer goes into the page
// as text (textContent), never as markup.
"use strict";
(() => {
  const REFRESH_MS = 3000;
  // sessionStorage: gone with the tab, never written to disk or the URL.
  const TOKEN_KEY = "lockrouter.token";
  const $ = (id) => document.getElementById(id);
  const ADMIN = "admin credential";

  const token = () => sessionStorage.getItem(TOKEN_KEY) || "";

  /**
   * JSON with every `fencingToken` kept as its digits (a string): tokens
   * reach 2^63, and JS numbers lose digits past 2^53. In the router's
   * compact JSON a quote right after `{` or `,` opens a key: a quote inside
   * a string is escaped, so no string's text matches.
   */
  function parseJson(text) {
    return JSON.parse(text.replace(/([{,])"fencingToken":(\d+)/g, '$1"fencingToken":"$2"'));
  }

  /**
   * A request to the router: {status, body (parsed JSON or null), text};
   * status 0 if it was not answered. `body`: an object, or JSON text as is
   * (to send a token's exact digits). Reads are marked as this page's, so
   * the router leaves them out of its request series.
   */
  async function call(method, path, body) {
    const headers = { Accept: "application/json" };
    if (token()) headers.Authorization = "Bearer " + token();
    if (method === "GET") headers["X-Lockrouter-Status-Page"] = "1";
    const init = { method, headers, cache: "no-store" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = typeof body === "string" ? body : JSON.stringify(body);
    }
    try {
      const resp = await fetch(path, init);
      const text = await resp.text();
      let json = null;
      try { json = parseJson(text); } catch (_) { /* not JSON: /metrics */ }
      return { status: resp.status, body: json, text, at: performance.now() };
    } catch (e) {
      return { status: 0, body: null, text: String(e) };
    }
  }

  /** Why an answer is not what was asked for, in words; `needs` names the credential a 401 or 403 asks for. */
  function problem(r, needs) {
    const msg = r.body && r.body.error ? `${r.body.error.code}: ${r.body.error.message}` : "";
    if ((r.status === 401 || r.status === 403) && needs) {
      return `${needs} needed (HTTP ${r.status}${msg ? ", " + msg : ""}): enter a token above.`;
    }
    if (r.status === 0) return `the router did not answer: ${r.text}`;
    return `HTTP ${r.status}${msg ? ": " + msg : ""}`;
  }

  function showError(id, text) {
    $(id).textContent = text || "";
    $(id).hidden = !text;
  }

  /** An element with text children (strings become text nodes). */
  function el(tag, props, ...children) {
    const e = document.createElement(tag);
    Object.assign(e, props || {});
    for (const c of children) e.append(c instanceof Node ? c : String(c));
    return e;
  }

  const stateClass = (s) => (s === "up" ? "good" : s === "unreachable" || s.endsWith("mismatch") || s === "cluster_changed" ? "bad" : "");

  // --- Shards: states from /readyz (open to all), ring roles from
  // /admin/v1/ring, load from /metrics.
  function renderShards(ready, ring, load) {
    const tbody = $("shards").tBodies[0];
    if (!ready.body || !Array.isArray(ready.body.shards)) {
      showError("shards-error", "readiness unknown: " + problem(ready));
      tbody.replaceChildren();
      return;
    }
    showError("shards-error", "");
    const ringShards = new Map((ring.body && Array.isArray(ring.body.shards) ? ring.body.shards : []).map((s) => [s.name, s]));
    tbody.replaceChildren(...ready.body.shards.map((s) => {
      const r = ringShards.get(s.name);
      const state = el("span", { className: "state " + stateClass(s.state) }, s.state.replaceAll("_", " "));
      const l = load.get(s.name) || {};
      const num = (col, v) => {
        const td = el("td", { className: "num" }, v == null ? "–" : v);
        td.dataset.col = col;
        return td;
      };
      const errors = l.errors ? l.errors.map(([kind, r]) => `${kind} ${fmtRate(r)}`).join(", ") : null;
      const errTd = el("td", { className: "errors" + (errors === "" ? " none" : "") }, errors == null ? "–" : errors || "none");
      errTd.dataset.col = "errors";
      const row = el("tr", {},
        el("td", { className: "mono" }, s.name),
        el("td", {}, state),
        el("td", {}, r ? r.state + (r.weight != null ? ` ×${r.weight}` : "") : "–"),
        el("td", {}, r && r.recordedEpoch != null ? r.recordedEpoch : "–"),
        num("held", l.held), num("sessions", l.sessions), num("waiters", l.waiters),
        num("acquires", l.acquires == null ? null : fmtRate(l.acquires)),
        num("renewals", l.renewals == null ? null : fmtRate(l.renewals)),
        num("acquire-p99", l.acquireP99 == null ? null : fmtSecs(l.acquireP99)),
        num("renew-p99", l.renewP99 == null ? null : fmtSecs(l.renewP99)),
        num("p99", l.p99 == null ? null : fmtSecs(l.p99)),
        errTd);
      row.dataset.shard = s.name;
      row.dataset.state = s.state;
      return row;
    }));
    const badge = $("ready");
    badge.textContent = ready.body.ready ? "ready" : "not ready";
    badge.className = "badge " + (ready.body.ready ? "good" : "bad");
    $("replica-name").textContent = ready.body.replica || "(no host name)";
    $("replica-version").textContent = ready.body.version ? "v" + ready.body.version : "–";
    $("replica-uptime").textContent = ready.body.uptimeMs == null ? "–" : "up " + fmtAge(ready.body.uptimeMs);
  }

  // --- Ring and migration. The migration is in /readyz too, so it shows
  // without admin rights; its progress is measured against the most moved
  // locks seen held since this page opened.
  const mostMoved = new Map();
  function renderRing(ready, ring) {
    if (ring.status === 200 && ring.body) {
      showError("ring-error", "");
      $("ring-fingerprint").textContent = ring.body.ring;
      $("ring-epoch").textContent = ring.body.epoch == null ? "none recorded" : ring.body.epoch;
      $("ring-granting").textContent = ring.body.granting ? "yes" : "no";
    } else {
      showError("ring-error", problem(ring, ADMIN));
      for (const id of ["ring-fingerprint", "ring-epoch", "ring-granting"]) $(id).textContent = "–";
    }
    const m = (ring.body && ring.body.migration) || (ready.body && ready.body.migration);
    $("migration-none").hidden = !!m;
    $("migration").hidden = !m;
    if (!m) return;
    const held = Object.entries(m.movedLocksHeld || {});
    const left = held.reduce((sum, [, n]) => sum + n, 0);
    const most = Math.max(mostMoved.get(m.toRing) || 0, left);
    mostMoved.set(m.toRing, most);
    $("migration-from").textContent = m.fromRing || "(none)";
    $("migration-to").textContent = m.toRing;
    $("migration-epoch").textContent = m.epoch;
    $("migration-progress").value = most ? (most - left) / most : 1;
    $("migration-summary").textContent = left
      ? `${left} moved lock${left === 1 ? "" : "s"} still held on previous shards`
      : "no moved lock held any more: the migration closes at its next check";
    $("migration-shards").replaceChildren(...held.map(([shard, n]) => el("li", {}, `${shard}: ${n}`)));
  }

  // --- Metrics: /metrics parsed into series, two samples apart.
  const fmtRate = (r) => (r >= 10 ? r.toFixed(0) : r.toFixed(1));
  const fmtSecs = (s) => (s >= 1 ? s.toFixed(2) + " s" : (s * 1000).toFixed(s >= 0.01 ? 0 : 1) + " ms");
  function fmtAge(ms) {
    const s = Math.max(0, Math.floor(ms / 1000));
    if (s < 120) return `${s} s`;
    if (s < 7200) return `${Math.floor(s / 60)} min`;
    if (s < 172800) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
    return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
  }

  /** Every sample line of a Prometheus text answer: {name, labels, value}. */
  function parseMetrics(text) {
    const series = [];
    for (const line of text.split("\n")) {
      const m = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
      if (!m) continue;
      const labels = {};
      for (const l of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
      series.push({ name: m[1], labels, value: Number(m[3]) });
    }
    return series;
  }

  /** Sums of `name` grouped by the label `by` (or all in ""), over series `keep` admits. */
  function sums(sample, name, by, keep) {
    const out = new Map();
    for (const s of sample.series) {
      if (s.name !== name || (keep && !keep(s.labels))) continue;
      const k = by ? s.labels[by] : "";
      out.set(k, (out.get(k) || 0) + s.value);
    }
    return out;
  }

  /** Per-second increase of a counter by `by`, between two samples; a group that went back (a restart, another replica) is left out. */
  function rates(now, before, name, by, keep) {
    const secs = (now.at - before.at) / 1000;
    const b = sums(before, name, by, keep);
    const out = new Map();
    for (const [k, n] of sums(now, name, by, keep)) {
      const r = (n - (b.get(k) || 0)) / secs;
      if (r >= 0) out.set(k, r);
    }
    return out;
  }

  /** The 99th percentile of a histogram by `by` between two samples, as Prometheus' histogram_quantile reads buckets; absent for a group with no sample in between. */
  function p99s(now, before, name, by, keep) {
    const buckets = (sample) => {
      const m = new Map();
      for (const s of sample.series) {
        if (s.name !== name + "_bucket" || (keep && !keep(s.labels))) continue;
        const k = by ? s.labels[by] : "";
        const le = s.labels.le === "+Inf" ? Infinity : Number(s.labels.le);
        if (!m.has(k)) m.set(k, new Map());
        m.get(k).set(le, (m.get(k).get(le) || 0) + s.value);
      }
      return m;
    };
    const b = buckets(before);
    const out = new Map();
    for (const [k, les] of buckets(now)) {
      const prev = b.get(k) || new Map();
      const counts = [...les].map(([le, n]) => [le, n - (prev.get(le) || 0)]).sort((x, y) => x[0] - y[0]);
      const total = counts.length ? counts[counts.length - 1][1] : 0;
      if (!(total > 0)) continue;
      const want = 0.99 * total;
      let lower = 0, below = 0;
      for (const [le, n] of counts) {
        if (n >= want) {
          if (le === Infinity) { out.set(k, lower); break; }
          out.set(k, lower + (le - lower) * ((want - below) / Math.max(n - below, 1e-9)));
          break;
        }
        lower = le; below = n;
      }
    }
    return out;
  }

  // Outcomes of lockrouter_requests_total that are answers, not errors.
  const ANSWERS = new Set(["acquired", "not_acquired", "renewed", "expired", "stolen", "released",
    "held", "free", "ok", "ready", "not_ready", "reloaded", "bumped"]);
  const SHARD_ERRORS = {
    acquire: new Set(["shard_unavailable", "rate_limited", "overloaded", "error"]),
    etcd: new Set(["unavailable", "error", "deadline"]),
  };

  let lastSample = null;
  /** What /metrics says now, and the rates since the sample before: {byShard, rates, p99, errors} or null before two samples. */
  function measure(metrics) {
    if (metrics.status !== 200) {
      showError("rates-error", problem(metrics));
      return null;
    }
    showError("rates-error", "");
    const now = { at: metrics.at, series: parseMetrics(metrics.text) };
    const before = lastSample;
    lastSample = now;
    const byShard = new Map();
    const shard = (name) => {
      if (!byShard.has(name)) byShard.set(name, {});
      return byShard.get(name);
    };
    for (const [key, series] of [["held", "lockrouter_active_locks"], ["sessions", "lockrouter_session_leases"], ["waiters", "lockrouter_waiters"]]) {
      for (const [name, v] of sums(now, series, "shard")) shard(name)[key] = v;
    }
    if (!before) return { byShard, rates: null };
    for (const [name, r] of rates(now, before, "lockrouter_acquires_total", "shard")) shard(name).acquires = r;
    for (const [name, r] of rates(now, before, "lockrouter_renewal_checks_total", "shard")) shard(name).renewals = r;
    const txn = (l) => l.rpc === "Txn";
    for (const [name, p] of p99s(now, before, "lockrouter_etcd_request_duration_seconds", "shard", txn)) shard(name).p99 = p;
    // Acquires and renewals as callers see them (the page makes neither).
    for (const [key, op] of [["acquireP99", "acquire"], ["renewP99", "renew"]]) {
      const of = (l) => l.op === op;
      for (const [name, p] of p99s(now, before, "lockrouter_shard_request_duration_seconds", "shard", of)) shard(name)[key] = p;
    }
    for (const l of byShard.values()) l.errors = [];
    for (const [what, series, label] of [["acquire", "lockrouter_acquires_total", "outcome"], ["etcd", "lockrouter_etcd_requests_total", "outcome"]]) {
      for (const s of now.series) {
        if (s.name !== series || !SHARD_ERRORS[what].has(s.labels[label])) continue;
        const was = before.series.find((b) => b.name === s.name && JSON.stringify(b.labels) === JSON.stringify(s.labels));
        const r = (s.value - (was ? was.value : 0)) / ((now.at - before.at) / 1000);
        if (r > 0) shard(s.labels.shard).errors.push([`${what} ${s.labels[label]}${s.labels.rpc ? " (" + s.labels.rpc + ")" : ""}`, r]);
      }
    }
    const isError = (l) => !ANSWERS.has(l.outcome);
    return {
      byShard,
      rates: rates(now, before, "lockrouter_requests_total", "op"),
      p99: p99s(now, before, "lockrouter_request_duration_seconds", "op"),
      errors: rates(now, before, "lockrouter_requests_total", "outcome", isError),
      errorTotals: sums(now, "lockrouter_requests_total", "outcome", isError),
    };
  }

  function renderRates(m) {
    if (!m || !m.rates) return; // the first sample only starts the measure
    const rs = [...m.rates].sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
    const rate = (op) => m.rates.get(op) || 0;
    $("rate-total").textContent = fmtRate(rs.reduce((s, [, r]) => s + r, 0));
    $("rate-renewals").textContent = fmtRate(rate("renew") + rate("renew_batch"));
    $("rates").tBodies[0].replaceChildren(...rs.filter(([, r]) => r > 0).map(([op, r]) => {
      const p = m.p99.get(op);
      const p99 = el("td", { className: "num" }, p == null ? "–" : fmtSecs(p));
      p99.dataset.col = "p99";
      const row = el("tr", {}, el("td", { className: "mono" }, op), el("td", { className: "num" }, fmtRate(r)), p99);
      row.dataset.op = op;
      return row;
    }));
    const kinds = [...m.errorTotals].filter(([, n]) => n > 0).sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
    $("errors").hidden = !kinds.length;
    $("errors-none").hidden = !!kinds.length;
    $("errors").tBodies[0].replaceChildren(...kinds.map(([kind, n]) => {
      const row = el("tr", {}, el("td", { className: "mono" }, kind),
        el("td", { className: "num" }, fmtRate(m.errors.get(kind) || 0)), el("td", { className: "num" }, n));
      row.dataset.kind = kind;
      return row;
    }));
  }

  // --- Held locks: a page of /admin/v1/locks, by name prefix, each with a
  // force-release that names the grant shown (its exact fencing token).
  const pages = { prefix: "", cursors: [null], at: 0, next: null };
  const validToken = (t) => typeof t === "string" && /^\d+$/.test(t);

  async function loadLocks() {
    const q = new URLSearchParams({ limit: $("locks-limit").value });
    if (pages.prefix) q.set("prefix", pages.prefix);
    const cursor = pages.cursors[pages.at];
    if (cursor) q.set("cursor", cursor);
    const asked = q.toString();
    const r = await call("GET", "/admin/v1/locks?" + asked);
    const tbody = $("locks").tBodies[0];
    if (r.status !== 200 || !r.body || !Array.isArray(r.body.locks)) {
      showError("locks-error", problem(r, ADMIN));
      tbody.replaceChildren();
      $("locks-empty").hidden = true;
      return;
    }
    showError("locks-error", "");
    pages.next = r.body.nextCursor || null;
    $("locks-prev").disabled = pages.at === 0;
    $("locks-next").disabled = !pages.next;
    $("locks-page").textContent = `page ${pages.at + 1}${pages.next ? "" : " (last)"}`;
    const now = Date.now();
    tbody.replaceChildren(...r.body.locks.map((l) => {
      const cell = (col, text, cls) => {
        const td = el("td", { className: cls || "" }, text);
        td.dataset.col = col;
        return td;
      };
      const acquired = l.acquiredAt ? Date.parse(l.acquiredAt) : NaN;
      // Counted from when the answer came, not by this browser's wall clock.
      const left = l.expiresInMs == null ? null : l.expiresInMs - (performance.now() - r.at);
      const button = el("button", { type: "button", className: "release" }, "Force-release…");
      button.addEventListener("click", () => forceRelease(l.name, l.fencingToken, "locks-result", loadLocks));
      const row = el("tr", {},
        cell("name", l.name, "mono"),
        cell("shard", l.shard, "mono"),
        cell("holder", (l.principal ? l.principal + " / " : "") + l.clientId, "mono"),
        cell("token", l.fencingToken, "num mono"),
        cell("age", Number.isNaN(acquired) ? "–" : fmtAge(now - acquired), "num"),
        cell("left", left == null ? "–" : fmtAge(left), "num"),
        el("td", {}, button));
      row.dataset.name = l.name;
      return row;
    }));
    const empty = $("locks-empty");
    empty.hidden = r.body.locks.length > 0;
    empty.textContent = pages.next
      ? "None on this part of the scan: go on with Next."
      : pages.prefix ? `No held lock's name starts with "${pages.prefix}".` : "No lock is held.";
  }

  // --- Lock lookup, and force-release behind the admin credential.
  const FIELDS = [
    ["name", "Name"], ["held", "Held"], ["shard", "Shard"], ["fencingToken", "Fencing token"],
    ["expiresAt", "Expires at"], ["acquiredAt", "Acquired at"], ["principal", "Principal"],
    ["clientId", "Client id"], ["waiters", "Waiters"], ["metadata", "Metadata"],
  ];
  let shown = ""; // the name on display, looked up again at each refresh
  let shownToken = null; // the fencing token of the grant on display

  function value(key, v) {
    if (key === "held") return v ? "yes" : "no";
    if (key === "expiresAt") {
      const secs = Math.round((Date.parse(v) - Date.now()) / 1000);
      return Number.isNaN(secs) ? v : `${v} (in ${secs} s)`;
    }
    if (key === "waiters" && Array.isArray(v)) return v.length + " waiting: " + v.map((w) => (typeof w === "object" ? JSON.stringify(w) : w)).join(", ");
    if (typeof v === "object" && v !== null) return el("pre", {}, JSON.stringify(v, null, 2));
    return String(v);
  }

  async function lookup(name) {
    const r = await call("GET", "/api/v1/locks/" + encodeURIComponent(name));
    if (name !== shown) return; // another lookup began meanwhile
    const out = $("lookup-result");
    if (r.status !== 200 || !r.body) {
      showError("lookup-error", problem(r, "credential (a principal's token for this name, or the admin credential)"));
      out.hidden = true;
      $("force-release").hidden = true;
      return;
    }
    showError("lookup-error", "");
    const known = new Set(FIELDS.map(([k]) => k));
    const rows = FIELDS.filter(([k]) => k in r.body)
      .concat(Object.keys(r.body).filter((k) => !known.has(k)).map((k) => [k, k]));
    out.replaceChildren(...rows.flatMap(([k, label]) => {
      const dd = el("dd", {}, value(k, r.body[k]));
      dd.dataset.field = k;
      return [el("dt", {}, label), dd];
    }));
    out.hidden = false;
    shownToken = r.body.held ? r.body.fencingToken : null;
    $("force-release").hidden = !r.body.held;
  }

  /**
   * Takes `name` from its holder after asking why and confirming; only the
   * grant with `fencing` (the one shown) is taken, never a later holder's.
   * The outcome goes in the element `out`; `then` runs after.
   */
  async function forceRelease(name, fencing, out, then) {
    const reason = window.prompt(`Force-release "${name}": why? (1 to 512 characters, written to the router's log)`);
    if (!reason) return;
    if (!window.confirm(`Take "${name}" from its holder now? The next holder gets a larger fencing token; the current holder learns it only when its next renewal fails.`)) return;
    const body = validToken(fencing)
      ? `{"reason":${JSON.stringify(reason)},"fencingToken":${fencing}}`
      : { reason };
    const r = await call("POST", `/admin/v1/locks/${encodeURIComponent(name)}/force-release`, body);
    const o = $(out);
    o.hidden = false;
    if (r.status === 200 && r.body) {
      o.className = "notice";
      o.textContent = r.body.released
        ? `Released "${r.body.name}" (fencing token ${r.body.fencingToken}, held by ${r.body.clientId || "?"}).`
        : `"${r.body.name}" was not held: nothing released.`;
    } else {
      o.className = "error";
      o.textContent = "Force-release refused: " + problem(r, ADMIN);
    }
    await then();
  }

  // --- Token, refresh loop, wiring.
  function showToken() {
    $("token").value = "";
    $("token-state").textContent = token() ? "token set for this tab" : "no token";
  }

  async function refresh() {
    const [ready, ring, metrics] = await Promise.all([
      call("GET", "/readyz"), call("GET", "/admin/v1/ring"), call("GET", "/metrics"),
    ]);
    const measured = measure(metrics);
    renderShards(ready, ring, (measured && measured.byShard) || new Map());
    renderRing(ready, ring);
    renderRates(measured);
    await Promise.all([loadLocks(), shown ? lookup(shown) : null]);
    $("refreshed").textContent = `updated ${new Date().toLocaleTimeString()}, every ${REFRESH_MS / 1000} s`;
  }

  // The second refresh comes sooner, so that rates show within a second.
  let refreshes = 0;
  async function tick() {
    try {
      await refresh();
    } catch (e) {
      $("refreshed").textContent = "refresh failed: " + e;
    } finally {
      setTimeout(tick, ++refreshes === 1 ? 1000 : REFRESH_MS);
    }
  }

  $("token-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const t = $("token").value.trim();
    if (t) sessionStorage.setItem(TOKEN_KEY, t);
    showToken();
    refresh();
  });
  $("token-forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    showToken();
    refresh();
  });
  $("lookup-form").addEventListener("submit", (e) => {
    e.preventDefault();
    shown = $("lookup-name").value.trim();
    $("force-result").hidden = true;
    if (shown) lookup(shown);
  });
  $("force-release").addEventListener("click", () =>
    forceRelease(shown, shownToken, "force-result", () => (shown ? lookup(shown) : null)));
  $("locks-form").addEventListener("submit", (e) => {
    e.preventDefault();
    Object.assign(pages, { prefix: $("locks-prefix").value, cursors: [null], at: 0 });
    $("locks-result").hidden = true;
    loadLocks();
  });
  $("locks-limit").addEventListener("change", () => {
    Object.assign(pages, { cursors: [null], at: 0 });
    loadLocks();
  });
  $("locks-next").addEventListener("click", () => {
    if (!pages.next) return;
    pages.cursors[pages.at + 1] = pages.next;
    pages.cursors.length = pages.at + 2;
    pages.at += 1;
    loadLocks();
  });
  $("locks-prev").addEventListener("click", () => {
    if (pages.at === 0) return;
    pages.at -= 1;
    loadLocks();
  });
  showToken();
  tick();
})();
