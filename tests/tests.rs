//! Integration tests: one binary, so the harness compiles once. Every test
//! starts its own etcd clusters (real processes on free loopback ports) and
//! its own routers.

mod support {
    pub mod etcd;
    pub mod router;
}

mod contract;
mod locks;
mod process;
mod shards;
