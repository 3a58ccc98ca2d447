//! What a web page can do to the admin routes: nothing. A router whose
//! admin routes are open to loopback clients (no `admin.token`, no
//! principals, the mode `make run` uses) refuses a cross-site form post
//! (no JSON media type, or another `Origin`) and a DNS-rebinding page (a
//! `Host` that is not loopback or an allowed name), while the CLI, curl
//! and the status page on the router's own origin go on working. And a
//! changed `admin.token` takes effect at the first reload.

use serde_json::json;

use lockrouter_testkit::api::{Api, Reply};
use lockrouter_testkit::config::config_toml;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::router::FileRouter;

fn code(r: &Reply) -> (u16, &str) {
    (r.status, r.body["error"]["code"].as_str().unwrap_or(""))
}

/// The ring epoch every shard records, as the router shows it.
async fn epoch(api: &Api) -> u64 {
    let ring = api.get("/admin/v1/ring").await;
    assert_eq!(ring.status, 200, "{ring:?}");
    ring.body["epoch"].as_u64().expect("an epoch")
}

async fn bump(api: &Api, headers: &[(&str, &str)], body: &str) -> Reply {
    let mut req = api.http.post(format!("{}/admin/v1/bump-epoch", api.base));
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    api.send(req.body(body.to_string())).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_web_page_cannot_drive_the_loopback_admin_routes() {
    let etcd = EtcdCluster::single();
    let toml = config_toml(
        &[&etcd],
        "127.0.0.1:0",
        "[admin]\nallowed_hosts = [\"router.internal\"]\n",
    );
    let router = FileRouter::start(&toml).await;
    let api = &router.api;
    let authority = api.base.trim_start_matches("http://").to_string();
    let port = authority.rsplit_once(':').unwrap().1.to_string();
    let before = epoch(api).await;

    // A cross-site form post: text/plain, another origin.
    let form = bump(
        api,
        &[
            ("content-type", "text/plain"),
            ("origin", "http://evil.example"),
        ],
        "{}",
    )
    .await;
    assert_eq!(form.status, 403, "{form:?}");
    // Either defence alone refuses it.
    let plain = bump(api, &[("content-type", "text/plain")], "{}").await;
    assert_eq!(code(&plain), (415, "unsupported_media_type"), "{plain:?}");
    let untyped = bump(api, &[], "").await;
    assert_eq!(
        code(&untyped),
        (415, "unsupported_media_type"),
        "{untyped:?}"
    );
    let other_origin = bump(
        api,
        &[
            ("content-type", "application/json"),
            ("origin", "http://evil.example"),
        ],
        "{}",
    )
    .await;
    assert_eq!(
        code(&other_origin),
        (403, "permission_denied"),
        "{other_origin:?}"
    );
    let null_origin = bump(
        api,
        &[("content-type", "application/json"), ("origin", "null")],
        "",
    )
    .await;
    assert_eq!(code(&null_origin), (403, "permission_denied"));
    // Reload too: a form post of any media type but JSON is refused.
    let reload = api
        .send(
            api.http
                .post(format!("{}/admin/v1/reload", api.base))
                .header("content-type", "application/x-www-form-urlencoded")
                .body("a=b"),
        )
        .await;
    assert_eq!(code(&reload), (415, "unsupported_media_type"));
    assert_eq!(epoch(api).await, before, "a refused call bumped the epoch");

    // A DNS-rebinding page: its own name in Host (and as its Origin).
    let rebound = format!("rebind.evil.example:{port}");
    let read = api
        .send(
            api.http
                .get(format!("{}/admin/v1/locks", api.base))
                .header("host", &rebound),
        )
        .await;
    assert_eq!(code(&read), (403, "permission_denied"), "{read:?}");
    let origin = format!("http://{rebound}");
    let rebound_bump = bump(
        api,
        &[
            ("content-type", "application/json"),
            ("host", &rebound),
            ("origin", &origin),
        ],
        "{}",
    )
    .await;
    assert_eq!(code(&rebound_bump), (403, "permission_denied"));
    assert_eq!(epoch(api).await, before);

    // What is allowed: loopback addresses, localhost and allowed names in
    // Host; the router's own origin (the status page); no Origin at all.
    for host in [
        authority.clone(),
        format!("localhost:{port}"),
        format!("router.internal:{port}"),
        format!("[::1]:{port}"),
    ] {
        let r = api
            .send(
                api.http
                    .get(format!("{}/admin/v1/locks", api.base))
                    .header("host", &host),
            )
            .await;
        assert_eq!(r.status, 200, "Host {host}: {r:?}");
    }
    let own = format!("http://{authority}");
    let same_origin = bump(
        api,
        &[("content-type", "application/json"), ("origin", &own)],
        "",
    )
    .await;
    assert_eq!(same_origin.status, 200, "{same_origin:?}");
    assert_eq!(epoch(api).await, before + 1);
    let cli_like = api.post("/admin/v1/reload", json!({})).await;
    assert_eq!(cli_like.status, 200, "{cli_like:?}");
}

/// With an admin token the Host is not checked (the token is the guard),
/// but another Origin still is: a browser holding a client certificate
/// must not be driven by a page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_admin_token_takes_effect_at_the_first_reload() {
    let etcd = EtcdCluster::single();
    let config = |token: &str| {
        config_toml(
            &[&etcd],
            "127.0.0.1:0",
            &format!("[admin]\ntoken = \"{token}\"\n"),
        )
    };
    let (first, second) = ("first-admin-token-0123", "second-admin-token-4567");
    let router = FileRouter::start(&config(first)).await;
    let (old, new) = (
        router.api.with_bearer(first),
        router.api.with_bearer(second),
    );
    assert_eq!(old.get("/admin/v1/ring").await.status, 200);
    assert_eq!(new.get("/admin/v1/ring").await.status, 403);
    let reloaded = router.reload_as(&old, &config(second)).await;
    assert_eq!(reloaded.status, 200, "{reloaded:?}");
    assert_eq!(new.get("/admin/v1/ring").await.status, 200);
    assert_eq!(code(&old.get("/admin/v1/ring").await).0, 403);

    // Any Host with the token; never another Origin.
    let r = new
        .send(
            new.http
                .get(format!("{}/admin/v1/ring", new.base))
                .header("host", "lockrouter.example:443"),
        )
        .await;
    assert_eq!(r.status, 200, "{r:?}");
    let r = new
        .send(
            new.http
                .get(format!("{}/admin/v1/ring", new.base))
                .header("origin", "https://evil.example"),
        )
        .await;
    assert_eq!(code(&r), (403, "permission_denied"));
}
