//! Property tests of the parsers an attacker or a damaged shard can feed:
//! lockIds ([`LockId::decode`]), config text ([`Settings::from_toml`]), the
//! ring record read from etcd ([`Recorded::parse`]), and request bodies
//! posted to a real router on real etcd. None may panic; a lockId
//! round-trips and any altered character is caught.
//!
//! Case counts are set explicitly so the suite stays within seconds, and no
//! failure files are written (`failure_persistence: None`): a failure
//! prints its minimal case, which belongs in a unit test.

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{json, Map, Value};

use lockrouter::keys::{PreviousRing, Recorded, RingMeta};
use lockrouter::token::fencing;
use lockrouter::token::lock_id::{LockId, Seal, Sealer};
use lockrouter::Settings;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::router::TestRouter;

/// `cases` cases and no persisted failures.
fn config(cases: u32) -> Config {
    Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    }
}

/// Any grant a router could encode: shard names as the config allows them,
/// tokens within range.
fn lock_ids() -> impl Strategy<Value = LockId> {
    (
        "[A-Za-z0-9_-]{1,64}",
        any::<u16>(),
        any::<u32>(),
        any::<i64>(),
        1..=(1i64 << fencing::REVISION_BITS) - 1,
        any::<[u8; 16]>(),
    )
        .prop_map(
            |(shard, epoch, ttl_secs, lease, revision, name_hash)| LockId {
                shard: shard.into(),
                epoch,
                ttl_secs,
                lease,
                revision,
                name_hash,
                owner: Default::default(),
            },
        )
}

/// Grants with an owner (a principal's name), as sealed lockIds carry.
fn owned_lock_ids() -> impl Strategy<Value = LockId> {
    (lock_ids(), "[A-Za-z0-9_-]{0,64}").prop_map(|(id, owner)| LockId {
        owner: owner.into(),
        ..id
    })
}

/// A sealer with the keys `k2` (sealing) and `k1`.
fn sealer() -> Sealer {
    let keys = [
        ("k2".to_string(), vec![2u8; 32]),
        ("k1".to_string(), vec![1u8; 32]),
    ];
    Sealer::new(&keys, false).expect("valid keys")
}

const BASE64URL: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

proptest! {
    #![proptest_config(config(512))]

    /// Whatever the string, decoding answers Ok or Err; what decodes
    /// carries a token in range and encodes to a lockId of the same grant.
    #[test]
    fn lock_id_decode_never_panics(s in "\\PC{0,200}|[A-Za-z0-9_-]{50,90}") {
        if let Ok(id) = LockId::decode(&s) {
            prop_assert!(id.token().is_some());
            prop_assert_eq!(LockId::decode(&id.encode()), Ok(id));
        }
    }

    /// Arbitrary bytes, as the JSON string a client could send.
    #[test]
    fn lock_id_decode_of_any_bytes_never_panics(b in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = LockId::decode(&String::from_utf8_lossy(&b));
    }

    /// A lockId decodes to its grant, its token is the grant's, and a
    /// change of any one character is refused (or, in the last character,
    /// whose low bits are padding, decodes to the same grant).
    #[test]
    fn lock_ids_round_trip_and_any_altered_character_is_caught(
        id in lock_ids(),
        at in any::<prop::sample::Index>(),
        to in 0..BASE64URL.len(),
    ) {
        let s = id.encode();
        prop_assert!(s.len() <= 144, "{} characters", s.len());
        prop_assert_eq!(LockId::decode(&s), Ok(id.clone()));
        prop_assert_eq!(id.token(), fencing::token(id.epoch.into(), id.revision));
        let i = at.index(s.len());
        let mut b = s.clone().into_bytes();
        prop_assume!(b[i] != BASE64URL[to]);
        b[i] = BASE64URL[to];
        let altered = String::from_utf8(b).unwrap();
        match LockId::decode(&altered) {
            Err(_) => {}
            Ok(other) => {
                prop_assert_eq!(i, s.len() - 1, "altered at {} of {}, decoded {:?}", i, s.len(), other);
                prop_assert_eq!(other, id);
            }
        }
    }

    /// Whatever the string or bytes, opening a lockId answers Ok or Err,
    /// and what opens seals back to the same grant.
    #[test]
    fn sealed_lock_id_open_never_panics(s in "\\PC{0,300}|[A-Za-z0-9_-]{80,280}", b in proptest::collection::vec(any::<u8>(), 0..300)) {
        let sealer = sealer();
        if let Ok((id, _)) = sealer.open(&s) {
            prop_assert_eq!(sealer.open(&sealer.seal(&id)).map(|(id, _)| id), Ok(id));
        }
        let _ = sealer.open(&String::from_utf8_lossy(&b));
    }

    /// A sealed lockId opens to its grant and owner under the sealing key;
    /// any one character changed (the last one included: its padding bits
    /// are checked by the MAC's length), cut or extended, it is refused.
    #[test]
    fn sealed_lock_ids_round_trip_and_any_edit_is_refused(
        id in owned_lock_ids(),
        at in any::<prop::sample::Index>(),
        to in 0..BASE64URL.len(),
        cut in 1usize..8,
        extra in "[A-Za-z0-9_-]{1,8}",
    ) {
        let sealer = sealer();
        let s = sealer.seal(&id);
        prop_assert!(s.len() <= 512, "{} characters", s.len());
        prop_assert_eq!(sealer.open(&s), Ok((id.clone(), Seal::Key("k2"))));
        let i = at.index(s.len());
        let mut b = s.clone().into_bytes();
        prop_assume!(b[i] != BASE64URL[to]);
        b[i] = BASE64URL[to];
        let altered = String::from_utf8(b).unwrap();
        match sealer.open(&altered) {
            Err(_) => {}
            Ok((other, _)) => {
                prop_assert_eq!(i, s.len() - 1, "altered at {} of {}, opened {:?}", i, s.len(), other);
                prop_assert_eq!(other, id.clone());
            }
        }
        prop_assert!(sealer.open(&s[..s.len().saturating_sub(cut)]).is_err());
        match sealer.open(&format!("{s}{extra}")) {
            Err(_) => {}
            Ok((other, _)) => prop_assert_eq!(other, id),
        }
    }

    /// Truncated or extended lockIds are refused.
    #[test]
    fn cut_or_extended_lock_ids_are_refused(id in lock_ids(), cut in 1usize..8, extra in "[A-Za-z0-9_-]{1,8}") {
        let s = id.encode();
        let cut_at = s.len().saturating_sub(cut);
        prop_assert!(LockId::decode(&s[..cut_at]).is_err());
        let extended = format!("{s}{extra}");
        match LockId::decode(&extended) {
            Err(_) => {}
            Ok(other) => prop_assert_eq!(other, id),
        }
    }
}

/// One line of TOML-ish text: a table header, a key and a value (known
/// names and a few others, values of every TOML type and some broken ones).
fn toml_lines() -> impl Strategy<Value = String> {
    let table = prop_oneof![
        Just("[server]"),
        Just("[etcd]"),
        Just("[ring]"),
        Just("[limits]"),
        Just("[admin]"),
        Just("[locks]"),
        Just("[[shards]]"),
        Just("[nope]"),
        Just("[server.inner]"),
        Just("[[server]]"),
    ]
    .prop_map(String::from);
    let key = prop_oneof![
        Just("listen"),
        Just("metrics_listen"),
        Just("max_in_flight"),
        Just("body_read_timeout_ms"),
        Just("request_timeout_ms"),
        Just("prefix"),
        Just("vnodes"),
        Just("min_ttl_ms"),
        Just("max_ttl_ms"),
        Just("max_batch"),
        Just("max_body_bytes"),
        Just("token"),
        Just("lock_delay"),
        Just("name"),
        Just("endpoints"),
        Just("weight"),
        Just("unknown"),
    ];
    let value = prop_oneof![
        any::<i64>().prop_map(|n| n.to_string()),
        Just("18446744073709551616".to_string()),
        Just("-0".to_string()),
        Just("1e400".to_string()),
        Just("nan".to_string()),
        Just("inf".to_string()),
        any::<bool>().prop_map(|b| b.to_string()),
        "\\PC{0,40}".prop_map(|s| format!("{s:?}")),
        Just("\"127.0.0.1:0\"".to_string()),
        Just("\"[::1]:99999\"".to_string()),
        Just("\"http://127.0.0.1:1\"".to_string()),
        Just("[\"http://127.0.0.1:1\", \"\"]".to_string()),
        Just("[]".to_string()),
        Just("{}".to_string()),
        Just("\"ttl\"".to_string()),
        Just("\"off\"".to_string()),
        Just("\"unterminated".to_string()),
        Just("1979-05-27T07:32:00Z".to_string()),
    ];
    prop_oneof![
        1 => table,
        4 => (key, value).prop_map(|(k, v)| format!("{k} = {v}")),
        1 => "\\PC{0,30}",
    ]
}

/// A config that is valid but for what the cases below change.
const VALID: &str = "[server]\nlisten = \"127.0.0.1:0\"\n\n[[shards]]\nname = \"a\"\nendpoints = [\"http://127.0.0.1:2379\"]\n";

proptest! {
    #![proptest_config(config(512))]

    /// Arbitrary text is a config or an error, never a panic.
    #[test]
    fn config_text_never_panics(text in "\\PC{0,400}") {
        let _ = Settings::from_toml(&text);
    }

    /// TOML-shaped text, mostly of known tables and keys with values of
    /// every type and range, alone or after a valid config.
    #[test]
    fn toml_shaped_config_never_panics(lines in proptest::collection::vec(toml_lines(), 0..24), after_valid in any::<bool>()) {
        let mut text = if after_valid { VALID.to_string() } else { String::new() };
        text.push_str(&lines.join("\n"));
        if let Ok(settings) = Settings::from_toml(&text) {
            prop_assert!(settings.validate().is_ok());
            prop_assert!(!settings.shards.is_empty());
        }
    }
}

fn ring_metas() -> impl Strategy<Value = RingMeta> {
    let previous = proptest::option::of(
        (
            "\\PC{0,20}",
            any::<u32>(),
            proptest::collection::vec(("[a-z]{1,4}", "\\PC{0,12}", any::<u32>()), 0..3),
        )
            .prop_map(|(ring, vnodes, shards)| PreviousRing {
                ring,
                vnodes,
                shards: shards
                    .into_iter()
                    .map(|(name, ep, weight)| lockrouter::config::ShardSettings {
                        name,
                        endpoints: vec![ep],
                        weight,
                        ..Default::default()
                    })
                    .collect(),
            }),
    );
    (any::<u64>(), "\\PC{0,40}", previous).prop_map(|(epoch, ring, previous)| RingMeta {
        epoch,
        ring,
        previous,
    })
}

proptest! {
    #![proptest_config(config(512))]

    /// Whatever a shard's ring key holds, parsing keeps its exact bytes
    /// (acquires compare them) and never panics.
    #[test]
    fn ring_record_parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let recorded = Recorded::parse(&bytes);
        prop_assert_eq!(recorded.bytes, bytes);
    }

    /// JSON-shaped ring records (truncated, or with a field replaced)
    /// parse or are kept as unreadable (epoch 0), never a panic.
    #[test]
    fn json_shaped_ring_records_never_panic(meta in ring_metas(), cut in any::<prop::sample::Index>(), junk in "\\PC{0,8}") {
        let bytes = meta.to_bytes();
        prop_assert_eq!(Recorded::parse(&bytes).meta, meta.clone());
        let cut = cut.index(bytes.len() + 1);
        let mut damaged = bytes[..cut].to_vec();
        damaged.extend_from_slice(junk.as_bytes());
        let recorded = Recorded::parse(&damaged);
        if recorded.meta != meta {
            prop_assert!(recorded.meta.epoch == 0 || serde_json::from_slice::<RingMeta>(&damaged).is_ok());
        }
    }
}

/// JSON values shaped like the lock routes' bodies: the real field names
/// (and a few others) with values of every JSON type, edge numbers, and
/// nesting a few levels deep.
fn bodies() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        prop_oneof![
            Just(0u64),
            Just(1999),
            Just(2000),
            Just(5000),
            Just(60_001),
            Just(u64::MAX)
        ]
        .prop_map(Value::from),
        "\\PC{0,24}".prop_map(Value::from),
        "[A-Za-z0-9_-]{40,80}".prop_map(Value::from),
    ];
    let key = prop_oneof![
        Just("name"),
        Just("ttlMs"),
        Just("clientId"),
        Just("waitMs"),
        Just("lockId"),
        Just("fencingToken"),
        Just("locks"),
        Just("x"),
    ]
    .prop_map(String::from);
    leaf.prop_recursive(3, 24, 6, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            proptest::collection::vec((key.clone(), inner), 0..5)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// Arbitrary JSON posted to acquire, renew, renew-batch and release of one
/// real router: every answer is 2xx, 409 (renew's not renewed) or a 4xx
/// with a JSON error code, never a 5xx.
#[test]
fn arbitrary_bodies_get_2xx_or_4xx_from_a_real_router() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let etcd = EtcdCluster::single();
    let router = rt.block_on(TestRouter::start(&[&etcd]));
    let api = router.api.clone();
    let held = rt.block_on(api.must_acquire("properties:held", 10_000, "keeper"));
    let routes = [
        "/api/v1/locks/acquire",
        "/api/v1/locks/renew",
        "/api/v1/locks/renew-batch",
        "/api/v1/locks/release",
    ];
    let mut runner = TestRunner::new(config(64));
    let cases = (0..routes.len(), bodies());
    let result = runner.run(&cases, |(route, body)| {
        let path = routes[route];
        let r = rt.block_on(api.post(path, body.clone()));
        let ok = (200..300).contains(&r.status)
            || (r.status == 409 && r.body["renewed"] == false)
            || ((400..500).contains(&r.status) && r.body["error"]["code"].is_string());
        prop_assert!(ok, "{} {}: {:?}", path, body, r);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    // The lock held before the barrage still renews.
    let r = rt.block_on(api.renew(&held));
    assert_eq!((r.status, &r.body["renewed"]), (200, &json!(true)), "{r:?}");
    drop(router);
}
