//! The route table: every route the server answers, in one place, with its
//! method, path template and metrics label. Requests are matched here and
//! dispatched by `Route` (see `mod.rs`); the OpenAPI document is tested
//! against [`Route::ALL`].

use http::Method;

/// Which routes a listener serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    /// The API, health, admin and metrics.
    Main,
    /// `/metrics` only (`server.metrics_listen`).
    MetricsOnly,
}

/// One route of the v1 API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Acquire,
    Renew,
    RenewBatch,
    Extend,
    Release,
    Inspect,
    Healthz,
    Readyz,
    Metrics,
    AdminReload,
    AdminBumpEpoch,
    AdminRing,
    AdminForceRelease,
    AdminLocks,
    AdminClient,
    Ui,
}

/// Where lock names live in paths (`GET /api/v1/locks/{name}`).
pub const LOCKS_PREFIX: &str = "/api/v1/locks/";
/// `POST /admin/v1/locks/{name}/force-release`: before and after the name.
pub const FORCE_PREFIX: &str = "/admin/v1/locks/";
pub const FORCE_SUFFIX: &str = "/force-release";
/// `GET /admin/v1/clients/{clientId}`: before the clientId.
pub const CLIENTS_PREFIX: &str = "/admin/v1/clients/";

impl Route {
    /// Every route, in the order the API documents them.
    pub const ALL: [Route; 16] = [
        Route::Acquire,
        Route::Renew,
        Route::RenewBatch,
        Route::Extend,
        Route::Release,
        Route::Inspect,
        Route::Healthz,
        Route::Readyz,
        Route::Metrics,
        Route::AdminReload,
        Route::AdminBumpEpoch,
        Route::AdminRing,
        Route::AdminForceRelease,
        Route::AdminLocks,
        Route::AdminClient,
        Route::Ui,
    ];

    pub fn method(self) -> Method {
        match self {
            Route::Acquire
            | Route::Renew
            | Route::RenewBatch
            | Route::Extend
            | Route::Release
            | Route::AdminReload
            | Route::AdminBumpEpoch
            | Route::AdminForceRelease => Method::POST,
            Route::Inspect
            | Route::Healthz
            | Route::Readyz
            | Route::Metrics
            | Route::AdminRing
            | Route::AdminLocks
            | Route::AdminClient
            | Route::Ui => Method::GET,
        }
    }

    /// The path, with `{name}` where a lock name goes.
    pub fn template(self) -> &'static str {
        match self {
            Route::Acquire => "/api/v1/locks/acquire",
            Route::Renew => "/api/v1/locks/renew",
            Route::RenewBatch => "/api/v1/locks/renew-batch",
            Route::Extend => "/api/v1/locks/extend",
            Route::Release => "/api/v1/locks/release",
            Route::Inspect => "/api/v1/locks/{name}",
            Route::Healthz => "/healthz",
            Route::Readyz => "/readyz",
            Route::Metrics => "/metrics",
            Route::AdminReload => "/admin/v1/reload",
            Route::AdminBumpEpoch => "/admin/v1/bump-epoch",
            Route::AdminRing => "/admin/v1/ring",
            Route::AdminForceRelease => "/admin/v1/locks/{name}/force-release",
            Route::AdminLocks => "/admin/v1/locks",
            Route::AdminClient => "/admin/v1/clients/{clientId}",
            Route::Ui => "/ui",
        }
    }

    /// The `op` label of its metrics: never the path itself, which may hold
    /// a lock name (bounded series).
    pub fn label(self) -> &'static str {
        match self {
            Route::Acquire => "acquire",
            Route::Renew => "renew",
            Route::RenewBatch => "renew_batch",
            Route::Extend => "extend",
            Route::Release => "release",
            Route::Inspect => "inspect",
            Route::Healthz => "healthz",
            Route::Readyz => "readyz",
            Route::Metrics => "metrics",
            Route::AdminReload => "admin_reload",
            Route::AdminBumpEpoch => "admin_bump_epoch",
            Route::AdminRing => "admin_ring",
            Route::AdminForceRelease => "admin_force_release",
            Route::AdminLocks => "admin_locks",
            Route::AdminClient => "admin_client",
            Route::Ui => "ui",
        }
    }

    /// The lock API: with principals configured, each needs one.
    pub fn is_lock_api(self) -> bool {
        matches!(
            self,
            Route::Acquire
                | Route::Renew
                | Route::RenewBatch
                | Route::Extend
                | Route::Release
                | Route::Inspect
        )
    }

    /// Routes that need the admin guard.
    pub fn is_admin(self) -> bool {
        matches!(
            self,
            Route::AdminReload
                | Route::AdminBumpEpoch
                | Route::AdminRing
                | Route::AdminForceRelease
                | Route::AdminLocks
                | Route::AdminClient
        )
    }

    /// The route a request is for, by its path (a wrong method is the
    /// route's to refuse, with 405). A GET below `/api/v1/locks/` is always
    /// an inspect, so a lock may be named "acquire" or "renew" like any
    /// other; any other path below it is an inspect asked with the wrong
    /// method.
    pub fn of(method: &Method, path: &str, listener: Listener) -> Option<Route> {
        if listener == Listener::MetricsOnly {
            return (path == Route::Metrics.template()).then_some(Route::Metrics);
        }
        if path.starts_with(LOCKS_PREFIX) && method == Method::GET {
            return Some(Route::Inspect);
        }
        if let Some(rest) = path.strip_prefix(FORCE_PREFIX) {
            return rest
                .strip_suffix(FORCE_SUFFIX)
                .filter(|name| !name.is_empty())
                .map(|_| Route::AdminForceRelease);
        }
        if let Some(client) = path.strip_prefix(CLIENTS_PREFIX) {
            return (!client.is_empty()).then_some(Route::AdminClient);
        }
        let exact = Route::ALL
            .into_iter()
            .find(|r| *r != Route::Inspect && r.template() == path);
        exact.or_else(|| path.starts_with(LOCKS_PREFIX).then_some(Route::Inspect))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_is_found_by_its_own_method_and_path() {
        for route in Route::ALL {
            let path = route
                .template()
                .replace("{name}", "order%3A42")
                .replace("{clientId}", "worker-7");
            assert_eq!(
                Route::of(&route.method(), &path, Listener::Main),
                Some(route)
            );
        }
    }

    #[test]
    fn lock_names_that_look_like_routes_are_inspected() {
        for name in ["acquire", "renew", "renew-batch", "extend", "release"] {
            let path = format!("{LOCKS_PREFIX}{name}");
            assert_eq!(
                Route::of(&Method::GET, &path, Listener::Main),
                Some(Route::Inspect)
            );
        }
        let post = Route::of(&Method::POST, "/api/v1/locks/other", Listener::Main);
        assert_eq!(post, Some(Route::Inspect), "answered 405 by inspect");
    }

    #[test]
    fn unknown_paths_and_the_metrics_listener() {
        assert_eq!(Route::of(&Method::GET, "/nope", Listener::Main), None);
        assert_eq!(
            Route::of(&Method::GET, "/metrics", Listener::MetricsOnly),
            Some(Route::Metrics)
        );
        assert_eq!(
            Route::of(&Method::GET, "/healthz", Listener::MetricsOnly),
            None
        );
    }

    #[test]
    fn labels_are_unique_and_admin_routes_are_guarded() {
        let mut labels: Vec<_> = Route::ALL.iter().map(|r| r.label()).collect();
        labels.sort();
        labels.dedup();
        assert_eq!(labels.len(), Route::ALL.len());
        for route in Route::ALL {
            assert_eq!(route.is_admin(), route.template().starts_with("/admin/"));
        }
    }
}
