//! lockrouter: a stateless HTTP lock router in front of several independent
//! etcd clusters. A lock is a lease with a monotonic fencing token.
//!
//! # Layout
//!
//! Ten layers, each importing only from the layers below it. Bottom to
//! top: `config`, `task` and `refusal`; `metrics`; `token` and `http::tls`
//! (the HTTP server's TLS, which the generation builds from below `http`);
//! `auth` and `shard`; `placement`; `locks` and `cli`; `generation`;
//! `reload`; `http`; `app`.
//! `layout.rs` holds these ranks and tests that keep them, and that this
//! list names every file.
//!
//! ```text
//! src/
//!   main.rs     the binary: serve | exec | plan | config check | the
//!               operator's commands (inspect, locks, status, ...)
//!   app.rs      Application: bind the listeners, connect, serve until shutdown
//!   reload.rs   Reloader: apply a changed config file while serving
//!   generation.rs  Generation: what a config makes, built in one place for
//!               start and reload, and the one in force
//!   http/       routes, body, answers, api, admin, admission, caller, error,
//!               failure_log, request_id, state, ui; tls (the main
//!               listener's certificates, rustls, swapped on reload)
//!   locks/      acquire, wait, limit, quota, renew, extend, release, inspect,
//!               force, listing, validate; decisions (their unit tests)
//!   placement/  ring, topology, migration, monitor
//!   shard/      conn, wire, access, login, keys, name, txn, leases, renewal, queue,
//!               commit, cutoff, records, scan, pages, cache, sessions, spares,
//!               recycle, keepalive, verify, pressure; ops (the trait the lock layer's
//!               decisions use), fake (the unit tests' in-memory shard)
//!   token/      fencing, lock_id, lease_tag
//!   auth/       principals: who is calling and what it may do; peer
//!               (a client certificate's identities), keygen (new
//!               tokens and keys)
//!   cli/        exec, plan, capacity, ops, conn, output, views, target
//!   config/     settings by section (server, etcd, limits, admin, auth,
//!               locks, shards), each with its durations and validation;
//!               secret (never shown), validate, and keys: every key they
//!               accept (leaf)
//!   metrics.rs  Prometheus series (leaf)
//!   task.rs     background tasks that end with their owner, and the
//!               deadline and names of the request a task serves (leaf)
//!   refusal.rs  refusals more than one layer gives: Denied (403) and
//!               RateLimited (429) (leaf)
//! ```
//!
//! - [`app`]: building and running a router ([`Application`]), and
//!   [`reload`]: applying a changed config file while it runs; both build
//!   what a config makes (TLS, principals, deadlines, the access log's
//!   switch, the router and the lock service's settings) with
//!   [`generation`], one function for both.
//! - [`http`]: the v1 HTTP API: the route table, request bodies, typed
//!   answers, the one place errors become responses, and the main
//!   listener's TLS.
//! - [`locks`]: the lock operations: acquire (plain and waiting), renew,
//!   release, inspect, lock-delays of lost holders, input validation; the
//!   policy over the shard's lock-level calls, naming no field of a shard.
//! - [`placement`]: which shard owns a name: the ring, the router over its
//!   shards (topology), the migration protocol that changes the shard set,
//!   and the monitor that follows what the shards record.
//! - [`shard`]: one etcd cluster: its connection, key layout, every etcd
//!   transaction, the queues of waiting acquires, session leases,
//!   keepalives and batched verification, offered to the layers above as
//!   lock-level calls on a `Shard` whose fields are private.
//!
//! Leaf modules, used by any layer: [`config`] (settings), [`token`]
//! (fencing-token and lockId formats), [`metrics`] (Prometheus series),
//! [`task`] (background tasks that end with their owner, and a request's
//! deadline), [`refusal`] (the refusals both the principals' checks and
//! the lock operations give, mapped once to their HTTP answers); [`auth`]
//! (principals, by token or client certificate, and the names each may
//! lock) sits beside the shard layer.
//! [`cli`] holds the other subcommands: `exec` and `plan`, which use only
//! the client crate and the capacity model, and the operator's commands,
//! which call a router's API and print its answers as tables, JSON or YAML.

// The layout above links the layers, some crate-private: their docs are
// built with `--document-private-items` (as `make test` does).
#![allow(rustdoc::private_intra_doc_links)]

pub mod app;
pub mod auth;
pub mod cli;
pub mod config;
pub(crate) mod generation;
pub mod http;
pub(crate) mod locks;
pub mod metrics;
pub(crate) mod placement;
pub mod refusal;
pub mod reload;
pub(crate) mod shard;
pub mod task;
pub mod token;

pub use app::{Application, StartError};
pub use config::Settings;
/// Placement of names on shards.
pub use placement::ring;
/// etcd releases with known bugs.
pub use shard::conn::{release_risk, Risk};
/// The data layout on a shard (keys and the records stored in them), for
/// tools and tests that read or repair what lockrouter stores.
pub use shard::keys;

#[cfg(test)]
mod layout;
