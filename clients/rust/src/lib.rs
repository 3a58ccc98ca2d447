//! Client for lockrouter, the HTTP lock router over sharded etcd.
//!
//! A lock from lockrouter is a lease with a fencing token. This crate holds
//! such leases for you: it renews every lock of a [`Client`] in the
//! background with one batched request per interval, judges each lock's
//! validity with this process's own monotonic clock (never the router's
//! wall-clock `expiresAt`), and tells your code the moment a lock can no
//! longer be trusted ([`Lock::lost`]). The fencing token
//! ([`Lock::fencing_token`]) is what makes the lock safe: send it with every
//! write and let the resource reject stale ones ([`fencing`]).
//!
//! ```no_run
//! # async fn demo() -> Result<(), lockrouter_client::Error> {
//! use std::time::Duration;
//! use lockrouter_client::Client;
//!
//! let client = Client::new("http://127.0.0.1:8080", None)?;
//! let done = client
//!     .with_lock("process_order:42", Duration::from_secs(30), |lock| async move {
//!         // Every write carries lock.fencing_token(); the database rejects
//!         // it if a newer holder has written since.
//!         lock.fencing_token()
//!     })
//!     .await;
//! match done {
//!     Ok(token) => println!("done under token {token}"),
//!     Err(lockrouter_client::Error::NotAcquired { .. }) => println!("someone else is on it"),
//!     Err(e) => eprintln!("{e}"),
//! }
//! # Ok(()) }
//! ```
//!
//! # Layout
//!
//! One file per concept, in layers, top to bottom. A file imports only from
//! the layers below it, never from beside or above, so no two files import
//! each other (the router crate's `layout.rs` tests keep it so).
//!
//! - `client`: [`Client`] and [`ClientBuilder`]: the client id, acquiring
//!   (at once or waiting), [`Client::with_lock`].
//! - `lock`: [`Lock`], [`LockHandle`]: a held lock, its validity and lost
//!   signal.
//! - `keeper`: what a client's locks need of it (transport, request
//!   timeout, renewal channel, registry, holds); each `Lock` holds it
//!   instead of its `Client`.
//! - `renewal`: the one background task per client that renews all locks
//!   (up to [`MAX_BATCH`] a request) and delivers the releases handed to
//!   it.
//! - `registry`: the client's grants by lockId, so that every `Lock` of a
//!   grant shares its one state; beside it, `release`: retrying a release
//!   until the router confirms it, and why; and `holds`: one hold of a
//!   name at a time within a client (its tasks exclude each other), or
//!   counted re-entrant holds when asked for.
//! - `state`: that state: validity, why the lock was lost, where its
//!   release stands. It tells the registry it is gone through a trait the
//!   registry implements, so it need not import it.
//! - `transport`: the v1 HTTP API over a pooled HTTP/1.1 client.
//! - Leaves any layer may use: `error` ([`Error`], [`LostReason`]: typed
//!   failures), `info` ([`LockInfo`]: the router's inspect answer), `validity` (the client-side clock rules: margin, at least
//!   [`MIN_MARGIN`], renewal interval, backoff) and [`fencing`] (what the
//!   protected resource must do, with helpers).
//!
//! [`Client::acquire_wait`] queues for a held lock at the router (the API's
//! `waitMs`: first come, first served across router replicas), for as long
//! as asked: a wait longer than the router's cap queues again.
//! [`Client::acquire_with`] also attaches metadata, or takes a re-entrant
//! hold; [`Client::inspect`] shows a name's holder, waiters and expiry.

mod client;
mod error;
pub mod fencing;
mod holds;
mod info;
mod keeper;
mod lock;
mod registry;
mod release;
mod renewal;
mod state;
mod transport;
mod validity;

pub use client::{AcquireOptions, Client, ClientBuilder};
pub use error::{Error, LostReason};
pub use info::LockInfo;
pub use lock::{Lock, LockHandle};
pub use renewal::MAX_BATCH;
pub use transport::connector;
pub use validity::MIN_MARGIN;
