//! Every key the config accepts, as dotted paths (`server.listen`,
//! `shards[].endpoints`), read off the settings types themselves: a serde
//! deserializer that reads no input and records each struct's fields as
//! it walks them. A field added to a settings struct is a key here at
//! once, with no list to keep up to date. `Settings::load` checks
//! `LOCKROUTER__…` variables against it, so that a misspelt variable is
//! named as a variable; the tests check that `config/example.toml` shows
//! every key.

use serde::de::value::{Error, StrDeserializer};
use serde::de::{self, DeserializeSeed, IntoDeserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

/// The keys of a settings type, in declaration order: sections and arrays
/// of tables (`auth.principals`) as well as the keys that hold values. An
/// array of tables' keys are below `name[]` (`shards[].weight`).
#[derive(Debug, Clone)]
pub struct Keys(Vec<String>);

impl Keys {
    /// The keys of `T`, read off its `Deserialize` impl.
    pub fn of<'de, T: Deserialize<'de>>() -> Self {
        let mut keys = Vec::new();
        let walker = Walker {
            path: String::new(),
            keys: &mut keys,
        };
        // The walker gives every field a value of its own type: only a
        // type serde cannot describe (a map, an untagged enum) fails here.
        T::deserialize(walker).expect("the settings types describe their keys");
        Self(keys)
    }

    pub fn all(&self) -> &[String] {
        &self.0
    }

    pub fn contains(&self, key: &str) -> bool {
        self.0.iter().any(|k| k == key)
    }

    /// Whether `key` is an array of tables (`shards`).
    pub fn is_array_of_tables(&self, key: &str) -> bool {
        let below = format!("{key}[].");
        self.0.iter().any(|k| k.starts_with(&below))
    }

    /// The keys that hold values (not sections nor arrays of tables).
    pub fn values(&self) -> Vec<String> {
        let is_table = |k: &String| {
            let (section, array) = (format!("{k}."), format!("{k}[]."));
            self.0
                .iter()
                .any(|other| other.starts_with(&section) || other.starts_with(&array))
        };
        self.0.iter().filter(|k| !is_table(k)).cloned().collect()
    }

    /// The keys directly below `parent` (`""` for the top level), by their
    /// last segment.
    pub fn children(&self, parent: &str) -> Vec<String> {
        self.0
            .iter()
            .filter_map(|k| {
                let rest = if parent.is_empty() {
                    k.as_str()
                } else {
                    k.strip_prefix(parent)?.strip_prefix('.')?
                };
                (!rest.contains('.') && !rest.contains("[]")).then(|| rest.to_string())
            })
            .collect()
    }
}

/// Deserializes any settings type from nothing, pushing the path of every
/// struct field it meets onto `keys`.
struct Walker<'a> {
    path: String,
    keys: &'a mut Vec<String>,
}

impl Walker<'_> {
    fn below(&mut self, segment: &str) -> Walker<'_> {
        let path = match (self.path.is_empty(), segment) {
            (_, "[]") => format!("{}[]", self.path),
            (true, _) => segment.to_string(),
            (false, _) => format!("{}.{segment}", self.path),
        };
        Walker {
            path,
            keys: self.keys,
        }
    }
}

/// Scalars get their zero value: the walk only needs the type to build.
macro_rules! zero {
    ($($method:ident => $visit:ident($($value:expr)?)),* $(,)?) => {
        $(fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            visitor.$visit($($value)?)
        })*
    };
}

impl<'de> de::Deserializer<'de> for Walker<'_> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Error> {
        Err(de::Error::custom(format!(
            "{}: a settings type without a fixed shape",
            self.path
        )))
    }

    zero! {
        deserialize_bool => visit_bool(false),
        deserialize_i8 => visit_i64(0),
        deserialize_i16 => visit_i64(0),
        deserialize_i32 => visit_i64(0),
        deserialize_i64 => visit_i64(0),
        deserialize_u8 => visit_u64(0),
        deserialize_u16 => visit_u64(0),
        deserialize_u32 => visit_u64(0),
        deserialize_u64 => visit_u64(0),
        deserialize_f32 => visit_f64(0.0),
        deserialize_f64 => visit_f64(0.0),
        deserialize_char => visit_char(' '),
        deserialize_str => visit_str(""),
        deserialize_string => visit_str(""),
        deserialize_bytes => visit_bytes(&[]),
        deserialize_byte_buf => visit_bytes(&[]),
        deserialize_unit => visit_unit(),
        deserialize_identifier => visit_str(""),
        deserialize_ignored_any => visit_unit(),
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_some(self)
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        visitor.visit_unit()
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        visitor.visit_newtype_struct(self)
    }

    /// One element, whose keys are below `path[]`.
    fn deserialize_seq<V: Visitor<'de>>(mut self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_seq(One(Some(self.below("[]"))))
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, _: usize, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: usize,
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_any(visitor)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        visitor.visit_map(Fields {
            walker: self,
            fields: fields.iter(),
            current: None,
        })
    }

    /// The first variant: enums in the settings are unit variants.
    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        let first: StrDeserializer<'_, Error> = variants[0].into_deserializer();
        visitor.visit_enum(first)
    }
}

/// A struct's fields, each recorded as a key and given a walked value.
struct Fields<'a> {
    walker: Walker<'a>,
    fields: std::slice::Iter<'static, &'static str>,
    current: Option<&'static str>,
}

impl<'de> MapAccess<'de> for Fields<'_> {
    type Error = Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Error> {
        let Some(field) = self.fields.next() else {
            return Ok(None);
        };
        self.current = Some(field);
        let key = self.walker.below(field).path;
        self.walker.keys.push(key);
        let name: StrDeserializer<'_, Error> = field.into_deserializer();
        seed.deserialize(name).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
        let field = self.current.take().expect("a value follows its key");
        seed.deserialize(self.walker.below(field))
    }
}

/// A sequence of one walked element.
struct One<'a>(Option<Walker<'a>>);

impl<'de> SeqAccess<'de> for One<'_> {
    type Error = Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Error> {
        self.0.take().map(|w| seed.deserialize(w)).transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;

    #[test]
    fn keys_come_from_the_settings_types() {
        let keys = Keys::of::<Settings>();
        for key in [
            "server",
            "server.listen",
            "server.max_in_flight",
            "limits.max_metadata_bytes",
            "auth.principals",
            "auth.principals[].max_sessions",
            "auth.lock_id_keys[].secret_file",
            "locks.lock_delay",
            "shards[].password_file",
        ] {
            assert!(keys.contains(key), "{key} missing: {keys:?}");
        }
        let values = keys.values();
        assert!(values.contains(&"shards[].endpoints".to_string()));
        assert!(!values.contains(&"server".to_string()));
        assert!(!values.contains(&"auth.principals".to_string()));
        assert!(keys.is_array_of_tables("shards") && !keys.is_array_of_tables("server"));
        let mut unique = keys.all().to_vec();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), keys.all().len(), "{keys:?}");
        assert_eq!(
            keys.children(""),
            ["server", "etcd", "ring", "limits", "admin", "auth", "locks", "shards"]
        );
        assert!(keys
            .children("server")
            .contains(&"tls_key_file".to_string()));
    }
}
