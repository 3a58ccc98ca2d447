//! Which principal a lock API request acts for, once [`crate::auth`] has
//! said who presented what: with principals configured, a principal
//! (401 without one); an admin may inspect any name.

use std::sync::Arc;

use super::error::ApiError;
use crate::auth::{AuthError, Credential, Principal, Principals};
use crate::locks::{Caller, Quota};
use crate::refusal::Denied;

/// The principal a lock API request acts for; `None` when principals are
/// not configured, or for an admin's inspect (which sees every name).
pub fn lock_caller(
    principals: &Principals,
    credential: Credential,
    admin: bool,
) -> Result<Option<Arc<Principal>>, ApiError> {
    if !principals.enabled() || admin {
        return Ok(None);
    }
    let refused = |msg: &str| Err(AuthError::Unauthenticated(msg.to_string()).into());
    match credential {
        Credential::Principal(p) => Ok(Some(p)),
        Credential::AdminToken => Err(Denied::new(
            "the admin token is not a principal: locks are taken by principals",
        )
        .into()),
        Credential::Unknown => refused("the bearer token names no principal"),
        Credential::None => refused(
            "send Authorization: Bearer <token> of a principal, or a client certificate naming one",
        ),
    }
}

/// The locks layer's view of `principal`.
pub fn as_caller(principal: &Option<Arc<Principal>>) -> Caller<'_> {
    match principal {
        Some(p) => Caller::Principal {
            name: &p.name,
            quota: Quota {
                max_held_locks: p.max_held_locks,
                max_sessions: p.max_sessions,
            },
        },
        None => Caller::Anyone,
    }
}
