//! Why the kit could not start a process. The panicking constructors panic
//! with it; the builders return it. Its text names the process and, when the
//! process ran, carries the end of its log, which is where it says why.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No etcd binary where the Debian and upstream packages put it.
    #[error("etcd is not installed (`make prereqs` installs Debian's etcd-server)")]
    EtcdMissing,
    /// The etcd binary named by `LOCKROUTER_ETCD_BIN` (or the system's)
    /// does not run as etcd.
    #[error("{} ({from}) is not a usable etcd: {why}", binary.display())]
    EtcdUnusable {
        binary: PathBuf,
        from: &'static str,
        why: String,
    },
    /// Which etcd to run could not be settled (the first failure, repeated
    /// to every later caller in the process).
    #[error("{0}")]
    EtcdRelease(String),
    /// Its temp dir, config file or log file could not be made.
    #[error("prepare {what}: {source}")]
    Prepare {
        what: String,
        #[source]
        source: io::Error,
    },
    /// No etcdctl where the Debian and upstream packages put it.
    #[error("etcdctl is not installed (`make prereqs` installs Debian's etcd-client)")]
    EtcdctlMissing,
    /// A program ran and failed.
    #[error("{command} failed:\n{output}")]
    Command { command: String, output: String },
    /// The program could not be run at all.
    #[error("start {}: {source}", program.display())]
    Spawn {
        program: PathBuf,
        #[source]
        source: io::Error,
    },
    /// It ran, but did not answer as healthy or ready in time.
    #[error("{what} did not become {state} within {within:?}; its log ends:\n{log}")]
    NotReady {
        what: String,
        state: &'static str,
        within: Duration,
        log: String,
    },
    /// A network namespace, bridge or link could not be set up or changed.
    #[error("{command}: {why}")]
    Network { command: String, why: String },
}

impl Error {
    pub(crate) fn prepare(what: impl Into<String>) -> impl FnOnce(io::Error) -> Self {
        let what = what.into();
        move |source| Self::Prepare { what, source }
    }
}
