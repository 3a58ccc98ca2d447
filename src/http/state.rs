//! What every request handler shares: the generation in force (the lock
//! operations, TLS, the principals and admin guard, the deadlines, the
//! access log's switch), the reloader, the metrics handle, the bound on
//! requests in flight and the log of failed requests.

use std::sync::Arc;

use metrics_exporter_prometheus::PrometheusHandle;

use crate::generation::InForce;
use crate::reload::Reloader;

/// What every request handler shares.
pub struct AppState {
    /// The generation in force (replaced by each reload).
    pub in_force: Arc<InForce>,
    pub reloader: Arc<Reloader>,
    pub metrics: PrometheusHandle,
    /// The bound on lock API requests in flight.
    pub admission: super::admission::Admission,
    /// Which failed requests get a line of their own.
    pub failures: super::failure_log::FailureLog,
    /// Who this replica is, for `/readyz` and the status page.
    pub replica: super::answers::Replica,
}
