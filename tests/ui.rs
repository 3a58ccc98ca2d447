//! The status page (`GET /ui`) in a real browser: headless Chromium, driven
//! over WebDriver (fantoccini) through a chromedriver the test starts on a
//! free loopback port, against real etcd shards and a router (a process of
//! its own where the figures shown must be only its test's: the metrics
//! recorder is process-wide). The page must show the replica, the live
//! shard states (and follow a shard's loss by itself) with each shard's
//! held locks, sessions, waiters, rates and acquire and renew p99 (a dash
//! where there were none), the ring, request rates without its own
//! polling, a paged and searchable list of held locks, and a held lock's
//! holder and token; with an admin token configured it must
//! say that it needs one, and force-release with it once given, naming
//! tokens past 2^53 to the digit.
//!
//! Chromium and chromedriver come from `make prereqs` (Debian's chromium
//! and chromium-driver); a test without them fails, naming that. With
//! `LOCKROUTER_UI_SCREENSHOT=<file.png>` the first test saves what the page
//! shows (the picture in docs/operations.md).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, Locator};
use serde_json::{json, Value};

use lockrouter_testkit::config::config_toml;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::loopback::free_port;
use lockrouter_testkit::router::TestRouter;
use lockrouter_testkit::router_process::RouterProcess;
use lockrouter_testkit::sleep_ms;

/// How long the page may take to show what a test waits for: it refreshes
/// every 3 s, and the router sees a shard gone within a second.
const SHOWN_WITHIN: Duration = Duration::from_secs(30);

/// Without these, a Chromium on a machine with no internet tries to reach
/// Google's services and logs their failures. No sandbox: Chromium refuses
/// to start one as root, which CI runs as.
const CHROMIUM_FLAGS: &[&str] = &[
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,900",
];

const INSTALL_HINT: &str = "the status page's browser test needs chromium and a chromedriver of \
    the same major version on PATH: `make prereqs` (deploy/local/prereqs.sh test) installs \
    Debian's chromium and chromium-driver";

/// The first file named `name` in a directory of PATH.
fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// A chromedriver process and the Chromium session it drives. Dropping it
/// kills chromedriver's process group, which holds the browser it started,
/// and then any process still naming this browser's dir (crash handlers
/// leave the group); then the dir goes.
struct Browser {
    /// The WebDriver session; `None` once [`close`](Self::close)d.
    client: Option<Client>,
    /// chromedriver, leading a process group of its own.
    driver: Child,
    /// The browser's fresh `--user-data-dir` and XDG dirs, and
    /// chromedriver's log.
    dir: tempfile::TempDir,
}

impl Browser {
    async fn start() -> Self {
        let find = |name| on_path(name).unwrap_or_else(|| panic!("no {name}: {INSTALL_HINT}"));
        let (driver, chromium) = (find("chromedriver"), find("chromium"));
        let dir = tempfile::tempdir().unwrap();
        let profile = dir.path().join("profile");
        let log = dir.path().join("chromedriver.log");
        let port = free_port();
        let mut cmd = Command::new(&driver);
        cmd.arg(format!("--port={port}"))
            .arg(format!("--log-path={}", log.display()))
            // Chromium's crash database and caches go there, not in $HOME.
            .env("XDG_CONFIG_HOME", dir.path().join("config"))
            .env("XDG_CACHE_HOME", dir.path().join("cache"))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e} ({INSTALL_HINT})", driver.display()));
        let mut browser = Self {
            client: None,
            driver: child,
            dir,
        };
        let url = format!("http://127.0.0.1:{port}");
        browser.wait_driver(&url, &log).await;
        let mut args: Vec<String> = CHROMIUM_FLAGS.iter().map(|f| f.to_string()).collect();
        args.push(format!("--user-data-dir={}", profile.display()));
        let caps = json!({"goog:chromeOptions": {"binary": chromium, "args": args}});
        let Value::Object(caps) = caps else {
            unreachable!()
        };
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let client = fantoccini::ClientBuilder::new(connector)
            .capabilities(caps)
            .connect(&url)
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "chromedriver could not start chromium: {e} ({INSTALL_HINT}); its log ends:\n{}",
                    tail(&log)
                )
            });
        let timeouts = fantoccini::wd::TimeoutConfiguration::new(
            Some(Duration::from_secs(10)),
            Some(Duration::from_secs(15)),
            Some(Duration::ZERO),
        );
        client.update_timeouts(timeouts).await.unwrap();
        browser.client = Some(client);
        browser
    }

    async fn wait_driver(&mut self, url: &str, log: &Path) {
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(r) = http.get(format!("{url}/status")).send().await {
                let status: Value = r.json().await.unwrap_or_default();
                if status["value"]["ready"] == true {
                    return;
                }
            }
            if let Ok(Some(exit)) = self.driver.try_wait() {
                panic!("chromedriver exited ({exit}); its log ends:\n{}", tail(log));
            }
            assert!(
                Instant::now() < deadline,
                "chromedriver did not answer ready within 20 s; its log ends:\n{}",
                tail(log)
            );
            sleep_ms(100).await;
        }
    }

    fn client(&self) -> &Client {
        self.client.as_ref().expect("a session")
    }

    /// Ends the session: Chromium quits.
    async fn close(mut self) {
        if let Some(c) = self.client.take() {
            c.close().await.unwrap();
        }
    }

    /// The text of the first element matching `css`, `None` if there is none
    /// or it is hidden.
    async fn text(&self, css: &str) -> Option<String> {
        let js = "const e = document.querySelector(arguments[0]);
                  return e && !e.closest('[hidden]') ? e.textContent.trim() : null;";
        let v = self.client().execute(js, vec![json!(css)]).await.unwrap();
        v.as_str().map(str::to_string)
    }

    /// Everything the page shows, for failure messages.
    async fn page_text(&self) -> String {
        let js = "return document.body.innerText;";
        match self.client().execute(js, vec![]).await {
            Ok(v) => v.as_str().unwrap_or_default().to_string(),
            Err(e) => format!("(unreadable: {e})"),
        }
    }

    /// Waits until the text of `css` satisfies `ok`, and returns it; fails
    /// within [`SHOWN_WITHIN`] with what the element and the page showed.
    async fn wait_text(&self, what: &str, css: &str, ok: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + SHOWN_WITHIN;
        loop {
            let text = self.text(css).await;
            if let Some(t) = text.as_deref().filter(|t| ok(t)) {
                return t.to_string();
            }
            if Instant::now() >= deadline {
                panic!(
                    "the page did not show {what} within {SHOWN_WITHIN:?}: `{css}` shows {text:?}; \
                     the page shows:\n{}",
                    self.page_text().await
                );
            }
            sleep_ms(200).await;
        }
    }

    /// Clicks the first element matching `css`. The page redraws its
    /// tables as it polls, so the element found may be replaced before the
    /// click reaches it (a stale element): then it is found again, as a
    /// user's next click would, until [`SHOWN_WITHIN`] has passed.
    async fn click(&self, css: &str) {
        let deadline = Instant::now() + SHOWN_WITHIN;
        loop {
            let found = self.client().find(Locator::Css(css)).await.unwrap();
            match found.click().await {
                Ok(_) => return,
                Err(e) if e.is_stale_element_reference() && Instant::now() < deadline => {
                    sleep_ms(50).await
                }
                Err(e) => panic!("clicking `{css}`: {e}"),
            }
        }
    }

    /// The `data-*` attribute `key` of every element matching `css`.
    async fn data_of_all(&self, css: &str, key: &str) -> Vec<String> {
        let js = "return [...document.querySelectorAll(arguments[0])].map(e => e.dataset[arguments[1]]);";
        let v = self
            .client()
            .execute(js, vec![json!(css), json!(key)])
            .await
            .unwrap();
        serde_json::from_value(v).unwrap()
    }

    /// Waits until `count` elements match `css`.
    async fn wait_count(&self, what: &str, css: &str, count: usize) {
        let deadline = Instant::now() + SHOWN_WITHIN;
        let js = "return document.querySelectorAll(arguments[0]).length;";
        loop {
            let n = self.client().execute(js, vec![json!(css)]).await.unwrap();
            if n == json!(count) {
                return;
            }
            if Instant::now() >= deadline {
                panic!(
                    "the page did not show {what} within {SHOWN_WITHIN:?}: {n} match `{css}`; \
                     the page shows:\n{}",
                    self.page_text().await
                );
            }
            sleep_ms(200).await;
        }
    }

    /// Chooses `value` in the select `css`, as a person would.
    async fn choose(&self, css: &str, value: &str) {
        let js = "const s = document.querySelector(arguments[0]); s.value = arguments[1]; \
                  s.dispatchEvent(new Event('change'));";
        let args = vec![json!(css), json!(value)];
        self.client().execute(js, args).await.unwrap();
    }

    async fn type_into(&self, css: &str, text: &str) {
        let field = self.client().find(Locator::Css(css)).await.unwrap();
        field.clear().await.unwrap();
        field.send_keys(text).await.unwrap();
    }

    /// Looks up `name` with the page's form.
    async fn look_up(&self, name: &str) {
        self.type_into("#lookup-name", name).await;
        self.click("#lookup-go").await;
    }

    /// Clicks force-release, gives `reason` to its prompt and accepts its
    /// confirmation.
    async fn force_release(&self, reason: &str) {
        self.force_release_with("#force-release", reason).await;
    }

    /// Like [`force_release`](Self::force_release), with the button `css`.
    async fn force_release_with(&self, css: &str, reason: &str) {
        self.click(css).await;
        self.client().send_alert_text(reason).await.unwrap();
        self.accept_dialog().await;
        self.accept_dialog().await;
    }

    /// Accepts the dialog that is open, or opens within a few seconds.
    async fn accept_dialog(&self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match self.client().accept_alert().await {
                Ok(()) => return,
                Err(e) if Instant::now() >= deadline => panic!("no dialog to accept: {e}"),
                Err(_) => sleep_ms(50).await,
            }
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let group = nix::unistd::Pid::from_raw(-(self.driver.id() as i32));
        let _ = nix::sys::signal::kill(group, nix::sys::signal::Signal::SIGKILL);
        let _ = self.driver.wait();
        kill_naming(self.dir.path());
    }
}

/// SIGKILLs every process whose command line names `dir` (a browser
/// helper that left chromedriver's process group): nothing else names this
/// test's fresh temp dir.
fn kill_naming(dir: &Path) {
    let needle = dir.as_os_str().as_encoded_bytes();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in procs.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if cmdline.windows(needle.len()).any(|w| w == needle) {
            let pid = nix::unistd::Pid::from_raw(pid);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
    }
}

fn tail(log: &Path) -> String {
    lockrouter_testkit::child::log_tail(log)
}

/// `name` granted to `client` once the router grants again after an epoch
/// bump.
async fn acquire_soon(
    api: &lockrouter_testkit::api::Api,
    name: &str,
    client: &str,
) -> (String, u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = api.acquire(name, 60_000, client).await;
        if r.status == 200 && r.body["acquired"] == true {
            return r.granted();
        }
        assert!(Instant::now() < deadline, "{name} not granted: {r:?}");
        sleep_ms(100).await;
    }
}

/// A bounded stream of renewals of `lock`, and of acquires of its `name`
/// again by its `holder` (answered with the holder's own grant), so the
/// page has rates and latencies to show.
fn renew_in_background(
    api: &lockrouter_testkit::api::Api,
    lock: (String, u64),
    name: &str,
    holder: &str,
) -> Renewer {
    let (api, name, holder) = (api.clone(), name.to_string(), holder.to_string());
    Renewer(tokio::spawn(async move {
        for _ in 0..600 {
            let _ = api.renew(&lock).await;
            let _ = api.acquire(&name, 60_000, &holder).await;
            sleep_ms(100).await;
        }
    }))
}

/// A duration as the page shows one: "12 ms", "0.4 ms", "1.20 s".
fn a_duration(text: &str) -> bool {
    let number = text.strip_suffix(" ms").or_else(|| text.strip_suffix(" s"));
    number.is_some_and(|n| n.parse::<f64>().is_ok_and(|v| v >= 0.0))
}

/// Stops its renewals when dropped.
struct Renewer(tokio::task::JoinHandle<()>);

impl Drop for Renewer {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Routes the page reads as it refreshes: none may show in its rates.
const POLLED: &[&str] = &[
    "readyz",
    "metrics",
    "admin_ring",
    "admin_locks",
    "inspect",
    "ui",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_live_shards_their_load_the_ring_rates_and_held_locks() {
    let a = EtcdCluster::single();
    let mut b = EtcdCluster::single();
    let port = free_port();
    // Named apart from every other test's shards; lock counts every 300 ms.
    let toml = config_toml(
        &[&a, &b],
        &format!("127.0.0.1:{port}"),
        "count_interval_ms = 300",
    )
    .replace("name = \"a\"", "name = \"east\"")
    .replace("name = \"b\"", "name = \"west\"");
    let router = RouterProcess::spawn(&toml, port);
    let api = &router.api;
    api.wait_ready().await;
    let name = "process_order:42";
    let lock = api.must_acquire(name, 60_000, "worker-17").await;
    let mut names = vec![name.to_string()];
    for i in 0..12 {
        let job = format!("batch:{i:02}");
        api.must_acquire(&job, 60_000, &format!("batch-worker-{i}"))
            .await;
        names.push(job);
    }
    // Locks per shard; each has a client, so a session, of its own.
    let mut held: BTreeMap<String, usize> = BTreeMap::new();
    for n in &names {
        let shard = api.inspect(n).await.body["shard"]
            .as_str()
            .unwrap()
            .to_string();
        *held.entry(shard).or_default() += 1;
    }
    let busy = api.inspect(name).await.body["shard"]
        .as_str()
        .unwrap()
        .to_string();
    let _renewer = renew_in_background(api, lock.clone(), name, "worker-17");
    let waiting = json!({"name": name, "ttlMs": 10_000, "clientId": "impatient", "waitMs": 50_000});
    let waiter = api
        .http
        .post(format!("{}/api/v1/locks/acquire", api.base))
        .timeout(Duration::from_secs(60))
        .json(&waiting);
    let _waiter = Renewer(tokio::spawn(async move {
        let _ = waiter.send().await;
    }));
    let ready = api.get("/readyz").await.body;
    let replica = ready["replica"].as_str().unwrap().to_string();
    assert!(!replica.is_empty(), "{ready}");
    let ring = api.get("/admin/v1/ring").await.body["ring"]
        .as_str()
        .unwrap()
        .to_string();

    // The page is served with a policy that admits its own script only.
    let r = api
        .http
        .get(format!("{}/ui", api.base))
        .send()
        .await
        .unwrap();
    let header = |h: &str| r.headers()[h].to_str().unwrap().to_string();
    assert_eq!(r.status(), 200);
    assert_eq!(header("content-type"), "text/html; charset=utf-8");
    assert!(
        header("content-security-policy").starts_with("default-src 'none'; script-src 'sha256-")
    );
    assert_eq!(header("x-content-type-options"), "nosniff");
    assert_eq!(header("cache-control"), "no-store");

    let browser = Browser::start().await;
    browser
        .client()
        .goto(&format!("{}/ui", api.base))
        .await
        .unwrap();
    for shard in ["east", "west"] {
        let css = format!("tr[data-shard=\"{shard}\"] .state");
        browser
            .wait_text(&format!("shard {shard} up"), &css, |t| t == "up")
            .await;
    }
    browser
        .wait_text("the replica", "#replica-name", |t| t == replica)
        .await;
    let version = format!("v{}", env!("CARGO_PKG_VERSION"));
    assert_eq!(browser.text("#replica-version").await, Some(version));
    let uptime = browser.text("#replica-uptime").await.unwrap_or_default();
    assert!(
        uptime.starts_with("up ") && uptime.ends_with(" s"),
        "{uptime}"
    );
    browser
        .wait_text("the ring's fingerprint", "#ring-fingerprint", |t| t == ring)
        .await;

    // Each shard's load.
    let cell = |shard: &str, col: &str| format!("tr[data-shard=\"{shard}\"] [data-col={col}]");
    for (shard, n) in &held {
        let locks = n.to_string();
        let what = format!("{shard}'s held locks");
        browser
            .wait_text(&what, &cell(shard, "held"), |t| t == locks)
            .await;
        // The waiting client has a session on its name's shard too.
        let sessions = if *shard == busy { n + 1 } else { *n }.to_string();
        let what = format!("{shard}'s sessions");
        browser
            .wait_text(&what, &cell(shard, "sessions"), |t| t == sessions)
            .await;
    }
    browser
        .wait_text("the waiter", &cell(&busy, "waiters"), |t| t == "1")
        .await;
    let positive = |t: &str| t.parse::<f64>().is_ok_and(|r| r > 0.0);
    browser
        .wait_text("the shard's renewals", &cell(&busy, "renewals"), positive)
        .await;
    browser
        .wait_text("the shard's etcd p99", &cell(&busy, "p99"), |t| {
            t.ends_with(" ms")
        })
        .await;
    // Its acquires and renewals as the client saw them; the other shard
    // had none between the page's last two samples.
    for col in ["acquire-p99", "renew-p99"] {
        let what = format!("the shard's {col}");
        browser
            .wait_text(&what, &cell(&busy, col), a_duration)
            .await;
    }
    let idle = held.keys().find(|s| **s != busy).expect("two shards");
    for col in ["acquire-p99", "renew-p99"] {
        let shown = browser.text(&cell(idle, col)).await;
        assert_eq!(shown.as_deref(), Some("–"), "{idle}'s {col}");
    }
    assert_eq!(
        browser.text(&cell(&busy, "errors")).await.as_deref(),
        Some("none")
    );

    // Request rates and p99, without the page's own polling.
    browser
        .wait_text("a renewal rate", "#rate-renewals", positive)
        .await;
    browser
        .wait_text(
            "renew's p99",
            "#rates tr[data-op=renew] [data-col=p99]",
            |t| t.ends_with(" ms"),
        )
        .await;
    sleep_ms(3500).await; // a refresh more, with every poll of the page in it
    let ops = browser.data_of_all("#rates tbody tr", "op").await;
    assert!(ops.contains(&"renew".to_string()), "{ops:?}");
    assert!(
        !ops.iter().any(|op| POLLED.contains(&op.as_str())),
        "the page's own polls: {ops:?}"
    );

    // The held locks, a page at a time, and by prefix.
    browser.choose("#locks-limit", "10").await;
    browser
        .wait_count("a page of 10 locks", "#locks tbody tr", 10)
        .await;
    assert_eq!(browser.text("#locks-page").await.as_deref(), Some("page 1"));
    browser.look_up(name).await;
    let token = lock.1.to_string();
    browser
        .wait_text(
            "the held lock's token",
            "#lookup-result [data-field=fencingToken]",
            |t| t == token,
        )
        .await;
    let field = |f: &str| format!("#lookup-result [data-field={f}]");
    assert_eq!(browser.text(&field("held")).await.as_deref(), Some("yes"));
    // No credential is configured: loopback callers are admin, and see the
    // holder.
    assert_eq!(
        browser.text(&field("clientId")).await.as_deref(),
        Some("worker-17")
    );
    if let Some(path) = std::env::var_os("LOCKROUTER_UI_SCREENSHOT") {
        sleep_ms(3500).await; // rates over a whole refresh
        let top = "window.scrollTo(0, 0);";
        browser.client().execute(top, vec![]).await.unwrap();
        let png = browser.client().screenshot().await.unwrap();
        std::fs::write(&path, png).unwrap();
    }
    browser.click("#locks-next").await;
    browser
        .wait_count("the last 3 locks", "#locks tbody tr", 3)
        .await;
    browser
        .wait_text("the last page", "#locks-page", |t| t == "page 2 (last)")
        .await;
    let mut listed = browser.data_of_all("#locks tbody tr", "name").await;
    browser.click("#locks-prev").await;
    browser
        .wait_text("the first page", "#locks-page", |t| t == "page 1")
        .await;
    browser
        .wait_count("the first page's locks", "#locks tbody tr", 10)
        .await;
    listed.extend(browser.data_of_all("#locks tbody tr", "name").await);
    listed.sort();
    names.sort();
    assert_eq!(listed, names, "every held lock once");
    browser.type_into("#locks-prefix", "process_order:").await;
    browser.click("#locks-search").await;
    browser
        .wait_count("the one lock found", "#locks tbody tr", 1)
        .await;
    let row = |col: &str| format!("#locks tr[data-name=\"{name}\"] [data-col={col}]");
    assert_eq!(
        browser.text(&row("holder")).await.as_deref(),
        Some("worker-17")
    );
    assert_eq!(browser.text(&row("token")).await, Some(token));
    let seconds = |t: &str| t.strip_suffix(" s").and_then(|n| n.parse::<u64>().ok());
    let left = browser.text(&row("left")).await.unwrap_or_default();
    assert!(
        seconds(&left).is_some_and(|s| (1..=60).contains(&s)),
        "time left {left:?}"
    );
    let age = browser.text(&row("age")).await.unwrap_or_default();
    assert!(seconds(&age).is_some_and(|s| s < 120), "age {age:?}");

    b.kill();
    browser
        .wait_text(
            "shard west unreachable",
            "tr[data-shard=\"west\"] .state",
            |t| t == "unreachable",
        )
        .await;
    assert_eq!(
        browser
            .text("tr[data-shard=\"east\"] .state")
            .await
            .as_deref(),
        Some("up")
    );
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_an_admin_token_the_page_asks_for_it_and_force_releases_with_it() {
    let etcd = EtcdCluster::single();
    let token = "an-admin-token-for-the-status-page";
    let toml =
        config_toml(&[&etcd], "127.0.0.1:0", "") + &format!("\n[admin]\ntoken = \"{token}\"\n");
    let router = TestRouter::with_toml(&toml).await;
    let api = &router.api;
    let admin = api.with_bearer(token);
    // Epoch 100: tokens past 2^53, where JS numbers lose digits.
    let bumped = admin
        .post("/admin/v1/bump-epoch", json!({"minEpoch": 100}))
        .await;
    assert_eq!(bumped.status, 200, "{bumped:?}");
    let name = "stuck/worker 17";
    let lock = acquire_soon(api, name, "worker-17").await;
    let other = "stuck/worker 18";
    let other_lock = acquire_soon(api, other, "worker-18").await;
    assert!(lock.1 > 1 << 53 && other_lock.1 > 1 << 53, "{lock:?}");
    let ring = admin.get("/admin/v1/ring").await.body["ring"]
        .as_str()
        .unwrap()
        .to_string();

    let browser = Browser::start().await;
    browser
        .client()
        .goto(&format!("{}/ui", api.base))
        .await
        .unwrap();
    // Without a token: readiness and inspect answer, the ring does not.
    let css = "tr[data-shard=\"a\"] .state";
    browser.wait_text("shard a up", css, |t| t == "up").await;
    browser
        .wait_text(
            "that the ring needs the admin credential",
            "#ring-error",
            |t| t.contains("admin credential needed"),
        )
        .await;
    // What an answer holds is shown as text, never run as markup.
    let field = |f: &str| format!("#lookup-result [data-field={f}]");
    let markup = "<img src=x onerror=\"document.title='run'\">";
    browser.look_up(markup).await;
    browser
        .wait_text("the name as text", &field("name"), |t| t == markup)
        .await;
    let js = "return [document.querySelectorAll('#lookup-result img').length, document.title];";
    let run = browser.client().execute(js, vec![]).await.unwrap();
    assert_eq!(run, json!([0, "lockrouter status"]));
    browser
        .wait_text(
            "that the list needs the admin credential",
            "#locks-error",
            |t| t.contains("admin credential needed"),
        )
        .await;
    browser.look_up(name).await;
    let fencing = lock.1.to_string();
    browser
        .wait_text("the lock's token", &field("fencingToken"), |t| t == fencing)
        .await;
    assert_eq!(browser.text(&field("clientId")).await, None, "admin only");
    browser.force_release("stuck in a test").await;
    browser
        .wait_text("force-release refused", "#force-result", |t| {
            t.contains("admin credential needed")
        })
        .await;
    assert_eq!(api.inspect(name).await.body["held"], true);

    // With the token: kept for the tab only, sent as a bearer header.
    browser.type_into("#token", token).await;
    browser.click("#token-use").await;
    browser
        .wait_text("the ring's fingerprint", "#ring-fingerprint", |t| t == ring)
        .await;
    browser
        .wait_text("the holder", &field("clientId"), |t| t == "worker-17")
        .await;
    let js = "return [sessionStorage.getItem('lockrouter.token'), localStorage.length, \
              location.href, document.getElementById('token').value];";
    let kept = browser.client().execute(js, vec![]).await.unwrap();
    let page = format!("{}/ui", api.base);
    assert_eq!(kept, json!([token, 0, page, ""]), "where the token is kept");

    // From the list: the exact token shown, and sent.
    browser.type_into("#locks-prefix", other).await;
    browser.click("#locks-search").await;
    let row = format!("#locks tr[data-name=\"{other}\"]");
    let exact = other_lock.1.to_string();
    browser
        .wait_text("the exact token", &format!("{row} [data-col=token]"), |t| {
            t == exact
        })
        .await;
    browser
        .force_release_with(&format!("{row} button.release"), "stuck in a test")
        .await;
    browser
        .wait_text("the release from the list", "#locks-result", |t| {
            t.starts_with("Released") && t.contains(&exact)
        })
        .await;
    browser
        .wait_count("the list without it", "#locks tbody tr", 0)
        .await;
    assert_eq!(api.inspect(other).await.body["held"], false);
    browser.force_release("stuck in a test").await;
    browser
        .wait_text("the release", "#force-result", |t| {
            t.starts_with("Released")
        })
        .await;
    browser
        .wait_text("the lock free", &field("held"), |t| t == "no")
        .await;
    assert_eq!(api.inspect(name).await.body["held"], false);
    browser.close().await;
}
