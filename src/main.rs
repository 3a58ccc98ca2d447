//! The `lockrouter` binary: parse arguments (`serve`, `exec`, `plan`,
//! `config check`, the operator's `inspect`, `locks`, `client`, `ring`,
//! `status`, `force-release`, `reload`, `bump-epoch`, and `completions`),
//! load config, set up tracing, run until SIGTERM or SIGINT. Everything
//! else lives in the library.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use lockrouter::cli::ops::{
    Call, BUMP_EPOCH_EXIT_CODES, EXIT_CODES, FORCE_RELEASE_EXIT_CODES, RELOAD_EXIT_CODES,
    STATUS_EXIT_CODES,
};
use lockrouter::cli::output::{Format, OutputArg};
use lockrouter::cli::target::Target;
use lockrouter::http::request_id::NamingRequests;
use lockrouter::{Application, Settings};
use tokio_util::sync::CancellationToken;

/// jemalloc: the allocator's share of the router's CPU falls from 12.5 %
/// to 5.2 %, at the same memory per held lock (docs/benchmarks.md).
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(version, about = "A stateless HTTP lock router over sharded etcd")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log lines as text (for people) or as one JSON object each (for log
    /// pipelines); a request's lines carry its `request_id` either way.
    #[arg(
        long,
        global = true,
        env = "LOCKROUTER_LOG_FORMAT",
        value_enum,
        default_value_t = LogFormat::Text
    )]
    log_format: LogFormat,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the router.
    Serve {
        /// TOML config file; `LOCKROUTER__SECTION__KEY` variables override it.
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Run a command while holding a lock (see docs/client.md).
    #[command(after_help = lockrouter::cli::exec::EXIT_CODES)]
    Exec(lockrouter::cli::exec::ExecArgs),
    /// Size a deployment: shards needed for a workload (see docs/capacity.md).
    Plan(lockrouter::cli::plan::PlanArgs),
    /// Work with a config file without running the router.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Make credentials for `[auth]` (see docs/security.md).
    #[command(subcommand)]
    Auth(AuthCommand),
    /// Who holds a lock: its token, expiry, shard (and, with the admin
    /// token, the holder's clientId).
    #[command(after_help = EXIT_CODES)]
    Inspect {
        /// The lock's name.
        name: String,
        #[command(flatten)]
        output: OutputArg,
        #[command(flatten)]
        target: Target,
    },
    /// Take a lock from its holder (admin): the next grant gets a larger
    /// token and the holder's renewals fail.
    #[command(after_help = FORCE_RELEASE_EXIT_CODES)]
    ForceRelease {
        /// The lock's name.
        name: String,
        /// Why, for the router's log.
        #[arg(long)]
        reason: String,
        /// Release only the grant with this fencing token (the one
        /// `inspect` showed): a worker that took the name since keeps it.
        #[arg(long, value_name = "FENCING_TOKEN")]
        if_token: Option<u64>,
        #[command(flatten)]
        target: Target,
    },
    /// The locks held across every shard whose names start with a prefix
    /// (admin), a page at a time (`--all`: every page). A table shows each
    /// lock's expiry and time left (one inspect per lock); JSON is the
    /// router's page, and with `--all` one lock a line.
    #[command(after_help = EXIT_CODES)]
    Locks {
        /// Only names starting with this.
        #[arg(long, default_value = "")]
        prefix: String,
        /// Locks per page (1 to 1000).
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// Where to go on: a `nextCursor` from a page before.
        #[arg(long)]
        cursor: Option<String>,
        /// Every page, following the cursors.
        #[arg(long)]
        all: bool,
        #[command(flatten)]
        output: OutputArg,
        #[command(flatten)]
        target: Target,
    },
    /// What a client holds: its locks and the session leases they ride on
    /// (admin).
    #[command(after_help = EXIT_CODES)]
    Client {
        /// The clientId.
        client_id: String,
        /// The principal it belongs to, when the router has principals.
        #[arg(long)]
        principal: Option<String>,
        #[command(flatten)]
        output: OutputArg,
        #[command(flatten)]
        target: Target,
    },
    /// The router's ring, shards and any open migration (admin).
    #[command(after_help = EXIT_CODES)]
    Ring {
        #[command(flatten)]
        output: OutputArg,
        #[command(flatten)]
        target: Target,
    },
    /// This replica at a glance: its version, whether it is ready, every
    /// shard's state, the ring and any migration (`/readyz`, and the ring
    /// with the admin credential).
    #[command(after_help = STATUS_EXIT_CODES)]
    Status {
        #[command(flatten)]
        output: OutputArg,
        #[command(flatten)]
        target: Target,
    },
    /// Make the router read its config file again (admin).
    #[command(after_help = RELOAD_EXIT_CODES)]
    Reload {
        #[command(flatten)]
        target: Target,
    },
    /// Record the next ring epoch on every shard (admin), so that every
    /// later token exceeds every earlier one: after a shard was restored
    /// from a snapshot, copied or wiped (see docs/operations.md).
    #[command(after_help = BUMP_EPOCH_EXIT_CODES)]
    BumpEpoch {
        /// A shard that records nothing (lost its data) to initialise;
        /// repeat it or separate names with commas.
        #[arg(long, value_name = "SHARD", value_delimiter = ',')]
        reinitialize: Vec<String>,
        /// The lowest epoch to record, when every shard lost its data
        /// (the highest fencing token your resources saw, `token >> 47`,
        /// plus one).
        #[arg(long, value_name = "EPOCH")]
        min_epoch: Option<u64>,
        #[command(flatten)]
        target: Target,
    },
    /// Print a shell completion script: `lockrouter completions bash >
    /// /etc/bash_completion.d/lockrouter`.
    Completions { shell: clap_complete::Shell },
}

#[derive(Subcommand)]
enum AuthCommand {
    /// A new random bearer token for a principal: the token (give it to
    /// the principal's workers) and its SHA-256 (the principal's
    /// `token_sha256`; the config never holds the token itself).
    NewToken,
    /// A new random lockId key (base64 of 32 bytes), for a
    /// `[[auth.lock_id_keys]]` entry's `secret` or `secret_file`.
    NewKey,
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Check a config file (and `LOCKROUTER__SECTION__KEY` overrides) as
    /// `serve` would, and print the ring it places names on.
    Check {
        #[arg(long, short)]
        config: PathBuf,
        /// `json`, the only format: one JSON document on stdout, the
        /// summary on stderr.
        #[arg(long, short = 'o', value_enum, value_name = "FORMAT", default_value_t = CheckFormat::Json)]
        output: CheckFormat,
    },
}

/// What `config check` prints on stdout.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CheckFormat {
    Json,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        // A log line that cannot be written (stderr closed: a log pipe that
        // died) is dropped. Reporting it would print to the same stderr,
        // which panics, and a panicking signal task would leave the router
        // deaf to SIGTERM.
        .log_internal_errors(false);
    // Every line logged while serving a request names it (its id, op,
    // shard, outcome): a `request{..}` prefix in text, `span` in JSON.
    let format = tracing_subscriber::fmt::format();
    match cli.log_format {
        LogFormat::Text => {
            let ansi = std::io::stderr().is_terminal();
            logs.with_ansi(ansi)
                .event_format(NamingRequests::text(format.with_ansi(ansi)))
                .init()
        }
        LogFormat::Json => logs
            .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
            .event_format(NamingRequests::json(
                format.json().with_current_span(true).with_span_list(false),
            ))
            .init(),
    }
    match cli.command {
        Command::Serve { config } => serve(config),
        Command::Exec(args) => ExitCode::from(lockrouter::cli::exec::main(args)),
        Command::Plan(args) => ExitCode::from(lockrouter::cli::plan::run(&args)),
        Command::Config(ConfigCommand::Check { config, .. }) => check(&config),
        Command::Auth(AuthCommand::NewToken) => {
            let (token, hash) = lockrouter::auth::new_token();
            println!("token = {token}\ntoken_sha256 = [\"{hash}\"]");
            ExitCode::SUCCESS
        }
        Command::Auth(AuthCommand::NewKey) => {
            println!("{}", lockrouter::auth::new_key());
            ExitCode::SUCCESS
        }
        Command::Inspect {
            name,
            output,
            target,
        } => ops(&target, Call::Inspect { name }, output.format()),
        Command::ForceRelease {
            name,
            reason,
            if_token,
            target,
        } => ops(
            &target,
            Call::ForceRelease {
                name,
                reason,
                if_token,
            },
            Format::Json,
        ),
        Command::Locks {
            prefix,
            limit,
            cursor,
            all,
            output,
            target,
        } => ops(
            &target,
            Call::Locks {
                prefix,
                limit,
                cursor,
                all,
            },
            output.format(),
        ),
        Command::Client {
            client_id,
            principal,
            output,
            target,
        } => ops(
            &target,
            Call::Client {
                client_id,
                principal,
            },
            output.format(),
        ),
        Command::Ring { output, target } => ops(&target, Call::Ring, output.format()),
        Command::Status { output, target } => ops(&target, Call::Status, output.format()),
        Command::Reload { target } => ops(&target, Call::Reload, Format::Json),
        Command::BumpEpoch {
            reinitialize,
            min_epoch,
            target,
        } => ops(
            &target,
            Call::BumpEpoch {
                reinitialize,
                min_epoch,
            },
            Format::Json,
        ),
        Command::Completions { shell } => {
            use clap::CommandFactory;
            let mut cmd = Cli::command();
            clap_complete::generate(shell, &mut cmd, "lockrouter", &mut std::io::stdout());
            ExitCode::SUCCESS
        }
    }
}

fn ops(target: &Target, call: Call, format: Format) -> ExitCode {
    ExitCode::from(lockrouter::cli::ops::run(target, &call, format))
}

/// `config check`: exit 0 and the effective settings (every key, defaults
/// and `LOCKROUTER__SECTION__KEY` overrides applied, secrets masked) as
/// one JSON document on stdout, for `jq`, with a summary for people on
/// stderr; or 2 and the problem on stderr.
fn check(path: &std::path::Path) -> ExitCode {
    match Settings::load(path) {
        Ok(s) => {
            let ring = lockrouter::ring::Ring::new(&s.shards, s.ring.vnodes);
            let names: Vec<&str> = s.shards.iter().map(|x| x.name.as_str()).collect();
            eprintln!(
                "{}: valid; shards: {}; ring {}",
                path.display(),
                names.join(", "),
                ring.fingerprint()
            );
            // Secrets serialise as "***".
            println!(
                "{}",
                serde_json::to_string_pretty(&s).expect("settings serialise")
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("lockrouter: {e}");
            ExitCode::from(2)
        }
    }
}

fn serve(path: PathBuf) -> ExitCode {
    let settings = match Settings::load(&path) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("lockrouter: {e}");
            return ExitCode::from(2);
        }
    };
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    if settings.server.worker_threads > 0 {
        runtime.worker_threads(settings.server.worker_threads);
    }
    let runtime = match runtime.build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lockrouter: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let shards = settings.shards.len();
        let app = match Application::build_from(settings, Some(path)).await {
            Ok(app) => app,
            Err(e) => {
                eprintln!("lockrouter: {e}");
                return ExitCode::FAILURE;
            }
        };
        let shutdown = CancellationToken::new();
        tokio::spawn(wait_for_signal(shutdown.clone()));
        tracing::info!(listen = %app.local_addr(), metrics = ?app.metrics_addr(), shards, "lockrouter ready");
        app.run(shutdown).await;
        tracing::info!("lockrouter stopped");
        ExitCode::SUCCESS
    })
}

/// Cancels `shutdown` on the first SIGTERM or SIGINT.
async fn wait_for_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let signal = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = tokio::signal::ctrl_c() => "SIGINT",
    };
    // First: nothing after this may keep the router from draining.
    shutdown.cancel();
    tracing::info!("{signal}: draining");
}
