//! `--compare`: the targets of earlier runs side by side, one column per
//! run, named by the etcd release it ran on (`make bench` runs the suite
//! on the system's etcd and again on etcd 3.5).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

#[derive(Deserialize)]
struct Summary {
    machine: Machine,
    targets: Vec<Target>,
}

#[derive(Deserialize)]
struct Machine {
    etcd: String,
}

#[derive(Deserialize)]
struct Target {
    name: String,
    rule: String,
    limit: f64,
    measured: f64,
    met: bool,
}

/// Writes `compare.md` under `out` from the `summary.json` of each of
/// `runs`; returns its path.
pub fn write(runs: &[PathBuf], out: &Path) -> Result<PathBuf> {
    if runs.len() < 2 {
        bail!("--compare needs two or more output directories");
    }
    let summaries = runs
        .iter()
        .map(|dir| {
            let path = dir.join("summary.json");
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            serde_json::from_str::<Summary>(&text)
                .with_context(|| format!("{} is not a summary", path.display()))
        })
        .collect::<Result<Vec<_>>>()?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let path = out.join("compare.md");
    std::fs::write(&path, table(runs, &summaries))
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// One row per target any run measured, in the first run's order; "–"
/// where a run did not measure it; misses in bold.
fn table(runs: &[PathBuf], summaries: &[Summary]) -> String {
    let mut names: Vec<(&str, String)> = Vec::new();
    for s in summaries {
        for t in &s.targets {
            if !names.iter().any(|(n, _)| *n == t.name) {
                names.push((&t.name, format!("{} {}", t.rule, number(t.limit))));
            }
        }
    }
    let mut md = String::from("# Targets side by side\n\n| target | limit |");
    for (dir, s) in runs.iter().zip(summaries) {
        let release = s.machine.etcd.trim_start_matches("etcd Version: ");
        md += &format!(" etcd {release} (`{}`) |", dir.display());
    }
    md += "\n|---|---|";
    md += &"---|".repeat(runs.len());
    md += "\n";
    for (name, limit) in names {
        md += &format!("| {name} | {limit} |");
        for s in summaries {
            md += &match s.targets.iter().find(|t| t.name == name) {
                Some(t) if t.met => format!(" {} |", number(t.measured)),
                Some(t) => format!(" **{}** |", number(t.measured)),
                None => " – |".to_string(),
            };
        }
        md += "\n";
    }
    md
}

fn number(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        format!("{x:.0}")
    } else {
        format!("{x:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(etcd: &str, targets: &[(&str, f64, bool)]) -> Summary {
        Summary {
            machine: Machine { etcd: etcd.into() },
            targets: targets
                .iter()
                .map(|&(name, measured, met)| Target {
                    name: name.into(),
                    rule: "<=".into(),
                    limit: 3.0,
                    measured,
                    met,
                })
                .collect(),
        }
    }

    #[test]
    fn every_target_gets_a_row_and_each_run_a_column() {
        let runs = [PathBuf::from("a"), PathBuf::from("b")];
        let md = table(
            &runs,
            &[
                summary(
                    "etcd Version: 3.4.23",
                    &[("etcd µs", 6.5, false), ("held", 200000.0, true)],
                ),
                summary("etcd Version: 3.5.16", &[("etcd µs", 2.5, true)]),
            ],
        );
        assert!(
            md.contains("| etcd 3.4.23 (`a`) | etcd 3.5.16 (`b`) |"),
            "{md}"
        );
        assert!(
            md.contains("| etcd µs | <= 3 | **6.500** | 2.500 |"),
            "{md}"
        );
        assert!(md.contains("| held | <= 3 | 200000 | – |"), "{md}");
    }
}
