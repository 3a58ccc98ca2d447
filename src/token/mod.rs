//! The formats lockrouter hands to clients: fencing tokens ([`fencing`]) and
//! lockIds ([`lock_id`]). Pure functions of their inputs; no I/O.

pub mod fencing;
pub mod lock_id;
