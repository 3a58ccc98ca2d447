//! TLS on the main listener (rustls): a certificate chain and key from PEM
//! files, and optionally a CA whose client certificates are required
//! (mTLS). The config in force is swapped on each config reload, so new
//! connections get new certificates while open ones go on undisturbed.
//! ALPN offers HTTP/2 and HTTP/1.1.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};

use crate::config::ServerSettings;

/// The TLS config `server` asks for, read from its files now; `None`
/// without `tls_cert_file`. The error names the setting and the problem.
pub fn load(server: &ServerSettings) -> Result<Option<Arc<ServerConfig>>, String> {
    let (Some(cert), Some(key)) = (&server.tls_cert_file, &server.tls_key_file) else {
        return Ok(None);
    };
    let certs = read_certs("server.tls_cert_file", cert)?;
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| format!("server.tls_key_file: {}: {e}", key.display()))?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?;
    let builder = match &server.tls_client_ca_file {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in read_certs("server.tls_client_ca_file", ca)? {
                roots
                    .add(c)
                    .map_err(|e| format!("server.tls_client_ca_file: {}: {e}", ca.display()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| format!("server.tls_client_ca_file: {}: {e}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|e| format!("server.tls_cert_file and server.tls_key_file: {e}"))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Some(Arc::new(config)))
}

fn read_certs(setting: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{setting}: {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{setting}: {}: no certificate in it",
            path.display()
        ));
    }
    Ok(certs)
}
