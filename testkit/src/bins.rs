//! Where cargo put this workspace's binaries. The kit is compiled before
//! the binaries it runs, so it cannot name them at compile time
//! (`CARGO_BIN_EXE_*` exists only for a package's own tests): it finds them
//! at run time beside the running executable. Examples are built on demand.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `target/<profile>`: the directory of the running executable, or its
/// parent for a test binary, which cargo puts in `target/<profile>/deps`.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the running executable's path");
    let dir = exe.parent().expect("an executable lives in a directory");
    if dir.ends_with("deps") {
        dir.parent().expect("deps lives in target/<profile>").into()
    } else {
        dir.into()
    }
}

/// The `lockrouter` binary of the same build (cargo builds it before the
/// package's integration tests run).
pub fn lockrouter() -> PathBuf {
    profile_dir().join("lockrouter")
}

/// The path of example `name` of the package in `package_dir` (its
/// `CARGO_MANIFEST_DIR`), built now if it is missing or older than its
/// sources: `cargo test` builds examples only when it builds every target,
/// not for `--test tests` alone.
pub fn example(package_dir: impl AsRef<Path>, name: &str) -> PathBuf {
    let package_dir = package_dir.as_ref();
    let profile_dir = profile_dir();
    let path = profile_dir.join("examples").join(name);
    if is_stale(&path, package_dir, name) {
        let mut cargo = Command::new(env!("CARGO"));
        cargo
            .args(["build", "--example", name, "--manifest-path"])
            .arg(package_dir.join("Cargo.toml"));
        if profile_dir.ends_with("release") {
            cargo.arg("--release");
        }
        let status = cargo.status().expect("run cargo build --example");
        assert!(status.success(), "cargo build --example {name} failed");
    }
    assert!(path.exists(), "example {name} not found at {path:?}");
    path
}

/// Missing, or older than a source it is built from (its own folder and
/// the client crate the examples are written against).
fn is_stale(binary: &Path, package_dir: &Path, name: &str) -> bool {
    let Ok(built) = binary.metadata().and_then(|m| m.modified()) else {
        return true;
    };
    let dirs = [
        package_dir.join("examples").join(name),
        package_dir.join("clients/rust/src"),
    ];
    dirs.iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flatten()
        .filter_map(|e| e.ok()?.metadata().ok()?.modified().ok())
        .any(|changed| changed > built)
}
