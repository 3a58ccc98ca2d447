//! `docs/openapi.yaml` as a checker of real HTTP exchanges: it finds the
//! documented response of an operation for a status and validates the
//! answer's media type, required headers and body against it. OpenAPI 3.1
//! schemas are JSON Schema 2020-12, so one validator (with `format`
//! asserted) covers them; `$ref`s to `components/...` resolve because each
//! checked schema is compiled beside the document's `components`.

use std::path::Path;

use serde_json::{json, Map, Value};

/// One answer as it came off the wire.
#[derive(Clone)]
pub struct Exchange {
    pub status: u16,
    /// Header names in lower case.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl std::fmt::Debug for Exchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {:?} {}",
            self.status,
            self.headers,
            String::from_utf8_lossy(&self.body)
        )
    }
}

impl Exchange {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON (`Null` when empty).
    pub fn json(&self) -> Value {
        if self.body.is_empty() {
            return Value::Null;
        }
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }
}

pub struct Spec {
    /// The whole document as JSON, `components` included for `$ref`s.
    doc: Value,
}

impl Spec {
    /// Reads the document at `path` (the package's `docs/openapi.yaml`).
    pub fn load(path: impl AsRef<Path>) -> Self {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        let docs = yaml_rust2::YamlLoader::load_from_str(&text).expect("openapi.yaml parses");
        let doc = to_json(&docs[0]);
        assert_eq!(doc["openapi"].as_str().map(|v| &v[..4]), Some("3.1."));
        Self { doc }
    }

    pub fn doc(&self) -> &Value {
        &self.doc
    }

    /// The operation `method` of `template` (a key of `paths`).
    fn operation(&self, method: &str, template: &str) -> Result<&Value, String> {
        let op = &self.doc["paths"][template][method.to_lowercase()];
        if op.is_object() {
            Ok(op)
        } else {
            Err(format!("{method} {template} is not documented"))
        }
    }

    /// Follows a local `$ref` (`#/components/...`) if `v` is one.
    fn resolve<'a>(&'a self, v: &'a Value) -> &'a Value {
        match v.get("$ref").and_then(Value::as_str) {
            Some(r) => self
                .doc
                .pointer(r.strip_prefix('#').expect("local $ref"))
                .unwrap_or_else(|| panic!("dangling $ref {r}")),
            None => v,
        }
    }

    /// Checks one real answer of `method template` against the document:
    /// the status is documented, the media type is the documented one (no
    /// body where none is documented), required headers are present and
    /// valid, and the body validates against the schema.
    pub fn check(&self, method: &str, template: &str, answer: &Exchange) -> Result<(), String> {
        let op = self.operation(method, template)?;
        let status = answer.status.to_string();
        let response = op["responses"]
            .get(&status)
            .map(|r| self.resolve(r))
            .ok_or_else(|| format!("{method} {template}: status {status} is not documented"))?;
        let at = format!("{method} {template} {status}");
        if let Some(headers) = response.get("headers").and_then(Value::as_object) {
            for (name, h) in headers {
                let h = self.resolve(h);
                match answer.header(&name.to_lowercase()) {
                    None if h["required"] == true => {
                        return Err(format!("{at}: no {name} header"));
                    }
                    None => {}
                    Some(v) => {
                        let value = match h["schema"]["type"].as_str() {
                            Some("integer") => v.parse::<i64>().map(Value::from).map_err(|_| {
                                format!("{at}: header {name}: {v:?} is not an integer")
                            })?,
                            _ => Value::from(v),
                        };
                        self.validate(&h["schema"], &value)
                            .map_err(|e| format!("{at}: header {name}: {e}"))?;
                    }
                }
            }
        }
        let Some(content) = response.get("content").and_then(Value::as_object) else {
            return if answer.body.is_empty() {
                Ok(())
            } else {
                Err(format!("{at}: a body where none is documented"))
            };
        };
        let given = answer.header("content-type").unwrap_or("");
        let (media, entry) = content
            .iter()
            .find(|(media, _)| essence(media) == essence(given))
            .ok_or_else(|| {
                format!(
                    "{at}: Content-Type {given:?}, documented: {:?}",
                    content.keys().collect::<Vec<_>>()
                )
            })?;
        let body = if essence(media) == "application/json" {
            serde_json::from_slice(&answer.body)
                .map_err(|e| format!("{at}: the body is not JSON: {e}"))?
        } else {
            Value::from(String::from_utf8_lossy(&answer.body).into_owned())
        };
        self.validate(&entry["schema"], &body)
            .map_err(|e| format!("{at}: {e}\nbody: {body}"))
    }

    /// Like [`check`](Self::check), panicking with the problem.
    pub fn assert(&self, method: &str, template: &str, answer: &Exchange) {
        if let Err(e) = self.check(method, template, answer) {
            panic!("the answer does not match docs/openapi.yaml: {e}");
        }
    }

    /// Whether `body` is a valid request body of `method template`.
    pub fn request_problems(&self, method: &str, template: &str, body: &Value) -> Option<String> {
        let op = self.operation(method, template).unwrap();
        let schema = &self.resolve(&op["requestBody"])["content"]["application/json"]["schema"];
        assert!(
            schema.is_object(),
            "{method} {template} documents no JSON body"
        );
        self.validate(schema, body).err()
    }

    /// Validates `instance` against `schema`, a schema object of the
    /// document (its `$ref`s resolve against the document's components).
    pub fn validate(&self, schema: &Value, instance: &Value) -> Result<(), String> {
        let root = json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "components": self.doc["components"],
            "allOf": [schema],
        });
        let validator = jsonschema::options()
            .with_draft(jsonschema::Draft::Draft202012)
            .should_validate_formats(true)
            .build(&root)
            .map_err(|e| format!("the schema does not compile: {e}"))?;
        let errors: Vec<String> = validator
            .iter_errors(instance)
            .map(|e| format!("at {:?}: {e}", e.instance_path().to_string()))
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }
}

/// A media type without its parameters, in lower case.
fn essence(media: &str) -> String {
    media
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

fn to_json(y: &yaml_rust2::Yaml) -> Value {
    use yaml_rust2::Yaml;
    match y {
        Yaml::Real(r) => json!(r.parse::<f64>().expect("a YAML float")),
        Yaml::Integer(i) => json!(i),
        Yaml::String(s) => json!(s),
        Yaml::Boolean(b) => json!(b),
        Yaml::Array(a) => Value::Array(a.iter().map(to_json).collect()),
        Yaml::Hash(h) => {
            let mut map = Map::new();
            for (k, v) in h {
                let key = match k {
                    Yaml::String(s) => s.clone(),
                    Yaml::Integer(i) => i.to_string(),
                    Yaml::Boolean(b) => b.to_string(),
                    other => panic!("unexpected YAML key {other:?}"),
                };
                map.insert(key, to_json(v));
            }
            Value::Object(map)
        }
        Yaml::Null => Value::Null,
        Yaml::Alias(_) | Yaml::BadValue => panic!("unsupported YAML in openapi.yaml"),
    }
}
