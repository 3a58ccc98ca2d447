//! How the operator's commands print what a router answered, as kubectl
//! and etcdctl do: `-o table` for people (the default when stdout is a
//! terminal), `-o json` for scripts (the default otherwise, so a pipe into
//! `jq` needs no flag) and `-o yaml`. JSON and YAML carry the router's
//! answer with every key sorted at every level, so the same answer always
//! prints the same text whatever order a router wrote it in; the tables
//! are in [`super::views`].

use std::io::IsTerminal;
use std::time::{Duration, SystemTime};

use serde_json::Value;

/// An output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Aligned columns for people.
    Table,
    /// The answer as JSON, keys sorted.
    Json,
    /// The answer as YAML, keys sorted.
    Yaml,
}

/// The `-o` flag, flattened into each command that prints an answer.
#[derive(clap::Args, Debug, Clone)]
pub struct OutputArg {
    /// How to print the answer: table, json or yaml (default: table when
    /// stdout is a terminal, json otherwise).
    #[arg(long, short = 'o', value_enum, value_name = "FORMAT")]
    pub output: Option<Format>,
}

impl OutputArg {
    /// The format asked for, or the default for where stdout goes.
    pub fn format(&self) -> Format {
        self.output.unwrap_or_else(|| {
            if std::io::stdout().is_terminal() {
                Format::Table
            } else {
                Format::Json
            }
        })
    }
}

/// `value` as pretty JSON with its keys sorted.
pub fn json(value: &Value) -> String {
    serde_json::to_string_pretty(&sorted(value.clone())).expect("JSON serialises")
}

/// `value` as one line of JSON with its keys sorted (`locks --all`).
pub fn json_line(value: &Value) -> String {
    sorted(value.clone()).to_string()
}

/// `value` as a YAML document (`---` first, a newline last) with its
/// keys sorted.
pub fn yaml(value: &Value) -> String {
    let mut out = String::new();
    let mut emitter = yaml_rust2::YamlEmitter::new(&mut out);
    emitter
        .dump(&to_yaml(&sorted(value.clone())))
        .expect("YAML emits into a String");
    out.push('\n');
    out
}

/// Sorts the keys of every object in `value`. serde_json keeps them
/// sorted already unless a dependency turns on its `preserve_order`
/// feature; this keeps the output the same either way.
fn sorted(value: Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut pairs: Vec<(String, Value)> = map.into_iter().collect();
            pairs.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Object(pairs.into_iter().map(|(k, v)| (k, sorted(v))).collect())
        }
        Value::Array(items) => Value::Array(items.into_iter().map(sorted).collect()),
        other => other,
    }
}

fn to_yaml(value: &Value) -> yaml_rust2::Yaml {
    use yaml_rust2::Yaml;
    match value {
        Value::Null => Yaml::Null,
        Value::Bool(b) => Yaml::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => Yaml::Integer(i),
            None => Yaml::Real(n.to_string()),
        },
        Value::String(s) => Yaml::String(s.clone()),
        Value::Array(items) => Yaml::Array(items.iter().map(to_yaml).collect()),
        Value::Object(map) => Yaml::Hash(
            map.iter()
                .map(|(k, v)| (Yaml::String(k.clone()), to_yaml(v)))
                .collect(),
        ),
    }
}

/// Rows under upper-case headers, each column as wide as its widest cell,
/// three spaces apart (kubectl's layout).
pub struct Table {
    header: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&'static str]) -> Self {
        Self {
            header: header.to_vec(),
            rows: Vec::new(),
        }
    }

    /// Adds a row; it must have a cell for each header.
    pub fn row(&mut self, cells: Vec<String>) {
        debug_assert_eq!(cells.len(), self.header.len());
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let header = self.header.iter().map(|h| h.to_string()).collect();
        let mut out = String::new();
        for row in std::iter::once(&header).chain(&self.rows) {
            let mut line = String::new();
            for (i, (cell, w)) in row.iter().zip(&widths).enumerate() {
                if i > 0 {
                    line.push_str("   ");
                }
                line.push_str(cell);
                line.extend(std::iter::repeat_n(' ', w - cell.chars().count()));
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// `label value` lines, the labels padded to one width.
pub fn fields(pairs: &[(&str, String)]) -> String {
    let width = pairs.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    pairs
        .iter()
        .map(|(k, v)| format!("{k:width$}   {v}\n"))
        .collect()
}

/// A duration as kubectl prints an age: its two largest units
/// (`45s`, `4m10s`, `2h5m`, `3d4h`).
pub fn short(d: Duration) -> String {
    let s = d.as_secs();
    let (days, hours, mins, secs) = (s / 86_400, s / 3_600 % 24, s / 60 % 60, s % 60);
    match (days, hours, mins) {
        (0, 0, 0) => format!("{secs}s"),
        (0, 0, _) if secs == 0 => format!("{mins}m"),
        (0, 0, _) => format!("{mins}m{secs}s"),
        (0, _, 0) => format!("{hours}h"),
        (0, _, _) => format!("{hours}h{mins}m"),
        (_, 0, _) => format!("{days}d"),
        _ => format!("{days}d{hours}h"),
    }
}

/// The time from `now` to an RFC 3339 `at` (`expiresAt`), by this
/// machine's clock: `-` when `at` is missing or unreadable, `0s` once past.
pub fn left(at: Option<&str>, now: SystemTime) -> String {
    match at.and_then(|a| humantime::parse_rfc3339(a).ok()) {
        Some(at) => short(at.duration_since(now).unwrap_or_default()),
        None => "-".into(),
    }
}

/// The time from an RFC 3339 `at` (`acquiredAt`) to `now`, by this
/// machine's clock: `-` when `at` is missing or unreadable.
pub fn age(at: Option<&str>, now: SystemTime) -> String {
    match at.and_then(|a| humantime::parse_rfc3339(a).ok()) {
        Some(at) => short(now.duration_since(at).unwrap_or_default()),
        None => "-".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_and_yaml_sort_keys_at_every_level() {
        let v = json!({"b": 1, "a": {"d": [{"r": true, "q": null}], "c": "x"}});
        assert_eq!(
            json_line(&v),
            r#"{"a":{"c":"x","d":[{"q":null,"r":true}]},"b":1}"#
        );
        let y = yaml(&v);
        assert!(y.find("a:").unwrap() < y.find("b:").unwrap(), "{y}");
        assert!(y.find("q: ~").unwrap() < y.find("r: true").unwrap(), "{y}");
        // A string that reads as another type stays a string.
        assert!(yaml(&json!({"n": "42"})).contains("\"42\""));
    }

    #[test]
    fn tables_align_columns_and_durations_read_like_kubectl() {
        let mut t = Table::new(&["NAME", "TOKEN"]);
        t.row(vec!["job:long-name".into(), "7".into()]);
        t.row(vec!["a".into(), "140737488355329".into()]);
        assert_eq!(
            t.render(),
            "NAME            TOKEN\njob:long-name   7\na               140737488355329\n"
        );
        for (secs, want) in [
            (0, "0s"),
            (45, "45s"),
            (60, "1m"),
            (250, "4m10s"),
            (7_500, "2h5m"),
            (7_200, "2h"),
            (273_600, "3d4h"),
        ] {
            assert_eq!(short(Duration::from_secs(secs)), want, "{secs}");
        }
        let now = humantime::parse_rfc3339("2026-11-30T03:38:20.000Z").unwrap();
        assert_eq!(left(Some("2026-11-30T03:38:50.123Z"), now), "30s");
        assert_eq!(left(Some("2026-11-30T03:38:00.000Z"), now), "0s");
        assert_eq!(age(Some("2026-11-30T03:37:20.000Z"), now), "1m");
        assert_eq!(left(None, now), "-");
    }
}
