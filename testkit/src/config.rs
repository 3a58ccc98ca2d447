//! Router configs for the kit's etcd clusters: the TOML a router (in-process
//! or a process) serves, with shards named a, b, c, ... in the order given.
//! A cluster with TLS gets its CA (and, if it requires one, its client
//! certificate), one with auth its user and password file: each on a line
//! of its own, which a test can replace or drop.

use crate::etcd::EtcdCluster;

/// [`config_toml`] for one shard named `shard` on any free port: a name of
/// its own for tests that read the metrics every router in the process
/// shares (one recorder), so that only their own router's series count.
pub fn one_named_shard(etcd: &EtcdCluster, shard: &str, extra: &str) -> String {
    config_toml(&[etcd], "127.0.0.1:0", extra)
        .replace("\nname = \"a\"\n", &format!("\nname = \"{shard}\"\n"))
}

/// TOML for a router listening on `listen` over `shards` named a, b, c, ...,
/// with short etcd deadlines so tests see failures fast; `extra` goes after
/// the `[etcd]` keys.
pub fn config_toml(shards: &[&EtcdCluster], listen: &str, extra: &str) -> String {
    let mut toml = format!(
        "[server]\nlisten = \"{listen}\"\n\n[etcd]\nprefix = \"/lockrouter\"\n\
         request_timeout_ms = 1000\nconnect_timeout_ms = 500\nhealth_interval_ms = 200\n{extra}\n"
    );
    toml.push_str(&shards_toml(shards));
    toml
}

/// The `[[shards]]` tables for `shards`, named a, b, c, ... in order.
pub fn shards_toml(shards: &[&EtcdCluster]) -> String {
    let mut toml = String::new();
    for (i, s) in shards.iter().enumerate() {
        let eps: Vec<String> = s.endpoints().iter().map(|e| format!("\"{e}\"")).collect();
        toml.push_str(&format!(
            "\n[[shards]]\nname = \"{}\"\nendpoints = [{}]\n",
            shard_name(i),
            eps.join(", ")
        ));
        let mut key = |key: &str, value: &dyn std::fmt::Display| {
            toml.push_str(&format!("{key} = \"{value}\"\n"));
        };
        if let Some(tls) = s.tls() {
            key("tls_ca_file", &tls.ca_file.display());
            if tls.client_cert_auth {
                key("tls_cert_file", &tls.client_cert_file.display());
                key("tls_key_file", &tls.client_key_file.display());
            }
        }
        if let Some(auth) = s.auth() {
            key("username", &auth.user);
            key("password_file", &auth.password_file.display());
        }
    }
    toml
}

/// The name [`config_toml`] gives the `i`th shard.
pub fn shard_name(i: usize) -> String {
    ((b'a' + i as u8) as char).to_string()
}
