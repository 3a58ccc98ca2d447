//! The identities a client certificate carries (mTLS), which principals'
//! `tls_identity` name.

/// The identities a client certificate carries: its DNS and URI subject
/// alternative names and its subject's common names. Read once per
/// connection; empty without a client certificate.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PeerIdentity {
    pub names: Vec<String>,
}

impl PeerIdentity {
    /// The identities of the first (end-entity) certificate of `chain`.
    /// The TLS layer has verified the chain; an unparsable certificate
    /// carries no identity.
    pub fn of(chain: Option<&[rustls::pki_types::CertificateDer<'_>]>) -> Self {
        use x509_parser::extensions::GeneralName;
        let Some(cert) = chain.and_then(|c| c.first()) else {
            return Self::default();
        };
        let Ok((_, cert)) = x509_parser::parse_x509_certificate(cert.as_ref()) else {
            return Self::default();
        };
        let mut names: Vec<String> = Vec::new();
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for name in &san.value.general_names {
                match name {
                    GeneralName::DNSName(n) | GeneralName::URI(n) => names.push(n.to_string()),
                    _ => {}
                }
            }
        }
        for cn in cert.subject().iter_common_name() {
            if let Ok(cn) = cn.as_str() {
                names.push(cn.to_string());
            }
        }
        Self { names }
    }
}
