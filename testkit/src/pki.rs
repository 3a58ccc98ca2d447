//! Certificates made at test time (rcgen): a CA, and the server and client
//! certificates it signs, as PEM text, for etcd clusters and routers that
//! speak TLS. Nothing is kept between runs, and nothing here is trusted
//! by anything but the test that made it.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};

/// A certificate authority that signs leaf certificates.
pub struct Ca {
    /// The CA certificate, PEM: what a peer must trust.
    pub pem: String,
    cert: rcgen::Certificate,
    key: KeyPair,
}

/// A certificate and its private key, PEM.
pub struct Leaf {
    pub cert_pem: String,
    pub key_pem: String,
}

impl Ca {
    /// A new self-signed CA named `name`.
    pub fn new(name: &str) -> Self {
        let key = KeyPair::generate().expect("a key pair");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name = named(name);
        let cert = params.self_signed(&key).expect("a self-signed CA");
        Self {
            pem: cert.pem(),
            cert,
            key,
        }
    }

    /// A server certificate for `names` (IP addresses or DNS names). It is
    /// also good for client authentication: etcd dials its own gRPC server
    /// with it for its HTTP gateway.
    pub fn server(&self, names: &[&str]) -> Leaf {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names).expect("server params");
        params.distinguished_name = named("etcd");
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        self.sign(params)
    }

    /// A client certificate whose common name is `common_name`.
    pub fn client(&self, common_name: &str) -> Leaf {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("client params");
        params.distinguished_name = named(common_name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(params)
    }

    fn sign(&self, params: CertificateParams) -> Leaf {
        let key = KeyPair::generate().expect("a key pair");
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .expect("a signed certificate");
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}

fn named(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn
}

/// Writes `text` to `dir/name` and returns its path.
pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    path
}
