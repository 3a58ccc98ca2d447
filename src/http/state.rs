//! What every request handler shares: the lock operations, the reloader,
//! the admin guard, the metrics handle, the deadlines and the access log's
//! switch.

use std::sync::Arc;

use metrics_exporter_prometheus::PrometheusHandle;

use crate::config::HttpTimeouts;
use crate::locks::Locks;
use crate::reload::Reloader;

/// What every request handler shares.
pub struct AppState {
    pub locks: Arc<Locks>,
    pub reloader: Arc<Reloader>,
    /// The principals in force and the admin token (swapped on reload).
    pub principals: crate::auth::Shared,
    pub metrics: PrometheusHandle,
    /// Header, body and whole-request deadlines.
    pub timeouts: HttpTimeouts,
    /// The bound on lock API requests in flight.
    pub admission: super::admission::Admission,
    /// TLS for new connections to the main listener; `None`: plain HTTP.
    pub tls: crate::tls::Shared,
    /// Whether each request gets an access log line (`server.access_log`,
    /// set by the reloader).
    pub access_log: super::access::Switch,
    /// Who this replica is, for `/readyz` and the status page.
    pub replica: super::answers::Replica,
}
