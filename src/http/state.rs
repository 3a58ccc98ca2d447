//! What every request handler shares: the lock operations, the reloader,
//! the admin guard, the metrics handle and the deadlines.

use std::sync::Arc;

use metrics_exporter_prometheus::PrometheusHandle;

use crate::config::HttpTimeouts;
use crate::locks::Locks;
use crate::reload::Reloader;

/// What every request handler shares.
pub struct AppState {
    pub locks: Arc<Locks>,
    pub reloader: Arc<Reloader>,
    /// Bearer token for `/admin/v1/*`; without one, loopback clients only.
    pub admin_token: Option<String>,
    pub metrics: PrometheusHandle,
    /// Header, body and whole-request deadlines.
    pub timeouts: HttpTimeouts,
    /// The bound on lock API requests in flight.
    pub admission: super::admission::Admission,
    /// TLS for new connections to the main listener; `None`: plain HTTP.
    pub tls: crate::tls::Shared,
}
