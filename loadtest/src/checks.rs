//! What `--check` insists on: no failed request anywhere, and accounting
//! that adds up. Costs per lock life are checked against what each design
//! can cost, not against what a fast machine reaches, and without the
//! session or per-lock lease grants of the window (each a raft write of its
//! own): `direct` is two raft writes per lock life (acquire txn, release
//! txn), `naive` two besides its grant (txn, revoke), and the router
//! anything above 0 up to 2.1, since group commit puts queued grants and
//! releases of a shard in one txn (alone, a lock life is two raft writes).

use serde_json::Value;

use crate::report::Record;

/// Problems found in `records`; empty when everything adds up.
pub fn check(records: &[Record]) -> Vec<String> {
    let mut problems = Vec::new();
    for r in records {
        if r.scenario == "rebalance" {
            problems.extend(check_rebalance(r));
            continue;
        }
        if r.scenario == "overload" || r.scenario == "overload-pinned" {
            problems.extend(check_overload(r));
            continue;
        }
        let at = where_(r);
        if r.errors_total > 0 || r.server_errors_total > 0 {
            problems.push(format!(
                "{at}: {} errors, {} 5xx{}{}",
                r.errors_total,
                r.server_errors_total,
                r.server_error_causes(),
                r.server_error_messages()
            ));
        }
        if r.acquires_total == 0 {
            problems.push(format!("{at}: no lock was acquired"));
        }
        // The baselines go straight to etcd.
        let is_router = !["direct", "naive", "barrier"]
            .iter()
            .any(|b| r.scenario.starts_with(b));
        if is_router && r.router_requests_total < r.requests_total as f64 * 0.99 {
            problems.push(format!(
                "{at}: the router counted {} requests, the load generator sent {}",
                r.router_requests_total, r.requests_total
            ));
        }
        match r.scenario.as_str() {
            "uncontested" => problems.extend(lock_life(r, (0.0, 2.1), (0.0, 2.1))),
            "direct" => problems.extend(lock_life(r, (1.5, 2.5), (1.99, 2.5))),
            // Its lease grant is taken out: the txn and the revoke are left.
            "naive" => problems.extend(lock_life(r, (1.5, 2.5), (0.99, 1.5))),
            "hold" | "per-lock-renew" => problems.extend(check_hold(r)),
            // One txn and one raft write per barrier; leases of earlier
            // windows that expire in this one add writes, as in `direct`.
            s if s.starts_with("barrier") => {
                problems.extend(lock_life(r, (0.99, 1.5), (0.99, 1.1)))
            }
            _ => {}
        }
    }
    problems
}

fn where_(r: &Record) -> String {
    match r.round {
        Some(n) => format!("{} ({} cores, round {n})", r.scenario, r.table),
        None => r.scenario.clone(),
    }
}

/// Raft writes and Txn RPCs per lock life within `(lo, hi]`. A session
/// lease granted in the window (a client whose session ran out, or that
/// the warm-up missed) is a raft write of its own, not of the lock life's
/// txns, so lease grants are taken out of the writes.
fn lock_life(r: &Record, writes: (f64, f64), txns: (f64, f64)) -> Vec<String> {
    let mut problems = Vec::new();
    let lock_writes = r.etcd_proposals_per_acquire - r.etcd_lease_grants_per_acquire;
    for (what, value, (lo, hi)) in [
        ("etcd raft writes besides lease grants", lock_writes, writes),
        ("Txn RPCs", r.etcd_txn_rpcs_per_acquire, txns),
    ] {
        if !(value > lo && value <= hi) {
            problems.push(format!(
                "{}: {value} {what} per lock life, expected more than {lo} and at most {hi}",
                where_(r)
            ));
        }
    }
    problems
}

fn check_hold(h: &Record) -> Vec<String> {
    let mut problems = Vec::new();
    let name = &h.scenario;
    if h.etcd_keepalives_per_s <= 0.0 || h.renewed_total == 0 {
        problems.push(format!("{name}: no renewals reached etcd"));
    }
    if let Some(reached) = h.detail.get("locks_reached").and_then(Value::as_u64) {
        let want = h
            .detail
            .get("locks_target")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        if reached < want {
            problems.push(format!("{name}: reached {reached} of {want} locks"));
        }
    }
    problems
}

/// `overload` refuses by design (503 `overloaded`, at once): what must
/// hold even at the smoke size is that no held lock is lost, nothing else
/// fails, every refusal says when to retry, and lock lives still complete.
fn check_overload(r: &Record) -> Vec<String> {
    let mut problems = Vec::new();
    let d = &r.detail;
    let n = |k: &str| d["counts"].get(k).and_then(Value::as_u64).unwrap_or(0);
    if r.lost_total > 0 {
        problems.push(format!(
            "overload: {} held locks lost ({} answered not renewed, {} renewed more than a TTL apart)",
            r.lost_total,
            n("locks_not_renewed"),
            n("locks_lapsed")
        ));
    }
    if r.server_errors_total > 0 || r.errors_total > 0 {
        problems.push(format!(
            "overload: {} 5xx other than 503, {} request errors besides refusals{}",
            r.server_errors_total,
            r.errors_total,
            r.server_error_messages()
        ));
    }
    if n("refusals_without_retry_after") > 0 {
        problems.push(format!(
            "overload: {} 503/429 answers without Retry-After",
            n("refusals_without_retry_after")
        ));
    }
    let want = d["holders"].as_u64().unwrap_or(0) * d["locks_per_holder"].as_u64().unwrap_or(0);
    if r.active_leases_peak < want {
        problems.push(format!(
            "overload: the holders got {} of their {want} locks",
            r.active_leases_peak
        ));
    }
    if r.releases_total == 0 {
        problems.push("overload: no lock life completed".into());
    }
    problems
}

/// `rebalance` may fail acquires while the router does not grant: from the
/// reload until it grants on the new ring, and from the migration's close
/// until it grants on the closed ring (the fence windows); outside them
/// every acquire must succeed, and the migration must close.
fn check_rebalance(r: &Record) -> Vec<String> {
    let mut problems = Vec::new();
    let d = &r.detail;
    let n = |k: &str| d.get(k).and_then(Value::as_u64).unwrap_or(0);
    if d.get("reload_status").and_then(Value::as_u64) != Some(200) {
        problems.push(format!(
            "rebalance: the reload answered {}",
            d.get("reload_status").unwrap_or(&Value::Null)
        ));
    }
    if d.get("migration_closed") != Some(&Value::Bool(true)) {
        problems.push("rebalance: the migration did not close".into());
    }
    if n("server_errors_outside_fence") > 0 || n("errors_outside_fence") > 0 {
        problems.push(format!(
            "rebalance: {} errors, {} 5xx outside the fence window{}",
            n("errors_outside_fence"),
            n("server_errors_outside_fence"),
            r.server_error_messages()
        ));
    }
    if r.acquires_total == 0 {
        problems.push("rebalance: no lock was acquired".into());
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    fn life(scenario: &str, writes: f64, txns: f64) -> Record {
        Record {
            scenario: scenario.into(),
            acquires_total: 100,
            etcd_proposals_per_acquire: writes,
            etcd_txn_rpcs_per_acquire: txns,
            ..Default::default()
        }
    }

    #[test]
    fn group_commit_may_take_a_lock_life_below_one_raft_write() {
        assert!(check(&[life("uncontested", 0.3, 0.3)]).is_empty());
        assert!(check(&[life("uncontested", 2.0, 2.0)]).is_empty());
        assert_eq!(check(&[life("uncontested", 0.0, 0.0)]).len(), 2);
        assert_eq!(check(&[life("uncontested", 2.5, 2.0)]).len(), 1);
    }

    #[test]
    fn session_grants_in_the_window_are_not_charged_to_lock_lives() {
        let mut r = life("uncontested", 2.117, 2.0);
        assert_eq!(check(std::slice::from_ref(&r)).len(), 1);
        r.etcd_lease_grants_per_acquire = 0.08;
        assert!(check(&[r]).is_empty());
    }

    #[test]
    fn overload_may_refuse_but_not_lose_or_fail() {
        let ok = Record {
            scenario: "overload".into(),
            releases_total: 10,
            active_leases_peak: 4,
            detail: serde_json::json!({"holders": 2, "locks_per_holder": 2,
                "counts": {"acquires_overloaded": 500, "refusals_without_retry_after": 0}}),
            ..Default::default()
        };
        assert!(check(std::slice::from_ref(&ok)).is_empty());
        let lost = Record {
            lost_total: 1,
            ..ok.clone()
        };
        assert_eq!(check(&[lost]).len(), 1);
        let mut bare = ok.clone();
        bare.detail["counts"]["refusals_without_retry_after"] = 1.into();
        assert_eq!(check(&[bare]).len(), 1);
    }

    #[test]
    fn baselines_cost_what_their_design_costs() {
        assert!(check(&[life("direct", 2.0, 2.0)]).is_empty());
        assert!(!check(&[life("direct", 1.0, 1.0)]).is_empty());
        let naive = |writes| Record {
            etcd_lease_grants_per_acquire: 1.0,
            ..life("naive", writes, 1.0)
        };
        assert!(check(&[naive(3.0)]).is_empty());
        // A barrier is one txn and one raft write, and the router sees none.
        assert!(check(&[life("barrier@50/s/shard", 1.0, 1.0)]).is_empty());
        assert!(!check(&[life("barrier@50/s/shard", 2.0, 1.0)]).is_empty());
        assert!(!check(&[naive(2.0)]).is_empty());
    }
}
