//! `lockrouter-keepalive-streams`: what one LeaseKeepAlive stream carries
//! on a three-member etcd cluster, and what more streams buy
//! (`etcd.keepalive_streams`, docs/capacity.md).
//!
//! etcd answers a stream's keepalives one after the other; 3.4.31 and
//! 3.5.13 on first make each wait for a check that its member still leads
//! (a ReadIndex round to a quorum). This starts a cluster of three members
//! of the etcd the kit runs (`LOCKROUTER_ETCD_BIN`, else the system's),
//! grants `--leases` leases, and for each stream count keeps the streams
//! busy for `--seconds`: each stream sends bursts of `--burst` keepalives
//! (one HTTP/2 frame, as the router's writer does) and sends the next
//! burst once the last one is answered. It prints, per stream count, the
//! keepalives answered per second, the time from a burst's send to its
//! last answer, and the CPU of the three members per keepalive, as a
//! Markdown table. Every process it starts is on loopback and stops with
//! it.

use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use clap::Parser;
use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper};
use lockrouter_testkit::etcd::{etcd_release, EtcdCluster};
use lockrouter_testkit::procfs::cpu_seconds;

#[derive(Parser)]
#[command(about = "What one LeaseKeepAlive stream carries, and what more streams buy")]
struct Cli {
    /// Stream counts to measure, in turn.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    streams: Vec<usize>,
    /// Leases kept alive (spread over the streams).
    #[arg(long, default_value_t = 4_000)]
    leases: usize,
    /// Keepalives per burst on a stream.
    #[arg(long, default_value_t = 50)]
    burst: usize,
    /// Seconds each stream count runs.
    #[arg(long, default_value_t = 8)]
    seconds: u64,
    /// Rounds over the stream counts (the figures of each are printed).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Send to a follower instead of the leader (which forwards each
    /// keepalive to the leader).
    #[arg(long)]
    follower: bool,
}

/// etcd's own raft timings, as the load suite runs them.
const ETCD_FLAGS: &[&str] = &[
    "--heartbeat-interval",
    "100",
    "--election-timeout",
    "1000",
    "--pre-vote",
];

struct Figures {
    per_second: f64,
    burst_p50: Duration,
    burst_p99: Duration,
    etcd_us_per_keepalive: f64,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(run(&cli))
}

async fn run(cli: &Cli) -> Result<()> {
    let (_, release) = etcd_release().map_err(|e| anyhow!("{e}"))?;
    let mut builder = EtcdCluster::builder(3).args(ETCD_FLAGS).die_with_parent();
    for (k, v) in [("GOGC", "400"), ("GOMEMLIMIT", "4GiB")] {
        builder = builder.env(k, v);
    }
    let etcd = builder.start().map_err(|e| anyhow!("{e}"))?;
    let leader = etcd.leader().await.context("no leader")?;
    let member = if cli.follower {
        (leader + 1) % 3
    } else {
        leader
    };
    let endpoint = etcd.endpoints()[member].clone();
    let mut client = Client::connect([endpoint], None).await?;
    let mut leases = Vec::with_capacity(cli.leases);
    for _ in 0..cli.leases {
        leases.push(client.lease_grant(600, None).await?.id());
    }
    let pids: Vec<u32> = (0..3).filter_map(|i| etcd.pid(i)).collect();
    let to = if cli.follower {
        "a follower"
    } else {
        "the leader"
    };
    println!(
        "{release}, 3 members, {} leases, bursts of {}, {} s per count, sent to {to}\n",
        cli.leases, cli.burst, cli.seconds
    );
    println!("| round | streams | keepalives/s | burst answered, p50 / p99 | etcd CPU µs per keepalive (3 members) |");
    println!("|---|---|---|---|---|");
    for round in 1..=cli.rounds {
        for &streams in &cli.streams {
            let f = measure(&client, &leases, streams, cli, &pids).await?;
            println!(
                "| {round} | {streams} | {:.0} | {:.2} / {:.2} ms | {:.1} |",
                f.per_second,
                f.burst_p50.as_secs_f64() * 1e3,
                f.burst_p99.as_secs_f64() * 1e3,
                f.etcd_us_per_keepalive
            );
        }
    }
    Ok(())
}

async fn measure(
    client: &Client,
    leases: &[i64],
    streams: usize,
    cli: &Cli,
    pids: &[u32],
) -> Result<Figures> {
    let cpu = || pids.iter().filter_map(|&p| cpu_seconds(p)).sum::<f64>();
    let mut opened = Vec::with_capacity(streams);
    for &first in &leases[..streams] {
        opened.push(client.lease_client().keep_alive(first).await?);
    }
    let (cpu_before, started) = (cpu(), Instant::now());
    let stop = started + Duration::from_secs(cli.seconds);
    let tasks: Vec<_> = opened
        .into_iter()
        .enumerate()
        .map(|(s, (keeper, stream))| {
            let mine: Vec<i64> = leases.iter().skip(s).step_by(streams).copied().collect();
            tokio::spawn(pump(keeper, stream, mine, cli.burst, stop))
        })
        .collect();
    let mut answered = 0usize;
    let mut bursts = Vec::new();
    for t in tasks {
        let (n, b) = t.await??;
        answered += n;
        bursts.extend(b);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let etcd_cpu = cpu() - cpu_before;
    bursts.sort();
    let at = |q: f64| bursts[((bursts.len() - 1) as f64 * q) as usize];
    Ok(Figures {
        per_second: answered as f64 / elapsed,
        burst_p50: at(0.5),
        burst_p99: at(0.99),
        etcd_us_per_keepalive: etcd_cpu * 1e6 / answered.max(1) as f64,
    })
}

/// Keeps one stream busy until `stop`: a burst of keepalives, then the
/// next once every one of it is answered. Returns the keepalives answered
/// and each burst's time to its last answer.
async fn pump(
    mut keeper: LeaseKeeper,
    mut stream: LeaseKeepAliveStream,
    leases: Vec<i64>,
    burst: usize,
    stop: Instant,
) -> Result<(usize, Vec<Duration>)> {
    let (mut answered, mut times) = (0, Vec::new());
    let mut next = leases.iter().cycle();
    while Instant::now() < stop {
        let sent = Instant::now();
        for _ in 0..burst {
            keeper.id = *next.next().expect("cycle");
            keeper.keep_alive().await?;
        }
        for _ in 0..burst {
            let answer = stream.message().await?.context("stream closed")?;
            if answer.ttl() <= 0 {
                return Err(anyhow!("lease {} gone", answer.id()));
            }
        }
        answered += burst;
        times.push(sent.elapsed());
    }
    Ok((answered, times))
}
