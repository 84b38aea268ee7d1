//! Offload and restore through the direct linker, byte for byte: across
//! layouts and page sizes, after the engine evicted its copy, under deadline
//! failure, and from a peer runner in another process. Each test runs with a
//! host-resident pool everywhere and, with `KVCR_TEST_GPU=1`, on the GPU with
//! both copy modes.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use kvcr_direct_linker::cuda::{Device, driver_present};
use kvcr_direct_linker::{CopyMode, DirectLinker, Error, KvLayout, KvMemory};
use kvcr_foundation::hint::FetchMode;
use kvcr_foundation::runner::PeerOptions;
use kvcr_foundation::{
    AttemptLedger, BlockKey, ControlEndpoint, FetchHint, Incarnation, NamespaceId, RequestId,
};
use kvcr_linker_contracts::{
    DeviceSlot, Linker, LinkerEvent, OffloadBatch, OffloadOutcome, PrefixQuery, RequestContext,
    RequestHooks,
};
use rstest::rstest;

use crate::fixture::{Fixture, config, gpu, gpu_required};

pub(crate) const NAMESPACE: NamespaceId = NamespaceId(0xd1ec7);

/// Which pools a test runs on: host always, the GPU (both copy modes) when
/// required.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Backend {
    Host,
    Cuda(CopyMode),
}

fn backends() -> Vec<Backend> {
    let mut out = vec![Backend::Host];
    if gpu_required() {
        out.push(Backend::Cuda(CopyMode::Batched));
        out.push(Backend::Cuda(CopyMode::PerSpan));
        out.push(Backend::Cuda(CopyMode::DriverBatch));
    }
    out
}

pub(crate) fn incarnation(n: u128) -> Incarnation {
    Incarnation::from_raw(n).unwrap()
}

pub(crate) fn fixture(backend: Backend, layout: KvLayout, store_pages: u32) -> Fixture {
    match backend {
        Backend::Host => Fixture::host(layout, store_pages, incarnation(1)),
        Backend::Cuda(mode) => Fixture::cuda(&gpu(), mode, layout, store_pages, incarnation(1)),
    }
}

fn geometry(layers: u32, page_tokens: u32, kv_heads: u32, head_dim: u32, pages: u32) -> KvLayout {
    KvLayout {
        layers,
        page_tokens,
        kv_heads,
        head_dim,
        dtype_bytes: 2,
        device_pages: pages,
        tp_rank: 0,
        tp_size: 1,
        k_bases: Vec::new(),
        v_bases: Vec::new(),
    }
}

/// Deterministic pseudo-random page bytes (xorshift over key and seed).
pub(crate) fn page_bytes(key: u64, seed: u64, len: usize) -> Vec<u8> {
    let mut state = key.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed ^ 0x5bd1_e995;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

pub(crate) fn keys(n: u64) -> Vec<BlockKey> {
    (1..=n).map(|k| BlockKey::from_u64(0x1000 + k)).collect()
}

/// Writes `keys`' pages into slots `0..` and offloads them; must succeed.
fn offload(f: &mut Fixture, keys: &[BlockKey], seed: u64) {
    let page = f.layout.page_bytes() as usize;
    let mut pages = Vec::new();
    for (slot, key) in keys.iter().enumerate() {
        let slot = DeviceSlot(slot as u32);
        f.write_page(slot, &page_bytes(key.as_u64(), seed, page));
        pages.push((*key, slot));
    }
    let outcome = f
        .linker
        .offload(OffloadBatch {
            namespace: NAMESPACE,
            pages,
        })
        .unwrap();
    let OffloadOutcome::Queued(ticket) = outcome else {
        panic!("offload declined: {outcome:?}");
    };
    let events = f.linker.settle(Duration::from_secs(60));
    assert!(
        events.contains(&LinkerEvent::OffloadDone {
            ticket,
            success: true
        }),
        "offload failed: {events:?}"
    );
}

/// Starts a request for `keys` (with `hints`), lets the preparation land, and
/// returns the attempt and the longest restorable prefix.
fn prepare(
    linker: &mut DirectLinker,
    ledger: &mut AttemptLedger,
    request: &str,
    keys: &[BlockKey],
    hints: Vec<FetchHint>,
) -> (kvcr_foundation::AttemptId, u32) {
    let query = PrefixQuery {
        namespace: NAMESPACE,
        device_prefix_pages: 0,
        tail: keys.to_vec(),
    };
    let (context, _) = RequestContext::begin(ledger, RequestId(request.into()), hints, query);
    linker.request_started(&context).unwrap();
    let attempt = context.attempt().clone();
    let _ = linker.settle(Duration::from_secs(60));
    let longest = linker.lookup(&attempt, 0, keys).unwrap().longest();
    (attempt, longest)
}

/// Each `FirstLayerLanded` of `ticket` in `events`: its position and pages.
pub(crate) fn first_layer_reports(
    events: &[LinkerEvent],
    ticket: kvcr_linker_contracts::LoadTicket,
) -> Vec<(usize, u32)> {
    events
        .iter()
        .enumerate()
        .filter_map(|(i, e)| match e {
            LinkerEvent::FirstLayerLanded {
                ticket: t, pages, ..
            } if *t == ticket => Some((i, *pages)),
            _ => None,
        })
        .collect()
}

/// Loads the first `count` prepared pages into slots `at..`; returns success.
fn load(
    linker: &mut DirectLinker,
    attempt: &kvcr_foundation::AttemptId,
    at: u32,
    count: u32,
) -> bool {
    load_reporting(linker, attempt, at, count).0
}

/// As [`load`], also returning the pages its `FirstLayerLanded` covered
/// (`None`: none came), checked to come once and before its `LoadDone`.
fn load_reporting(
    linker: &mut DirectLinker,
    attempt: &kvcr_foundation::AttemptId,
    at: u32,
    count: u32,
) -> (bool, Option<u32>) {
    let slots: Vec<DeviceSlot> = (at..at + count).map(DeviceSlot).collect();
    let ticket = linker.load(attempt, &slots).unwrap();
    let events = linker.settle(Duration::from_secs(60));
    let done = events.iter().position(
        |e| matches!(e, LinkerEvent::LoadDone { ticket: t, success: true, .. } if *t == ticket),
    );
    let first = first_layer_reports(&events, ticket);
    assert!(first.len() <= 1, "one first-layer report: {events:?}");
    if let (Some(&(at, _)), Some(done)) = (first.first(), done) {
        assert!(at < done, "the first layer before the load: {events:?}");
    }
    (done.is_some(), first.first().map(|f| f.1))
}

#[rstest]
#[case::one_layer_small(geometry(1, 16, 1, 64, 8), 4)]
#[case::qwen_like_shard(geometry(4, 64, 4, 128, 6), 3)]
#[case::odd_span_multiple(geometry(3, 3, 2, 8, 10), 5)]
#[case::many_layers(geometry(64, 4, 1, 16, 4), 2)]
#[case::large_pages(geometry(2, 512, 8, 128, 4), 3)]
fn offload_then_restore_is_byte_exact(#[case] layout: KvLayout, #[case] pages: u64) {
    for backend in backends() {
        let mut f = fixture(backend, layout.clone(), 8);
        let keys = keys(pages);
        offload(&mut f, &keys, 7);
        let page = f.layout.page_bytes() as usize;
        // Each page's deposit digest is xxh3-64 of its bytes, taken on the
        // device where every span is whole 1 KiB blocks, else in DRAM.
        for key in &keys {
            let bytes = page_bytes(key.as_u64(), 7, page);
            let want = kvcr_foundation::sys::digest::digest_bytes(&bytes);
            let digest = f.linker.page_digest(NAMESPACE, *key);
            assert_eq!(digest, Some(want), "{backend:?}");
        }
        if let KvMemory::Cuda(copier) = f.linker.memory() {
            let on_device = layout.span_bytes().is_multiple_of(1024);
            let digested = copier.last_profile().digested;
            assert_eq!(digested, if on_device { pages } else { 0 }, "{backend:?}");
        }
        // The engine evicts its copy: the slots are reused for other bytes.
        for slot in 0..pages as u32 {
            f.write_page(DeviceSlot(slot), &vec![0xee; page]);
        }
        let mut ledger = AttemptLedger::new();
        let (attempt, longest) = prepare(&mut f.linker, &mut ledger, "r", &keys, Vec::new());
        assert_eq!(longest, pages as u32, "{backend:?}: every page restorable");
        let at = layout.device_pages - pages as u32;
        let (loaded, first_layer) = load_reporting(&mut f.linker, &attempt, at, pages as u32);
        assert!(loaded, "{backend:?}");
        // On a GPU the copy lands layer 0's K and V first and says so; a
        // host pool's copy thread reports nothing early.
        let expected = matches!(backend, Backend::Cuda(_)).then_some(pages as u32);
        assert_eq!(
            first_layer, expected,
            "{backend:?}: the first layer's report"
        );
        for (i, key) in keys.iter().enumerate() {
            assert_eq!(
                f.read_page(DeviceSlot(at + i as u32)),
                page_bytes(key.as_u64(), 7, page),
                "{backend:?}: page {i} differs"
            );
        }
        if let Backend::Cuda(mode) = backend
            && let KvMemory::Cuda(copier) = f.linker.memory()
        {
            let profile = copier.last_profile();
            assert_eq!(profile.spans, pages * layout.spans_per_page() as u64);
            assert_eq!(profile.bytes, pages * layout.page_bytes());
            let per_index = layout.spans_per_page() as u64;
            match mode {
                CopyMode::Batched => assert_eq!(profile.operations, per_index),
                CopyMode::PerSpan => assert_eq!(profile.operations, profile.spans),
                // Per span index one batch, or one 2D copy of a run of
                // consecutive slots, or both (a run and its strays).
                CopyMode::DriverBatch => {
                    assert!(
                        (per_index..=2 * per_index).contains(&profile.operations),
                        "{profile:?}"
                    );
                    assert!(profile.row_copies <= per_index, "{profile:?}");
                }
            }
            if mode != CopyMode::DriverBatch {
                assert_eq!(profile.row_copies, 0, "{mode:?}");
            }
        }
        f.linker.request_finished(&attempt).unwrap();
        assert_eq!(f.linker.accounting().claims_held, 0);
        f.linker.runner().check_invariants().unwrap();
        // Every undo call the CUDA handles make in `Drop` (unpin, free,
        // destroy, unload) succeeded: their errors are recorded on the device.
        let device = match f.linker.memory() {
            KvMemory::Cuda(copier) => Some(Arc::clone(copier.device())),
            _ => None,
        };
        drop(f);
        if let Some(device) = device {
            let (errors, more) = device.take_drop_errors();
            assert!(
                errors.is_empty() && more == 0,
                "{backend:?}: {errors:?} (+{more})"
            );
        }
    }
}

/// A deadline that passes before the copy starts fails the offload cleanly:
/// nothing is stored, no slot leaks, and the linker keeps serving.
#[test]
fn deadline_failure_holds_nothing() {
    for backend in backends() {
        let layout = geometry(2, 8, 1, 32, 4);
        let mut f = fixture(backend, layout.clone(), 4);
        let total = f.linker.runner().stats().pools[0].total_slots;
        // Reach into the config: a new linker whose operations cannot start
        // in time.
        let mut cfg = config(f.layout.clone(), 4, incarnation(2));
        cfg.operation_timeout = Duration::from_nanos(1);
        let memory = f.linker.memory().clone();
        // SAFETY: (test) the fixture's buffers outlive this linker, which is
        // dropped before `f`.
        let mut tight = unsafe { DirectLinker::new(cfg, memory) }.unwrap();
        let page = layout.page_bytes() as usize;
        f.write_page(DeviceSlot(0), &page_bytes(1, 1, page));
        let OffloadOutcome::Queued(ticket) = tight
            .offload(OffloadBatch {
                namespace: NAMESPACE,
                pages: vec![(BlockKey::from_u64(1), DeviceSlot(0))],
            })
            .unwrap()
        else {
            panic!("declined");
        };
        let events = tight.settle(Duration::from_secs(30));
        assert!(
            events.contains(&LinkerEvent::OffloadDone {
                ticket,
                success: false
            }),
            "{backend:?}: {events:?}"
        );
        assert!(!tight.stores(NAMESPACE, BlockKey::from_u64(1)));
        let stats = tight.runner().stats();
        assert_eq!(stats.pools[0].free_slots, stats.pools[0].total_slots);
        assert_eq!(stats.copies_in_flight, 0);
        assert_eq!(tight.accounting().transfers_in_flight, 0);
        drop(tight);
        // The normal linker on the same pool is unaffected.
        offload(&mut f, &keys(1), 3);
        assert_eq!(total, f.linker.runner().stats().pools[0].total_slots);
    }
}

/// Without a driver, opening a GPU is a typed error, not a panic. On a GPU
/// machine with `KVCR_TEST_GPU=1`, it opens.
#[test]
fn missing_driver_is_a_typed_error() {
    if gpu_required() {
        let device = gpu();
        assert!(!device.name().is_empty());
        return;
    }
    if !driver_present() {
        assert!(matches!(Device::open(0), Err(Error::NoDriver)));
    }
}

// ------------------------------------------------------------ peer restore

const CHILD_ENV: &str = "KVCR_DIRECT_LINKER_SOURCE";
const CHILD_TEST: &str = "restore::source_process";
const TAG: &str = "KVCR-SOURCE";
pub(crate) const PEER_PAGES: u64 = 6;
pub(crate) const PEER_SEED: u64 = 42;

pub(crate) fn peer_layout() -> KvLayout {
    geometry(4, 16, 2, 64, 8)
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{TAG} {line}").unwrap();
    out.flush().unwrap();
}

pub(crate) fn peer_fixture(backend: Backend) -> Fixture {
    peer_fixture_with(backend, peer_layout())
}

fn peer_fixture_with(backend: Backend, layout: KvLayout) -> Fixture {
    peer_fixture_with_options(backend, layout, PeerOptions::loopback())
}

/// A peer-enabled fixture with `options`.
pub(crate) fn peer_fixture_with_options(
    backend: Backend,
    layout: KvLayout,
    options: PeerOptions,
) -> Fixture {
    let mut f = fixture(backend, layout, 8);
    let layout = f.layout.clone();
    let memory = f.linker.memory().clone();
    let mut cfg = config(layout, 8, incarnation(3));
    cfg.peer = Some(options);
    // SAFETY: (test) the fixture's buffers outlive the new linker (it replaces
    // the fixture's first linker, and fields drop linker first).
    f.linker = unsafe { DirectLinker::new(cfg, memory) }.unwrap();
    f
}

/// The source process's entry point (returns at once in a normal run): it
/// offloads `PEER_PAGES` pages, prints its endpoint, and serves until stdin
/// closes.
#[test]
fn source_process() {
    let Ok(backend) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut f = match backend.as_str() {
        "host" => peer_fixture(Backend::Host),
        // A source that does not open targets' device memory: the target's
        // restores take two hops (`one_hop_peer`).
        "cuda-two-hop" => {
            let mut options = PeerOptions::loopback();
            options.one_hop = false;
            peer_fixture_with_options(Backend::Cuda(CopyMode::default()), peer_layout(), options)
        }
        _ => peer_fixture(Backend::Cuda(CopyMode::default())),
    };
    offload(&mut f, &keys(PEER_PAGES), PEER_SEED);
    let endpoint = f.linker.runner().peers().endpoint().unwrap().to_string();
    say(&format!("READY {endpoint}"));
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {
        line.clear();
    }
}

pub(crate) struct Source {
    pub(crate) child: Child,
    stdin: Option<ChildStdin>,
    pub(crate) endpoint: ControlEndpoint,
}

impl Source {
    pub(crate) fn spawn(backend: &str) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", CHILD_TEST, "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, backend)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(at) = line.find(TAG) {
                    let _ = tx.send(line[at + TAG.len()..].trim().to_owned());
                }
            }
        });
        let ready = rx.recv_timeout(Duration::from_secs(120)).unwrap();
        let endpoint = ready.strip_prefix("READY ").unwrap().parse().unwrap();
        Self {
            stdin: child.stdin.take(),
            child,
            endpoint,
        }
    }
}

impl Drop for Source {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

/// A destination restores the source process's pages on a router hint: peer
/// KVCR DRAM → local KVCR DRAM (UCX) → the destination's KV pool, byte exact;
/// keys the source lacks are not restorable.
#[test]
fn peer_restore_from_another_process() {
    let mut runs = vec![("host", Backend::Host)];
    if gpu_required() {
        runs.push(("cuda", Backend::Cuda(CopyMode::default())));
    }
    for (name, backend) in runs {
        let source = Source::spawn(name);
        let mut dest = peer_fixture(backend);
        let mut wanted = keys(PEER_PAGES);
        wanted.push(BlockKey::from_u64(0xdead)); // not on the source
        let hint = FetchHint {
            source: source.endpoint.clone(),
            block_hashes: wanted.clone(),
            mode: FetchMode::Copy,
            action_id: None,
        };
        let mut ledger = AttemptLedger::new();
        let (attempt, longest) = prepare(&mut dest.linker, &mut ledger, "p", &wanted, vec![hint]);
        assert_eq!(
            longest, PEER_PAGES as u32,
            "{name}: the source's pages only"
        );
        assert!(
            load(&mut dest.linker, &attempt, 0, PEER_PAGES as u32),
            "{name}"
        );
        let page = dest.layout.page_bytes() as usize;
        for (i, key) in wanted.iter().take(PEER_PAGES as usize).enumerate() {
            assert_eq!(
                dest.read_page(DeviceSlot(i as u32)),
                page_bytes(key.as_u64(), PEER_SEED, page),
                "{name}: page {i} differs"
            );
        }
        dest.linker.request_finished(&attempt).unwrap();
        assert_eq!(dest.linker.accounting().claims_held, 0);
        drop(source);
    }
}

fn hint_to(source: &Fixture, keys: &[BlockKey]) -> FetchHint {
    FetchHint {
        source: source.linker.runner().peers().endpoint().unwrap().clone(),
        block_hashes: keys.to_vec(),
        mode: FetchMode::Copy,
        action_id: None,
    }
}

/// TP=2: each rank of the destination engine restores its own shard from the
/// same rank of the source engine (byte exact, never the other shard's
/// bytes); a hint that sends rank 1 to rank 0's runner restores nothing,
/// because a shard's pages are its own keys.
#[test]
fn tp2_ranks_restore_their_own_shard() {
    let mut runs = vec![Backend::Host];
    if gpu_required() {
        runs.push(Backend::Cuda(CopyMode::default()));
    }
    let shard = |backend, rank| {
        let mut layout = peer_layout();
        layout.kv_heads = 1;
        layout.tp_rank = rank;
        layout.tp_size = 2;
        peer_fixture_with(backend, layout)
    };
    let wanted = keys(4);
    for backend in runs {
        let mut sources = [shard(backend, 0), shard(backend, 1)];
        for (rank, source) in sources.iter_mut().enumerate() {
            offload(source, &wanted, 100 + rank as u64);
        }
        for rank in 0..2u32 {
            let mut dest = shard(backend, rank);
            let hint = hint_to(&sources[rank as usize], &wanted);
            let mut ledger = AttemptLedger::new();
            let (attempt, longest) =
                prepare(&mut dest.linker, &mut ledger, "tp", &wanted, vec![hint]);
            assert_eq!(longest, 4, "{backend:?} rank {rank}");
            assert!(
                load(&mut dest.linker, &attempt, 2, 4),
                "{backend:?} rank {rank}"
            );
            let page = dest.layout.page_bytes() as usize;
            for (i, key) in wanted.iter().enumerate() {
                let got = dest.read_page(DeviceSlot(2 + i as u32));
                assert_eq!(got, page_bytes(key.as_u64(), 100 + u64::from(rank), page));
                assert_ne!(got, page_bytes(key.as_u64(), 101 - u64::from(rank), page));
            }
            dest.linker.request_finished(&attempt).unwrap();
        }
        // The wrong-shard dial: rank 1 sent to rank 0's runner.
        let mut misdirected = shard(backend, 1);
        let hint = hint_to(&sources[0], &wanted);
        let mut ledger = AttemptLedger::new();
        let (attempt, longest) = prepare(
            &mut misdirected.linker,
            &mut ledger,
            "wrong",
            &wanted,
            vec![hint],
        );
        assert_eq!(
            longest, 0,
            "{backend:?}: another shard's pages are never restorable"
        );
        misdirected.linker.request_finished(&attempt).unwrap();
        assert_eq!(misdirected.linker.accounting().claims_held, 0);
    }
}

// ------------------------------------------------------- pipelined restore

/// Waits for the restore `ticket` to land and returns `(restored, pages)`.
pub(crate) fn restore_landed(
    f: &mut Fixture,
    ticket: kvcr_linker_contracts::LoadTicket,
) -> (u32, u32) {
    let events = f.linker.settle(Duration::from_secs(60));
    events
        .iter()
        .find_map(|e| match e {
            LinkerEvent::RestoreDone {
                ticket: t,
                restored,
                pages,
                ..
            } if *t == ticket => Some((*restored, *pages)),
            _ => None,
        })
        .unwrap_or_else(|| panic!("restore {ticket:?} did not land: {events:?}"))
}

/// A pipelined restore pulls the source process's pages in one-page batches
/// (so every page is its own write, moved on to the device as it lands) and
/// reports the leading pages restored: a key the source lacks ends the
/// prefix, its slot is never written, and the pages after it land but are
/// not counted. The same whether the restore goes to the runner whole or
/// in parts of two pages (the missing key then ends the second part: the
/// parts after it land, uncounted).
#[rstest]
#[case::one_part(64)]
#[case::parts_of_two(2)]
fn pipelined_peer_restore_reports_the_restored_prefix(#[case] part_pages: usize) {
    let mut runs = vec![("host", Backend::Host)];
    if gpu_required() {
        runs.push(("cuda", Backend::Cuda(CopyMode::default())));
    }
    for (name, backend) in runs {
        let source = Source::spawn(name);
        let mut dest = peer_fixture(backend);
        let page = dest.layout.page_bytes() as usize;
        let mut options = PeerOptions::loopback();
        options.write_batch_bytes = page as u64;
        // The two-hop path (pages land in this rank's KVCR DRAM too, which
        // the second restore below reads); `one_hop_peer` tests one hop.
        options.one_hop = false;
        let memory = dest.linker.memory().clone();
        let mut cfg = config(dest.layout.clone(), 8, incarnation(4));
        cfg.peer = Some(options);
        // SAFETY: (test) the fixture's buffers outlive the new linker.
        dest.linker = unsafe { DirectLinker::new(cfg, memory) }.unwrap();
        dest.linker
            .set_restore_part_pages(std::num::NonZeroUsize::new(part_pages).unwrap());
        let sentinel = vec![0x5a; page];
        for slot in 0..8 {
            dest.write_page(DeviceSlot(slot), &sentinel);
        }
        let present = keys(PEER_PAGES);
        let missing = BlockKey::from_u64(0xdead);
        let mut wanted = present[..3].to_vec();
        wanted.push(missing);
        wanted.extend_from_slice(&present[3..]);
        let hint = FetchHint {
            source: source.endpoint.clone(),
            block_hashes: wanted.clone(),
            mode: FetchMode::Copy,
            action_id: None,
        };
        let mut ledger = AttemptLedger::new();
        let query = PrefixQuery {
            namespace: NAMESPACE,
            device_prefix_pages: 0,
            tail: wanted.clone(),
        };
        let (context, _) =
            RequestContext::begin(&mut ledger, RequestId("pipe".into()), vec![hint], query);
        let slots: Vec<DeviceSlot> = (0..wanted.len() as u32).map(DeviceSlot).collect();
        let ticket = dest.linker.restore_hinted(&context, &slots).unwrap();
        assert_eq!(
            restore_landed(&mut dest, ticket),
            (3, wanted.len() as u32),
            "{name}: the prefix before the missing key"
        );
        let counters = dest.linker.runner().peers().stats().counters;
        assert_eq!(
            counters.writes_requested,
            wanted.len() as u64,
            "{name}: one write per hinted page (batches of one page)"
        );
        for (i, key) in wanted.iter().enumerate() {
            let expected = if *key == missing {
                sentinel.clone()
            } else {
                page_bytes(key.as_u64(), PEER_SEED, page)
            };
            assert_eq!(
                dest.read_page(DeviceSlot(i as u32)),
                expected,
                "{name}: slot {i}"
            );
        }
        // Again without the missing key: every page from the local store now.
        let query = PrefixQuery {
            namespace: NAMESPACE,
            device_prefix_pages: 0,
            tail: present.clone(),
        };
        let (context, _) =
            RequestContext::begin(&mut ledger, RequestId("again".into()), Vec::new(), query);
        let slots: Vec<DeviceSlot> = (0..PEER_PAGES as u32).rev().map(DeviceSlot).collect();
        let ticket = dest.linker.restore_hinted(&context, &slots).unwrap();
        assert_eq!(
            restore_landed(&mut dest, ticket),
            (PEER_PAGES as u32, PEER_PAGES as u32),
            "{name}"
        );
        for (key, slot) in present.iter().zip(&slots) {
            assert_eq!(
                dest.read_page(*slot),
                page_bytes(key.as_u64(), PEER_SEED, page),
                "{name}: {slot:?}"
            );
        }
        assert_eq!(dest.linker.accounting().transfers_in_flight, 0);
        assert_eq!(dest.linker.accounting().claims_held, 0);
        drop(source);
    }
}

/// Slots that do not match the tail (too few, too many, one named twice, or
/// outside the pool) are a typed error and nothing is queued.
#[rstest]
#[case::too_few(vec![0, 1])]
#[case::too_many(vec![0, 1, 2, 3])]
#[case::duplicate(vec![0, 1, 1])]
#[case::outside_the_pool(vec![0, 1, 8])]
fn pipelined_restore_refuses_slots_that_do_not_match(#[case] slots: Vec<u32>) {
    let mut f = fixture(Backend::Host, peer_layout(), 8);
    let wanted = keys(3);
    offload(&mut f, &wanted, 7);
    let mut ledger = AttemptLedger::new();
    let query = PrefixQuery {
        namespace: NAMESPACE,
        device_prefix_pages: 0,
        tail: wanted,
    };
    let (context, _) =
        RequestContext::begin(&mut ledger, RequestId("bad".into()), Vec::new(), query);
    let slots: Vec<DeviceSlot> = slots.into_iter().map(DeviceSlot).collect();
    let err = f.linker.restore_hinted(&context, &slots).unwrap_err();
    assert!(
        matches!(err, Error::RestoreSlots { slots: n, pages: 3, .. } if n == slots.len()),
        "{err}"
    );
    assert_eq!(f.linker.accounting().transfers_in_flight, 0);
}
