//! The backend with its controls: the default behaves exactly as the storage
//! crate alone (same results, same bytes, same span plan and runner
//! counters), and batching on changes nothing but how calls are split —
//! on TP=2, ranks as threads agreeing through an in-process group.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::sync::Arc;
use std::time::Duration;

use kvcr_foundation::BlockKey;
use kvcr_hicache_perf::{KvcrHiCachePerf, PerfConfig};
use kvcr_hicache_storage::{
    ExtraInfo, HostLayout, HostPoolDesc, KvGeometry, KvcrHiCacheStorage, LocalRankGroup,
    RankGroups, StorageConfig,
};
use rstest::rstest;
use serde_json::json;

const HOST_PAGES: u64 = 16;

fn geometry() -> KvGeometry {
    KvGeometry {
        layers: 2,
        kv_heads: 1,
        head_dim: 8,
        dtype_bytes: 2,
        page_size: 4,
    }
}

enum Backend {
    Plain(KvcrHiCacheStorage),
    Perf(KvcrHiCachePerf),
}

impl Backend {
    fn storage(&self) -> &KvcrHiCacheStorage {
        match self {
            Self::Plain(s) => s,
            Self::Perf(p) => p.storage(),
        }
    }
    fn exists(&self, k: &[BlockKey]) -> usize {
        match self {
            Self::Plain(s) => s.batch_exists(k, &ExtraInfo::default()),
            Self::Perf(p) => p.batch_exists(k, &ExtraInfo::default()),
        }
    }
    fn get(&self, k: &[BlockKey], pages: &[u64]) -> Vec<bool> {
        match self {
            Self::Plain(s) => s.batch_get(k, pages, &ExtraInfo::default()),
            Self::Perf(p) => p.batch_get(k, pages, &ExtraInfo::default()),
        }
    }
    fn set(&self, k: &[BlockKey], pages: &[u64]) -> Vec<bool> {
        match self {
            Self::Plain(s) => s.batch_set(k, pages, &ExtraInfo::default()),
            Self::Perf(p) => p.batch_set(k, pages, &ExtraInfo::default()),
        }
    }
}

/// One rank: backend first, so it drops before the memory it registered.
struct Rank {
    backend: Backend,
    host: Vec<u8>,
}

/// What a scenario observed on every rank.
#[derive(Debug, PartialEq)]
struct Observed {
    results: Vec<String>,
    host: Vec<Vec<u8>>,
    plans: Vec<kvcr_hicache_storage::SpanPlan>,
    runner: Vec<kvcr_foundation::runner::RunnerStats>,
    stats: Vec<kvcr_hicache_storage::StorageStats>,
}

fn engine(perf: Option<PerfConfig>) -> Vec<Rank> {
    let prefetch = LocalRankGroup::new(2, Duration::from_secs(30));
    let backup = LocalRankGroup::new(2, Duration::from_secs(30));
    let g = geometry();
    prefetch
        .into_iter()
        .zip(backup)
        .enumerate()
        .map(|(r, (p, b))| {
            let extra = json!({
                "local_dram_bytes": 8 * g.page_bytes(),
                "operation_timeout_ms": 5000,
                "get_timeout_s": 10,
                "prefault": false,
            });
            let config = StorageConfig::single_rank("perf-model", extra).with_tp(r as u32, 2);
            let groups = RankGroups {
                prefetch: Arc::new(p),
                backup: Arc::new(b),
            };
            let backend = match &perf {
                None => Backend::Plain(KvcrHiCacheStorage::new(config, groups).unwrap()),
                Some(perf) => {
                    Backend::Perf(KvcrHiCachePerf::new(config, groups, perf.clone()).unwrap())
                }
            };
            let len = HostPoolDesc::required_len(&g, HOST_PAGES).unwrap();
            let mut host: Vec<u8> = (0..len)
                .map(|i| (i as u8).wrapping_mul(13).wrapping_add(r as u8))
                .collect();
            let desc = HostPoolDesc {
                layout: HostLayout::PageFirst,
                base: host.as_mut_ptr() as u64,
                len,
                pages: HOST_PAGES,
                geometry: g,
            };
            match &backend {
                // SAFETY: (test) `host` lives in the same `Rank`, after the
                // backend, and is read only between calls.
                Backend::Plain(s) => unsafe { s.register_host_pool(desc) }.unwrap(),
                // SAFETY: as above.
                Backend::Perf(p) => unsafe { p.register_host_pool(desc) }.unwrap(),
            }
            Rank { backend, host }
        })
        .collect()
}

fn keys(raw: impl IntoIterator<Item = u64>) -> Vec<BlockKey> {
    raw.into_iter().map(BlockKey::from_u64).collect()
}

/// Runs `f` on both ranks at once (collectives need both).
fn all<T: Send + std::fmt::Debug>(ranks: &[Rank], f: impl Fn(&Backend) -> T + Sync) -> String {
    let out: Vec<T> = std::thread::scope(|s| {
        let hs: Vec<_> = ranks.iter().map(|r| s.spawn(|| f(&r.backend))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    format!("{out:?}")
}

/// Stores pages 0..6, queries 10 keys (a miss at 6), restores 8 keys (two
/// misses) into other host pages, with a key named twice.
fn scenario(perf: Option<PerfConfig>) -> Observed {
    let ranks = engine(perf);
    let mut results = vec![
        all(&ranks, |b| b.set(&keys(0..6), &[0, 1, 2, 3, 4, 5])),
        all(&ranks, |b| b.exists(&keys(0..10))),
        all(&ranks, |b| b.exists(&keys([1, 2, 99, 3]))),
    ];
    results.push(all(&ranks, |b| {
        b.get(
            &keys([0, 1, 2, 7, 3, 4, 8, 1]),
            &[8, 9, 10, 11, 12, 13, 14, 15],
        )
    }));
    Observed {
        results,
        plans: ranks
            .iter()
            .map(|r| r.backend.storage().span_plan().unwrap().clone())
            .collect(),
        runner: ranks
            .iter()
            .map(|r| r.backend.storage().runner_stats().unwrap())
            .collect(),
        stats: ranks.iter().map(|r| r.backend.storage().stats()).collect(),
        host: ranks
            .into_iter()
            .map(|r| {
                let Rank { backend, host } = r;
                drop(backend);
                host
            })
            .collect(),
    }
}

#[test]
fn the_default_configuration_behaves_exactly_as_the_storage_crate_alone() {
    let plain = scenario(None);
    let perf = scenario(Some(PerfConfig::default()));
    assert_eq!(plain, perf);
    // The scenario is not vacuous: hits, misses and restored bytes.
    assert_eq!(plain.results[1], "[6, 6]");
    assert_eq!(plain.results[2], "[2, 2]");
    assert_eq!(
        plain.results[3],
        "[[true, true, true, false, true, true, false, true], [true, true, true, false, true, true, false, true]]"
    );
}

#[rstest]
#[case::read_pages(PerfConfig { read_batch_pages: 3, ..PerfConfig::default() })]
#[case::read_bytes(PerfConfig { read_batch_bytes: 2 * geometry().page_bytes(), ..PerfConfig::default() })]
#[case::exists(PerfConfig { exists_batch_pages: 4, ..PerfConfig::default() })]
#[case::all(PerfConfig { read_batch_pages: 1, exists_batch_pages: 1, ..PerfConfig::default() })]
#[case::anonymous_pool_and_split(PerfConfig {
    pool_memory: kvcr_hicache_perf::placement::anonymous(kvcr_hicache_perf::placement::HugePages::Prefer),
    put_split: kvcr_hicache_perf::placement::split_for(None),
    read_batch_pages: 2,
    ..PerfConfig::default()
})]
fn batching_changes_how_calls_split_not_what_they_return(#[case] config: PerfConfig) {
    let plain = scenario(None);
    let batched = scenario(Some(config.clone()));
    assert_eq!(plain.results, batched.results);
    for rank in engine(Some(config.clone())) {
        let tuning = rank.backend.storage().runner_tuning();
        assert_eq!(
            (&tuning.pool_memory, tuning.put_split),
            (&config.pool_memory, config.put_split)
        );
    }
    assert_eq!(plain.host, batched.host);
    assert_eq!(plain.plans, batched.plans);
}

fn extensions(v: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
    v.as_object().unwrap().clone()
}

#[rstest]
#[case::wrong_type(json!({"perf_read_batch_pages": "8"}), "perf_read_batch_pages")]
#[case::negative(json!({"perf_read_batch_bytes": -1}), "perf_read_batch_bytes")]
#[case::huge_word(json!({"perf_huge_pages": "always", "perf_anonymous_dram": true}), "perf_huge_pages")]
#[case::huge_without_anon(json!({"perf_huge_pages": "prefer"}), "perf_anonymous_dram")]
#[case::node_too_big(json!({"perf_numa_node": 5000, "perf_anonymous_dram": true}), "perf_numa_node")]
#[case::mode_without_node(json!({"perf_numa_mode": "bind", "perf_anonymous_dram": true}), "perf_numa_mode")]
#[case::mode_word(json!({"perf_numa_node": 0, "perf_numa_mode": "spread", "perf_anonymous_dram": true}), "perf_numa_mode")]
#[case::in_flight_without_split(json!({"perf_put_split_in_flight": 2}), "perf_put_split_in_flight")]
#[case::anon_not_bool(json!({"perf_anonymous_dram": 1}), "perf_anonymous_dram")]
fn bad_perf_keys_are_refused_by_name(#[case] value: serde_json::Value, #[case] key: &str) {
    match PerfConfig::from_extensions(&extensions(value)) {
        Err(kvcr_hicache_perf::PerfError::Config { field, .. }) => assert_eq!(field, key),
        other => panic!("{other:?}"),
    }
}

#[test]
fn perf_keys_parse_into_controls() {
    use kvcr_hicache_perf::placement::{
        AnonymousMemory, HugePages, NumaBinding, NumaMode, PoolMemory, PutSplit,
    };
    let config = PerfConfig::from_extensions(&extensions(json!({
        "perf_read_batch_pages": 32,
        "perf_exists_batch_pages": 128,
        "perf_anonymous_dram": true,
        "perf_huge_pages": "prefer",
        "perf_numa_node": 0,
        "perf_put_split_bytes": 4194304,
        "perf_put_split_in_flight": 1,
    })))
    .unwrap();
    assert_eq!(
        config,
        PerfConfig {
            pool_memory: PoolMemory::Anonymous(AnonymousMemory {
                huge_pages: HugePages::Prefer,
                numa: Some(NumaBinding {
                    mode: NumaMode::Bind,
                    nodes: vec![0]
                }),
            }),
            put_split: PutSplit {
                chunk_bytes: 4 << 20,
                max_chunks_in_flight: 1
            },
            read_batch_pages: 32,
            read_batch_bytes: 0,
            exists_batch_pages: 128,
        }
    );
    assert_eq!(
        PerfConfig::from_extensions(&serde_json::Map::new()).unwrap(),
        PerfConfig::default()
    );
}

#[test]
fn the_engine_extra_config_carries_perf_keys_and_other_unknown_keys_are_refused() {
    let groups = || RankGroups::solo();
    let extra = |more: serde_json::Value| {
        let mut v = json!({"local_dram_bytes": 1 << 20});
        v.as_object_mut()
            .unwrap()
            .extend(more.as_object().unwrap().clone());
        StorageConfig::single_rank("perf-model", v)
    };
    let backend =
        KvcrHiCachePerf::from_engine(extra(json!({"perf_read_batch_pages": 4})), groups()).unwrap();
    assert_eq!(backend.config().read_batch_pages, 4);
    let err = KvcrHiCachePerf::from_engine(extra(json!({"perf_bogus": 1})), groups()).unwrap_err();
    assert!(err.to_string().contains("perf_bogus"), "{err}");
    // The JSON text form works too.
    let text = StorageConfig::single_rank(
        "perf-model",
        serde_json::Value::String(
            r#"{"local_dram_bytes": 1048576, "perf_exists_batch_pages": 2}"#.into(),
        ),
    );
    assert_eq!(
        KvcrHiCachePerf::from_engine(text, groups())
            .unwrap()
            .config()
            .exists_batch_pages,
        2
    );
}
