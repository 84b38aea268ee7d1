//! Arbitrary text to the HiCache backend's configuration parsing: the
//! extra-config text the engine passes (`BackendConfig::parse`), the same as a
//! JSON value (`BackendConfig::from_value_with_env`, with a layer's extension
//! keys and no environment), and the engine's whole storage-config JSON the
//! Python face parses first (`StorageConfig::from_engine_json`), whose extra
//! config then goes the way the backend sends it. Bad input must be a typed
//! error, never a panic.
//!
//! Kept hermetic: `@path` texts and `cluster_secret_file` keys (both read a
//! file) are left out.
#![no_main]

use kvcr_hicache_storage::{BackendConfig, ClusterSecret, StorageConfig};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

const SECRET_FILE_KEY: &str = "cluster_secret_file";

/// Drops the key that reads a file.
fn hermetic(mut value: Value) -> Value {
    if let Value::Object(map) = &mut value {
        map.remove(SECRET_FILE_KEY);
    }
    value
}

fn backend_text(text: &str) {
    if text.trim_start().starts_with('@') || text.contains(SECRET_FILE_KEY) {
        return;
    }
    if let Ok(c) = BackendConfig::parse(text) {
        check(&c);
    }
}

fn backend_value(value: &Value) {
    let value = hermetic(value.clone());
    match BackendConfig::from_value_with_env(&value, &["delivery", "placement"], &|_| None) {
        Ok((c, extensions)) => {
            check(&c);
            assert!(
                extensions
                    .keys()
                    .all(|k| k == "delivery" || k == "placement")
            );
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
}

/// What every accepted configuration promises.
fn check(c: &BackendConfig) {
    assert!(c.local_dram_bytes > 0);
    assert!(c.get_timeout > c.operation_timeout);
    assert!(c.max_hinted_requests >= 1);
    if c.enable_remote_hint {
        assert_ne!(c.control_port, 0);
    }
    let _ = format!("{c:?}");
}

fuzz_target!(|data: &[u8]| {
    let _ = ClusterSecret::new(data.to_vec());
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    backend_text(text);
    let Ok(value) = serde_json::from_str::<Value>(text) else {
        return;
    };
    backend_value(&value);
    if let Ok(storage) = StorageConfig::from_engine_json(&value) {
        let _ = format!("{storage:?}");
        match &storage.extra_config {
            Some(Value::String(extra)) => backend_text(extra),
            Some(other) => backend_value(other),
            None => {}
        }
    }
});
