//! `lockrouter plan` as users run it: every example in `docs/capacity.md`
//! is the binary's real output (so the document cannot drift from the
//! model), `--json` carries the same numbers for machines, and inputs the
//! model refuses exit 2 naming the flag.

use std::process::{Command, Output};

use serde_json::Value;

fn plan(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lockrouter"))
        .arg("plan")
        .args(args)
        .output()
        .expect("run lockrouter plan")
}

/// `(arguments, printed output)` of each "$ lockrouter plan ..." example
/// in a ```text block of the document.
fn examples(doc: &str) -> Vec<(Vec<String>, String)> {
    let mut out = Vec::new();
    let mut lines = doc.lines();
    while let Some(line) = lines.next() {
        let Some(args) = line.strip_prefix("$ lockrouter plan ") else {
            continue;
        };
        let mut printed = String::new();
        for l in lines.by_ref() {
            if l.starts_with("```") {
                break;
            }
            printed.push_str(l);
            printed.push('\n');
        }
        let args = args.split_whitespace().map(str::to_string).collect();
        out.push((args, printed));
    }
    out
}

#[test]
fn capacity_doc_examples_are_real_output() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/capacity.md"))
        .expect("docs/capacity.md");
    let examples = examples(&doc);
    assert!(!examples.is_empty(), "no `$ lockrouter plan` example found");
    for (args, printed) in examples {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = plan(&args);
        assert!(out.status.success(), "{args:?}: {out:?}");
        let got = String::from_utf8(out.stdout).unwrap();
        assert_eq!(
            got,
            printed,
            "docs/capacity.md shows other output for `lockrouter plan {}`; paste the new output",
            args.join(" ")
        );
    }
}

/// docs/capacity.md's worked example: 1M locks, 10K clients, 10K acquires/s.
const WORKED_EXAMPLE: [&str; 7] = [
    "--locks",
    "1000000",
    "--clients",
    "10000",
    "--acquires-per-sec",
    "10000",
    "--json",
];

#[test]
fn json_output_matches_the_worked_example() {
    let args = WORKED_EXAMPLE;
    let out = plan(&args);
    assert!(out.status.success(), "{out:?}");
    let p: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let shards = p["recommendedShards"].as_u64().unwrap();
    assert_eq!(p["lockrouter"]["shards"].as_u64(), Some(shards));
    let busiest = &p["lockrouter"]["busiestShard"];
    assert!(busiest["utilisation"].as_f64().unwrap() <= 0.6);
    let all = &p["lockrouter"]["allShards"];
    // Renewal keepalives are one per session every other round (20 s):
    // a renewal sends one only once less than half the TTL is left.
    let sessions = all["leases"].as_f64().unwrap();
    let keepalives = all["keepalivesPerSec"].as_f64().unwrap();
    assert!(
        (keepalives - sessions / 20.0).abs() <= 1.0,
        "{keepalives} != {sessions} / 20"
    );
    // Renewals cost barriers (raft writes, at most one per renew-batch:
    // 10K clients every 10 s), no reads; refusals alone read.
    let barriers = all["barrierWritesPerSec"].as_f64().unwrap();
    assert!(
        barriers > 0.0 && barriers <= 1_000.0 * shards as f64,
        "{barriers}"
    );
    assert!(all["raftWritesPerSec"].as_f64().unwrap() >= 20_000.0 + barriers);
    assert_eq!(all["readsPerSec"].as_f64(), Some(0.0));
    assert!(all.get("lockChecksPerSec").is_none(), "renamed");
    // One lease per lock: a keepalive per lock every 10 s, three writes per lock.
    let naive = &p["oneLeasePerLock"]["allShards"];
    assert_eq!(naive["keepalivesPerSec"].as_f64(), Some(100_000.0));
    assert_eq!(naive["raftWritesPerSec"].as_f64(), Some(30_000.0));
    assert!(p["oneLeasePerLock"]["shards"].as_u64().unwrap() > shards);
    assert_eq!(p["workload"]["renewEverySecs"].as_f64(), Some(10.0));

    // Asking for fewer shards than recommended shows less headroom.
    let fewer = (shards - 1).to_string();
    let mut args = args.to_vec();
    args.extend(["--shards", &fewer]);
    let p: Value = serde_json::from_slice(&plan(&args).stdout).unwrap();
    assert!(p["lockrouter"]["growthToTarget"].as_f64().unwrap() < 1.0);
    assert_eq!(p["recommendedShards"].as_u64(), Some(shards));
}

/// The busiest shard's barriers follow the routers' spacing: the worked
/// example's renew-batches always find one in flight, so each replica
/// writes one per spacing (`2 / 0.05 = 40` at the default 50 ms, 100 at
/// 20 ms), and the raft writes move by as many.
#[test]
fn barriers_follow_the_routers_spacing() {
    let busiest = |extra: &[&str]| {
        let mut args = WORKED_EXAMPLE.to_vec();
        args.extend(["--shards", "5"]);
        args.extend(extra);
        let out = plan(&args);
        assert!(out.status.success(), "{out:?}");
        let p: Value = serde_json::from_slice(&out.stdout).unwrap();
        let b = &p["lockrouter"]["busiestShard"];
        let f = |k: &str| b[k].as_f64().unwrap();
        (f("barrierWritesPerSec"), f("raftWritesPerSec"))
    };
    let (default, raft_default) = busiest(&[]);
    let (twenty, raft_twenty) = busiest(&["--barrier-spacing-ms", "20"]);
    assert!((default - 40.0).abs() < 0.5, "{default}");
    assert!((twenty - 100.0).abs() < 0.5, "{twenty}");
    let moved = (raft_twenty - raft_default) - (twenty - default);
    assert!(moved.abs() < 1e-6, "{raft_twenty} - {raft_default}");
}

#[test]
fn refused_acquires_are_reads_not_raft_writes() {
    let base = WORKED_EXAMPLE;
    let calm: Value = serde_json::from_slice(&plan(&base).stdout).unwrap();
    let mut args = base.to_vec();
    args.extend(["--refused-acquires-per-sec", "20000"]);
    let out = plan(&args);
    assert!(out.status.success(), "{out:?}");
    let busy: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(busy["recommendedShards"], calm["recommendedShards"]);
    let (c, b) = (
        &calm["lockrouter"]["allShards"],
        &busy["lockrouter"]["allShards"],
    );
    assert_eq!(b["raftWritesPerSec"], c["raftWritesPerSec"]);
    assert_eq!(b["keepalivesPerSec"], c["keepalivesPerSec"]);
    let reads = b["readsPerSec"].as_f64().unwrap();
    assert!((reads - 20_000.0).abs() < 1e-6, "{reads}");
}

#[test]
fn refused_inputs_exit_2_naming_the_flag() {
    let base = ["--locks", "10", "--clients", "1", "--acquires-per-sec", "1"];
    let refused: [(&[&str], &str); 5] = [
        (&["--ttl-secs", "1"], "--ttl-secs"),
        (&["--renew-every-secs", "60"], "--renew-every-secs"),
        (&["--target-utilisation", "1.5"], "--target-utilisation"),
        (&["--shards", "0"], "--shards"),
        (&["--barrier-spacing-ms=-5"], "--barrier-spacing-ms"),
    ];
    for (extra, flag) in refused {
        let mut args = base.to_vec();
        args.extend(extra);
        let out = plan(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.contains(flag), "{err:?} should name {flag}");
    }
}
