//! How the router reaches one shard's etcd and proves who it is: TLS (the
//! CA that signed the members' certificates, and a client certificate for
//! etcd started with `--client-cert-auth`) and an etcd user, read from the
//! files the shard's settings name.
//!
//! Every client the router opens to a shard (its balanced channel, each
//! member's own client for probes, hedges and keepalive streams) is built
//! from one [`Access`], so none goes out with less TLS or other
//! credentials than the rest. The files are read and checked at start and
//! at every reload, before anything changes: a file that cannot be used
//! refuses both, naming the setting. Two loads are equal only if the
//! files' contents are, so a reload after a certificate or password file
//! changed connects the shard anew with them (how they are rotated).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use etcd_client::ConnectOptions;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::config::{Secret, ShardSettings};

/// What the router connects to a shard with.
#[derive(Clone, PartialEq, Eq)]
pub struct Access {
    /// The members' client URLs, all `http://` or all `https://`.
    pub endpoints: Vec<String>,
    /// `None` for `http://` endpoints.
    tls: Option<TlsFiles>,
    /// `None` when etcd auth is not used.
    user: Option<User>,
}

/// PEM contents, kept to compare loads and to build the clients.
#[derive(Clone, PartialEq, Eq)]
struct TlsFiles {
    ca: Vec<u8>,
    /// Client certificate chain and key.
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

/// An etcd user and its password.
#[derive(Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    password: Secret,
}

impl User {
    pub fn credentials(&self) -> (String, String) {
        (self.name.clone(), self.password.expose().clone())
    }
}

impl std::fmt::Debug for Access {
    /// Names what is used, never a key or a password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Access")
            .field("endpoints", &self.endpoints)
            .field("tls", &self.tls.is_some())
            .field(
                "client_cert",
                &self.tls.as_ref().is_some_and(|t| t.identity.is_some()),
            )
            .field("user", &self.user.as_ref().map(|u| &u.name))
            .finish()
    }
}

/// A file a shard's settings name cannot be used; the message names the
/// shard, the setting, the file and the problem.
#[derive(Debug, Clone, thiserror::Error)]
#[error("shard {shard:?}: shards[].{setting}: {}: {problem}", path.display())]
pub struct AccessError {
    pub shard: String,
    pub setting: &'static str,
    pub path: PathBuf,
    #[source]
    pub problem: FileProblem,
}

/// What is wrong with a file a shard's settings name. The errors of the
/// file system and of TLS are kept as they came (shared, so that the
/// error stays `Clone`).
#[derive(Debug, Clone, thiserror::Error)]
pub enum FileProblem {
    /// It cannot be read.
    #[error("{0}")]
    Unreadable(Arc<std::io::Error>),
    /// A password file that is not UTF-8 text.
    #[error("not UTF-8 text")]
    NotText,
    /// A password file with nothing in it.
    #[error("it is empty")]
    Empty,
    /// A certificate file without a certificate.
    #[error("no PEM certificate in it")]
    NoCertificate,
    /// Its PEM does not parse, or it does not make a TLS client config.
    #[error("{0}")]
    Tls(Arc<dyn std::error::Error + Send + Sync>),
    /// A client key that is not the client certificate's.
    #[error("does not go with shards[].tls_cert_file: {0}")]
    KeyMismatch(Arc<rustls::Error>),
}

impl FileProblem {
    fn tls(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Tls(Arc::new(e))
    }
}

impl Access {
    /// Reads and checks the files `shard` names (validated settings).
    pub fn load(shard: &ShardSettings) -> Result<Self, AccessError> {
        let fail = |setting: &'static str, path: &Path, problem| AccessError {
            shard: shard.name.clone(),
            setting,
            path: path.to_path_buf(),
            problem,
        };
        let read = |setting: &'static str, path: &Path| {
            std::fs::read(path).map_err(|e| fail(setting, path, FileProblem::Unreadable(e.into())))
        };
        let tls = match &shard.tls_ca_file {
            None => None,
            Some(ca_path) => {
                let ca = read("tls_ca_file", ca_path)?;
                let identity = match (&shard.tls_cert_file, &shard.tls_key_file) {
                    (Some(c), Some(k)) => {
                        Some((read("tls_cert_file", c)?, read("tls_key_file", k)?))
                    }
                    _ => None,
                };
                let files = TlsFiles { ca, identity };
                files.check().map_err(|(setting, why)| {
                    let path = match setting {
                        "tls_ca_file" => ca_path,
                        "tls_cert_file" => shard.tls_cert_file.as_deref().unwrap_or(ca_path),
                        _ => shard.tls_key_file.as_deref().unwrap_or(ca_path),
                    };
                    fail(setting, path, why)
                })?;
                Some(files)
            }
        };
        let user = match (&shard.username, &shard.password_file) {
            (Some(name), Some(path)) => {
                let bytes = read("password_file", path)?;
                let text = String::from_utf8(bytes)
                    .map_err(|_| fail("password_file", path, FileProblem::NotText))?;
                let password = text.strip_suffix('\n').unwrap_or(&text);
                let password = password.strip_suffix('\r').unwrap_or(password);
                if password.is_empty() {
                    return Err(fail("password_file", path, FileProblem::Empty));
                }
                Some(User {
                    name: name.clone(),
                    password: Secret::new(password.to_string()),
                })
            }
            _ => None,
        };
        Ok(Self {
            endpoints: shard.endpoints.clone(),
            tls,
            user,
        })
    }

    /// Plain `http://` endpoints without a user.
    pub fn plain(endpoints: &[String]) -> Self {
        Self {
            endpoints: endpoints.to_vec(),
            tls: None,
            user: None,
        }
    }

    /// The etcd user, if any.
    pub fn user(&self) -> Option<&User> {
        self.user.as_ref()
    }

    /// The options of every client to this shard: expired tokens are
    /// renewed by etcd-client when a user is set (the first token is asked
    /// for by [`Login`](super::login::Login), not at connect).
    pub fn options(&self) -> ConnectOptions {
        ConnectOptions::new().with_auto_token_refresh(self.user.is_some())
    }

    /// The TLS client config of `https://` endpoints (`None` for
    /// `http://`), from files [`Access::load`] checked; Err names the
    /// setting.
    pub fn tls_config(
        &self,
    ) -> Result<Option<Arc<rustls::ClientConfig>>, (&'static str, FileProblem)> {
        self.tls
            .as_ref()
            .map(|tls| tls.client_config().map(Arc::new))
            .transpose()
    }
}

impl TlsFiles {
    /// Checks that these files make a TLS client config (see
    /// [`TlsFiles::client_config`]). Err names the setting.
    fn check(&self) -> Result<(), (&'static str, FileProblem)> {
        self.client_config().map(|_| ())
    }

    /// The TLS client config these files make (rustls, aws-lc-rs, ALPN
    /// `h2`): every PEM parses, the CA has a usable certificate and the
    /// key is the certificate's. Err names the setting.
    fn client_config(&self) -> Result<rustls::ClientConfig, (&'static str, FileProblem)> {
        let certs = |setting, pem: &[u8]| {
            let certs = CertificateDer::pem_slice_iter(pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| (setting, FileProblem::tls(e)))?;
            if certs.is_empty() {
                return Err((setting, FileProblem::NoCertificate));
            }
            Ok(certs)
        };
        let mut roots = rustls::RootCertStore::empty();
        for c in certs("tls_ca_file", &self.ca)? {
            roots
                .add(c)
                .map_err(|e| ("tls_ca_file", FileProblem::tls(e)))?;
        }
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| ("tls_ca_file", FileProblem::tls(e)))?
            .with_root_certificates(roots);
        let mut config = if let Some((cert, key)) = &self.identity {
            let chain = certs("tls_cert_file", cert)?;
            let key = PrivateKeyDer::from_pem_slice(key)
                .map_err(|e| ("tls_key_file", FileProblem::tls(e)))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| ("tls_key_file", FileProblem::KeyMismatch(Arc::new(e))))?
        } else {
            builder.with_no_client_auth()
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(dir: &Path, files: &[(&str, &str)]) -> ShardSettings {
        let path = |name: &str| {
            files.iter().find(|(n, _)| *n == name).map(|(n, text)| {
                let p = dir.join(n);
                std::fs::write(&p, text).unwrap();
                p
            })
        };
        ShardSettings {
            name: "a".into(),
            endpoints: vec!["https://127.0.0.1:2379".into()],
            weight: 1,
            tls_ca_file: path("ca.pem").or(Some(dir.join("missing.pem"))),
            tls_cert_file: path("cert.pem"),
            tls_key_file: path("key.pem"),
            username: path("password").map(|_| "router".into()),
            password_file: path("password"),
        }
    }

    fn pki() -> (String, String, String) {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca.self_signed(&ca_key).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["router".to_string()])
            .unwrap()
            .signed_by(&key, &ca, &ca_key)
            .unwrap();
        (ca.pem(), cert.pem(), key.serialize_pem())
    }

    #[test]
    fn files_that_cannot_be_used_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, cert, _) = pki();
        let err = |files: &[(&str, &str)]| Access::load(&shard(dir.path(), files)).unwrap_err();
        let e = err(&[]);
        assert_eq!(e.setting, "tls_ca_file");
        assert!(e.to_string().contains("missing.pem"), "{e}");
        // The file system's error is kept as the source, not only as text.
        let source = std::error::Error::source(&e).expect("a source");
        let FileProblem::Unreadable(io) =
            source.downcast_ref::<FileProblem>().expect("a FileProblem")
        else {
            panic!("not Unreadable: {e}");
        };
        assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
        let e = err(&[("ca.pem", "not a certificate")]);
        assert_eq!(e.setting, "tls_ca_file");
        assert!(matches!(e.problem, FileProblem::NoCertificate), "{e}");
        let e = err(&[("ca.pem", &ca), ("cert.pem", &cert), ("key.pem", "garbage")]);
        assert_eq!(e.setting, "tls_key_file", "{e}");
        let (_, _, other_key) = pki();
        let e = err(&[
            ("ca.pem", &ca),
            ("cert.pem", &cert),
            ("key.pem", &other_key),
        ]);
        assert_eq!(e.setting, "tls_key_file", "{e}");
        assert!(matches!(e.problem, FileProblem::KeyMismatch(_)), "{e}");
        let e = err(&[("ca.pem", &ca), ("password", "\n")]);
        assert_eq!(e.setting, "password_file", "{e}");
        assert!(matches!(e.problem, FileProblem::Empty), "{e}");
    }

    #[test]
    fn loads_compare_by_content_and_never_print_secrets() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, cert, key) = pki();
        let files = [
            ("ca.pem", ca.as_str()),
            ("cert.pem", &cert),
            ("key.pem", &key),
            ("password", "s3cret-pw\n"),
        ];
        let s = shard(dir.path(), &files);
        let first = Access::load(&s).unwrap();
        assert_eq!(first.user().unwrap().credentials().1, "s3cret-pw");
        assert_eq!(first, Access::load(&s).unwrap());
        let shown = format!("{first:?}");
        assert!(
            !shown.contains("s3cret") && !shown.contains("PRIVATE"),
            "{shown}"
        );
        // A rotated certificate (same paths, new contents) is another access.
        let (_, cert2, key2) = pki();
        std::fs::write(dir.path().join("cert.pem"), cert2).unwrap();
        std::fs::write(dir.path().join("key.pem"), key2).unwrap();
        let rotated = Access::load(&s).unwrap();
        assert_ne!(first, rotated);
    }
}
