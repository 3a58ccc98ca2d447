//! Running one goose attack the way every scenario here needs it: the
//! configuration set in code (this binary has its own command line), no
//! telnet controller, no gzip, metrics not reset after the ramp (the
//! accounting window covers the whole attack), an HTML report per attack,
//! and an upper bound on its run time so nothing runs unbounded.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{anyhow, Result};
use goose::config::GooseConfiguration;
use goose::prelude::*;

/// How to run one attack.
pub struct Plan {
    pub host: String,
    pub users: usize,
    /// Seconds the attack runs once its users have started; the hold
    /// scenarios stop earlier through goose's killswitch.
    pub run_time_s: usize,
    /// Requests per second for the whole attack (goose's throttle); None: as
    /// fast as the users go.
    pub throttle: Option<usize>,
    /// goose's HTML report (None: no report).
    pub report: Option<PathBuf>,
}

/// Runs `scenarios` under `plan`; returns goose's metrics.
pub async fn run(plan: &Plan, scenarios: Vec<Scenario>) -> Result<GooseMetrics> {
    goose::reset_killswitch();
    let mut attack = GooseAttack::initialize_with_config(GooseConfiguration::default())
        .map_err(|e| anyhow!("goose: {e}"))?;
    for s in scenarios {
        attack = attack.register_scenario(s.register_transaction(client_setup()));
    }
    let g = |e: GooseError| anyhow!("goose: {e}");
    let mut attack = *attack
        .set_default(GooseDefault::Host, plan.host.as_str())
        .map_err(g)?
        .set_default(GooseDefault::Users, plan.users)
        .map_err(g)?
        // Every user at once: the scenarios ramp their own load.
        .set_default(GooseDefault::IncreaseRate, plan.users.to_string().as_str())
        .map_err(g)?
        .set_default(GooseDefault::RunTime, plan.run_time_s)
        .map_err(g)?
        .set_default(GooseDefault::NoResetMetrics, true)
        .map_err(g)?
        .set_default(GooseDefault::NoTelnet, true)
        .map_err(g)?
        .set_default(GooseDefault::NoGzip, true)
        .map_err(g)?
        .set_default(GooseDefault::NoPrintMetrics, true)
        .map_err(g)?
        .set_default(GooseDefault::Quiet, 1)
        .map_err(g)?;
    if let Some(report) = &plan.report {
        attack = *attack
            .set_default(GooseDefault::ReportFile, report.to_string_lossy().as_ref())
            .map_err(g)?;
    }
    if let Some(rps) = plan.throttle {
        // No coordinated-omission mitigation: nothing is back-filled, in
        // goose's reports or ours (see `stats`).
        attack = *attack
            .set_default(GooseDefault::ThrottleRequests, rps)
            .map_err(g)?;
    }
    attack.execute().await.map_err(g)
}

/// Gives each user goose's HTTP client with one change: a connection idle
/// for 5 s leaves the pool. The router closes a keep-alive connection idle
/// for `server.header_read_timeout_ms` (10 s by default), and a holder
/// renews every TTL/3, 10 s for a 30 s TTL: with reqwest's 90 s pool, some
/// renewals went out on a connection the router was closing and were
/// counted as errors. The SDKs keep idle connections 5 s for that reason.
fn client_setup() -> Transaction {
    let setup: TransactionFunction = Arc::new(|user| {
        Box::pin(async move {
            let builder = reqwest::Client::builder()
                .user_agent("lockrouter-loadtest")
                .timeout(std::time::Duration::from_secs(60))
                .pool_idle_timeout(std::time::Duration::from_secs(5));
            user.set_client_builder(builder).await?;
            Ok(())
        })
    });
    Transaction::new(setup)
        .set_name("client setup")
        .set_on_start()
}

/// Requests goose counted as failed (non-2xx, transport errors), and
/// transactions that returned an error.
pub fn goose_failures(m: &GooseMetrics) -> u64 {
    let requests: usize = m.requests.values().map(|r| r.fail_count).sum();
    let transactions: usize = m.transactions.iter().flatten().map(|t| t.fail_count).sum();
    (requests + transactions) as u64
}

/// A goose transaction from an async closure over shared state `ctx`.
pub fn transaction<C, F>(name: &str, ctx: &Arc<C>, f: F) -> Transaction
where
    C: Send + Sync + 'static,
    F: for<'r> Fn(&'r mut GooseUser, Arc<C>) -> futures_like::BoxFuture<'r> + Send + Sync + 'static,
{
    let ctx = ctx.clone();
    let func: TransactionFunction = Arc::new(move |user| f(user, ctx.clone()));
    Transaction::new(func).set_name(name)
}

/// The future type goose transactions return.
pub mod futures_like {
    use std::future::Future;
    use std::pin::Pin;

    pub type BoxFuture<'r> =
        Pin<Box<dyn Future<Output = goose::goose::TransactionResult> + Send + 'r>>;
}
