//! Where the router is and how to authenticate to it: the one set of
//! connection flags and variables of every command that calls a router
//! (`exec` and the operator's commands), so that a script sets
//! `LOCKROUTER_URL`, `LOCKROUTER_TOKEN` and `LOCKROUTER_CA_FILE` once.

use std::path::PathBuf;

/// The connection flags, flattened into each command's arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct Target {
    /// The router's base URL: `http://host:port` or `https://host:port`.
    // `--router` is what `exec` called it first.
    #[arg(
        long,
        alias = "router",
        env = "LOCKROUTER_URL",
        default_value = "http://127.0.0.1:8080",
        global = true
    )]
    pub url: String,
    /// The bearer token to send, if the router needs one: a principal's
    /// (see docs/security.md), and for admin commands `admin.token` or an
    /// admin principal's.
    #[arg(long, env = "LOCKROUTER_TOKEN", hide_env_values = true, global = true)]
    pub token: Option<String>,
    /// PEM CA certificates to trust for an `https://` router, besides the
    /// public web roots.
    #[arg(long, env = "LOCKROUTER_CA_FILE", global = true)]
    pub ca_file: Option<PathBuf>,
}

impl Target {
    /// The `--ca-file` certificates, if one is named; the error names the
    /// file.
    pub fn ca_pem(&self) -> Result<Option<Vec<u8>>, String> {
        let Some(path) = &self.ca_file else {
            return Ok(None);
        };
        std::fs::read(path)
            .map(Some)
            .map_err(|e| format!("--ca-file {}: {e}", path.display()))
    }
}
