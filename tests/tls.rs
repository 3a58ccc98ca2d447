//! TLS on the main listener: a real handshake with certificates made at
//! test time (rcgen), a client that does not trust the CA refused, the
//! certificate replaced by a config reload for new connections, a bad
//! certificate file refused by the reload, and client certificates
//! required when a client CA is configured (mTLS).

use std::path::Path;
use std::time::{Duration, Instant};

use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use serde_json::json;

use lockrouter_testkit::config::config_toml;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::loopback::free_port;
use lockrouter_testkit::router_process::RouterProcess;
use lockrouter_testkit::sleep_ms;

/// A CA, and a certificate it signed for `names`; PEMs.
pub(crate) struct Pki {
    pub(crate) ca_pem: String,
    pub(crate) cert_pem: String,
    pub(crate) key_pem: String,
}

pub(crate) fn pki(names: &[&str]) -> Pki {
    pki_many(&[names]).remove(0)
}

/// One CA, and a certificate it signed for each entry of `leaves`.
pub(crate) fn pki_many(leaves: &[&[&str]]) -> Vec<Pki> {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    leaves
        .iter()
        .map(|names| {
            let key = KeyPair::generate().unwrap();
            let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
            let cert = CertificateParams::new(names)
                .unwrap()
                .signed_by(&key, &ca_cert, &ca_key)
                .unwrap();
            Pki {
                ca_pem: ca_cert.pem(),
                cert_pem: cert.pem(),
                key_pem: key.serialize_pem(),
            }
        })
        .collect()
}

pub(crate) fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

/// A client trusting `ca_pem` only (and presenting `identity`, if given).
pub(crate) fn client(ca_pem: &str, identity: Option<String>) -> reqwest::Client {
    let mut b = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca_pem.as_bytes()).unwrap())
        .timeout(Duration::from_secs(10))
        .pool_max_idle_per_host(0);
    if let Some(pem) = identity {
        b = b.identity(reqwest::Identity::from_pem(pem.as_bytes()).unwrap());
    }
    b.build().unwrap()
}

/// `GET /healthz` through `c` answers 200.
async fn assert_healthy(c: &reqwest::Client, base: &str) {
    let r = c.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

pub(crate) async fn wait_ready(c: &reqwest::Client, base: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(r) = c.get(format!("{base}/readyz")).send().await {
            if r.status() == 200 {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the router never answered over TLS"
        );
        sleep_ms(100).await;
    }
}

pub(crate) fn tls_toml(
    etcd: &EtcdCluster,
    port: u16,
    cert: &str,
    key: &str,
    extra: &str,
) -> String {
    config_toml(&[etcd], &format!("127.0.0.1:{port}"), "").replace(
        "[server]\n",
        &format!("[server]\ntls_cert_file = \"{cert}\"\ntls_key_file = \"{key}\"\n{extra}"),
    )
}

/// A router process serving TLS on a free port with a certificate for
/// 127.0.0.1 from a private CA, once it is ready.
pub(crate) struct TlsRouter {
    pub(crate) server: Pki,
    /// The CA's PEM file.
    pub(crate) ca: String,
    /// `https://127.0.0.1:<port>`.
    pub(crate) base: String,
    _router: RouterProcess,
    _dir: tempfile::TempDir,
}

impl TlsRouter {
    pub(crate) async fn start(etcd: &EtcdCluster) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let server = pki(&["127.0.0.1"]);
        let cert = write(dir.path(), "cert.pem", &server.cert_pem);
        let key = write(dir.path(), "key.pem", &server.key_pem);
        let ca = write(dir.path(), "ca.pem", &server.ca_pem);
        let port = free_port();
        let router = RouterProcess::spawn(&tls_toml(etcd, port, &cert, &key, ""), port);
        let base = format!("https://127.0.0.1:{port}");
        wait_ready(&client(&server.ca_pem, None), &base).await;
        Self {
            server,
            ca,
            base,
            _router: router,
            _dir: dir,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_serves_tls_and_a_reload_replaces_its_certificate() {
    let etcd = EtcdCluster::single();
    let dir = tempfile::tempdir().unwrap();
    let first = pki(&["127.0.0.1", "localhost"]);
    let cert = write(dir.path(), "cert.pem", &first.cert_pem);
    let key = write(dir.path(), "key.pem", &first.key_pem);
    let port = free_port();
    let router = RouterProcess::spawn(&tls_toml(&etcd, port, &cert, &key, ""), port);
    let base = format!("https://127.0.0.1:{port}");
    let trusting = client(&first.ca_pem, None);
    wait_ready(&trusting, &base).await;
    let r = trusting
        .post(format!("{base}/api/v1/locks/acquire"))
        .json(&json!({"name": "tls", "ttlMs": 5000, "clientId": "A"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // A client that does not trust the CA is refused in the handshake.
    let stranger = client(&pki(&["127.0.0.1"]).ca_pem, None);
    assert!(stranger
        .get(format!("{base}/healthz"))
        .send()
        .await
        .is_err());
    // Plain HTTP to the TLS port gets no HTTP answer.
    let plain = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let r = plain
        .get(format!("http://127.0.0.1:{port}/healthz"))
        .send()
        .await;
    assert!(r.is_err() || r.unwrap().status() != 200);

    // New certificate from another CA, applied by a reload.
    let second = pki(&["127.0.0.1"]);
    write(dir.path(), "cert.pem", &second.cert_pem);
    write(dir.path(), "key.pem", &second.key_pem);
    let r = trusting
        .post(format!("{base}/admin/v1/reload"))
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    let renewed = client(&second.ca_pem, None);
    assert_healthy(&renewed, &base).await;
    assert!(
        trusting
            .get(format!("{base}/healthz"))
            .send()
            .await
            .is_err(),
        "new connections still get the old certificate"
    );
    // A certificate file that cannot be used is refused; the one in force stays.
    write(dir.path(), "cert.pem", "not a certificate");
    let r = renewed
        .post(format!("{base}/admin/v1/reload"))
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("server.tls_cert_file"),
        "{body}"
    );
    assert_healthy(&renewed, &base).await;
    drop(router);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_client_ca_only_clients_with_its_certificates_get_in() {
    let etcd = EtcdCluster::single();
    let dir = tempfile::tempdir().unwrap();
    let server = pki(&["127.0.0.1"]);
    let clients = pki(&["worker-17"]);
    let cert = write(dir.path(), "cert.pem", &server.cert_pem);
    let key = write(dir.path(), "key.pem", &server.key_pem);
    let ca = write(dir.path(), "clients.pem", &clients.ca_pem);
    let port = free_port();
    let extra = format!("tls_client_ca_file = \"{ca}\"\n");
    let _router = RouterProcess::spawn(&tls_toml(&etcd, port, &cert, &key, &extra), port);
    let base = format!("https://127.0.0.1:{port}");
    let with_cert = client(
        &server.ca_pem,
        Some(format!("{}{}", clients.cert_pem, clients.key_pem)),
    );
    wait_ready(&with_cert, &base).await;
    assert_healthy(&with_cert, &base).await;
    let without = client(&server.ca_pem, None);
    assert!(without.get(format!("{base}/healthz")).send().await.is_err());
    let other = pki(&["intruder"]);
    let wrong = client(
        &server.ca_pem,
        Some(format!("{}{}", other.cert_pem, other.key_pem)),
    );
    assert!(wrong.get(format!("{base}/healthz")).send().await.is_err());
}

#[test]
fn tls_settings_that_cannot_work_stop_the_router_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let shard = "\n[[shards]]\nname = \"a\"\nendpoints = [\"http://127.0.0.1:1\"]\n";
    let run = |server: &str| {
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            format!("[server]\nlisten = \"127.0.0.1:0\"\n{server}{shard}"),
        )
        .unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_lockrouter"))
            .args(["serve", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = run("tls_cert_file = \"/nonexistent/cert.pem\"\n");
    assert_ne!(code, Some(0));
    assert!(err.contains("tls_key_file"), "{err}");
    let (code, err) =
        run("tls_cert_file = \"/nonexistent/c.pem\"\ntls_key_file = \"/nonexistent/k.pem\"\n");
    assert_ne!(code, Some(0));
    assert!(
        err.contains("server.tls_cert_file") && err.contains("/nonexistent/c.pem"),
        "{err}"
    );
    let (code, err) = run("tls_client_ca_file = \"/nonexistent/ca.pem\"\n");
    assert_ne!(code, Some(0));
    assert!(err.contains("tls_client_ca_file"), "{err}");
}

/// The Rust SDK, `lockrouter exec` and the operator's commands reach a TLS
/// router whose certificate a private CA signed, when given that CA;
/// without it they are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdk_and_exec_speak_https_with_a_private_ca() {
    let etcd = EtcdCluster::single();
    let TlsRouter {
        server, ca, base, ..
    } = &TlsRouter::start(&etcd).await;

    let sdk = lockrouter_client::Client::builder(base)
        .ca_pem(server.ca_pem.as_bytes().to_vec())
        .build()
        .unwrap();
    let lock = sdk
        .acquire("https:sdk", Duration::from_secs(3))
        .await
        .unwrap()
        .expect("acquired");
    sleep_ms(4_000).await;
    assert!(lock.is_held(), "renewed over https past its TTL");
    lock.release().await.unwrap();
    let untrusting = lockrouter_client::Client::new(base, None).unwrap();
    assert!(untrusting
        .acquire("https:other", Duration::from_secs(3))
        .await
        .is_err());

    let out = tokio::task::block_in_place(|| {
        std::process::Command::new(env!("CARGO_BIN_EXE_lockrouter"))
            .args([
                "exec",
                "--router",
                base,
                "--ca-file",
                ca,
                "--name",
                "https:exec",
            ])
            .args([
                "--ttl",
                "5s",
                "--",
                "sh",
                "-c",
                "echo \"token $LOCKROUTER_FENCING_TOKEN\"",
            ])
            .output()
            .unwrap()
    });
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("token "));

    // The operator's commands too: with the CA they reach it, without it
    // they are refused (69: unavailable).
    let ring = |ca: Option<&str>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_lockrouter"));
        cmd.args(["ring", "--url", base])
            .env_remove("LOCKROUTER_CA_FILE");
        if let Some(ca) = ca {
            cmd.args(["--ca-file", ca]);
        }
        tokio::task::block_in_place(|| cmd.output().unwrap())
    };
    let out = ring(Some(ca));
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"ring\""));
    assert_eq!(ring(None).status.code(), Some(69));
}
