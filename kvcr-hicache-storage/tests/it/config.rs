//! Extra-config and engine-config validation (contract cases 7, 8, 11).

use std::ffi::OsString;
use std::path::PathBuf;

use kvcr_foundation::runner::{DataStream, KeylessSources};
use kvcr_hicache_storage::{
    BackendConfig, CLUSTER_SECRET_ENV, ClusterSecret, Error, EvictionPolicy, KvcrHiCacheStorage,
    RankGroups, StorageConfig,
};
use rstest::rstest;
use serde_json::{Value, json};

/// A cluster secret of the minimum length.
const SECRET: &str = "0123456789abcdef";

/// An empty environment (tests never read the process's).
fn no_env(_: &str) -> Option<OsString> {
    None
}

fn with(extra: Value) -> Value {
    let mut base = json!({"local_dram_bytes": 1 << 20});
    for (k, v) in extra.as_object().unwrap() {
        base[k] = v.clone();
    }
    base
}

#[test]
fn shipped_defaults_are_accepted() {
    let c = BackendConfig::from_value(&json!({"local_dram_bytes": 1 << 20})).unwrap();
    assert_eq!(c.operation_timeout.as_millis(), 20_000);
    assert_eq!(c.get_timeout.as_secs(), 30);
    assert_eq!(c.policy, EvictionPolicy::Lru);
    assert!(!c.enable_remote_hint);
    assert_eq!(c.data_stream, DataStream::Auto);
}

#[rstest]
#[case::auto("auto", DataStream::Auto)]
#[case::on("on", DataStream::On)]
#[case::off("off", DataStream::Off)]
fn data_stream_spellings(#[case] text: &str, #[case] mode: DataStream) {
    let c = BackendConfig::from_value(&with(json!({ "data_stream": text }))).unwrap();
    assert_eq!(c.data_stream, mode);
}

#[rstest]
#[case::auto("auto", None)]
#[case::refuse("refuse", Some(KeylessSources::Refused))]
#[case::allow("allow", Some(KeylessSources::Allowed))]
fn keyless_sources_spellings(#[case] text: &str, #[case] policy: Option<KeylessSources>) {
    let c = BackendConfig::from_value(&with(json!({ "keyless_sources": text }))).unwrap();
    assert_eq!(c.keyless_sources, policy);
}

/// Case 7: `get_timeout_s * 1000 <= operation_timeout_ms` is refused,
/// equality included.
#[rstest]
#[case::equal(json!({"operation_timeout_ms": 30000, "get_timeout_s": 30}), false)]
#[case::below(json!({"operation_timeout_ms": 20000, "get_timeout_s": 19.999}), false)]
#[case::default_get_below_long_op(json!({"operation_timeout_ms": 40000}), false)]
#[case::just_above(json!({"operation_timeout_ms": 20000, "get_timeout_s": 20.001}), true)]
#[case::defaults(json!({}), true)]
fn get_timeout_must_exceed_operation_timeout(#[case] extra: Value, #[case] ok: bool) {
    let got = BackendConfig::from_value(&with(extra));
    match (got, ok) {
        (Ok(_), true) => {}
        (Err(Error::Config { key, .. }), false) => assert_eq!(key, "get_timeout_s"),
        (other, _) => panic!("{other:?}"),
    }
}

/// Case 8: remote hints need a fixed port and a dialable advertise host; a
/// wildcard bind with an explicit advertise host is fine; local-only keeps
/// port 0.
#[rstest]
#[case::port_zero(json!({"enable_remote_hint": true, "control_port": 0, "control_advertise_host": "10.0.0.5"}), Some("control_port"))]
#[case::advertise_absent(json!({"enable_remote_hint": true, "control_port": 25000}), Some("control_advertise_host"))]
#[case::advertise_empty(json!({"enable_remote_hint": true, "control_port": 25000, "control_advertise_host": ""}), Some("control_advertise_host"))]
#[case::advertise_v4_wildcard(json!({"enable_remote_hint": true, "control_port": 25000, "control_advertise_host": "0.0.0.0"}), Some("control_advertise_host"))]
#[case::advertise_v6_wildcard(json!({"enable_remote_hint": true, "control_port": 25000, "control_advertise_host": "::"}), Some("control_advertise_host"))]
#[case::advertise_v6_bracketed_wildcard(json!({"enable_remote_hint": true, "control_port": 25000, "control_advertise_host": "[::]"}), Some("control_advertise_host"))]
#[case::advertise_star(json!({"enable_remote_hint": true, "control_port": 25000, "control_advertise_host": "*"}), Some("control_advertise_host"))]
#[case::loopback_cross_host(json!({"enable_remote_hint": true, "control_port": 25000, "control_advertise_host": "127.0.0.1"}), Some("control_advertise_host"))]
#[case::loopback_single_host(json!({"enable_remote_hint": true, "control_port": 25000, "control_advertise_host": "127.0.0.1", "single_host": true}), None)]
#[case::wildcard_bind_explicit_advertise(json!({"enable_remote_hint": true, "control_host": "0.0.0.0", "control_port": 25000, "control_advertise_host": "10.0.0.5", "cluster_secret": SECRET}), None)]
#[case::v6_wildcard_bind(json!({"enable_remote_hint": true, "control_host": "::", "control_port": 25000, "control_advertise_host": "fd00::1", "cluster_secret": SECRET}), None)]
#[case::cross_host_without_secret(json!({"enable_remote_hint": true, "control_port": 25000, "control_advertise_host": "10.0.0.5"}), Some("cluster_secret"))]
#[case::named_host_without_secret(json!({"enable_remote_hint": true, "control_port": 25000, "control_advertise_host": "node7", "single_host": true}), Some("cluster_secret"))]
#[case::localhost_name_without_secret(json!({"enable_remote_hint": true, "control_port": 25000, "control_advertise_host": "localhost", "single_host": true}), None)]
#[case::local_only_cross_host_without_secret(json!({"control_advertise_host": "10.0.0.5"}), None)]
#[case::local_only_port_zero(json!({"control_port": 0}), None)]
#[case::bind_host_name(json!({"control_host": "node7"}), Some("control_host"))]
fn remote_hint_settings(#[case] extra: Value, #[case] refused_key: Option<&str>) {
    match (
        BackendConfig::from_value_with_env(&with(extra), &[], &no_env),
        refused_key,
    ) {
        (Ok(_), None) => {}
        (Err(Error::Config { key, .. }), Some(expected)) => assert_eq!(key, expected),
        (other, _) => panic!("{other:?}"),
    }
}

/// `publish_inventory` advertises its KV-event endpoints with the control
/// channel's advertise host (same loopback rule as peers); every new key is
/// bound-checked by name.
#[rstest]
#[case::off_needs_nothing(json!({"kv_events_port": 65535}), None)]
#[case::advertise_absent(json!({"publish_inventory": true}), Some("control_advertise_host"))]
#[case::advertise_wildcard(json!({"publish_inventory": true, "control_advertise_host": "0.0.0.0"}), Some("control_advertise_host"))]
#[case::loopback_cross_host(json!({"publish_inventory": true, "control_advertise_host": "127.0.0.1"}), Some("control_advertise_host"))]
#[case::loopback_single_host(json!({"publish_inventory": true, "control_advertise_host": "127.0.0.1", "single_host": true}), None)]
#[case::without_remote_hints(json!({"publish_inventory": true, "control_advertise_host": "10.0.0.5"}), None)]
#[case::replay_port_overflows(json!({"publish_inventory": true, "control_advertise_host": "10.0.0.5", "kv_events_port": 65535}), Some("kv_events_port"))]
#[case::port_too_big(json!({"kv_events_port": 65536}), Some("kv_events_port"))]
#[case::not_a_bool(json!({"publish_inventory": 1}), Some("publish_inventory"))]
#[case::worker_type(json!({"worker_type": "router"}), Some("worker_type"))]
#[case::heartbeat_too_fast(json!({"inventory_heartbeat_ms": 9}), Some("inventory_heartbeat_ms"))]
#[case::heartbeat_too_slow(json!({"inventory_heartbeat_ms": 60001}), Some("inventory_heartbeat_ms"))]
#[case::medium_cpu(json!({"medium": "CPU"}), None)]
#[case::medium_gpu(json!({"medium": "GPU"}), Some("medium"))]
fn publishing_settings(#[case] extra: Value, #[case] refused_key: Option<&str>) {
    match (
        BackendConfig::from_value_with_env(&with(extra), &[], &no_env),
        refused_key,
    ) {
        (Ok(c), None) => assert_eq!(
            c.0.medium.as_str(),
            "CPU",
            "KVCR DRAM is pageable host memory"
        ),
        (Err(Error::Config { key, .. }), Some(expected)) => assert_eq!(key, expected),
        (other, _) => panic!("{other:?}"),
    }
}

/// `guard_socket` needs peer mode (the guard keeps its pools and listener);
/// `guard_journal_bytes` needs the socket and is bounded.
#[rstest]
#[case::without_peers(json!({"guard_socket": "/run/kvcr/guard.sock"}), false, None, Some("guard_socket"))]
#[case::with_peers(json!({"guard_socket": "/run/kvcr/guard.sock"}), true, Some(64 << 20), None)]
#[case::journal_set(json!({"guard_socket": "/g.sock", "guard_journal_bytes": 4096}), true, Some(4096), None)]
#[case::journal_alone(json!({"guard_journal_bytes": 1048576}), true, None, Some("guard_socket"))]
#[case::journal_too_small(json!({"guard_socket": "/g.sock", "guard_journal_bytes": 4095}), true, None, Some("guard_journal_bytes"))]
#[case::journal_too_big(json!({"guard_socket": "/g.sock", "guard_journal_bytes": 17179869185u64}), true, None, Some("guard_journal_bytes"))]
#[case::empty_socket(json!({"guard_socket": " "}), true, None, Some("guard_socket"))]
#[case::not_a_path(json!({"guard_socket": 7}), true, None, Some("guard_socket"))]
fn guard_settings(
    #[case] mut extra: Value,
    #[case] peers: bool,
    #[case] journal: Option<u64>,
    #[case] refused_key: Option<&str>,
) {
    if peers {
        extra["enable_remote_hint"] = json!(true);
        extra["control_port"] = json!(25000);
        extra["control_advertise_host"] = json!("127.0.0.1");
        extra["single_host"] = json!(true);
    }
    match (
        BackendConfig::from_value_with_env(&with(extra), &[], &no_env),
        refused_key,
    ) {
        (Ok(c), None) => assert_eq!(c.0.guard.map(|(_, bytes)| bytes), journal),
        (Err(Error::Config { key, .. }), Some(expected)) => assert_eq!(key, expected),
        (other, _) => panic!("{other:?}"),
    }
}

/// Unknown keys are refused with the key named; the engine's loader keys are not.
#[test]
fn unknown_keys_are_named() {
    let err = BackendConfig::from_value(&with(json!({"local_dram_byte": 5}))).unwrap_err();
    assert_eq!(err, Error::UnknownKey("local_dram_byte".into()));
    assert!(err.to_string().contains("`local_dram_byte`"), "{err}");
    BackendConfig::from_value(&with(json!({
        "backend_name": "kvcr", "module_path": "m", "class_name": "C", "interface_v1": 1
    })))
    .unwrap();
}

/// Every bound, with the key named.
#[rstest]
#[case::dram_missing(json!({}), "local_dram_bytes")]
#[case::dram_zero(json!({"local_dram_bytes": 0}), "local_dram_bytes")]
#[case::dram_huge(json!({"local_dram_bytes": 1u64 << 50}), "local_dram_bytes")]
#[case::dram_string(json!({"local_dram_bytes": "1G"}), "local_dram_bytes")]
#[case::dram_negative(json!({"local_dram_bytes": -1}), "local_dram_bytes")]
#[case::op_zero(json!({"local_dram_bytes": 1, "operation_timeout_ms": 0}), "operation_timeout_ms")]
#[case::get_nan(json!({"local_dram_bytes": 1, "get_timeout_s": "x"}), "get_timeout_s")]
#[case::get_negative(json!({"local_dram_bytes": 1, "get_timeout_s": -3}), "get_timeout_s")]
#[case::policy_unknown(json!({"local_dram_bytes": 1, "policy": "g3_lru"}), "policy")]
#[case::data_stream_unknown(json!({"local_dram_bytes": 1, "data_stream": "maybe"}), "data_stream")]
#[case::keyless_unknown(json!({"local_dram_bytes": 1, "keyless_sources": "maybe"}), "keyless_sources")]
#[case::data_stream_bool(json!({"local_dram_bytes": 1, "data_stream": true}), "data_stream")]
#[case::policy_number(json!({"local_dram_bytes": 1, "policy": 1}), "policy")]
#[case::port_range(json!({"local_dram_bytes": 1, "control_port": 70000}), "control_port")]
#[case::medium(json!({"local_dram_bytes": 1, "medium": "GPU"}), "medium")]
#[case::remote_not_bool(json!({"local_dram_bytes": 1, "enable_remote_hint": "yes"}), "enable_remote_hint")]
#[case::hinted_zero(json!({"local_dram_bytes": 1, "max_hinted_requests": 0}), "max_hinted_requests")]
#[case::tls_empty(json!({"local_dram_bytes": 1, "ucx_tls": ""}), "ucx_tls")]
fn bounds_name_their_key(#[case] extra: Value, #[case] expected: &str) {
    match BackendConfig::from_value(&extra) {
        Err(Error::Config { key, .. }) => assert_eq!(key, expected),
        other => panic!("{other:?}"),
    }
}

/// The three spellings the engine passes: object, JSON text, `@path`; empty
/// text is `{}` (and so misses the required size).
#[test]
fn config_spellings() {
    let text = r#"{"local_dram_bytes": 4096, "policy": "fifo"}"#;
    assert_eq!(
        BackendConfig::parse(text).unwrap().policy,
        EvictionPolicy::Fifo
    );
    let path = std::env::temp_dir().join(format!("kvcr-hicache-{}.json", std::process::id()));
    std::fs::write(&path, text).unwrap();
    let from_file = BackendConfig::parse(&format!("@{}", path.display())).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(from_file.local_dram_bytes, 4096);
    assert!(matches!(
        BackendConfig::parse("  "),
        Err(Error::Config { key, .. }) if key == "local_dram_bytes"
    ));
    assert!(matches!(
        BackendConfig::parse("[1]"),
        Err(Error::ConfigSyntax(_))
    ));
    assert!(matches!(
        BackendConfig::parse("{"),
        Err(Error::ConfigSyntax(_))
    ));
    assert!(matches!(
        BackendConfig::parse("@/nonexistent/kvcr.json"),
        Err(Error::ConfigSyntax(_))
    ));
}

/// Case 11: pipeline parallelism and head splitting are refused, named.
#[rstest]
#[case::pp(|c: &mut StorageConfig| c.pp_size = 2, "pipeline parallelism")]
#[case::split_heads(|c: &mut StorageConfig| c.should_split_heads = true, "heterogeneous TP")]
#[case::mla(|c: &mut StorageConfig| c.is_mla_model = true, "is_mla_model")]
fn unsupported_topologies_are_named(#[case] change: fn(&mut StorageConfig), #[case] named: &str) {
    let mut config = StorageConfig::single_rank("m", json!({"local_dram_bytes": 4096}));
    change(&mut config);
    match KvcrHiCacheStorage::new(config, RankGroups::solo()) {
        Err(e @ Error::Unsupported(_)) => assert!(e.to_string().contains(named), "{e}"),
        other => panic!("{other:?}"),
    }
}

/// The rank group must match the TP size, and the rank must be in range.
#[test]
fn rank_group_must_match_the_topology() {
    let config = StorageConfig::single_rank("m", json!({"local_dram_bytes": 4096})).with_tp(0, 2);
    assert!(matches!(
        KvcrHiCacheStorage::new(config, RankGroups::solo()),
        Err(Error::Config { key, .. }) if key == "rank_groups"
    ));
    let config = StorageConfig::single_rank("m", json!({"local_dram_bytes": 4096})).with_tp(2, 2);
    assert!(matches!(
        KvcrHiCacheStorage::new(config, RankGroups::solo()),
        Err(Error::Config { key, .. }) if key == "tp_rank"
    ));
}

/// A layer above names its own keys: they come back; others are still refused.
#[test]
fn extension_keys_are_handed_back() {
    let value = with(json!({"max_inflight_restore_ops": 8}));
    let (config, extensions) =
        BackendConfig::from_value_with_extensions(&value, &["max_inflight_restore_ops"]).unwrap();
    assert_eq!(config.local_dram_bytes, 1 << 20);
    assert_eq!(extensions.get("max_inflight_restore_ops"), Some(&json!(8)));
    assert_eq!(
        BackendConfig::from_value_with_extensions(&value, &["other"]).unwrap_err(),
        Error::UnknownKey("max_inflight_restore_ops".into())
    );
}

/// A rank whose port (base + rank offset) would pass 65535 is refused at once.
#[test]
fn rank_port_overflow_is_refused() {
    let extra = json!({"local_dram_bytes": 4096, "enable_remote_hint": true,
        "control_port": 65535, "control_advertise_host": "10.0.0.5", "cluster_secret": SECRET});
    let groups = kvcr_hicache_storage::LocalRankGroup::new(2, std::time::Duration::from_secs(1));
    let g1: std::sync::Arc<dyn kvcr_hicache_storage::RankGroup> =
        std::sync::Arc::new(groups.into_iter().nth(1).unwrap());
    let config = StorageConfig::single_rank("m", extra).with_tp(1, 2);
    match KvcrHiCacheStorage::new(config, RankGroups::shared(g1)) {
        Err(Error::Config { key, .. }) => assert_eq!(key, "control_port"),
        other => panic!("{other:?}"),
    }
}

/// The engine's storage config as JSON: known fields type-checked by name,
/// the engine's other fields ignored, topology refusals still named.
#[test]
fn storage_config_from_the_engine() {
    let c = StorageConfig::from_engine_json(&json!({
        "tp_rank": 1, "tp_size": 2, "pp_rank": 0, "pp_size": 1, "attn_cp_rank": 0,
        "attn_cp_size": 1, "is_mla_model": false, "enable_storage_metrics": true,
        "is_page_first_layout": true, "model_name": "Qwen/Qwen3-0.6B", "dp_rank": 0,
        "dp_size": 1, "tp_lcm_size": null, "should_split_heads": false,
        "extra_config": {"local_dram_bytes": 4096}
    }))
    .unwrap();
    assert_eq!((c.tp_rank, c.tp_size), (1, 2));
    assert_eq!(c.model_name, "Qwen/Qwen3-0.6B");
    assert_eq!(c.extra_config, Some(json!({"local_dram_bytes": 4096})));
    assert!(matches!(
        StorageConfig::from_engine_json(&json!({"tp_rank": "1"})),
        Err(Error::Config { key, .. }) if key == "tp_rank"
    ));
    let pp = StorageConfig::from_engine_json(&json!({"pp_size": 2, "model_name": "m",
        "extra_config": {"local_dram_bytes": 4096}}))
    .unwrap();
    let err = KvcrHiCacheStorage::new(pp, RankGroups::solo()).unwrap_err();
    assert!(err.to_string().contains("pp_size = 2"), "{err}");
}

/// A secret file for one test case (removed on drop).
struct SecretFile(PathBuf);

impl SecretFile {
    fn new(case: &str, contents: &[u8]) -> Self {
        let path =
            std::env::temp_dir().join(format!("kvcr-hicache-secret-{}-{case}", std::process::id()));
        std::fs::write(&path, contents).unwrap();
        Self(path)
    }
}

impl Drop for SecretFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Where a case's file comes from: none, a file with these contents, or a
/// path that is not a readable file.
#[derive(Debug, Clone, Copy)]
enum File {
    None,
    With(&'static [u8]),
    Missing,
    Directory,
}

/// The cluster secret: `cluster_secret` (used byte for byte), or
/// `cluster_secret_file` (trimmed), never both; else `KVCR_CLUSTER_SECRET`
/// (byte for byte; empty is unset); at least 16 bytes wherever it comes from;
/// a refusal names where it came from.
#[rstest]
#[case::none(json!({}), File::None, None, Ok(None))]
#[case::inline(json!({"cluster_secret": SECRET}), File::None, None, Ok(Some(SECRET.as_bytes())))]
#[case::inline_kept_exactly(json!({"cluster_secret": " 0123456789abcdef "}), File::None, None, Ok(Some(&b" 0123456789abcdef "[..])))]
#[case::inline_short(json!({"cluster_secret": "0123456789abcde"}), File::None, None, Err("cluster_secret"))]
#[case::inline_empty(json!({"cluster_secret": ""}), File::None, None, Err("cluster_secret"))]
#[case::inline_not_a_string(json!({"cluster_secret": 1234567890123456u64}), File::None, None, Err("cluster_secret"))]
#[case::inline_too_long(json!({"cluster_secret": "x".repeat(65 * 1024)}), File::None, None, Err("cluster_secret"))]
#[case::inline_null_falls_back(json!({"cluster_secret": null}), File::None, Some("env-secret-0123456789"), Ok(Some(&b"env-secret-0123456789"[..])))]
#[case::file_trimmed(json!({}), File::With(b"  file-secret-0123456789\n"), None, Ok(Some(&b"file-secret-0123456789"[..])))]
#[case::file_binary(json!({}), File::With(b"\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\xff\xfe\xfd\xfc\xfb\xfa\x00"), None, Ok(Some(&b"\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\xff\xfe\xfd\xfc\xfb\xfa\x00"[..])))]
#[case::file_short_after_trim(json!({}), File::With(b"   short-secret  \n\n"), None, Err("cluster_secret_file"))]
#[case::file_blank(json!({}), File::With(b" \n\t\n"), None, Err("cluster_secret_file"))]
#[case::file_missing(json!({}), File::Missing, None, Err("cluster_secret_file"))]
#[case::file_is_a_directory(json!({}), File::Directory, None, Err("cluster_secret_file"))]
#[case::file_too_large(json!({}), File::With(&[b'x'; 64 * 1024 + 1]), None, Err("cluster_secret_file"))]
#[case::file_empty_path(json!({"cluster_secret_file": ""}), File::None, None, Err("cluster_secret_file"))]
#[case::both(json!({"cluster_secret": SECRET}), File::With(b"file-secret-0123456789"), None, Err("cluster_secret"))]
#[case::both_even_if_env(json!({"cluster_secret": SECRET}), File::With(b"file-secret-0123456789"), Some("env-secret-0123456789"), Err("cluster_secret"))]
#[case::env(json!({}), File::None, Some("env-secret-0123456789"), Ok(Some(&b"env-secret-0123456789"[..])))]
#[case::env_short(json!({}), File::None, Some("env-short"), Err(CLUSTER_SECRET_ENV))]
#[case::env_empty_is_unset(json!({}), File::None, Some(""), Ok(None))]
#[case::key_wins_over_env(json!({"cluster_secret": SECRET}), File::None, Some("env-short"), Ok(Some(SECRET.as_bytes())))]
#[case::file_wins_over_env(json!({}), File::With(b"file-secret-0123456789\n"), Some("env-short"), Ok(Some(&b"file-secret-0123456789"[..])))]
fn cluster_secret_sources(
    #[case] extra: Value,
    #[case] file: File,
    #[case] env: Option<&'static str>,
    #[case] expected: Result<Option<&[u8]>, &str>,
) {
    static CASE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let mut extra = with(extra);
    let case = CASE
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        .to_string();
    let _held = match file {
        File::None => None,
        File::With(contents) => {
            let f = SecretFile::new(&case, contents);
            extra["cluster_secret_file"] = json!(f.0.to_str().unwrap());
            Some(f)
        }
        File::Missing => {
            extra["cluster_secret_file"] = json!("/nonexistent/kvcr/secret");
            None
        }
        File::Directory => {
            extra["cluster_secret_file"] = json!(std::env::temp_dir().to_str().unwrap());
            None
        }
    };
    let lookup = |name: &str| {
        assert_eq!(name, CLUSTER_SECRET_ENV);
        env.map(OsString::from)
    };
    let got = BackendConfig::from_value_with_env(&extra, &[], &lookup).map(|(c, _)| c);
    match (got, expected) {
        (Ok(c), Ok(want)) => assert_eq!(c.cluster_secret.as_ref().map(ClusterSecret::expose), want),
        (Err(Error::Config { key, .. }), Err(want)) => assert_eq!(key, want),
        (other, _) => panic!("{other:?}"),
    }
}

/// The secret is never echoed: not by a refusal, not by `Debug` of the
/// backend's configuration, of the engine's storage configuration (which
/// carries the raw extra config) or of the backend.
#[test]
fn the_cluster_secret_is_never_echoed() {
    let long = "LONG-SECRET-VALUE-0123456789";
    let short = "SHORT-SECRET";
    let refusals = [
        BackendConfig::from_value_with_env(&with(json!({"cluster_secret": short})), &[], &no_env),
        BackendConfig::from_value_with_env(
            &with(json!({"cluster_secret": long, "cluster_secret_file": "/x"})),
            &[],
            &no_env,
        ),
        BackendConfig::from_value_with_env(&with(json!({})), &[], &|_| Some(short.into())),
    ];
    for refusal in refusals {
        let err = refusal.unwrap_err();
        for text in [err.to_string(), format!("{err:?}")] {
            assert!(!text.contains(short) && !text.contains(long), "{text}");
        }
    }
    let extra = with(json!({"cluster_secret": long}));
    let (config, _) = BackendConfig::from_value_with_env(&extra, &[], &no_env).unwrap();
    assert_eq!(
        config.cluster_secret.as_ref().unwrap().expose(),
        long.as_bytes()
    );
    let debug = format!("{config:?} {:?}", config.cluster_secret);
    assert!(
        !debug.contains(long) && debug.contains("<redacted>"),
        "{debug}"
    );
    // The engine's storage config, as an object and as JSON text.
    for extra_config in [extra.clone(), json!(extra.to_string())] {
        let storage = StorageConfig::single_rank("m", extra_config);
        let debug = format!("{storage:?}");
        assert!(
            !debug.contains(long) && debug.contains("redacted"),
            "{debug}"
        );
        let backend = KvcrHiCacheStorage::new(storage, RankGroups::solo()).unwrap();
        assert_eq!(
            backend
                .backend_config()
                .cluster_secret
                .as_ref()
                .unwrap()
                .expose(),
            long.as_bytes()
        );
        let debug = format!("{backend:?} {:?}", backend.backend_config());
        assert!(!debug.contains(long), "{debug}");
    }
    // Unparseable text that names the key is redacted whole.
    let storage =
        StorageConfig::single_rank("m", json!(format!("{{\"cluster_secret\": \"{long}\"")));
    assert!(!format!("{storage:?}").contains(long));
    // A constructor refusal (a short secret) does not echo it either.
    let storage = StorageConfig::single_rank("m", with(json!({"cluster_secret": short})));
    let err = KvcrHiCacheStorage::new(storage, RankGroups::solo()).unwrap_err();
    assert!(!err.to_string().contains(short), "{err}");
    assert!(matches!(
        ClusterSecret::new(short.into()),
        Err(Error::Config { .. })
    ));
}

/// A secret key with a typo is an unknown key, named (the value is not).
#[test]
fn a_misspelt_secret_key_is_refused_by_name() {
    let err = BackendConfig::from_value_with_env(
        &with(json!({"cluster_secrets": "0123456789abcdef0"})),
        &[],
        &no_env,
    )
    .unwrap_err();
    assert_eq!(err, Error::UnknownKey("cluster_secrets".into()));
    assert!(!err.to_string().contains("0123456789abcdef0"));
}
