//! Integration tests: one binary, so everything compiles once. Every test
//! starts its own etcd clusters (real processes on free loopback ports) and
//! its own routers, with the harness in `lockrouter-testkit`.

mod client;
mod commit;
mod contract;
mod dashboards;
mod exec;
mod faults;
mod fencing;
mod hostile;
mod identity;
mod locks;
mod overload;
mod partitions;
mod plan;
mod process;
mod properties;
mod rebalance;
mod renewals;
mod shards;
mod tls;
mod wait;
