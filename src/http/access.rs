//! The access log: with `server.access_log` on, one info line per HTTP
//! request, target `lockrouter::access`, logged while the request is
//! served, so that its names (`op`, `request_id`, `shard`, `outcome`) go
//! with it as with every line logged for the request: the `request{...}`
//! prefix in text, `span` in JSON (`request_id::NamingRequests`). Whether
//! it is on comes with the generation in force, so a reload turns the log
//! on or off from the next request on.
//!
//! A line says: `method`; `route`, the route's label (never the raw path,
//! which may hold a lock name or a clientId); `status`; `latency_ms`;
//! `client_id`, the clientId an acquire's body names; `principal`, when the
//! caller authenticated as one; `lock_name`, for an inspect or a
//! force-release only (a request about one lock by name, where an operator
//! reading the log wants to know which; an acquire's name is the
//! application's data and the hot path's volume, and is left out); and
//! `request_id` again, so the line stands alone under any log filter. It
//! never says a bearer token, a lockId (a credential once lockIds are
//! sealed: renewals and releases name their lock only by lockId, so their
//! lines carry no name and no clientId) or a body. Names and clientIds are
//! logged quoted and escaped, so a newline in one cannot forge a line.

use std::time::Duration;

use http::Method;

/// What a request's line says beyond its route and answer, learnt while the
/// request is handled. With the log off nothing is copied.
#[derive(Debug, Default)]
pub struct Facts {
    on: bool,
    client_id: Option<String>,
    principal: Option<String>,
    name: Option<String>,
}

impl Facts {
    /// The facts of a request that arrives while the log is `on` (as the
    /// generation in force says).
    pub fn of(on: bool) -> Self {
        Self {
            on,
            ..Self::default()
        }
    }

    /// Whether this request gets a line.
    pub fn on(&self) -> bool {
        self.on
    }

    /// The clientId an acquire's body names.
    pub fn client_id(&mut self, client_id: &str) {
        if self.on {
            self.client_id = Some(client_id.to_string());
        }
    }

    /// The principal the caller authenticated as.
    pub fn principal(&mut self, principal: &str) {
        if self.on {
            self.principal = Some(principal.to_string());
        }
    }

    /// The lock an inspect or a force-release names.
    pub fn name(&mut self, name: &str) {
        if self.on {
            self.name = Some(name.to_string());
        }
    }
}

/// How the request went, as its line says it.
pub struct Line<'a> {
    pub method: &'a Method,
    /// The route's label (`op` of the metrics), `unknown` for no route.
    pub route: &'static str,
    pub status: u16,
    pub elapsed: Duration,
    pub request_id: &'a str,
}

/// Logs the request's line, if its facts say the log was on when it
/// arrived (named by the request's names, as every line logged while it is
/// served).
pub fn log(line: Line<'_>, facts: &Facts) {
    if !facts.on {
        return;
    }
    // Milliseconds to the microsecond.
    let latency_ms = (line.elapsed.as_secs_f64() * 1e6).round() / 1e3;
    tracing::info!(
        target: "lockrouter::access",
        method = line.method.as_str(),
        route = line.route,
        status = line.status,
        latency_ms,
        client_id = facts.client_id.as_deref(),
        principal = facts.principal.as_deref(),
        lock_name = facts.name.as_deref(),
        request_id = line.request_id,
        "request"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_are_kept_only_while_the_log_is_on() {
        let mut facts = Facts::of(false);
        facts.client_id("worker-1");
        facts.principal("payments");
        facts.name("order:42");
        assert!(!facts.on());
        assert!(facts.client_id.is_none() && facts.principal.is_none() && facts.name.is_none());

        let mut facts = Facts::of(true);
        facts.client_id("worker-1");
        facts.principal("payments");
        facts.name("order:42");
        assert!(facts.on());
        assert_eq!(facts.client_id.as_deref(), Some("worker-1"));
        assert_eq!(facts.principal.as_deref(), Some("payments"));
        assert_eq!(facts.name.as_deref(), Some("order:42"));
    }
}
