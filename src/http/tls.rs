//! TLS on the main listener (rustls): a certificate chain and key from PEM
//! files, and optionally a CA whose client certificates are required
//! (mTLS). The config in force is swapped on each config reload, so new
//! connections get new certificates while open ones go on undisturbed.
//! ALPN offers HTTP/2 and HTTP/1.1.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{VerifierBuilderError, WebPkiClientVerifier};
use rustls::{RootCertStore, ServerConfig};

use crate::config::ServerSettings;

/// Why the TLS files of `[server]` cannot be used. Each message names the
/// setting, and the file where one is at fault.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file that cannot be read or parsed.
    #[error("{setting}: {}: {source}", path.display())]
    Pem {
        setting: &'static str,
        path: PathBuf,
        #[source]
        source: pem::Error,
    },
    /// A certificate file without a certificate in it.
    #[error("{setting}: {}: no certificate in it", path.display())]
    NoCertificate {
        setting: &'static str,
        path: PathBuf,
    },
    /// The provider offers no protocol version rustls accepts.
    #[error("TLS: {0}")]
    Protocols(#[source] rustls::Error),
    /// A client CA certificate rustls refuses as a root.
    #[error("server.tls_client_ca_file: {}: {source}", path.display())]
    ClientCa {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    /// Client CA roots no verifier can be built from.
    #[error("server.tls_client_ca_file: {}: {source}", path.display())]
    ClientVerifier {
        path: PathBuf,
        #[source]
        source: VerifierBuilderError,
    },
    /// A certificate and key that do not make a server identity (a key
    /// not of the certificate, an unsupported key type).
    #[error("server.tls_cert_file and server.tls_key_file: {0}")]
    CertAndKey(#[source] rustls::Error),
}

/// The TLS config `server` asks for, read from its files now; `None`
/// without `tls_cert_file`.
pub fn load(server: &ServerSettings) -> Result<Option<Arc<ServerConfig>>, TlsError> {
    let (Some(cert), Some(key)) = (&server.tls_cert_file, &server.tls_key_file) else {
        return Ok(None);
    };
    let certs = read_certs("server.tls_cert_file", cert)?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|source| TlsError::Pem {
        setting: "server.tls_key_file",
        path: key.clone(),
        source,
    })?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Protocols)?;
    let builder = match &server.tls_client_ca_file {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in read_certs("server.tls_client_ca_file", ca)? {
                roots.add(c).map_err(|source| TlsError::ClientCa {
                    path: ca.clone(),
                    source,
                })?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|source| TlsError::ClientVerifier {
                    path: ca.clone(),
                    source,
                })?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(TlsError::CertAndKey)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Some(Arc::new(config)))
}

fn read_certs(
    setting: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|source| TlsError::Pem {
            setting,
            path: path.to_path_buf(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            setting,
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}
