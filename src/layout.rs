//! Tests that keep the source tree's layout true to the `# Layout` doc of
//! `lib.rs`: every module is named there, each layer imports only from the
//! layers below it, and no modules import each other in a cycle. They
//! parse the source files (syn): every path counts, in grouped `use`s, in
//! code and in macro calls, outside `#[cfg(test)]` items; so a `use` that
//! breaks the layering fails the build's tests, not a review. Two rules
//! the ranks alone would not give are checked too: only `shard/` names
//! etcd's client, and no layer above `locks/` and `placement/` reaches
//! into `shard/`.
//!
//! The same checks, with their own rank table, hold the client crate
//! (`clients/rust/src`, a flat crate: one layer entry per file) to the layers its
//! `lib.rs` describes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The router's layers, bottom (0) to top. A layer is a top-level module
/// or, where it has an entry of its own, a module inside one (`http::tls`:
/// the HTTP server's TLS, which `generation` builds from below `http`). A
/// module belongs to the longest entry that names it or a folder above it,
/// and may import from its own layer and from layers of a lower rank.
const RANKS: &[(&str, u32)] = &[
    ("config", 0),
    ("task", 0),
    ("refusal", 0),
    ("metrics", 1),
    ("token", 2),
    ("http::tls", 2),
    ("auth", 3),
    ("shard", 3),
    ("placement", 4),
    ("locks", 5),
    ("cli", 5),
    ("generation", 6),
    ("reload", 7),
    ("http", 8),
    ("app", 9),
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
    /// Every path the file names outside its `#[cfg(test)]` items, as
    /// written (`crate::a::b`, `super::c`, `child::d`), `use` groups
    /// expanded and paths inside macro calls included.
    paths: Vec<Vec<String>>,
    /// What the file re-exports (`pub use`): the name it is known by and
    /// the path it comes from.
    reexports: Vec<(String, Vec<String>)>,
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The client crate's sources (`clients/rust/src`).
fn client_src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/rust/src")
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
        let ast =
            syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: not Rust: {e}", file.display()));
        let mut seen = Paths::default();
        syn::visit::Visit::visit_file(&mut seen, &ast);
        out.push(Module {
            path,
            file,
            paths: seen.paths,
            reexports: seen.reexports,
        });
    }
}

/// The paths a file names, gathered from its syntax tree.
#[derive(Default)]
struct Paths {
    paths: Vec<Vec<String>>,
    reexports: Vec<(String, Vec<String>)>,
}

impl<'ast> syn::visit::Visit<'ast> for Paths {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        // A test module (or any `#[cfg(test)]` item) may use what it likes.
        if !item_attrs(item).iter().any(is_cfg_test) {
            syn::visit::visit_item(self, item);
        }
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        let mut leaves = Vec::new();
        use_leaves(&item.tree, &mut Vec::new(), &mut leaves);
        for (name, path) in leaves {
            if matches!(item.vis, syn::Visibility::Public(_)) {
                self.reexports.push((name, path.clone()));
            }
            self.paths.push(path);
        }
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        if path.segments.len() > 1 {
            let segments = path.segments.iter().map(|s| s.ident.to_string()).collect();
            self.paths.push(segments);
        }
        syn::visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        // A macro's arguments are tokens, not syntax: take the paths in
        // them from their text (`crate :: a :: b`).
        self.paths.extend(paths_in_tokens(&mac.tokens.to_string()));
        syn::visit::visit_macro(self, mac);
    }
}

/// Every path a `use` tree brings in, with the name each is known by:
/// `use a::{b, c::d as e, f::*}` gives `b` (a::b), `e` (a::c::d) and
/// `*` (a::f).
fn use_leaves(tree: &syn::UseTree, prefix: &mut Vec<String>, out: &mut Vec<(String, Vec<String>)>) {
    let with = |prefix: &Vec<String>, last: &syn::Ident| {
        let mut p = prefix.clone();
        if last != "self" {
            p.push(last.to_string());
        }
        p
    };
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_leaves(&p.tree, prefix, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) => {
            let path = with(prefix, &n.ident);
            let name = path.last().cloned().unwrap_or_default();
            out.push((name, path));
        }
        syn::UseTree::Rename(r) => out.push((r.rename.to_string(), with(prefix, &r.ident))),
        syn::UseTree::Glob(_) => out.push(("*".into(), prefix.clone())),
        syn::UseTree::Group(g) => {
            for tree in &g.items {
                use_leaves(tree, prefix, out);
            }
        }
    }
}

/// Paths of two segments or more in a macro's token text, whose segments
/// the tokenizer separated by ` :: `.
fn paths_in_tokens(text: &str) -> Vec<Vec<String>> {
    let words: Vec<&str> = text.split_whitespace().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < words.len() {
        let ident = |w: &str| w.chars().all(|c| c.is_alphanumeric() || c == '_');
        let mut path = vec![];
        let mut j = i;
        while j < words.len() && ident(words[j]) {
            path.push(words[j].to_string());
            if words.get(j + 1) == Some(&"::") {
                j += 2;
            } else {
                j += 1;
                break;
            }
        }
        if path.len() > 1 {
            out.push(path);
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

fn item_attrs(item: &syn::Item) -> &[syn::Attribute] {
    use syn::Item::*;
    match item {
        Const(i) => &i.attrs,
        Enum(i) => &i.attrs,
        ExternCrate(i) => &i.attrs,
        Fn(i) => &i.attrs,
        ForeignMod(i) => &i.attrs,
        Impl(i) => &i.attrs,
        Macro(i) => &i.attrs,
        Mod(i) => &i.attrs,
        Static(i) => &i.attrs,
        Struct(i) => &i.attrs,
        Trait(i) => &i.attrs,
        TraitAlias(i) => &i.attrs,
        Type(i) => &i.attrs,
        Union(i) => &i.attrs,
        Use(i) => &i.attrs,
        _ => &[],
    }
}

fn is_cfg_test(attr: &syn::Attribute) -> bool {
    attr.path().is_ident("cfg")
        && attr
            .meta
            .require_list()
            .is_ok_and(|l| l.tokens.to_string() == "test")
}

/// Names the crate root re-exports (`pub use a::b::{C, D}`), each with the
/// module it comes from, so that `crate::C` counts as an import of `a::b`
/// rather than of the root.
fn reexports(modules: &[Module], longest: impl Fn(Vec<String>) -> Vec<String>) -> Reexports {
    let mut out = BTreeMap::new();
    let Some(root) = modules.iter().find(|m| m.path.is_empty()) else {
        return out;
    };
    for (name, path) in &root.reexports {
        let full: Vec<String> = path.iter().filter(|s| *s != "crate").cloned().collect();
        out.insert(name.clone(), longest(full));
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
        let is_folder = m.file.file_name().is_some_and(|f| f == "mod.rs") || m.path.is_empty();
        let mut refs = BTreeSet::new();
        for p in &m.paths {
            let Some(first) = p.first() else { continue };
            let full = match first.as_str() {
                "crate" => p[1..].to_vec(),
                // `super` of a/b.rs is a, and of a/mod.rs the crate root.
                "super" => {
                    let mut base: Vec<String> = m.path.clone();
                    let mut rest = &p[..];
                    while rest.first().is_some_and(|s| s == "super") {
                        base.pop();
                        rest = &rest[1..];
                    }
                    base.extend(rest.iter().cloned());
                    base
                }
                "self" if is_folder => [&m.path[..], &p[1..]].concat(),
                // A folder's mod.rs (or lib.rs) naming its children
                // (`child::Item`, `use child::…`).
                name if is_folder
                    && known.contains(&[&m.path[..], &[name.to_string()]].concat()) =>
                {
                    [&m.path[..], &p[..]].concat()
                }
                _ => continue,
            };
            refs.insert(resolve(full));
        }
        refs.remove(&m.path);
        refs.remove(&Vec::new());
        graph.insert(m.path.clone(), refs);
    }
    graph
}

/// The layer of the module at `path` and its rank: the longest entry of
/// `ranks` that names the module or a folder above it.
fn layer<'r>(ranks: &[(&'r str, u32)], path: &[String]) -> (&'r str, u32) {
    (1..=path.len())
        .rev()
        .find_map(|n| {
            let name = path[..n].join("::");
            ranks.iter().find(|(layer, _)| *layer == name).copied()
        })
        .unwrap_or_else(|| panic!("module {} has no layer in layout.rs", path.join("::")))
}

/// Imports, in the crate at `src`, from a layer of `ranks` above or beside
/// the importing module's.
fn upward_imports(src: &Path, ranks: &[(&str, u32)]) -> Vec<String> {
    let modules = modules(src);
    let mut wrong = Vec::new();
    for (from, refs) in edges(&modules) {
        if from.is_empty() {
            continue; // lib.rs
        }
        let (own, rank) = layer(ranks, &from);
        for to in refs {
            let (theirs, their_rank) = layer(ranks, &to);
            if theirs != own && their_rank >= rank {
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

#[test]
fn no_load_suite_files_import_each_other_in_a_cycle() {
    let cycles = cycles(&Path::new(env!("CARGO_MANIFEST_DIR")).join("loadtest/src"));
    assert!(
        cycles.is_empty(),
        "loadtest: import cycles:\n{}",
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
        .map(|name| format!("the # Layout of clients/rust/src/lib.rs does not name {name}"))
        .collect();
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

/// The checks see what a text scan missed: grouped imports, code after a
/// test module, paths inside macro calls, and `super` paths; and they
/// leave test modules out.
#[test]
fn grouped_imports_macros_and_code_after_tests_are_seen() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    std::fs::create_dir(src.join("http")).unwrap();
    let files = [
        (
            "lib.rs",
            "pub mod config;\npub mod http;\npub mod metrics;\n",
        ),
        (
            "metrics.rs",
            "#[cfg(test)]\nmod tests { use crate::http::Server; }\n",
        ),
        (
            "config.rs",
            "use crate::{http::{self, Server}};\n\
             #[cfg(test)]\nmod tests {}\n\
             fn after() { tracing::info!(\"{}\", crate::metrics::COUNT); }\n",
        ),
        ("http/mod.rs", "mod server;\npub use server::Server;\n"),
        (
            "http/server.rs",
            "pub struct Server;\nfn f() { super::super::config::g(); }\n",
        ),
    ];
    for (name, text) in files {
        std::fs::write(src.join(name), text).unwrap();
    }
    let ranks = &[("config", 0), ("metrics", 1), ("http", 2)];
    let mut wrong = upward_imports(src, ranks);
    wrong.sort();
    assert_eq!(
        wrong,
        // http from the grouped import; metrics only from the macro call
        // after the test module.
        ["config imports http", "config imports metrics"]
    );
    // The grouped import, the `super::super` path and the folder's child.
    let graph = edges(&modules(src));
    let of = |m: &[&str]| -> BTreeSet<String> {
        let key: Vec<String> = m.iter().map(|s| s.to_string()).collect();
        graph[&key].iter().map(|p| p.join("::")).collect()
    };
    assert!(of(&["http", "server"]).contains("config"));
    assert!(of(&["http"]).contains("http::server"));
    // The test module of metrics imports nothing that counts.
    assert!(of(&["metrics"]).is_empty());
}

/// A module ranked apart from its folder (as `http::tls` is) may be
/// imported by the layers between the two, and is held to its own rank:
/// it may not import the rest of its folder.
#[test]
fn a_module_ranked_apart_from_its_folder_keeps_its_own_rank() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    std::fs::create_dir(src.join("http")).unwrap();
    let files = [
        (
            "lib.rs",
            "pub mod config;\npub mod generation;\npub mod http;\n",
        ),
        ("config.rs", "pub struct Server;\n"),
        ("generation.rs", "use crate::http::tls::load;\n"),
        (
            "http/mod.rs",
            "pub mod error;\npub mod tls;\nuse crate::generation::Generation;\nuse tls::load;\n",
        ),
        ("http/error.rs", "pub struct ApiError;\n"),
        (
            "http/tls.rs",
            "use crate::config::Server;\nuse super::error::ApiError;\n",
        ),
    ];
    for (name, text) in files {
        std::fs::write(src.join(name), text).unwrap();
    }
    let ranks = &[
        ("config", 0),
        ("http::tls", 1),
        ("generation", 2),
        ("http", 3),
    ];
    assert_eq!(
        upward_imports(src, ranks),
        ["http::tls imports http::error"]
    );
}

/// Only `shard/` names etcd's client (its types, its kv, watch and lease
/// clients): the shard speaks locks to the layers above it, and is the
/// only module that speaks etcd. And only `locks/` and `placement/` import
/// `shard/`: the layers above them go through them.
#[test]
fn etcd_is_spoken_only_in_shard_and_shard_only_below_locks_and_placement() {
    let modules = modules(&src());
    let etcd: Vec<String> = modules
        .iter()
        .filter(|m| m.path.first().is_some_and(|top| top != "shard"))
        .filter(|m| (m.paths.iter()).any(|p| p.first().is_some_and(|f| f == "etcd_client")))
        .map(|m| m.path.join("::"))
        .collect();
    let mut from_above = Vec::new();
    for (from, refs) in edges(&modules) {
        let top = from.first().map(String::as_str).unwrap_or_default();
        if ["shard", "locks", "placement", ""].contains(&top) {
            continue;
        }
        for to in refs.iter().filter(|to| to[0] == "shard") {
            from_above.push(format!("{} -> {}", from.join("::"), to.join("::")));
        }
    }
    assert!(
        etcd.is_empty(),
        "modules outside shard/ that name etcd's client:\n{}",
        etcd.join("\n")
    );
    assert!(
        from_above.is_empty(),
        "imports of shard/ from above locks/ and placement/:\n{}",
        from_above.join("\n")
    );
}
