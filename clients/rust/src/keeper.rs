//! [`Keeper`]: what a client's locks need of their client, and nothing
//! more: the transport (to release), the request timeout, the renewal
//! task's channel and the registry of grants. A `Lock` holds this instead
//! of its `Client`, so the lock layer sits below the client that makes
//! locks rather than beside it.
//!
//! It uses the registry, the holds, the renewal task's [`Command`]s, the
//! grant state (`state`) and the transport; the client and its locks share
//! one.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::holds::Holds;
use crate::registry::Registry;
use crate::release::Tries;
use crate::renewal::Command;
use crate::state::Shared;
use crate::transport::Transport;

/// The part of a client its locks share with it.
pub(crate) struct Keeper {
    /// The router's API, for releases.
    pub transport: Transport,
    /// How long one request may take before it counts as failed.
    pub request_timeout: Duration,
    /// The configured safety margin (`None`: a tenth of the TTL), for a
    /// lock an extend moves to another TTL.
    pub margin: Option<Duration>,
    /// To the renewal task; the task ends when the last sender (held by
    /// clients and locks, through their keeper) is dropped.
    pub commands: mpsc::UnboundedSender<Command>,
    /// One state per grant, shared by every `Lock` of it.
    pub registry: Arc<Registry>,
    /// Which grant holds each name's turn in this client, and how often.
    pub holds: Arc<Holds>,
}

impl Keeper {
    /// Starts releasing `shared` and, if this call started it (it is the
    /// grant's current state and nobody released it yet), hands the
    /// release to the renewal task, which retries it while the client
    /// lives. Never blocks.
    pub fn release_in_background(&self, shared: &Arc<Shared>) {
        if self.registry.begin_release(shared) == Some(true) {
            // Unbounded send never blocks; if the task is gone (runtime
            // shutting down) so is this process's hold on the session.
            let _ = self.commands.send(Command::Release {
                shared: shared.clone(),
                tries: Tries::default(),
            });
        }
    }
}
