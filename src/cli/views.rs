//! The tables of the operator's commands (`-o table`): each reads a
//! router's answer into the typed view below, which names only the fields
//! it shows (fields a router adds later are ignored; ones an older router
//! lacks are optional), and renders it with [`super::output`]. Times left
//! are counted by the router where it says (`expiresInMs`), else from
//! `expiresAt` by this machine's clock: for people, never for safety.

use std::collections::HashMap;
use std::fmt::Write;
use std::time::{Duration, SystemTime};

use serde::Deserialize;
use serde_json::Value;

use super::output::{age, fields, left, short, Table};

/// `GET /api/v1/locks/{name}`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Inspected {
    pub name: String,
    pub held: bool,
    pub shard: String,
    pub fencing_token: Option<u64>,
    pub expires_at: Option<String>,
    pub acquired_at: Option<String>,
    pub metadata: Option<Value>,
    pub waiters: Option<u64>,
    pub principal: Option<String>,
    pub client_id: Option<String>,
}

/// A lock of `GET /admin/v1/locks` and `GET /admin/v1/clients/{id}`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Listed {
    pub name: String,
    pub shard: String,
    pub fencing_token: u64,
    pub principal: Option<String>,
    pub client_id: String,
    pub ttl_ms: u64,
    pub acquired_at: Option<String>,
}

/// `GET /admin/v1/locks`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Page {
    pub locks: Vec<Listed>,
    pub next_cursor: Option<String>,
}

/// `GET /admin/v1/clients/{id}`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientView {
    pub client_id: String,
    pub principal: Option<String>,
    pub locks: Vec<Listed>,
    pub sessions: Vec<Session>,
    #[serde(default)]
    pub truncated: bool,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Session {
    pub shard: String,
    pub lease: i64,
    pub ttl_ms: u64,
    pub expires_at: Option<String>,
    pub expires_in_ms: Option<u64>,
    pub locks: u64,
}

/// `GET /admin/v1/ring`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RingView {
    pub ring: String,
    pub epoch: Option<u64>,
    pub granting: bool,
    pub shards: Vec<RingShard>,
    pub migration: Option<Migration>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RingShard {
    pub name: String,
    /// `active` (of the ring) or `draining` (of a migration's old ring).
    pub state: String,
    pub up: bool,
    pub recorded_ring: Option<String>,
    pub recorded_epoch: Option<u64>,
    pub weight: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Migration {
    pub from_ring: Option<String>,
    pub to_ring: String,
    pub epoch: u64,
    #[serde(default)]
    pub moved_locks_held: std::collections::BTreeMap<String, i64>,
}

/// `GET /readyz`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Readiness {
    pub ready: bool,
    /// Absent from older routers' answers.
    pub version: Option<String>,
    pub shards: Vec<ShardReadiness>,
    pub migration: Option<Migration>,
}

#[derive(Debug, Deserialize)]
pub struct ShardReadiness {
    pub name: String,
    pub state: String,
}

fn or_dash<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

fn yes(b: bool) -> String {
    if b { "yes" } else { "no" }.into()
}

fn ttl(ms: u64) -> String {
    short(Duration::from_millis(ms))
}

/// `inspect NAME`: one lock, a field a line.
pub fn inspect(i: &Inspected, now: SystemTime) -> String {
    let mut rows = vec![
        ("NAME", i.name.clone()),
        ("SHARD", i.shard.clone()),
        ("HELD", yes(i.held)),
    ];
    if i.held {
        rows.push(("TOKEN", or_dash(i.fencing_token)));
        if let Some(p) = &i.principal {
            rows.push(("PRINCIPAL", p.clone()));
        }
        // Only admin callers see the holder.
        rows.push(("CLIENT", or_dash(i.client_id.as_ref())));
        rows.push(("ACQUIRED", or_dash(i.acquired_at.as_ref())));
        rows.push(("AGE", age(i.acquired_at.as_deref(), now)));
        rows.push(("EXPIRES", or_dash(i.expires_at.as_ref())));
        rows.push(("LEFT", left(i.expires_at.as_deref(), now)));
        if let Some(m) = &i.metadata {
            rows.push(("METADATA", m.to_string()));
        }
    }
    rows.push(("WAITERS", i.waiters.unwrap_or(0).to_string()));
    fields(&rows)
}

/// `locks`: a page of held locks, with each one's expiry when `expiries`
/// has it (by name: the `expiresAt` of an inspect that found the same
/// grant, `None` when that grant was gone by then).
pub fn locks(page: &Page, expiries: &HashMap<String, Option<String>>, now: SystemTime) -> String {
    let principals = page.locks.iter().any(|l| l.principal.is_some());
    let mut header = vec!["NAME", "SHARD", "TOKEN"];
    if principals {
        header.push("PRINCIPAL");
    }
    header.extend(["CLIENT", "TTL", "AGE", "EXPIRES", "LEFT"]);
    let mut t = Table::new(&header);
    for l in &page.locks {
        let mut row = vec![l.name.clone(), l.shard.clone(), l.fencing_token.to_string()];
        if principals {
            row.push(or_dash(l.principal.as_ref()));
        }
        let expires = expiries.get(&l.name);
        let (at, left) = match expires {
            Some(Some(at)) => (at.clone(), left(Some(at), now)),
            Some(None) => ("-".into(), "gone".into()),
            None => ("-".into(), "-".into()),
        };
        row.extend([
            l.client_id.clone(),
            ttl(l.ttl_ms),
            age(l.acquired_at.as_deref(), now),
            at,
            left,
        ]);
        t.row(row);
    }
    t.render()
}

/// `client ID`: its locks, then the session leases they ride on.
pub fn client(c: &ClientView, now: SystemTime) -> String {
    let mut out = fields(&[
        ("CLIENT", c.client_id.clone()),
        ("PRINCIPAL", or_dash(c.principal.as_ref())),
        (
            "LOCKS",
            format!(
                "{}{}",
                c.locks.len(),
                if c.truncated {
                    " (more not listed)"
                } else {
                    ""
                }
            ),
        ),
    ]);
    let mut locks = Table::new(&["NAME", "SHARD", "TOKEN", "TTL", "AGE"]);
    for l in &c.locks {
        locks.row(vec![
            l.name.clone(),
            l.shard.clone(),
            l.fencing_token.to_string(),
            ttl(l.ttl_ms),
            age(l.acquired_at.as_deref(), now),
        ]);
    }
    let mut sessions = Table::new(&["SHARD", "LEASE", "TTL", "EXPIRES", "LEFT", "LOCKS"]);
    for s in &c.sessions {
        let left = match s.expires_in_ms {
            Some(ms) => short(Duration::from_millis(ms)),
            None => left(s.expires_at.as_deref(), now),
        };
        sessions.row(vec![
            s.shard.clone(),
            s.lease.to_string(),
            ttl(s.ttl_ms),
            or_dash(s.expires_at.as_ref()),
            left,
            s.locks.to_string(),
        ]);
    }
    let _ = write!(
        out,
        "\n{}\nSESSION LEASES\n{}",
        locks.render(),
        sessions.render()
    );
    out
}

fn migration(m: Option<&Migration>) -> String {
    let Some(m) = m else {
        return "none".into();
    };
    let held: Vec<String> = m
        .moved_locks_held
        .iter()
        .map(|(shard, n)| format!("{shard} {n}"))
        .collect();
    format!(
        "from {} to {} at epoch {}; moved locks still held: {}",
        or_dash(m.from_ring.as_ref()),
        m.to_ring,
        m.epoch,
        if held.is_empty() {
            "none".into()
        } else {
            held.join(", ")
        }
    )
}

/// `ring`: the ring, then a shard a row.
pub fn ring(r: &RingView) -> String {
    let mut out = fields(&[
        ("RING", r.ring.clone()),
        ("EPOCH", or_dash(r.epoch)),
        ("GRANTING", yes(r.granting)),
        ("MIGRATION", migration(r.migration.as_ref())),
    ]);
    let mut t = Table::new(&[
        "SHARD",
        "ROLE",
        "UP",
        "WEIGHT",
        "RECORDED RING",
        "RECORDED EPOCH",
    ]);
    for s in &r.shards {
        t.row(vec![
            s.name.clone(),
            s.state.clone(),
            yes(s.up),
            or_dash(s.weight),
            or_dash(s.recorded_ring.as_ref()),
            or_dash(s.recorded_epoch),
        ]);
    }
    out.push('\n');
    out.push_str(&t.render());
    out
}

/// `status`: `/readyz` as a table, with the ring's epoch and each shard's
/// role and weight when the ring could be read (it needs the admin
/// credential).
pub fn status(ready: &Readiness, ring: Option<&RingView>) -> String {
    let ring_line = match ring {
        Some(r) => format!(
            "{} (epoch {}, {})",
            r.ring,
            or_dash(r.epoch),
            if r.granting {
                "granting"
            } else {
                "not granting"
            }
        ),
        None => "- (`lockrouter ring` needs the admin credential)".into(),
    };
    let mut out = fields(&[
        ("VERSION", or_dash(ready.version.as_ref())),
        ("READY", yes(ready.ready)),
        ("RING", ring_line),
        ("MIGRATION", migration(ready.migration.as_ref())),
    ]);
    let mut t = Table::new(&["SHARD", "STATE", "ROLE", "WEIGHT", "EPOCH"]);
    let of_ring = |name: &str| ring.and_then(|r| r.shards.iter().find(|s| s.name == name));
    for s in &ready.shards {
        let r = of_ring(&s.name);
        t.row(vec![
            s.name.clone(),
            s.state.clone(),
            or_dash(r.map(|r| &r.state)),
            or_dash(r.and_then(|r| r.weight)),
            or_dash(r.and_then(|r| r.recorded_epoch)),
        ]);
    }
    // Draining shards of a migration are not in `/readyz`.
    for r in ring.into_iter().flat_map(|r| &r.shards) {
        if !ready.shards.iter().any(|s| s.name == r.name) {
            let state = if r.up { "up" } else { "unreachable" };
            t.row(vec![
                r.name.clone(),
                state.into(),
                r.state.clone(),
                or_dash(r.weight),
                or_dash(r.recorded_epoch),
            ]);
        }
    }
    out.push('\n');
    out.push_str(&t.render());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn at(s: &str) -> SystemTime {
        humantime::parse_rfc3339(s).unwrap()
    }

    #[test]
    fn status_joins_readiness_and_the_ring_by_shard() {
        let ready: Readiness = serde_json::from_value(json!({
            "ready": true, "version": "0.1.0",
            "shards": [{"name": "a", "state": "up"}, {"name": "b", "state": "unreachable"}],
            "unreachableShards": ["b"], "refusingShards": [], "migration": null
        }))
        .unwrap();
        let ring: RingView = serde_json::from_value(json!({
            "ring": "f00d", "epoch": 3, "granting": true, "migration": null,
            "shards": [
                {"name": "a", "state": "active", "up": true, "recordedRing": "f00d", "recordedEpoch": 3, "weight": 2},
                {"name": "b", "state": "active", "up": false, "recordedRing": null, "recordedEpoch": null, "weight": 1},
                {"name": "old", "state": "draining", "up": true, "recordedRing": "f00d", "recordedEpoch": 3}
            ]
        }))
        .unwrap();
        let out = status(&ready, Some(&ring));
        assert!(out.contains("VERSION     0.1.0\n"), "{out}");
        assert!(out.contains("f00d (epoch 3, granting)"), "{out}");
        assert!(
            out.contains("\na       up            active     2        3\n"),
            "{out}"
        );
        assert!(
            out.contains("\nb       unreachable   active     1        -\n"),
            "{out}"
        );
        assert!(
            out.contains("\nold     up            draining   -        3\n"),
            "{out}"
        );
        let alone = status(&ready, None);
        assert!(alone.contains("admin credential"), "{alone}");
    }

    #[test]
    fn locks_show_expiry_and_time_left_and_a_grant_gone_since() {
        let page: Page = serde_json::from_value(json!({"locks": [
            {"name": "job:1", "shard": "a", "fencingToken": 7, "clientId": "w1",
             "ttlMs": 30000, "acquiredAt": "2026-11-30T03:38:00.000Z"},
            {"name": "job:2", "shard": "b", "fencingToken": 8, "clientId": "w2", "ttlMs": 5000}
        ]}))
        .unwrap();
        let expiries = HashMap::from([
            (
                "job:1".to_string(),
                Some("2026-11-30T03:38:50.000Z".to_string()),
            ),
            ("job:2".to_string(), None),
        ]);
        let out = locks(&page, &expiries, at("2026-11-30T03:38:20.000Z"));
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines[0],
            "NAME    SHARD   TOKEN   CLIENT   TTL   AGE   EXPIRES                    LEFT"
        );
        assert!(
            lines[1].ends_with("30s   20s   2026-11-30T03:38:50.000Z   30s"),
            "{out}"
        );
        assert!(
            lines[2].ends_with("5s    -     -                          gone"),
            "{out}"
        );
    }
}
