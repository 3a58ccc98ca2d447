//! The files a run writes under its output dir: `summary.json` (every
//! figure) and `summary.md` (the targets, the router at rest, the paired
//! tables, every window, and the overload windows side by side).

use std::path::Path;

use anyhow::Result;
use serde_json::Value;

use crate::idle::RouterAtRest;
use crate::paired::Paired;
use crate::report::{Record, Target};

/// Writes `summary.json` and `summary.md`.
pub fn write(
    out: &Path,
    summary: &Value,
    records: &[Record],
    paired: &[Paired],
    targets: &[Target],
    at_rest: Option<&RouterAtRest>,
) -> Result<()> {
    std::fs::create_dir_all(out)?;
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(summary)?,
    )?;
    let md = markdown(records, paired, targets, at_rest);
    std::fs::write(out.join("summary.md"), md)?;
    Ok(())
}

fn markdown(
    records: &[Record],
    paired: &[Paired],
    targets: &[Target],
    at_rest: Option<&RouterAtRest>,
) -> String {
    let mut s = String::from("## Targets\n\n");
    s.push_str(&targets_markdown(targets));
    if let Some(r) = at_rest {
        s.push_str(&format!(
            "\n## The router at rest\n\nNothing sent to it for {:.0} s after start: {:.1} context switches/s, {:.1} per shard ({} shards); {:.4} cores.\n",
            r.seconds, r.context_switches_per_s, r.context_switches_per_s_per_shard, r.shards, r.cores
        ));
    }
    for p in paired {
        s.push('\n');
        s.push_str(&p.markdown());
    }
    s.push_str(&overload_markdown(records, "overload", "Overload"));
    s.push_str(&overload_markdown(
        records,
        "overload-pinned",
        "Overload, the load generator on a CPU of its own",
    ));
    s.push_str(
        "\n## Every window\n\n| scenario | table | round | s | users | clients | acquires/s | p50 ms | p99 ms | max ms | most in flight | errors | 5xx | raft writes/acquire | grants/acquire | keepalives/acquire | commit batch | cores loadgen/router/etcd/machine | idle before |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in records {
        let idle = match &r.idle {
            Some(i) if i.idle => format!("yes ({} ms)", i.waited_ms),
            Some(i) => format!(
                "NO ({} proposals, {} keepalives)",
                i.proposals, i.keepalives
            ),
            None => "–".into(),
        };
        s.push_str(&format!(
            "| {} | {} | {} | {:.0} | {} | {} | {:.0} | {:.2} | {:.2} | {:.1} | {} | {} | {}{} | {:.3} | {:.4} | {:.3} | {} | {:.2} / {:.2} / {:.2} / {:.2} | {} |\n",
            r.scenario,
            r.table,
            r.round.map_or("–".into(), |n| n.to_string()),
            r.duration_s,
            r.users,
            r.clients,
            r.acquires_per_s,
            r.acquire_p50_ms,
            r.acquire_p99_ms,
            r.latency.max_ms,
            r.in_flight_peak,
            r.errors_total,
            r.server_errors_total,
            r.server_error_causes(),
            r.etcd_proposals_per_acquire,
            r.etcd_lease_grants_per_acquire,
            r.etcd_keepalives_per_acquire,
            r.router_commit_batch_mean.map_or("–".into(), |b| b.to_string()),
            r.cores.loadgen,
            r.cores.router,
            r.cores.etcd,
            r.cores.machine,
            idle
        ));
    }
    s
}

/// `overload` side by side: the capacity and unloaded windows it was
/// sized from, and the overloaded window (empty if it did not run).
fn overload_markdown(records: &[Record], name: &str, title: &str) -> String {
    let find = |name: &str| records.iter().find(|r| r.scenario == name);
    let (Some(cap), Some(un), Some(o)) = (
        find(&format!("{name}-capacity")),
        find(&format!("{name}-unloaded")),
        find(name),
    ) else {
        return String::new();
    };
    let d = &o.detail;
    let k = &d["counts"];
    let mut s = format!(
        "\n## {title}\n\nThe router's capacity and unloaded latency, then {}x that capacity offered open-loop to a router with `server.max_in_flight = {}` ({}), while {} holders renew {} locks each (TTL {} ms).\n\n",
        d["offered_factor"], d["max_in_flight"], d["max_in_flight_rule"].as_str().unwrap_or("?"),
        d["holders"], d["locks_per_holder"], d["holder_ttl_ms"]
    );
    s.push_str("| window | load | lock lives/s | acquire p50 ms | p99 ms | max ms | 503 overloaded | cores loadgen/router/etcd/machine |\n|---|---|---|---|---|---|---|---|\n");
    for (r, load, refused) in [
        (
            cap,
            format!("{} users, closed loop", cap.users),
            "–".to_string(),
        ),
        (
            un,
            format!("{} lock lives/s", un.throttle_rps.unwrap_or(0) / 2),
            "–".to_string(),
        ),
        (
            o,
            format!("{} lock lives/s open-loop", d["offered_lives_per_s"]),
            k["acquires_overloaded"].to_string(),
        ),
    ] {
        let lives = if r.scenario == name {
            d["goodput_lives_per_s"].as_f64().unwrap_or(0.0)
        } else {
            r.acquires_per_s
        };
        s.push_str(&format!(
            "| {} | {load} | {lives:.0} | {:.2} | {:.2} | {:.1} | {refused} | {:.2} / {:.2} / {:.2} / {:.2} |\n",
            r.scenario, r.acquire_p50_ms, r.acquire_p99_ms, r.latency.max_ms,
            r.cores.loadgen, r.cores.router, r.cores.etcd, r.cores.machine
        ));
    }
    let rows = [
        ("goodput / capacity", d["goodput_over_capacity"].to_string()),
        (
            "admitted acquire p99 / unloaded p99",
            d["admitted_acquire_p99_over_unloaded"].to_string(),
        ),
        (
            "admitted release p99 (ms)",
            d["admitted_release"]["p99_ms"].to_string(),
        ),
        (
            "503 answer to an acquire, p99 (ms)",
            d["refused_acquire"]["p99_ms"].to_string(),
        ),
        (
            "lock lives sent / offered per s",
            format!("{} / {}", d["sent_lives_per_s"], d["offered_lives_per_s"]),
        ),
        (
            "arrivals skipped (no generator user free)",
            k["arrivals_skipped"].to_string(),
        ),
        (
            "releases answered 503 (retried), given up",
            format!("{}, {}", k["releases_refused"], k["releases_given_up"]),
        ),
        (
            "acquires answered 429",
            k["acquires_rate_limited"].to_string(),
        ),
        (
            "503 not `overloaded`; refusals without Retry-After",
            format!("{}; {}", k["other_503"], k["refusals_without_retry_after"]),
        ),
        (
            "5xx other than 503; other request errors",
            format!("{}; {}", o.server_errors_total, o.errors_total),
        ),
        (
            "renewals lost (not renewed + lapsed)",
            format!(
                "{} ({} + {})",
                o.lost_total, k["locks_not_renewed"], k["locks_lapsed"]
            ),
        ),
        (
            "renew-batches, answered 503 (retried)",
            format!("{}, {}", k["renew_batches"], k["renew_batches_refused"]),
        ),
        (
            "lock renewals answered shard_unavailable (retried, not lost)",
            k["locks_unavailable"].to_string(),
        ),
        (
            "admitted renew-batch p99 (ms); worst renewal lateness (ms)",
            format!(
                "{}; {}",
                d["admitted_renew_batch"]["p99_ms"], k["renew_lag_max_ms"]
            ),
        ),
        (
            "router requests in flight, highest sample; generator's most outstanding",
            format!(
                "{}; {}",
                d["outcome"]["router_in_flight_sampled_max"], o.in_flight_peak
            ),
        ),
    ];
    s.push_str("\n| figure | value |\n|---|---|\n");
    for (what, value) in rows {
        s.push_str(&format!("| {what} | {value} |\n"));
    }
    s
}

/// The targets as a Markdown table.
fn targets_markdown(targets: &[Target]) -> String {
    let mut s = String::from(
        "| target | measured | rule | met | how | cause of a miss |\n|---|---|---|---|---|---|\n",
    );
    for t in targets {
        s.push_str(&format!(
            "| {} | {} | {} {} | {} | {} | {} |\n",
            t.name,
            t.measured,
            t.rule,
            t.limit,
            if t.met { "yes" } else { "**no**" },
            t.note,
            t.cause
        ));
    }
    s
}
