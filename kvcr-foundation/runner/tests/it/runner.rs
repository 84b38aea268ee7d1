//! The rank-local runner through its public API, with real memory and the real
//! copy thread: the reference runtime's local-DRAM behaviours, bad input, and
//! byte exactness.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvcr_contracts::protocol::{ElementRef, OpHandle, RegionId};
use kvcr_contracts::{
    BlockKey, CompatDigest, InventoryEvent, InventorySink, Namespace, NamespaceId, ScopedKey,
};
use kvcr_runner::error::RunnerReason;
use kvcr_runner::policy::{BlockMeta, CachePolicy, EvictionOrder, IngestDecision};
use kvcr_runner::{
    ClaimedCopy, DeliverEntry, DepositEntry, EntryStatus, FailReason, OpResult, PageInfo, PoolId,
    QueryStatus, RegionDesc, ReleaseHandle, Runner, RunnerConfig, policy,
};
use rstest::rstest;

const BLOCK: usize = 4096;

/// Engine-side host memory: `pages` blocks the runner reads from and writes to.
struct Host {
    buf: Vec<u8>,
    region: RegionId,
}

impl Host {
    fn new(runner: &mut Runner, label: &str, pages: usize) -> Self {
        let mut buf = vec![0u8; pages * BLOCK];
        // SAFETY: (test) `buf` lives in the returned Host, which every test
        // keeps alive until after the runner is closed or dropped, and no test
        // touches an element while an operation naming it is in flight.
        let region = unsafe {
            runner.register_region(RegionDesc {
                label: label.into(),
                base: buf.as_mut_ptr() as u64,
                size: BLOCK as u64,
                stride: 0,
                count: pages as u64,
            })
        }
        .unwrap();
        Self { buf, region }
    }

    fn fill(&mut self, page: usize, seed: u64) {
        for (i, b) in self.buf[page * BLOCK..(page + 1) * BLOCK]
            .iter_mut()
            .enumerate()
        {
            *b = (seed
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .wrapping_add(i as u64)
                >> 7) as u8;
        }
    }

    fn page(&self, page: usize) -> &[u8] {
        &self.buf[page * BLOCK..(page + 1) * BLOCK]
    }

    fn at(&self, page: usize) -> ElementRef {
        ElementRef {
            region: self.region,
            index: page as u64,
        }
    }
}

#[derive(Clone, Default)]
struct SharedSink(Arc<Mutex<Vec<InventoryEvent>>>);

impl InventorySink for SharedSink {
    fn publish(&mut self, event: &InventoryEvent) {
        self.0.lock().unwrap().push(event.clone());
    }
}

impl SharedSink {
    fn take(&self) -> Vec<InventoryEvent> {
        std::mem::take(&mut self.0.lock().unwrap())
    }
}

fn start(blocks: u32, policy: Option<Box<dyn CachePolicy>>) -> (Runner, NamespaceId, SharedSink) {
    start_with(
        RunnerConfig::single_pool("kv", BLOCK as u64, blocks),
        policy,
    )
}

fn start_with(
    config: RunnerConfig,
    policy: Option<Box<dyn CachePolicy>>,
) -> (Runner, NamespaceId, SharedSink) {
    let runner = Runner::start(config, policy).unwrap();
    let ns = runner.register_namespace(Namespace::base(CompatDigest(7)));
    let sink = SharedSink::default();
    runner.set_inventory_sink(Box::new(sink.clone()));
    (runner, ns, sink)
}

fn key(ns: NamespaceId, k: u64) -> ScopedKey {
    ScopedKey {
        namespace: ns,
        key: BlockKey::from_u64(k),
    }
}

/// Waits (bounded) until `op` completes and returns its result.
fn wait(runner: &mut Runner, op: OpHandle) -> OpResult {
    for _ in 0..1000 {
        for result in runner.wait_completed(Duration::from_millis(50)) {
            if result.op == op {
                return result;
            }
        }
    }
    panic!("operation {op:?} did not complete");
}

fn statuses(result: &OpResult) -> Vec<EntryStatus> {
    result.entries.iter().map(|(_, e)| e.status).collect()
}

fn deposit(
    runner: &mut Runner,
    host: &Host,
    ns: NamespaceId,
    pages: &[u64],
    no_evict: bool,
) -> OpResult {
    let entries = pages
        .iter()
        .map(|p| DepositEntry {
            key: key(ns, *p),
            spans: vec![host.at(*p as usize)],
            page: None,
        })
        .collect();
    let op = runner.deposit(entries, no_evict).unwrap();
    wait(runner, op)
}

fn deliver(runner: &mut Runner, ns: NamespaceId, pairs: &[(u64, ElementRef)]) -> OpResult {
    let entries = pairs
        .iter()
        .map(|(k, dst)| DeliverEntry {
            key: key(ns, *k),
            destinations: vec![*dst],
        })
        .collect();
    let op = runner.deliver(entries).unwrap();
    wait(runner, op)
}

fn stored_keys(events: &[InventoryEvent]) -> Vec<(char, u64)> {
    events
        .iter()
        .flat_map(|e| match e {
            InventoryEvent::Stored { keys, .. } => keys.iter().map(|k| ('+', k.as_u64())).collect(),
            InventoryEvent::Removed { keys, .. } => {
                keys.iter().map(|k| ('-', k.as_u64())).collect()
            }
            InventoryEvent::AllCleared { .. } => vec![('!', 0)],
        })
        .collect()
}

#[test]
fn deposit_then_deliver_is_byte_exact() {
    let (mut runner, ns, _) = start(64, None);
    let mut src = Host::new(&mut runner, "kv", 64);
    let dst = Host::new(&mut runner, "kv:out", 64);
    for p in 0..64 {
        src.fill(p, p as u64 + 1);
    }
    let pages: Vec<u64> = (0..64).collect();
    assert!(
        deposit(&mut runner, &src, ns, &pages, false)
            .entries
            .iter()
            .all(|(_, e)| e.is_success())
    );
    let pairs: Vec<(u64, ElementRef)> = pages
        .iter()
        .map(|p| (*p, dst.at(63 - *p as usize)))
        .collect();
    let result = deliver(&mut runner, ns, &pairs);
    assert!(
        result.entries.iter().all(|(_, e)| e.is_success()),
        "{result:?}"
    );
    for p in 0..64 {
        assert_eq!(dst.page(63 - p), src.page(p), "page {p}");
    }
    runner.check_invariants().unwrap();
    runner.close().map_err(|(_, e)| e).unwrap();
}

/// Reference: a deposit deduplicates (a READY duplicate succeeds at once),
/// eviction is FIFO under FIFO, inventory goes stored then removed.
#[test]
fn deposit_dedup_fifo_eviction_and_inventory() {
    let (mut runner, ns, sink) = start(2, Some(Box::new(policy::Fifo)));
    let mut host = Host::new(&mut runner, "kv", 8);
    for p in 0..8 {
        host.fill(p, p as u64);
    }
    assert_eq!(
        statuses(&deposit(&mut runner, &host, ns, &[1, 1], false)),
        vec![EntryStatus::Success; 2]
    );
    assert_eq!(
        runner.stats().counters.committed,
        1,
        "the duplicate shared one copy"
    );
    assert_eq!(
        statuses(&deposit(&mut runner, &host, ns, &[1], false)),
        vec![EntryStatus::Success]
    );
    deposit(&mut runner, &host, ns, &[2], false);
    deposit(&mut runner, &host, ns, &[3], false);
    assert_eq!(
        runner.query(&key(ns, 1)),
        QueryStatus::Miss,
        "FIFO evicts the oldest"
    );
    assert_eq!(runner.query(&key(ns, 2)), QueryStatus::Hit);
    assert_eq!(runner.query(&key(ns, 3)), QueryStatus::Hit);
    assert_eq!(
        stored_keys(&sink.take()),
        vec![('+', 1), ('+', 2), ('-', 1), ('+', 3)]
    );
}

/// Contract case 49: FIFO and LRU pick different victims after an access.
#[rstest]
#[case::lru("lru", 2)]
#[case::fifo("fifo", 1)]
fn eviction_order(#[case] name: &str, #[case] victim: u64) {
    let (mut runner, ns, _) = start(2, policy::builtin(name));
    let mut host = Host::new(&mut runner, "kv", 8);
    let out = Host::new(&mut runner, "kv:out", 8);
    host.fill(1, 1);
    deposit(&mut runner, &host, ns, &[1, 2], false);
    // Access page 1 (a deliver reads it): LRU now prefers to evict 2.
    assert!(
        deliver(&mut runner, ns, &[(1, out.at(0))]).entries[0]
            .1
            .is_success()
    );
    deposit(&mut runner, &host, ns, &[3], false);
    assert_eq!(
        runner.query(&key(ns, victim)),
        QueryStatus::Miss,
        "{name} evicts {victim}"
    );
    assert_eq!(runner.query(&key(ns, 3 - victim)), QueryStatus::Hit);
    assert_eq!(runner.stats().policy, name);
}

#[test]
fn unknown_policy_name_is_none() {
    assert!(policy::builtin("mru").is_none());
}

struct DropOdd;
impl CachePolicy for DropOdd {
    fn name(&self) -> &str {
        "drop-odd"
    }
    fn order(&self) -> EvictionOrder {
        EvictionOrder::Scored
    }
    fn decide_ingest(&mut self, meta: &BlockMeta, _required_local: bool) -> IngestDecision {
        if meta.key.key.as_u64() % 2 == 1 {
            IngestDecision::Drop
        } else {
            IngestDecision::Keep
        }
    }
    fn eviction_score(&mut self, meta: &BlockMeta) -> Option<f64> {
        Some(-(meta.key.key.as_u64() as f64))
    }
}

/// Admission DROP gives Dropped, except for no_evict deposits; a scored
/// policy evicts the lowest score first.
#[test]
fn admission_drop_and_scored_eviction() {
    let (mut runner, ns, _) = start(2, Some(Box::new(DropOdd)));
    let host = Host::new(&mut runner, "kv", 16);
    assert_eq!(
        statuses(&deposit(&mut runner, &host, ns, &[1, 2], false)),
        vec![EntryStatus::Dropped, EntryStatus::Success]
    );
    let kept = deposit(&mut runner, &host, ns, &[3], true);
    assert_eq!(
        statuses(&kept),
        vec![EntryStatus::Success],
        "required locally: DROP becomes KEEP"
    );
    let release = kept.entries[0].1.release.unwrap();
    assert_eq!(runner.release(&[release]), vec![true]);
    // Scores are -key: 3 (score -3) goes before 2 (score -2).
    deposit(&mut runner, &host, ns, &[4], false);
    assert_eq!(runner.query(&key(ns, 3)), QueryStatus::Miss);
    assert_eq!(runner.query(&key(ns, 2)), QueryStatus::Hit);
    assert_eq!(runner.stats().counters.dropped, 1);
}

struct Panicky;
impl CachePolicy for Panicky {
    fn name(&self) -> &str {
        "panicky"
    }
    fn order(&self) -> EvictionOrder {
        EvictionOrder::Scored
    }
    fn decide_ingest(&mut self, _: &BlockMeta, _: bool) -> IngestDecision {
        panic!("policy bug")
    }
    fn eviction_score(&mut self, _: &BlockMeta) -> Option<f64> {
        Some(f64::NAN)
    }
}

/// A policy that panics or returns garbage is sanitised: ingest KEEP, score
/// kept, faults counted, the operation completes.
#[test]
fn policy_faults_are_sanitised() {
    // Each caught panic runs the panic hook, which under RUST_BACKTRACE
    // symbolises a backtrace: seconds on a loaded CI machine, all of it inside
    // the deposit's one-second budget (CI saw `Timeout` for both entries).
    // The budget is not what this test is about, so give it room.
    let config = RunnerConfig {
        operation_timeout: Duration::from_secs(120),
        ..RunnerConfig::single_pool("kv", BLOCK as u64, 4)
    };
    let (mut runner, ns, _) = start_with(config, Some(Box::new(Panicky)));
    let host = Host::new(&mut runner, "kv", 4);
    let result = deposit(&mut runner, &host, ns, &[1, 2], false);
    assert_eq!(statuses(&result), vec![EntryStatus::Success; 2]);
    assert!(
        runner.stats().counters.policy_faults >= 4,
        "{:?}",
        runner.stats().counters
    );
    runner.check_invariants().unwrap();
}

/// Claims: fetch claims, releasing twice is false, a full pool of claimed
/// pages fails a new deposit without evicting anything, release frees it.
#[test]
fn claims_block_eviction_until_released() {
    let (mut runner, ns, _) = start(2, None);
    let mut host = Host::new(&mut runner, "kv", 8);
    host.fill(1, 11);
    deposit(&mut runner, &host, ns, &[1, 2], false);
    let pool = runner.pool("kv").unwrap();
    let op = runner
        .fetch(&[key(ns, 1), key(ns, 2), key(ns, 1)], &[pool])
        .unwrap();
    let fetched = wait(&mut runner, op);
    assert_eq!(fetched.entries.len(), 2, "keys are deduplicated");
    let handles: Vec<ReleaseHandle> = fetched
        .entries
        .iter()
        .map(|(_, e)| e.release.unwrap())
        .collect();
    assert_eq!(
        runner.read_claimed(handles[0], 0).unwrap(),
        host.page(1),
        "the claim reads the stored bytes"
    );
    let full = deposit(&mut runner, &host, ns, &[3], false);
    assert_eq!(
        statuses(&full),
        vec![EntryStatus::Failed(FailReason::CapacityExhausted)]
    );
    assert_eq!(runner.query(&key(ns, 1)), QueryStatus::Hit);
    assert_eq!(runner.query(&key(ns, 2)), QueryStatus::Hit);
    assert_eq!(runner.release(&handles), vec![true, true]);
    assert_eq!(
        runner.release(&handles),
        vec![false, false],
        "double release"
    );
    assert!(
        runner.read_claimed(handles[0], 0).is_err(),
        "a released claim reads nothing"
    );
    assert_eq!(
        statuses(&deposit(&mut runner, &host, ns, &[3], false)),
        vec![EntryStatus::Success]
    );
    runner.check_invariants().unwrap();
}

/// `capacity_needed` fires once when pools drop below the watermark, and
/// again only after recovering.
#[test]
fn capacity_needed_is_edge_triggered() {
    let mut config = RunnerConfig::single_pool("kv", BLOCK as u64, 4);
    config.capacity_low_watermark_percent = 50;
    let mut runner = Runner::start(config, None).unwrap();
    let ns = runner.register_namespace(Namespace::base(CompatDigest(1)));
    let host = Host::new(&mut runner, "kv", 8);
    let signals = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&signals);
    runner.set_capacity_needed(Box::new(move |s: &[(PoolId, u32)]| {
        seen.lock().unwrap().push(s.to_vec())
    }));
    let a = deposit(&mut runner, &host, ns, &[1, 2], true);
    assert!(
        signals.lock().unwrap().is_empty(),
        "2 of 4 reclaimable is not below 50%"
    );
    let b = deposit(&mut runner, &host, ns, &[3], true);
    deposit(&mut runner, &host, ns, &[4], true);
    assert_eq!(
        *signals.lock().unwrap(),
        vec![vec![(PoolId(0), 2)]],
        "fired once"
    );
    let handles: Vec<_> = a
        .entries
        .iter()
        .chain(&b.entries)
        .map(|(_, e)| e.release.unwrap())
        .collect();
    runner.release(&handles);
    deposit(&mut runner, &host, ns, &[5, 6, 7], true);
    assert_eq!(
        signals.lock().unwrap().len(),
        2,
        "fires again after recovering"
    );
}

/// Bad input: typed errors, nothing changes, the runner keeps serving.
#[test]
fn bad_input_is_refused_unchanged() {
    let (mut runner, ns, _) = start(4, None);
    let host = Host::new(&mut runner, "kv", 4);
    let unknown_ns = key(NamespaceId(12345), 1);
    let cases: Vec<(Vec<DepositEntry>, RunnerReason)> = vec![
        (
            vec![DepositEntry {
                key: key(ns, 1),
                spans: vec![ElementRef {
                    region: host.region,
                    index: 4,
                }],
                page: None,
            }],
            RunnerReason::ElementOutOfRange {
                region: host.region.0,
                index: 4,
                count: 4,
            },
        ),
        (
            vec![DepositEntry {
                key: key(ns, 1),
                spans: vec![ElementRef {
                    region: RegionId(99),
                    index: 0,
                }],
                page: None,
            }],
            RunnerReason::UnknownRegion(99),
        ),
        (
            vec![DepositEntry {
                key: key(ns, 1),
                spans: vec![],
                page: None,
            }],
            RunnerReason::LayoutLength {
                got: 0,
                max: kvcr_runner::MAX_SPANS_PER_KEY,
            },
        ),
        (
            vec![DepositEntry {
                key: unknown_ns,
                spans: vec![host.at(0)],
                page: None,
            }],
            RunnerReason::UnknownNamespace(12345),
        ),
        (
            // The runner's own pool region is not framework memory.
            vec![DepositEntry {
                key: key(ns, 1),
                spans: vec![ElementRef {
                    region: RegionId(0),
                    index: 0,
                }],
                page: None,
            }],
            RunnerReason::NotFrameworkRegion(0),
        ),
        (
            // A good entry followed by a bad one: the whole call is refused.
            vec![
                DepositEntry {
                    key: key(ns, 2),
                    spans: vec![host.at(1)],
                    page: None,
                },
                DepositEntry {
                    key: key(ns, 1),
                    spans: vec![ElementRef {
                        region: host.region,
                        index: u64::MAX,
                    }],
                    page: None,
                },
            ],
            RunnerReason::ElementOutOfRange {
                region: host.region.0,
                index: u64::MAX,
                count: 4,
            },
        ),
    ];
    for (entries, expected) in cases {
        let err = runner.deposit(entries, false).unwrap_err();
        assert_eq!(err.runner_reason(), Some(&expected));
    }
    assert_eq!(runner.pools().resident_blocks(), 0);
    assert_eq!(runner.stats().ops_in_flight, 0);
    // Wrong layouts and unknown handles.
    let pool = runner.pool("kv").unwrap();
    assert!(runner.fetch(&[key(ns, 1)], &[]).is_err());
    assert!(runner.fetch(&[key(ns, 1)], &[PoolId(9)]).is_err());
    assert!(!runner.abort(OpHandle(424242), None));
    assert_eq!(runner.release(&[ReleaseHandle(7)]), vec![false]);
    assert!(runner.read_claimed(ReleaseHandle(7), 0).is_err());
    // And it still serves.
    assert_eq!(
        statuses(&deposit(&mut runner, &host, ns, &[1], false)),
        vec![EntryStatus::Success]
    );
    let op = runner_fetch(&mut runner, ns, 1, pool);
    let fetched = wait(&mut runner, op);
    assert!(fetched.entries[0].1.is_success());
    // Fetching with another layout than the stored one fails that key.
    let mut config2 = RunnerConfig::single_pool("a", BLOCK as u64, 2);
    config2.pools.push(kvcr_runner::PoolConfig {
        name: "b".into(),
        block_size: BLOCK as u64,
        blocks: 2,
    });
    let (mut two, _) = (Runner::start(config2, None).unwrap(), ());
    let ns2 = two.register_namespace(Namespace::base(CompatDigest(1)));
    let a = Host::new(&mut two, "a", 2);
    let b = Host::new(&mut two, "b", 2);
    let op = two
        .deposit(
            vec![DepositEntry {
                key: key(ns2, 1),
                spans: vec![a.at(0), b.at(0)],
                page: None,
            }],
            false,
        )
        .unwrap();
    assert!(wait(&mut two, op).entries[0].1.is_success());
    let pa = two.pool("a").unwrap();
    let op = two.fetch(&[key(ns2, 1)], &[pa]).unwrap();
    assert_eq!(
        statuses(&wait(&mut two, op)),
        vec![EntryStatus::Failed(FailReason::LayoutMismatch)]
    );
    let op = two
        .deliver(vec![DeliverEntry {
            key: key(ns2, 1),
            destinations: vec![b.at(1), a.at(1)],
        }])
        .unwrap();
    assert_eq!(
        statuses(&wait(&mut two, op)),
        vec![EntryStatus::Failed(FailReason::LayoutMismatch)]
    );
}

fn runner_fetch(runner: &mut Runner, ns: NamespaceId, k: u64, pool: PoolId) -> OpHandle {
    runner.fetch(&[key(ns, k)], &[pool]).unwrap()
}

/// Region registration is validated: overlap, label, size, pool.
#[rstest]
#[case::no_pool("other", 0, BLOCK as u64, 0, 4)]
#[case::wrong_size("kv", 0, 1024, 0, 4)]
#[case::overlap("kv:b", 4096, BLOCK as u64, 0, 4)]
#[case::stride_too_small("kv:c", 1 << 20, BLOCK as u64, 16, 4)]
#[case::zero_count("kv:d", 1 << 20, BLOCK as u64, 0, 0)]
#[case::bad_label("kv:a:b", 1 << 20, BLOCK as u64, 0, 1)]
#[case::extent_overflow("kv:e", u64::MAX - 8192, BLOCK as u64, 0, 4)]
fn region_registration_refused(
    #[case] label: &str,
    #[case] offset: u64,
    #[case] size: u64,
    #[case] stride: u64,
    #[case] count: u64,
) {
    let (runner, _, _) = start(4, None);
    let mut buf = vec![0u8; 1 << 21];
    let base = buf.as_mut_ptr() as u64;
    // SAFETY: (test) the first registration covers `buf`, which outlives the runner.
    unsafe {
        runner.register_region(RegionDesc {
            label: "kv".into(),
            base,
            size: BLOCK as u64,
            stride: 0,
            count: 4,
        })
    }
    .unwrap();
    let base = if offset > u64::MAX / 2 {
        offset
    } else {
        base + offset
    };
    // SAFETY: (test) every case is refused before anything is dereferenced.
    let err = unsafe {
        runner.register_region(RegionDesc {
            label: label.into(),
            base,
            size,
            stride,
            count,
        })
    }
    .unwrap_err();
    assert!(err.runner_reason().is_some(), "{err}");
    drop(runner);
    drop(buf);
}

/// Abort: a deposit key whose copy has not started is cancelled (best
/// effort); an op with nothing pending cannot be aborted.
#[test]
fn abort_is_real_and_best_effort() {
    // 256 pages of 256 KiB: the copy thread needs milliseconds for the job,
    // the abort right after the call takes microseconds.
    const BIG: u64 = 256 << 10;
    let mut runner = Runner::start(RunnerConfig::single_pool("kv", BIG, 256), None).unwrap();
    let ns = runner.register_namespace(Namespace::base(CompatDigest(7)));
    let mut buf = vec![0u8; 256 * BIG as usize];
    // SAFETY: (test) `buf` outlives the runner (dropped at the end).
    let region = unsafe {
        runner.register_region(RegionDesc {
            label: "kv".into(),
            base: buf.as_mut_ptr() as u64,
            size: BIG,
            stride: 0,
            count: 256,
        })
    }
    .unwrap();
    let host = Host {
        buf: Vec::new(),
        region,
    };
    // Whether the abort beats the copy is a race the test thread can lose
    // on a loaded machine (descheduled for the copy's milliseconds right
    // after the deposit): then the whole deposit must have landed, and the
    // test tries again under fresh keys. Every attempt is one of the two
    // outcomes, never a mix; at least one must be the abort.
    let mut op = None;
    for attempt in 0..8u64 {
        let entries: Vec<DepositEntry> = (0..256)
            .map(|p| DepositEntry {
                key: key(ns, attempt * 256 + p),
                spans: vec![host.at(p as usize)],
                page: None,
            })
            .collect();
        let this = runner.deposit(entries, false).unwrap();
        let aborted = runner.abort(this, None);
        let result = wait(&mut runner, this);
        let expected = if aborted {
            EntryStatus::Failed(FailReason::Aborted)
        } else {
            EntryStatus::Success
        };
        assert!(
            result.entries.iter().all(|(_, e)| e.status == expected),
            "aborted: {aborted}, {:?}",
            result
                .entries
                .iter()
                .map(|(_, e)| e.status)
                .collect::<Vec<_>>()
        );
        // Whatever copies had started completed; the rest were skipped and
        // freed.
        assert_eq!(runner.stats().copies_in_flight, 0);
        runner.check_invariants().unwrap();
        if aborted {
            op = Some(this);
            break;
        }
        // The next attempt's deposit evicts these landed pages.
    }
    let op = op.expect("no abort beat its copy in 8 attempts");
    assert!(!runner.abort(op, None), "a completed op cannot be aborted");
    let done = deposit(&mut runner, &host, ns, &[1], false);
    assert!(!runner.abort(done.op, None));
    drop(runner);
    drop(buf);
}

/// Deadlines: a deposit whose copy could not start by its deadline fails,
/// and nothing is left half-stored.
#[test]
fn deadline_before_copy_fails_cleanly() {
    let mut config = RunnerConfig::single_pool("kv", BLOCK as u64, 4096);
    config.operation_timeout = Duration::from_nanos(1);
    let mut runner = Runner::start(config, None).unwrap();
    let ns = runner.register_namespace(Namespace::base(CompatDigest(1)));
    let host = Host::new(&mut runner, "kv", 4096);
    let entries: Vec<DepositEntry> = (0..4096)
        .map(|p| DepositEntry {
            key: key(ns, p),
            spans: vec![host.at(p as usize)],
            page: None,
        })
        .collect();
    let op = runner.deposit(entries, false).unwrap();
    let result = wait(&mut runner, op);
    let timed_out = result
        .entries
        .iter()
        .filter(|(_, e)| e.status == EntryStatus::Failed(FailReason::Timeout))
        .count();
    let ok = result
        .entries
        .iter()
        .filter(|(_, e)| e.is_success())
        .count();
    assert_eq!(timed_out + ok, 4096);
    assert!(timed_out > 0, "a 1 ns budget cannot copy 16 MiB");
    assert_eq!(
        runner.stats().ready,
        ok,
        "exactly the copied keys are stored"
    );
    runner.check_invariants().unwrap();
}

/// Close refuses while claims are held, hands the runner back, and succeeds
/// after release. (That close frees the pools is checked exactly by the
/// runner's unit test of startup and close, where no other test allocates
/// pools meanwhile; this binary runs runner tests in parallel, so the
/// process-wide pool count cannot be compared here.)
#[test]
fn close_refuses_until_quiescent() {
    let (mut runner, ns, _) = start(4, None);
    let host = Host::new(&mut runner, "kv", 4);
    let held = deposit(&mut runner, &host, ns, &[1], true);
    let (runner, err) = runner.close().unwrap_err();
    assert_eq!(
        err.runner_reason(),
        Some(&RunnerReason::ClaimsOutstanding(1))
    );
    assert_eq!(
        runner.release(&[held.entries[0].1.release.unwrap()]),
        vec![true]
    );
    runner.close().map_err(|(_, e)| e).unwrap();
    drop(host);
}

/// Startup refuses bad configurations with the stage named.
#[rstest]
#[case::no_pools(RunnerConfig { pools: vec![], ..RunnerConfig::default() })]
#[case::zero_block(RunnerConfig::single_pool("kv", 0, 4))]
#[case::zero_blocks(RunnerConfig::single_pool("kv", 4096, 0))]
#[case::bad_name(RunnerConfig::single_pool("kv:x", 4096, 4))]
#[case::too_big(RunnerConfig::single_pool("kv", 1 << 40, 1 << 20))]
#[case::watermark(RunnerConfig { capacity_low_watermark_percent: 101, ..RunnerConfig::single_pool("kv", 4096, 4) })]
#[case::timeout(RunnerConfig { operation_timeout: Duration::ZERO, ..RunnerConfig::single_pool("kv", 4096, 4) })]
fn startup_refuses_bad_config(#[case] config: RunnerConfig) {
    let err = Runner::start(config, None).unwrap_err();
    match &err {
        kvcr_runner::Error::Startup {
            stage,
            retained: false,
            ..
        } => assert_eq!(*stage, "validate configuration"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn duplicate_pool_names_refused() {
    let mut config = RunnerConfig::single_pool("kv", 4096, 4);
    config.pools.push(config.pools[0].clone());
    assert!(Runner::start(config, None).is_err());
}

/// An allocation the machine cannot satisfy fails at its stage, typed.
#[test]
fn allocation_failure_is_typed() {
    let config = RunnerConfig {
        prefault: false,
        ..RunnerConfig::single_pool("kv", 1 << 26, 1 << 20)
    };
    let err = Runner::start(config, None).unwrap_err();
    match &err {
        kvcr_runner::Error::Startup { stage, .. } => {
            assert_eq!(*stage, "allocate pools")
        }
        other => panic!("{other:?}"),
    }
}

/// Stored events carry the real tokens, parent and LoRA name; a chain of
/// pages committed together is one event; another LoRA adapter is another
/// namespace and never shares a page.
#[test]
fn inventory_events_carry_page_info() {
    let (mut runner, base_ns, sink) = start(8, None);
    let lora_ns = runner.register_namespace(Namespace {
        compat: CompatDigest(7),
        lora_name: Some("adapter-a".into()),
        cache_salt: None,
    });
    let host = Host::new(&mut runner, "kv", 8);
    let entries = |ns: NamespaceId| -> Vec<DepositEntry> {
        (0..2u64)
            .map(|p| DepositEntry {
                key: key(ns, 100 + p),
                spans: vec![host.at(p as usize)],
                page: Some(PageInfo {
                    parent: p.checked_sub(1).map(|q| BlockKey::from_u64(100 + q)),
                    token_ids: vec![p as u32; 4],
                }),
            })
            .collect()
    };
    let op = runner.deposit(entries(base_ns), false).unwrap();
    wait(&mut runner, op);
    let op = runner.deposit(entries(lora_ns), false).unwrap();
    wait(&mut runner, op);
    let events = sink.take();
    assert_eq!(events.len(), 2, "{events:#?}");
    match (&events[0], &events[1]) {
        (
            InventoryEvent::Stored {
                keys: k0,
                token_ids: t0,
                parent: p0,
                lora_name: l0,
                block_size: b0,
                scope: s0,
                ..
            },
            InventoryEvent::Stored {
                keys: k1,
                lora_name: l1,
                scope: s1,
                ..
            },
        ) => {
            assert_eq!(k0, &vec![BlockKey::from_u64(100), BlockKey::from_u64(101)]);
            assert_eq!(t0, &vec![0, 0, 0, 0, 1, 1, 1, 1]);
            assert_eq!((*p0, *b0, l0.as_deref()), (None, 4, None));
            assert_eq!(k1, k0);
            assert_eq!(l1.as_deref(), Some("adapter-a"));
            assert_ne!(s0.namespace, s1.namespace);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        runner.pools().resident_blocks(),
        4,
        "same hashes, two namespaces, four pages"
    );
}

/// A job big enough to be split over two copy threads is byte exact both
/// ways; a deliver that names one destination twice (not disjoint, so never
/// split) still completes with the page's bytes.
#[test]
fn large_jobs_are_byte_exact() {
    const BIG: u64 = 256 << 10;
    const PAGES: u64 = 64; // 16 MiB: above the split threshold
    let mut runner =
        Runner::start(RunnerConfig::single_pool("kv", BIG, PAGES as u32), None).unwrap();
    let ns = runner.register_namespace(Namespace::base(CompatDigest(7)));
    let mut src = vec![0u8; (PAGES * BIG) as usize];
    for (i, b) in src.iter_mut().enumerate() {
        *b = ((i * 7) >> 9) as u8 ^ (i / BIG as usize) as u8;
    }
    let mut dst = vec![0u8; (PAGES * BIG) as usize];
    let register = |label: &str, buf: &mut Vec<u8>| {
        // SAFETY: (test) both buffers outlive the runner (dropped after it).
        unsafe {
            runner.register_region(RegionDesc {
                label: label.into(),
                base: buf.as_mut_ptr() as u64,
                size: BIG,
                stride: 0,
                count: PAGES,
            })
        }
        .unwrap()
    };
    let src_region = register("kv", &mut src);
    let dst_region = register("kv:out", &mut dst);
    let entries = (0..PAGES)
        .map(|p| DepositEntry {
            key: key(ns, p),
            spans: vec![ElementRef {
                region: src_region,
                index: p,
            }],
            page: None,
        })
        .collect();
    let op = runner.deposit(entries, false).unwrap();
    assert!(
        wait(&mut runner, op)
            .entries
            .iter()
            .all(|(_, e)| e.is_success())
    );
    // Reversed order, so a split would cross the halves.
    let entries = (0..PAGES)
        .map(|p| DeliverEntry {
            key: key(ns, p),
            destinations: vec![ElementRef {
                region: dst_region,
                index: PAGES - 1 - p,
            }],
        })
        .collect();
    let op = runner.deliver(entries).unwrap();
    assert!(
        wait(&mut runner, op)
            .entries
            .iter()
            .all(|(_, e)| e.is_success())
    );
    let page = |buf: &[u8], p: u64| buf[(p * BIG) as usize..((p + 1) * BIG) as usize].to_vec();
    for p in 0..PAGES {
        assert_eq!(page(&dst, PAGES - 1 - p), page(&src, p), "page {p}");
    }
    // Two keys into one destination element: never split; the last wins.
    let entries = vec![
        DeliverEntry {
            key: key(ns, 3),
            destinations: vec![ElementRef {
                region: dst_region,
                index: 0,
            }],
        },
        DeliverEntry {
            key: key(ns, 5),
            destinations: vec![ElementRef {
                region: dst_region,
                index: 0,
            }],
        },
    ];
    let op = runner.deliver(entries).unwrap();
    assert!(
        wait(&mut runner, op)
            .entries
            .iter()
            .all(|(_, e)| e.is_success())
    );
    assert_eq!(page(&dst, 0), page(&src, 5));
    runner.close().map_err(|(_, e)| e).unwrap();
    drop(src);
    drop(dst);
}

/// Several threads share one runner (`&self`) and each waits for its own
/// operation: no thread sees, loses or sorts another's result, whatever order
/// they complete in, and a taken result cannot be taken twice.
#[test]
fn each_thread_waits_for_its_own_operation() {
    let (mut runner, ns, _) = start(64, None);
    let mut src = Host::new(&mut runner, "kv", 64);
    for p in 0..64 {
        src.fill(p, p as u64 + 1);
    }
    let ops: Vec<(u64, OpHandle)> = (0..8u64)
        .map(|t| {
            let entries = (t * 8..t * 8 + 8)
                .map(|p| DepositEntry {
                    key: key(ns, p),
                    spans: vec![src.at(p as usize)],
                    page: None,
                })
                .collect();
            (t, runner.deposit(entries, false).unwrap())
        })
        .collect();
    let shared = &runner;
    let results: Vec<(u64, OpHandle, OpResult)> = std::thread::scope(|scope| {
        // Waiters start in reverse order of submission, so results drained
        // for one waiter's wake-up belong to others.
        let handles: Vec<_> = ops
            .iter()
            .rev()
            .map(|&(t, op)| {
                scope.spawn(move || {
                    let result = shared.wait(op, Duration::from_secs(30)).unwrap().unwrap();
                    (t, op, result)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(results.len(), 8);
    for (t, op, result) in &results {
        assert_eq!(result.op, *op);
        let keys: Vec<u64> = result.entries.iter().map(|(k, _)| k.key.as_u64()).collect();
        assert_eq!(keys, (t * 8..t * 8 + 8).collect::<Vec<_>>());
        assert!(
            result.entries.iter().all(|(_, e)| e.is_success()),
            "{result:?}"
        );
        // Taken once: a second wait names an operation the runner no longer has.
        let again = runner.wait(*op, Duration::ZERO).unwrap_err();
        assert_eq!(
            again.runner_reason(),
            Some(&RunnerReason::UnknownOperation(op.0))
        );
    }
    assert!(runner.poll_completed().is_empty(), "nothing left behind");
    runner.check_invariants().unwrap();
    runner.close().map_err(|(_, e)| e).unwrap();
}

/// A result nobody will wait for is dropped, not kept forever: before
/// completion (the runner drops it when it completes) and after it (dropped
/// at once). Other operations' results are untouched.
#[test]
fn a_discarded_result_is_dropped_and_others_kept() {
    let (mut runner, ns, _) = start(16, None);
    let mut src = Host::new(&mut runner, "kv", 16);
    src.fill(0, 1);
    src.fill(1, 2);
    src.fill(2, 3);
    let deposit_one = |p: u64| {
        runner
            .deposit(
                vec![DepositEntry {
                    key: key(ns, p),
                    spans: vec![src.at(p as usize)],
                    page: None,
                }],
                false,
            )
            .unwrap()
    };
    let discarded_early = deposit_one(0);
    runner.discard_result(discarded_early);
    let discarded_late = deposit_one(2);
    let kept = deposit_one(1);
    // One copy thread runs jobs in submission order: once `kept` is done, so
    // is `discarded_late`, whose result now waits to be taken.
    let kept_result = runner.wait(kept, Duration::from_secs(30)).unwrap().unwrap();
    assert_eq!(kept_result.op, kept);
    assert_eq!(runner.stats().ops_in_flight, 0);
    runner.discard_result(discarded_late);
    for op in [discarded_early, discarded_late] {
        assert_eq!(
            runner.wait(op, Duration::ZERO).unwrap_err().runner_reason(),
            Some(&RunnerReason::UnknownOperation(op.0))
        );
    }
    assert!(runner.poll_completed().is_empty());
    for p in 0..3 {
        assert_eq!(
            runner.query(&key(ns, p)),
            QueryStatus::Hit,
            "page {p} stored"
        );
    }
    runner.close().map_err(|(_, e)| e).unwrap();
}

/// `copy_claimed` copies claimed pages into framework memory byte-exactly,
/// one run per page or one run over adjacent pages, and refuses, whole and
/// before copying anything, every run it cannot prove safe: past the claimed
/// slots, with a dead handle, into runner memory, past the destination
/// region, or across elements of a strided region. Nothing stays pinned.
#[test]
fn copy_claimed_is_exact_and_refuses_runs_it_cannot_prove() {
    let (mut runner, ns, _) = start(16, None);
    let mut src = Host::new(&mut runner, "kv", 8);
    let dst = Host::new(&mut runner, "kv:out", 8);
    for p in 0..4 {
        src.fill(p, 100 + p as u64);
    }
    deposit(&mut runner, &src, ns, &[0, 1, 2, 3], false);
    let pool = runner.pool("kv").unwrap();
    let keys: Vec<ScopedKey> = (0..4).map(|k| key(ns, k)).collect();
    let op = runner.fetch(&keys, &[pool]).unwrap();
    let fetched = wait(&mut runner, op);
    let handles: Vec<ReleaseHandle> = fetched
        .entries
        .iter()
        .filter_map(|(_, e)| e.release)
        .collect();
    let slots: Vec<ElementRef> = fetched.entries.iter().map(|(_, e)| e.slots[0]).collect();
    assert_eq!(handles.len(), 4);
    let block = BLOCK as u64;
    let run = |src: ElementRef, page: usize, len: u64| ClaimedCopy {
        src,
        dst: dst.at(page),
        len,
    };

    // One run per page, into pages in reverse order.
    let runs: Vec<ClaimedCopy> = (0..4).map(|i| run(slots[i], 7 - i, block)).collect();
    runner.copy_claimed(&handles, &runs).unwrap();
    for i in 0..4 {
        assert_eq!(dst.page(7 - i), src.page(i), "page {i}");
    }

    // Two pages whose slots are adjacent move as one run into adjacent pages.
    let adjacent = (0..4)
        .flat_map(|a| (0..4).map(move |b| (a, b)))
        .find(|&(a, b)| slots[a].region == slots[b].region && slots[b].index == slots[a].index + 1);
    // A fresh pool hands out slots in order, so some two are adjacent.
    let (a, b) = adjacent.unwrap();
    runner
        .copy_claimed(&handles, &[run(slots[a], 0, 2 * block)])
        .unwrap();
    assert_eq!(dst.page(0), src.page(a));
    assert_eq!(dst.page(1), src.page(b));

    let before: Vec<Vec<u8>> = (0..8).map(|p| dst.page(p).to_vec()).collect();
    let refusal = |handles: &[ReleaseHandle], runs: &[ClaimedCopy]| {
        runner.copy_claimed(handles, runs).unwrap_err()
    };
    let claimed_copy =
        |e: &kvcr_runner::Error| matches!(e.runner_reason(), Some(RunnerReason::ClaimedCopy(_)));
    // Past the slots one claim holds (only page 0's claim is given).
    let one = [handles[0]];
    assert!(claimed_copy(&refusal(&one, &[run(slots[0], 0, 2 * block)])));
    // A slot no given claim holds.
    assert!(claimed_copy(&refusal(&one, &[run(slots[1], 0, block)])));
    // An empty run.
    assert!(claimed_copy(&refusal(&handles, &[run(slots[0], 0, 0)])));
    // Past the end of the destination region.
    assert!(claimed_copy(&refusal(
        &handles,
        &[run(slots[0], 7, 2 * block)]
    )));
    // A handle that is not a live claim.
    assert_eq!(
        refusal(&[ReleaseHandle(9_999)], &[run(slots[0], 0, block)]).runner_reason(),
        Some(&RunnerReason::UnknownClaim(9_999))
    );
    // Into runner memory: the destination must be a framework region.
    let into_pool = ClaimedCopy {
        src: slots[0],
        dst: slots[1],
        len: block,
    };
    assert!(matches!(
        refusal(&handles, &[into_pool]).runner_reason(),
        Some(RunnerReason::NotFrameworkRegion(_))
    ));
    // One good run and one bad: refused whole, the good one not copied.
    assert!(claimed_copy(&refusal(
        &handles,
        &[run(slots[3], 2, block), run(slots[0], 7, 2 * block)]
    )));
    for (p, page) in before.iter().enumerate() {
        assert_eq!(dst.page(p), page, "page {p} written by a refused call");
    }

    // Across elements of a strided region (a gap between its elements).
    let mut gapped = vec![0u8; 4 * BLOCK];
    // SAFETY: (test) `gapped` outlives the runner, which is closed below, and
    // nothing touches it while a call names it.
    let strided = unsafe {
        runner.register_region(RegionDesc {
            label: "kv:gapped".into(),
            base: gapped.as_mut_ptr() as u64,
            size: block,
            stride: 2 * block,
            count: 2,
        })
    }
    .unwrap();
    let across = ClaimedCopy {
        src: slots[a],
        dst: ElementRef {
            region: strided,
            index: 0,
        },
        len: 2 * block,
    };
    // The source run is claimed (two adjacent slots); the destination is not
    // contiguous.
    assert!(claimed_copy(&refusal(&handles, &[across])));
    let single = ClaimedCopy {
        len: block,
        ..across
    };
    runner.copy_claimed(&handles, &[single]).unwrap();
    assert_eq!(&gapped[..BLOCK], src.page(a));

    // Nothing pinned stays behind: once released, nothing is claimed.
    assert!(runner.release(&handles).iter().all(|released| *released));
    assert_eq!(runner.stats().public_claims, 0);
    runner.check_invariants().unwrap();
    runner.close().map_err(|(_, e)| e).unwrap();
    drop(gapped);
}
