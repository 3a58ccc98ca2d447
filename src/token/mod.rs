//! The formats lockrouter hands to clients, fencing tokens ([`fencing`]) and
//! lockIds ([`lock_id`]), and the tags it puts in the etcd lease ids of
//! principals' sessions ([`lease_tag`]). Pure functions of their inputs; no
//! I/O.

pub mod fencing;
pub mod lease_tag;
pub mod lock_id;
