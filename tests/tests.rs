//! Integration tests: one binary, so the harness compiles once. Every test
//! starts its own etcd clusters (real processes on free loopback ports) and
//! its own routers.

mod support {
    pub mod etcd;
    pub mod history;
    pub mod openapi;
    pub mod procs;
    pub mod router;
}

mod client;
mod commit;
mod contract;
mod dashboards;
mod exec;
mod faults;
mod fencing;
mod identity;
mod locks;
mod plan;
mod process;
mod rebalance;
mod renewals;
mod shards;
mod wait;
