//! Integration tests: one binary, so everything compiles once. Every test
//! starts its own etcd clusters (real processes on free loopback ports) and
//! its own routers, with the harness in `lockrouter-testkit`.

mod access_log;
mod admin_guard;
mod client;
mod commands;
mod commit;
mod contract;
mod dashboards;
mod docs;
mod etcd_tls;
mod exec;
mod extend;
mod faults;
mod fencing;
mod hostile;
mod identity;
mod late_release;
mod lock_metrics;
mod locks;
mod operators;
mod overload;
mod partitions;
mod plan;
mod process;
mod properties;
mod rebalance;
mod renewals;
mod shards;
mod tenants;
mod tls;
mod ui;
mod wait;
