//! A secret value of the config: the admin token, a lockId key, a
//! password read from a file. Its `Debug` prints `Secret(***)`, it
//! serialises as `"***"` (what `config check` prints) and it has no
//! `Display`, so that no log line, error message or debug dump of the
//! settings carries it; [`Secret::expose`] is the one way to read it, at
//! the place that uses it.

use std::fmt;

/// A value never shown: see the module doc.
#[derive(Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(transparent)]
pub struct Secret<T = String>(T);

impl<T> Secret<T> {
    pub fn new(value: T) -> Self {
        Self(value)
    }

    /// The value, for the one use that needs it (a comparison, a key).
    pub fn expose(&self) -> &T {
        &self.0
    }
}

impl<T> fmt::Debug for Secret<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl<T> serde::Serialize for Secret<T> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("***")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_shows_as_stars_and_reads_only_by_expose() {
        let s = Secret::new("hunter2-hunter2-hunter2".to_string());
        assert_eq!(format!("{s:?}"), "Secret(***)");
        assert_eq!(format!("{:?}", Some(&s)), "Some(Secret(***))");
        assert_eq!(serde_json::to_string(&s).unwrap(), r#""***""#);
        assert_eq!(s.expose(), "hunter2-hunter2-hunter2");
        let read: Secret = serde_json::from_str(r#""from-a-file""#).unwrap();
        assert_eq!(read.expose(), "from-a-file");
    }
}
