//! The G3 file tier through the runner: real files (`O_DIRECT`, locked), the
//! real copy thread and the store's workers. Pages evicted from a small DRAM
//! pool move to G3 and come back byte-exact; G3's own eviction, its
//! inventory, and configurations it refuses.

use std::path::PathBuf;
use std::time::Duration;

use kvcr_contracts::protocol::{ElementRef, RegionId};
use kvcr_contracts::{
    CompatDigest, InventoryEvent, InventorySink, Medium, Namespace, NamespaceId, Tier,
};
use kvcr_runner::{
    DeliverEntry, DepositEntry, EntryStatus, FailReason, G3Options, PageInfo, QueryStatus,
    RegionDesc, Runner, RunnerConfig,
};
use kvcr_sys::direct_io::DirectBuf;

const BLOCK: usize = 4096;

/// A scratch folder for G3 files, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("g3-tier-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn files(&self, n: usize) -> Vec<PathBuf> {
        (0..n).map(|i| self.0.join(format!("g3-{i}.bin"))).collect()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[derive(Clone, Default)]
struct Events(std::sync::Arc<std::sync::Mutex<Vec<InventoryEvent>>>);

impl InventorySink for Events {
    fn publish(&mut self, event: &InventoryEvent) {
        self.0.lock().unwrap().push(event.clone());
    }
}

impl Events {
    /// (medium, stored?, key) per key event, in order.
    fn take(&self) -> Vec<(Medium, bool, u64)> {
        std::mem::take(&mut *self.0.lock().unwrap())
            .into_iter()
            .flat_map(|e| match e {
                InventoryEvent::Stored { scope, keys, .. } => keys
                    .into_iter()
                    .map(|k| (scope.medium, true, k.as_u64()))
                    .collect::<Vec<_>>(),
                InventoryEvent::Removed { scope, keys } => keys
                    .into_iter()
                    .map(|k| (scope.medium, false, k.as_u64()))
                    .collect(),
                InventoryEvent::AllCleared { .. } => Vec::new(),
            })
            .collect()
    }
}

/// Page-aligned engine memory (as an engine's host pool is): G3 reads
/// straight into an aligned deliver destination.
fn aligned_zeroed(len: usize) -> DirectBuf {
    DirectBuf::new(len, BLOCK).unwrap()
}

struct Host {
    buf: DirectBuf,
    region: RegionId,
}

impl Host {
    fn new(runner: &mut Runner, pages: usize) -> Self {
        let mut buf = aligned_zeroed(pages * BLOCK);
        // SAFETY: (test) `buf` lives in the returned Host, which outlives the
        // runner in every test, and no element is touched while an
        // operation naming it is in flight.
        let region = unsafe {
            runner.register_region(RegionDesc {
                label: "kv".into(),
                base: buf.as_mut_ptr() as u64,
                size: BLOCK as u64,
                stride: 0,
                count: pages as u64,
            })
        }
        .unwrap();
        for page in 0..pages {
            for (i, b) in buf[page * BLOCK..(page + 1) * BLOCK].iter_mut().enumerate() {
                *b = ((page as u64 * 0x9e37_79b9 + i as u64 * 31) >> 3) as u8;
            }
        }
        Self { buf, region }
    }

    fn at(&self, page: u64) -> ElementRef {
        ElementRef {
            region: self.region,
            index: page,
        }
    }

    fn page(&self, page: u64) -> &[u8] {
        &self.buf[page as usize * BLOCK..(page as usize + 1) * BLOCK]
    }
}

fn start(dram_blocks: u32, g3: G3Options) -> (Runner, NamespaceId, Events) {
    let config = RunnerConfig {
        g3: Some(g3),
        prefault: false,
        operation_timeout: Duration::from_secs(20),
        ..RunnerConfig::single_pool("kv", BLOCK as u64, dram_blocks)
    };
    let runner = Runner::start(config, None).unwrap();
    let ns = runner.register_namespace(Namespace::base(CompatDigest(3)));
    let events = Events::default();
    runner.set_inventory_sink(Box::new(events.clone()));
    (runner, ns, events)
}

use crate::nodes::{key, wait};

fn deposit(runner: &mut Runner, host: &Host, ns: NamespaceId, page: u64) -> EntryStatus {
    let op = runner
        .deposit(
            vec![DepositEntry {
                key: key(ns, page),
                spans: vec![host.at(page)],
                page: Some(PageInfo {
                    parent: None,
                    token_ids: vec![page as u32; 4],
                }),
            }],
            false,
        )
        .unwrap();
    wait(runner, op).entries[0].1.status
}

/// Pages past DRAM's capacity move to G3 (the deposits that needed the room
/// wait for the spills), are reported fetchable from disk, published with
/// medium DISK, and come back byte-exact through `deliver`.
#[test]
fn evicted_pages_move_to_g3_and_come_back_byte_exact() {
    let _serial = crate::serial();
    let scratch = Scratch::new("move");
    let (mut runner, ns, events) = start(
        4,
        G3Options {
            paths: scratch.files(2),
            capacity_bytes_per_file: 8 * BLOCK as u64,
        },
    );
    let host = Host::new(&mut runner, 32);
    for page in 0..12 {
        assert_eq!(
            deposit(&mut runner, &host, ns, page),
            EntryStatus::Success,
            "page {page}"
        );
    }
    for page in 0..8 {
        assert_eq!(
            runner.query(&key(ns, page)),
            QueryStatus::Fetchable(Tier::Disk),
            "page {page} moved to G3"
        );
    }
    for page in 8..12 {
        assert_eq!(runner.query(&key(ns, page)), QueryStatus::Hit);
    }
    let g3 = runner.pools().g3_stats().unwrap();
    // At least the 8 moved pages were written (a spill ahead may also have
    // copied a page DRAM still holds).
    assert!(g3.counters.spills_committed >= 8, "{g3:?}");
    assert_eq!((g3.failed_transfers, g3.last_error), (0, None));
    let published = events.take();
    for page in 0..8 {
        assert!(
            published.contains(&(Medium::Disk, true, page)),
            "{published:?}"
        );
        assert!(
            published.contains(&(Medium::CpuPinned, false, page)),
            "{published:?}"
        );
    }
    runner.check_invariants().unwrap();

    // Every page back, byte-exact: from DRAM or, through a fill, from G3.
    let entries = (0..12)
        .map(|page| DeliverEntry {
            key: key(ns, page),
            destinations: vec![host.at(16 + page)],
        })
        .collect();
    let op = runner.deliver(entries).unwrap();
    let result = wait(&mut runner, op);
    let ok: Vec<bool> = result.entries.iter().map(|(_, e)| e.is_success()).collect();
    assert_eq!(ok, vec![true; 12], "{result:?}");
    for page in 0..12 {
        assert_eq!(host.page(16 + page), host.page(page), "page {page} differs");
    }
    assert!(runner.pools().g3_stats().unwrap().counters.fills >= 8);
    runner.check_invariants().unwrap();
    drop(runner);
    drop(host);
}

/// G3 has its own eviction: when its slots are full the least recently used
/// G3 page goes (published removed, medium DISK) and is a miss afterwards.
#[test]
fn a_full_g3_evicts_its_least_recently_used_page() {
    let _serial = crate::serial();
    let scratch = Scratch::new("evict");
    let (mut runner, ns, events) = start(
        2,
        G3Options {
            paths: scratch.files(1),
            capacity_bytes_per_file: 2 * BLOCK as u64,
        },
    );
    let host = Host::new(&mut runner, 8);
    for page in 0..6 {
        assert_eq!(deposit(&mut runner, &host, ns, page), EntryStatus::Success);
    }
    let status: Vec<QueryStatus> = (0..6).map(|p| runner.query(&key(ns, p))).collect();
    let disk = QueryStatus::Fetchable(Tier::Disk);
    assert_eq!(
        status,
        [
            QueryStatus::Miss,
            QueryStatus::Miss,
            disk,
            disk,
            QueryStatus::Hit,
            QueryStatus::Hit
        ]
    );
    let published = events.take();
    assert!(
        published.contains(&(Medium::Disk, false, 0))
            && published.contains(&(Medium::Disk, false, 1))
    );
    assert_eq!(runner.pools().g3_stats().unwrap().counters.evictions, 2);
    runner.check_invariants().unwrap();
}

/// G3 serves one pool; files it cannot use refuse the start, named.
#[test]
fn g3_configurations_it_cannot_serve_are_refused() {
    let scratch = Scratch::new("refuse");
    let mut two_pools = RunnerConfig::single_pool("a", BLOCK as u64, 4);
    two_pools.pools.push(
        RunnerConfig::single_pool("b", BLOCK as u64, 4)
            .pools
            .remove(0),
    );
    two_pools.g3 = Some(G3Options {
        paths: scratch.files(1),
        capacity_bytes_per_file: 4 * BLOCK as u64,
    });
    let e = Runner::start(two_pools, None).unwrap_err();
    assert!(e.to_string().contains("exactly one pool"), "{e}");

    let directory = RunnerConfig {
        g3: Some(G3Options {
            paths: vec![scratch.0.clone()],
            capacity_bytes_per_file: 4 * BLOCK as u64,
        }),
        ..RunnerConfig::single_pool("kv", BLOCK as u64, 4)
    };
    let e = Runner::start(directory, None).unwrap_err();
    assert!(e.to_string().contains("open G3"), "{e}");

    // A slot (the pool's block) that is not a multiple of the direct-I/O
    // alignment.
    let unaligned = RunnerConfig {
        g3: Some(G3Options {
            paths: scratch.files(1),
            capacity_bytes_per_file: 4 * 1000,
        }),
        ..RunnerConfig::single_pool("kv", 1000, 4)
    };
    let e = Runner::start(unaligned, None).unwrap_err();
    assert!(e.to_string().contains("open G3"), "{e}");
}

/// A peer restores pages that only the source's G3 holds: the source fills
/// them back into its DRAM first (room made by moving pages the write does
/// not name to G3), then writes them; every byte equals what was deposited.
#[rstest::rstest]
#[case::one_copy(true)]
#[case::ucx(false)]
fn a_peer_restores_pages_only_g3_holds(#[case] mapping: bool) {
    use kvcr_runner::PeerOptions;
    let _serial = crate::serial();
    const PEER_BLOCK: usize = crate::nodes::BLOCK;
    let scratch = Scratch::new(if mapping { "peer-map" } else { "peer-ucx" });
    let mut options = PeerOptions::loopback();
    // `sm` lists sysv beside cma, which a route cannot bind to the worker
    // its nonce reaches: same-host UCX routes are posix and cma alone.
    options.ucx_tls = Some("posix,cma,self".into());
    options.same_host_mapping = mapping;
    let config = RunnerConfig {
        g3: Some(G3Options {
            paths: scratch.files(2),
            capacity_bytes_per_file: 8 * PEER_BLOCK as u64,
        }),
        prefault: false,
        operation_timeout: Duration::from_secs(20),
        ..RunnerConfig::single_pool("kv", PEER_BLOCK as u64, 8)
    };
    let mut source = Runner::start_with_peers(config, None, &options).unwrap();
    let ns = source.register_namespace(Namespace::base(CompatDigest(42)));
    let pages = 12u64;
    let mut host = aligned_zeroed(pages as usize * PEER_BLOCK);
    for (i, b) in host.iter_mut().enumerate() {
        *b = ((i * 131) >> 5) as u8 ^ (i / PEER_BLOCK) as u8;
    }
    // SAFETY: (test) `host` outlives `source` (dropped first below) and is
    // not touched while operations on it are in flight.
    let region = unsafe {
        source.register_region(RegionDesc {
            label: "kv".into(),
            base: host.as_mut_ptr() as u64,
            size: PEER_BLOCK as u64,
            stride: 0,
            count: pages,
        })
    }
    .unwrap();
    for chunk in (0..pages).collect::<Vec<_>>().chunks(2) {
        let entries = chunk
            .iter()
            .map(|p| DepositEntry {
                key: key(ns, *p),
                spans: vec![ElementRef { region, index: *p }],
                page: None,
            })
            .collect();
        let op = source.deposit(entries, false).unwrap();
        assert!(
            wait(&mut source, op)
                .entries
                .iter()
                .all(|(_, e)| e.is_success())
        );
    }
    let only_g3 = (0..pages)
        .filter(|p| source.query(&key(ns, *p)) == QueryStatus::Fetchable(Tier::Disk))
        .count();
    assert_eq!(only_g3, 4, "4 of 12 pages live only in G3");

    let mut target = crate::nodes::node_with(&options, 16, Duration::from_secs(20));
    // Pages 0..6: four only in G3, two in DRAM (a write's pages must fit in
    // the source's DRAM together; room for the fills comes from pages the
    // write does not name).
    let wanted: Vec<u64> = (0..6).collect();
    let restored = crate::nodes::restore_all(
        &mut target,
        "g3",
        source.peers().endpoint().unwrap(),
        &wanted,
    );
    for (i, bytes) in restored.iter().enumerate() {
        assert_eq!(
            bytes[..],
            host[i * PEER_BLOCK..(i + 1) * PEER_BLOCK],
            "page {i} differs"
        );
    }
    let g3 = source.pools().g3_stats().unwrap();
    assert!(g3.counters.fills >= 4, "{g3:?}");
    source.check_invariants().unwrap();
    target.runner.check_invariants().unwrap();
    drop(target);
    drop(source);
    drop(host);
}

/// Another user rewrites spilled pages in a G3 file behind the runner's
/// back: every read of them is checked against the digest the page was
/// deposited with, so a fill (`fetch`) and a direct read (`deliver`) both
/// fail `DigestMismatch`, are counted, and the G3 copy is dropped, never
/// served; pages still in DRAM are untouched.
#[test]
fn a_spilled_page_altered_on_disk_is_refused_on_fill() {
    let _serial = crate::serial();
    let scratch = Scratch::new("altered");
    let files = scratch.files(1);
    let (mut runner, ns, _events) = start(
        4,
        G3Options {
            paths: files.clone(),
            capacity_bytes_per_file: 16 * BLOCK as u64,
        },
    );
    let host = Host::new(&mut runner, 32);
    for page in 0..8 {
        assert_eq!(deposit(&mut runner, &host, ns, page), EntryStatus::Success);
    }
    for page in 0..4 {
        let status = runner.query(&key(ns, page));
        assert_eq!(
            status,
            QueryStatus::Fetchable(Tier::Disk),
            "page {page} moved to G3"
        );
    }
    // One byte of every slot of the file, wherever the slots start.
    let mut file = std::fs::read(&files[0]).unwrap();
    for at in (100..file.len()).step_by(BLOCK) {
        file[at] ^= 0x01;
    }
    std::fs::write(&files[0], &file).unwrap();
    let pool = runner.pool("kv").unwrap();
    let op = runner.fetch(&[key(ns, 0)], &[pool]).unwrap();
    let fetched = wait(&mut runner, op);
    assert_eq!(
        fetched.entries[0].1.status,
        EntryStatus::Failed(FailReason::DigestMismatch)
    );
    let delivered = DeliverEntry {
        key: key(ns, 1),
        destinations: vec![host.at(20)],
    };
    let op = runner.deliver(vec![delivered]).unwrap();
    let delivered = wait(&mut runner, op);
    assert_eq!(
        delivered.entries[0].1.status,
        EntryStatus::Failed(FailReason::DigestMismatch)
    );
    for page in 0..2 {
        assert_ne!(
            runner.query(&key(ns, page)),
            QueryStatus::Fetchable(Tier::Disk),
            "dropped"
        );
        assert_ne!(
            runner.query(&key(ns, page)),
            QueryStatus::Hit,
            "never served"
        );
    }
    let g3 = runner.pools().g3_stats().unwrap();
    assert_eq!(g3.counters.digest_mismatches, 2, "{g3:?}");
    // A page DRAM holds still comes back byte-exact.
    let entry = DeliverEntry {
        key: key(ns, 7),
        destinations: vec![host.at(21)],
    };
    let op = runner.deliver(vec![entry]).unwrap();
    assert!(wait(&mut runner, op).entries[0].1.is_success());
    assert_eq!(host.page(21), host.page(7));
    runner.check_invariants().unwrap();
}
