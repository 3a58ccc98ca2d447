//! Docs that must agree with the code, read from the code's own sources of
//! truth: `config/example.toml` shows every key the config accepts (and
//! no other), `docs/metrics.md` has a row for every series the router
//! names (`src/metrics.rs`, where every `lockrouter_*` name is written) and
//! lists every `op` label of `lockrouter_requests_total` (and no other).
//! Adding a key, a series or a route without documenting it fails here.

use std::collections::BTreeSet;
use std::path::Path;

use lockrouter::http::routes::Route;
use lockrouter::Settings;

fn read(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The example with its commented-out settings (`# key = value`,
/// `# [section]`, `# [[table]]`, however deeply commented) turned back
/// into TOML; explanatory comments stay comments.
fn uncommented(example: &str) -> String {
    example
        .lines()
        .map(|line| {
            let bare = line.trim_start_matches(|c: char| c == '#' || c.is_whitespace());
            let key: String = bare
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            let setting = !key.is_empty() && bare[key.len()..].trim_start().starts_with('=');
            let table = bare.starts_with('[') && bare.trim_end().ends_with(']')
                || bare.starts_with('[') && bare.contains("] ");
            if line.trim_start().starts_with('#') && (setting || table) {
                bare.to_string()
            } else {
                line.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The keys holding values in `value`, as `Settings::keys` names them
/// (`server.listen`, `shards[].weight`).
fn keys_of(value: &serde_json::Value, path: &str, out: &mut BTreeSet<String>) {
    let below = |key: &str| {
        if path.is_empty() {
            key.to_string()
        } else {
            format!("{path}.{key}")
        }
    };
    match value {
        serde_json::Value::Object(map) => {
            for (key, v) in map {
                match v {
                    serde_json::Value::Object(_) => keys_of(v, &below(key), out),
                    serde_json::Value::Array(items) if items.iter().all(|i| i.is_object()) => {
                        let array = format!("{}[]", below(key));
                        if items.is_empty() {
                            out.insert(below(key));
                        }
                        for item in items {
                            keys_of(item, &array, out);
                        }
                    }
                    _ => {
                        out.insert(below(key));
                    }
                }
            }
        }
        other => panic!("{path}: not a table: {other}"),
    }
}

#[test]
fn the_example_config_shows_every_key_the_config_accepts() {
    let example = read("config/example.toml");
    // As shipped, it is a config the router accepts.
    if let Err(e) = Settings::from_toml(&example) {
        panic!("config/example.toml is refused: {e}");
    }
    let all = uncommented(&example);
    let parsed: serde_json::Value = config::Config::builder()
        .add_source(config::File::from_str(&all, config::FileFormat::Toml))
        .build()
        .and_then(|c| c.try_deserialize())
        .unwrap_or_else(|e| panic!("config/example.toml, uncommented, is not TOML ({e}):\n{all}"));
    let mut shown = BTreeSet::new();
    keys_of(&parsed, "", &mut shown);
    let accepted: BTreeSet<String> = Settings::keys().values().into_iter().collect();
    let missing: Vec<&String> = accepted.difference(&shown).collect();
    let unknown: Vec<&String> = shown.difference(&accepted).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "config/example.toml lacks {missing:?} and shows keys the config refuses: {unknown:?}"
    );
}

/// The `op` label of requests no route matches (set where requests are
/// counted, in the HTTP layer).
const UNMATCHED_OP: &str = "unknown";

#[test]
fn metrics_md_lists_every_op_label() {
    let doc = read("docs/metrics.md");
    let row = doc
        .lines()
        .find(|l| l.starts_with("| `lockrouter_requests_total`"))
        .expect("docs/metrics.md has a row for lockrouter_requests_total");
    let ops = row
        .split_once("`op`: ")
        .and_then(|(_, rest)| rest.split_once(". `outcome`"))
        .map(|(ops, _)| ops)
        .expect("the row lists `op`: ... before `outcome`");
    let documented: BTreeSet<&str> = ops.split('`').skip(1).step_by(2).collect();
    let labels: BTreeSet<&str> = Route::ALL
        .iter()
        .map(|r| r.label())
        .chain([UNMATCHED_OP])
        .collect();
    let missing: Vec<&&str> = labels.difference(&documented).collect();
    let unknown: Vec<&&str> = documented.difference(&labels).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "docs/metrics.md's op list lacks {missing:?} and names labels no route has: {unknown:?}"
    );
}

#[test]
fn metrics_md_has_a_row_for_every_series() {
    let doc = read("docs/metrics.md");
    let code = read("src/metrics.rs");
    // The unit tests record series of their own.
    let code = code.split("#[cfg(test)]").next().unwrap();
    let named: BTreeSet<&str> = code
        .split('"')
        .skip(1)
        .step_by(2)
        .filter(|s| s.starts_with("lockrouter_"))
        .collect();
    assert!(named.len() > 30, "{named:?}");
    let missing: Vec<&&str> = named
        .iter()
        .filter(|n| !doc.contains(&format!("\n| `{n}` |")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/metrics.md has no row for {missing:?}"
    );
}

/// The README's configuration table has a row for every key the config
/// accepts (design.md says it lists them all): named in a row's first
/// cell, or, for an array's entries, in the row of the array (`a[]`).
#[test]
fn the_readme_lists_every_config_key() {
    let readme = read("README.md");
    // Each row's first cell's keys, and the whole row.
    let rows: Vec<(Vec<&str>, &str)> = readme
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|l| {
            let first = l[1..].split('|').next().unwrap_or("");
            (first.split('`').skip(1).step_by(2).collect(), l)
        })
        .collect();
    let listed = |key: &str| {
        rows.iter().any(|(keys, row)| {
            keys.contains(&key)
                || key.split_once("[].").is_some_and(|(array, field)| {
                    keys.contains(&format!("{array}[]").as_str())
                        && row.contains(&format!("`{field}`"))
                })
        })
    };
    let missing: Vec<String> = Settings::keys()
        .values()
        .into_iter()
        .filter(|k| !listed(k))
        .collect();
    assert!(
        missing.is_empty(),
        "README.md's configuration table lacks {missing:?}"
    );
}
