//! `lockrouter plan`: the command line of the capacity model
//! ([`capacity`](super::capacity)): its flags, and the plan printed as a
//! table or as JSON.

use std::fmt::Write as _;

use super::capacity::{calibration, plan, Plan, Renewal, ShardLoad, Workload};

/// How clients renew their locks (`--renewal`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RenewalArg {
    /// One `renew-batch` per client per interval: one keepalive per session.
    Batch,
    /// One `renew` per lock, spread over the interval.
    Each,
}

/// The workload and limits to plan for (the `plan` subcommand's arguments).
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// Locks held at the same moment, over all shards.
    #[arg(long)]
    pub locks: f64,
    /// Distinct clientIds holding them.
    #[arg(long)]
    pub clients: f64,
    /// Granted acquires per second (each lock is later released).
    #[arg(long)]
    pub acquires_per_sec: f64,
    /// Acquire attempts per second answered `acquired: false` (contention).
    #[arg(long, default_value_t = 0.0)]
    pub refused_acquires_per_sec: f64,
    /// Lock TTL in seconds.
    #[arg(long, default_value_t = 30.0)]
    pub ttl_secs: f64,
    /// Seconds between renewals of a lock [default: TTL / 3].
    #[arg(long)]
    pub renew_every_secs: Option<f64>,
    /// How clients renew.
    #[arg(long, value_enum, default_value_t = RenewalArg::Batch)]
    pub renewal: RenewalArg,
    /// Evaluate this many shards [default: the recommended number].
    #[arg(long)]
    pub shards: Option<u32>,
    /// Router replicas a client's acquires are spread over (each grants
    /// its own session leases).
    #[arg(long, default_value_t = 2)]
    pub router_replicas: u32,
    /// Distinct TTLs one client uses (one session lease per TTL).
    #[arg(long, default_value_t = 1)]
    pub ttls_per_client: u32,
    /// How long a clientId lives; each ends with a session revoke per shard.
    #[arg(long, default_value_t = 3_600.0)]
    pub client_lifetime_secs: f64,
    /// The routers' `etcd.keepalive_coalesce_ms`.
    #[arg(long, default_value_t = 1_000.0)]
    pub coalesce_ms: f64,
    /// The routers' `etcd.keepalive_below_pct`.
    #[arg(long, default_value_t = 50.0)]
    pub keepalive_below_pct: f64,
    /// How long one lock-key cache barrier (a one-key `Put`) takes from
    /// send to answer, in milliseconds.
    #[arg(long, default_value_t = 5.0)]
    pub barrier_latency_ms: f64,
    /// The routers' `etcd.barrier_spacing_ms` (the router's default unless
    /// given).
    #[arg(long, default_value_t = crate::config::EtcdSettings::default().barrier_spacing_ms as f64)]
    pub barrier_spacing_ms: f64,
    /// The routers' `ring.vnodes`.
    #[arg(long, default_value_t = 160)]
    pub vnodes: u32,
    /// Raft writes/s one shard sustains.
    #[arg(long, default_value_t = calibration::RAFT_WRITES_PER_SEC)]
    pub max_raft_writes_per_sec: f64,
    /// Keepalives/s one shard's leader sustains.
    #[arg(long, default_value_t = calibration::KEEPALIVES_PER_SEC)]
    pub max_keepalives_per_sec: f64,
    /// Share of a shard's capacity the busiest shard may use.
    #[arg(long, default_value_t = 0.6)]
    pub target_utilisation: f64,
    /// etcd's `--quota-backend-bytes`.
    #[arg(long, default_value_t = calibration::QUOTA_BYTES)]
    pub quota_bytes: f64,
    /// etcd's periodic `--auto-compaction-retention`, in seconds.
    #[arg(long, default_value_t = 300.0)]
    pub compaction_retention_secs: f64,
    /// Print JSON instead of a table (as `-o json`).
    #[arg(long, conflicts_with = "output")]
    pub json: bool,
    /// `table` (the default, wherever stdout goes) or `json` (one JSON
    /// document on stdout, nothing else).
    #[arg(long, short = 'o', value_enum, value_name = "FORMAT")]
    pub output: Option<PlanFormat>,
}

/// What `plan` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PlanFormat {
    Table,
    Json,
}

impl From<&PlanArgs> for Workload {
    fn from(a: &PlanArgs) -> Self {
        Workload {
            locks: a.locks,
            clients: a.clients,
            acquires_per_sec: a.acquires_per_sec,
            refused_acquires_per_sec: a.refused_acquires_per_sec,
            ttl_secs: a.ttl_secs,
            renew_every_secs: a.renew_every_secs,
            shards: a.shards,
            router_replicas: a.router_replicas,
            ttls_per_client: a.ttls_per_client,
            client_lifetime_secs: a.client_lifetime_secs,
            coalesce_ms: a.coalesce_ms,
            keepalive_below_pct: a.keepalive_below_pct,
            barrier_latency_ms: a.barrier_latency_ms,
            barrier_spacing_ms: a.barrier_spacing_ms,
            vnodes: a.vnodes,
            max_raft_writes_per_sec: a.max_raft_writes_per_sec,
            max_keepalives_per_sec: a.max_keepalives_per_sec,
            target_utilisation: a.target_utilisation,
            quota_bytes: a.quota_bytes,
            compaction_retention_secs: a.compaction_retention_secs,
            renewal: match a.renewal {
                RenewalArg::Batch => Renewal::Batch,
                RenewalArg::Each => Renewal::Each,
            },
        }
    }
}

/// The `plan` subcommand: prints the plan (a table, or JSON with `--json`)
/// and returns the process exit code (2 for inputs the model refuses).
pub fn run(args: &PlanArgs) -> u8 {
    match plan(&Workload::from(args)) {
        Ok(p) if args.json || args.output == Some(PlanFormat::Json) => {
            println!(
                "{}",
                serde_json::to_string_pretty(&p).expect("a plan serialises")
            );
            0
        }
        Ok(p) => {
            print!("{}", render(&p));
            0
        }
        Err(e) => {
            eprintln!("lockrouter plan: {e}");
            2
        }
    }
}

/// The plan as a table for people.
pub fn render(p: &Plan) -> String {
    let w = &p.workload;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "workload: {} locks held by {} clients through {} router replica(s); \
         {} acquires/s (+{} refused); TTL {} s, renewed every {} s ({})",
        num(w.locks),
        num(w.clients),
        w.router_replicas,
        num(w.acquires_per_sec),
        num(w.refused_acquires_per_sec),
        num(w.ttl_secs),
        num(w.renew_every()),
        match w.renewal {
            Renewal::Batch => "renew-batch",
            Renewal::Each => "one renew per lock",
        }
    );
    let _ = writeln!(
        out,
        "limits per shard: {} raft writes/s, {} keepalives/s, {} backend quota, \
         {} ms per barrier write, at least {} ms apart; target utilisation {:.0}%",
        num(w.max_raft_writes_per_sec),
        num(w.max_keepalives_per_sec),
        bytes(w.quota_bytes),
        w.barrier_latency_ms,
        w.barrier_spacing_ms,
        w.target_utilisation * 100.0
    );
    let _ = writeln!(out, "calibration: {}", p.calibration_source);
    let _ = writeln!(
        out,
        "\nrecommended: {} shard(s); one lease per lock would need {}\n",
        p.recommended_shards, p.one_lease_per_lock.shards
    );
    let (l, n) = (&p.lockrouter, &p.one_lease_per_lock);
    let _ = writeln!(
        out,
        "{:<32}{:>14}{:>14}{:>20}",
        format!("lockrouter on {} shard(s)", l.shards),
        "busiest shard",
        "all shards",
        format!("1 lease/lock ({})", n.shards)
    );
    type Row = (&'static str, fn(&ShardLoad) -> String);
    let rows: [Row; 9] = [
        ("lock keys", |s| num(s.locks)),
        ("leases", |s| num(s.leases)),
        ("raft writes/s", |s| num(s.raft_writes_per_sec)),
        ("  of which renewal barriers", |s| {
            num(s.barrier_writes_per_sec)
        }),
        ("keepalives/s", |s| num(s.keepalives_per_sec)),
        ("reads/s (refused acquires)", |s| num(s.reads_per_sec)),
        ("utilisation (100% = 1 shard)", |s| {
            format!("{:.0}%", s.utilisation * 100.0)
        }),
        ("etcd db size", |s| bytes(s.db_bytes)),
        ("etcd memory (RSS)", |s| bytes(s.memory_bytes)),
    ];
    for (label, f) in rows {
        let _ = writeln!(
            out,
            "{label:<32}{:>14}{:>14}{:>20}",
            f(&l.busiest_shard),
            f(&l.all_shards),
            f(&n.all_shards)
        );
    }
    let _ = writeln!(
        out,
        "\nbusiest shard holds {:.2}x the mean share of names (ring of {} vnodes per shard)",
        l.imbalance, w.vnodes
    );
    let _ = writeln!(
        out,
        "headroom: the workload can grow {:.2}x before the busiest shard reaches the target, \
         {:.2}x before it saturates",
        l.growth_to_target, l.growth_to_saturation
    );
    // With few locks held and many clients, the sessions their acquires
    // alone keep alive can need more keepalives than one lease per lock's
    // renewals: then coalescing costs keepalives instead of saving them.
    let versus = |saving: f64, what: &str, digits: usize| {
        if saving >= 1.0 {
            ("saves", format!("{saving:.digits$}x {what}"))
        } else if saving > 0.0 {
            ("costs", format!("{:.digits$}x the {what}", 1.0 / saving))
        } else {
            (
                "costs",
                format!("{what} that one lease per lock does not need"),
            )
        }
    };
    let (k_verb, keepalives) = versus(p.keepalive_saving, "keepalives/s", 1);
    let (w_verb, writes) = versus(p.raft_write_saving, "raft writes/s", 2);
    // One verb for both when they share it ("saves A and B").
    let writes = if k_verb == w_verb {
        writes
    } else {
        format!("{w_verb} {writes}")
    };
    let _ = writeln!(
        out,
        "coalescing {k_verb} {keepalives} and {writes} against one lease per lock"
    );
    out
}

/// A number rounded to an integer, with thousands separators.
fn num(v: f64) -> String {
    let digits = format!("{:.0}", v.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if v < -0.5 {
        out.insert(0, '-');
    }
    out
}

fn bytes(v: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = v;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_well() {
        assert_eq!(num(1_234_567.4), "1,234,567");
        assert_eq!(num(12.0), "12");
        assert_eq!(bytes(2_147_483_648.0), "2.0 GiB");
    }
}
