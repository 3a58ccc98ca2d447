//! Tests that keep the source tree's layout true to the `# Layout` doc of
//! `lib.rs`: every module is named there, each layer imports only from the
//! layers below it, and no modules import each other in a cycle. They read
//! the source files, so a `use` that breaks the layering fails the build's
//! tests, not a review.
//!
//! The same checks, with their own rank table, hold the client crate
//! (`client/src`, a flat crate: one layer entry per file) to the layers its
//! `lib.rs` describes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The router's layers, bottom (0) to top. A module may import from modules
/// of a lower rank, and from its own top-level module.
const RANKS: &[(&str, u32)] = &[
    ("config", 0),
    ("task", 0),
    ("metrics", 1),
    ("token", 2),
    ("tls", 2),
    ("auth", 3),
    ("shard", 3),
    ("placement", 4),
    ("locks", 5),
    ("cli", 5),
    ("reload", 6),
    ("http", 7),
    ("app", 8),
];

/// The client crate's layers, bottom (0) to top, one entry per file. Files
/// of one rank are independent of each other.
const CLIENT_RANKS: &[(&str, u32)] = &[
    ("error", 0),
    ("validity", 0),
    ("fencing", 0),
    ("info", 0),
    ("transport", 1),
    ("state", 2),
    ("registry", 3),
    ("release", 3),
    ("holds", 3),
    ("renewal", 4),
    ("keeper", 5),
    ("lock", 6),
    ("client", 7),
];

/// A source file and the module path it defines.
struct Module {
    path: Vec<String>,
    file: PathBuf,
    /// The code before its `#[cfg(test)]` module, comments dropped.
    code: String,
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The client crate's sources (`../client/src` from this crate's `src`).
fn client_src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("client/src")
}

fn modules(src: &Path) -> Vec<Module> {
    let mut out = Vec::new();
    walk(src, &mut Vec::new(), &mut out);
    out
}

fn walk(dir: &Path, prefix: &mut Vec<String>, out: &mut Vec<Module>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().flatten().collect();
    entries.sort_by_key(|e| e.path());
    for entry in entries {
        let file = entry.path();
        let name = file.file_stem().unwrap().to_string_lossy().to_string();
        if file.is_dir() {
            prefix.push(name);
            walk(&file, prefix, out);
            prefix.pop();
            continue;
        }
        if file.extension().is_none_or(|e| e != "rs") || name == "main" || name == "layout" {
            continue;
        }
        let mut path = prefix.clone();
        if name != "mod" && name != "lib" {
            path.push(name);
        }
        let text = std::fs::read_to_string(&file).unwrap();
        let before_tests = text.split("#[cfg(test)]").next().unwrap_or_default();
        let code = before_tests
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        out.push(Module { path, file, code });
    }
}

/// Identifiers following `prefix` in `code` (`crate::a::b` gives `a`, `b`).
fn paths_after(code: &str, prefix: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find(prefix) {
        let before = rest[..at].chars().last();
        rest = &rest[at + prefix.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        let segments: Vec<String> = rest
            .split("::")
            .map(|s| {
                s.chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect::<String>()
            })
            .take_while(|s| !s.is_empty())
            .collect();
        found.push(segments);
    }
    found
}

/// Names the crate root re-exports (`pub use a::b::{C, D}`), each with the
/// module it comes from, so that `crate::C` counts as an import of `a::b`
/// rather than of the root.
fn reexports(modules: &[Module], longest: impl Fn(Vec<String>) -> Vec<String>) -> Reexports {
    let mut out = BTreeMap::new();
    let Some(root) = modules.iter().find(|m| m.path.is_empty()) else {
        return out;
    };
    for statement in root.code.split(';') {
        let Some(at) = statement.find("pub use ") else {
            continue;
        };
        let used = statement[at + "pub use ".len()..].trim();
        let (prefix, items) = match used.split_once("::{") {
            Some((prefix, items)) => (prefix, items.trim_end_matches('}')),
            None => ("", used),
        };
        for item in items.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (item, name) = match item.split_once(" as ") {
                Some((item, alias)) => (item.trim(), alias.trim()),
                None => (item, item.rsplit("::").next().unwrap_or(item)),
            };
            let full: Vec<String> = prefix
                .split("::")
                .chain(item.split("::"))
                .filter(|s| !s.is_empty() && *s != "crate")
                .map(str::to_string)
                .collect();
            out.insert(name.to_string(), longest(full));
        }
    }
    out
}

type Reexports = BTreeMap<String, Vec<String>>;

/// Module paths each module refers to (the longest prefix that is a module,
/// or for a name the root re-exports, the module it comes from).
fn edges(modules: &[Module]) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let known: BTreeSet<Vec<String>> = modules.iter().map(|m| m.path.clone()).collect();
    let longest = |mut p: Vec<String>| {
        while !p.is_empty() && !known.contains(&p) {
            p.pop();
        }
        p
    };
    let reexported = reexports(modules, longest);
    let resolve = |p: Vec<String>| {
        let module = longest(p.clone());
        match p.first().and_then(|name| reexported.get(name)) {
            Some(source) if module.is_empty() => source.clone(),
            _ => module,
        }
    };
    let mut graph = BTreeMap::new();
    for m in modules {
        let mut refs = BTreeSet::new();
        for p in paths_after(&m.code, "crate::") {
            refs.insert(resolve(p));
        }
        let is_mod_rs = m.file.file_name().is_some_and(|f| f == "mod.rs");
        // `super` of a/b.rs is a, and of a/mod.rs the crate root.
        let parent: Vec<String> = m.path[..m.path.len().saturating_sub(1)].to_vec();
        for p in paths_after(&m.code, "super::") {
            let mut full = parent.clone();
            full.extend(p);
            refs.insert(resolve(full));
        }
        // A folder's mod.rs naming its children (`child::Item`, `use child::…`).
        if is_mod_rs || m.path.is_empty() {
            for child in known.iter().filter(|k| k.len() == m.path.len() + 1) {
                if !child.starts_with(&m.path) {
                    continue;
                }
                let name = format!("{}::", child.last().unwrap());
                if !paths_after(&m.code, &name).is_empty() {
                    refs.insert(child.clone());
                }
            }
        }
        refs.remove(&m.path);
        refs.remove(&Vec::new());
        graph.insert(m.path.clone(), refs);
    }
    graph
}

fn rank(ranks: &[(&str, u32)], top: &str) -> u32 {
    ranks
        .iter()
        .find(|(name, _)| *name == top)
        .unwrap_or_else(|| panic!("module {top} has no layer in layout.rs"))
        .1
}

/// Imports, in the crate at `src`, from a layer of `ranks` above or beside
/// the importing module's.
fn upward_imports(src: &Path, ranks: &[(&str, u32)]) -> Vec<String> {
    let modules = modules(src);
    let mut wrong = Vec::new();
    for (from, refs) in edges(&modules) {
        let Some(top) = from.first() else { continue }; // lib.rs
        for to in refs {
            let target = &to[0];
            if target != top && rank(ranks, target) >= rank(ranks, top) {
                wrong.push(format!("{} imports {}", from.join("::"), to.join("::")));
            }
        }
    }
    wrong
}

#[test]
fn every_layer_imports_only_from_layers_below_it() {
    let wrong = upward_imports(&src(), RANKS);
    assert!(
        wrong.is_empty(),
        "imports from a layer above (or beside):\n{}",
        wrong.join("\n")
    );
}

#[test]
fn every_client_file_imports_only_from_layers_below_it() {
    let wrong = upward_imports(&client_src(), CLIENT_RANKS);
    assert!(
        wrong.is_empty(),
        "client: imports from a layer above (or beside):\n{}",
        wrong.join("\n")
    );
}

#[test]
fn no_modules_import_each_other_in_a_cycle() {
    let cycles = cycles(&src());
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

#[test]
fn no_client_files_import_each_other_in_a_cycle() {
    let cycles = cycles(&client_src());
    assert!(
        cycles.is_empty(),
        "client: import cycles:\n{}",
        cycles.join("\n")
    );
}

/// Import cycles among the modules of the crate at `src`.
fn cycles(src: &Path) -> Vec<String> {
    let graph = edges(&modules(src));
    // Depth-first search; a grey node met again closes a cycle.
    fn visit<'a>(
        node: &'a Vec<String>,
        graph: &'a BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        state: &mut BTreeMap<&'a Vec<String>, bool>,
        stack: &mut Vec<&'a Vec<String>>,
        cycles: &mut Vec<String>,
    ) {
        match state.get(node) {
            Some(true) => {
                let at = stack.iter().position(|n| *n == node).unwrap();
                let cycle: Vec<String> = stack[at..].iter().map(|n| n.join("::")).collect();
                cycles.push(format!("{} -> {}", cycle.join(" -> "), node.join("::")));
                return;
            }
            Some(false) => return,
            None => {}
        }
        state.insert(node, true);
        stack.push(node);
        for next in graph.get(node).into_iter().flatten() {
            visit(next, graph, state, stack, cycles);
        }
        stack.pop();
        state.insert(node, false);
    }
    let mut state = BTreeMap::new();
    let mut cycles = Vec::new();
    for node in graph.keys() {
        visit(node, &graph, &mut state, &mut Vec::new(), &mut cycles);
    }
    cycles
}

#[test]
fn the_layout_doc_names_every_module() {
    let modules = modules(&src());
    let lib = std::fs::read_to_string(src().join("lib.rs")).unwrap();
    let mut missing = Vec::new();
    for m in modules.iter().filter(|m| m.path.len() == 1) {
        if !lib.contains(&format!("[`{}`]", m.path[0])) {
            missing.push(format!("lib.rs does not name {}", m.path[0]));
        }
    }
    // Each folder's mod.rs names each of its files.
    for m in modules.iter().filter(|m| m.path.len() == 2) {
        let folder = src().join(&m.path[0]).join("mod.rs");
        let doc = std::fs::read_to_string(&folder).unwrap();
        let name = &m.path[1];
        if !doc.contains(&format!("[`{name}`]")) && !doc.contains(&format!("`{name}.rs`")) {
            missing.push(format!("{}/mod.rs does not name {name}", m.path[0]));
        }
    }
    // The tree in lib.rs names every file.
    let tree: String = lib
        .lines()
        .filter(|l| l.starts_with("//!   "))
        .collect::<Vec<_>>()
        .join("\n");
    for m in &modules {
        let Some(name) = m.path.last() else { continue };
        let word = |w: &str| {
            tree.split(|c: char| !c.is_alphanumeric() && c != '_')
                .any(|x| x == w)
        };
        if !word(name) {
            missing.push(format!(
                "the tree in lib.rs does not name {}",
                m.path.join("/")
            ));
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

#[test]
fn the_client_layout_doc_names_every_file() {
    let lib = std::fs::read_to_string(client_src().join("lib.rs")).unwrap();
    let layout: String = lib
        .lines()
        .filter_map(|l| l.strip_prefix("//!"))
        .skip_while(|l| l.trim() != "# Layout")
        .skip(1)
        .take_while(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    let missing: Vec<String> = modules(&client_src())
        .iter()
        .filter_map(|m| m.path.first())
        .filter(|name| !layout.contains(&format!("`{name}`")))
        .map(|name| format!("the # Layout of client/src/lib.rs does not name {name}"))
        .collect();
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}
