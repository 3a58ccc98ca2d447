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

  /** A request to the router: {status, body (parsed JSON or null), text}; status 0 if it was not answered. */
  async function call(method, path, body) {
    const headers = { Accept: "application/json" };
    if (token()) headers.Authorization = "Bearer " + token();
    const init = { method, headers, cache: "no-store" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    try {
      const resp = await fetch(path, init);
      const text = await resp.text();
      let json = null;
      try { json = JSON.parse(text); } catch (_) { /* not JSON: /metrics */ }
      return { status: resp.status, body: json, text };
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

  // --- Shards: states from /readyz (open to all), ring roles from /admin/v1/ring.
  function renderShards(ready, ring) {
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
      const row = el("tr", {},
        el("td", { className: "mono" }, s.name),
        el("td", {}, state),
        el("td", {}, r ? r.state : "–"),
        el("td", {}, r && r.weight != null ? r.weight : "–"),
        el("td", {}, r && r.recordedEpoch != null ? r.recordedEpoch : "–"));
      row.dataset.shard = s.name;
      row.dataset.state = s.state;
      return row;
    }));
    const badge = $("ready");
    badge.textContent = ready.body.ready ? "ready" : "not ready";
    badge.className = "badge " + (ready.body.ready ? "good" : "bad");
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

  // --- Rates: lockrouter_requests_total summed by op, two samples apart.
  let lastSample = null;
  function sample(text) {
    const byOp = new Map();
    for (const line of text.split("\n")) {
      const m = /^lockrouter_requests_total\{(.*)\}\s+(\S+)/.exec(line);
      if (!m) continue;
      const op = /(?:^|,)op="([^"]*)"/.exec(m[1]);
      if (op) byOp.set(op[1], (byOp.get(op[1]) || 0) + Number(m[2]));
    }
    return { at: performance.now(), byOp };
  }
  function renderRates(metrics) {
    if (metrics.status !== 200) {
      showError("rates-error", problem(metrics));
      return;
    }
    showError("rates-error", "");
    const now = sample(metrics.text);
    const before = lastSample;
    lastSample = now;
    if (!before) return; // the first sample only starts the measure
    const secs = (now.at - before.at) / 1000;
    const rates = [...now.byOp].map(([op, n]) => [op, (n - (before.byOp.get(op) || 0)) / secs])
      .filter(([, r]) => r >= 0) // a counter that went back: another replica, or a restart
      .sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
    const fmt = (r) => (r >= 10 ? r.toFixed(0) : r.toFixed(1));
    const rate = (op) => (rates.find(([o]) => o === op) || [op, 0])[1];
    $("rate-total").textContent = fmt(rates.reduce((s, [, r]) => s + r, 0));
    $("rate-renewals").textContent = fmt(rate("renew") + rate("renew_batch"));
    $("rates").tBodies[0].replaceChildren(...rates.filter(([, r]) => r > 0).map(([op, r]) => {
      const row = el("tr", {}, el("td", { className: "mono" }, op), el("td", {}, fmt(r)));
      row.dataset.op = op;
      return row;
    }));
  }

  // --- Lock lookup, and force-release behind the admin credential.
  const FIELDS = [
    ["name", "Name"], ["held", "Held"], ["shard", "Shard"], ["fencingToken", "Fencing token"],
    ["expiresAt", "Expires at"], ["acquiredAt", "Acquired at"], ["principal", "Principal"],
    ["clientId", "Client id"], ["waiters", "Waiters"], ["metadata", "Metadata"],
  ];
  let shown = ""; // the name on display, looked up again at each refresh

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
    $("force-release").hidden = !r.body.held;
  }

  async function forceRelease() {
    const name = shown;
    const reason = window.prompt(`Force-release "${name}": why? (1 to 512 characters, written to the router's log)`);
    if (!reason) return;
    if (!window.confirm(`Take "${name}" from its holder now? The next holder gets a larger fencing token; the current holder learns it only when its next renewal fails.`)) return;
    const r = await call("POST", `/admin/v1/locks/${encodeURIComponent(name)}/force-release`, { reason });
    const out = $("force-result");
    out.hidden = false;
    if (r.status === 200 && r.body) {
      out.className = "notice";
      out.textContent = r.body.released
        ? `Released "${r.body.name}" (fencing token ${r.body.fencingToken}, held by ${r.body.clientId || "?"}).`
        : `"${r.body.name}" was not held: nothing released.`;
    } else {
      out.className = "error";
      out.textContent = "Force-release refused: " + problem(r, ADMIN);
    }
    if (name === shown) await lookup(name);
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
    renderShards(ready, ring);
    renderRing(ready, ring);
    renderRates(metrics);
    if (shown) await lookup(shown);
    $("refreshed").textContent = `updated ${new Date().toLocaleTimeString()}, every ${REFRESH_MS / 1000} s`;
  }

  async function tick() {
    try {
      await refresh();
    } catch (e) {
      $("refreshed").textContent = "refresh failed: " + e;
    } finally {
      setTimeout(tick, REFRESH_MS);
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
  $("force-release").addEventListener("click", forceRelease);
  showToken();
  tick();
})();
