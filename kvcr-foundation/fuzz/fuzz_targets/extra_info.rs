//! Arbitrary JSON to the path the engine's per-request `extra_info` takes in
//! the HiCache backend: `ExtraInfo::from_engine` (request id, router hint
//! under its keys), then the hint's text through the backend's dispatch
//! (versioned `kv.fetch@1.0` envelope, or the legacy compact form), then the
//! per-rank dial of the hinted source. `hint_parse` fuzzes the hint parsers
//! on bare text; this target starts where the engine hands the dict over.
#![no_main]

use kvcr_contracts::RankLayout;
use kvcr_hicache_storage::{ExtraInfo, ROUTER_HINT_KEYS, parse_router_hint};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(value) = serde_json::from_str::<Value>(text) else {
        return;
    };
    let extra = ExtraInfo::from_engine(&value);
    if !value.is_object() {
        assert_eq!(extra, ExtraInfo::default());
    }
    if extra.router_hint.is_some() {
        assert!(ROUTER_HINT_KEYS.iter().any(|k| value.get(*k).is_some()));
    }
    let Some(raw) = &extra.router_hint else {
        return;
    };
    let hint_text = match raw {
        Value::String(t) => t.clone(),
        other => other.to_string(),
    };
    let Ok(hint) = parse_router_hint(&hint_text) else {
        return;
    };
    assert!(!hint.block_hashes.is_empty());
    assert_eq!(
        hint.covered_prefix(&hint.block_hashes),
        hint.block_hashes.len()
    );
    // Every rank of a few layouts dials its own shard of the source.
    for (dp, cp, tp) in [(1, 1, 1), (1, 1, 2), (2, 1, 4), (1, 2, 8)] {
        let Ok(layout) = RankLayout::new(dp, cp, tp) else {
            continue;
        };
        for rank in 0..tp {
            if let Ok(coordinate) = layout.coordinate(0, 0, rank) {
                let _ = coordinate.dial(&hint.source);
            }
        }
    }
});
