//! The one-hop route between two real processes on one GPU (only with
//! `KVCR_TEST_GPU=1`, which fails without a GPU): a same-host source's KVCR
//! DRAM straight into this rank's granted GPU slots through the CUDA IPC
//! import, never through this rank's KVCR DRAM, every landed page hashed on
//! the GPU against the source's digest; a source that does not open our
//! device memory (two hops, counted, the restore unchanged); the first
//! layer reported before the restore lands; a source killed
//! with a one-hop write outstanding (the slots stay granted: the restore is
//! never reported, nothing lands).

use std::process::Command;
use std::time::Duration;

use kvcr_direct_linker::{CopyMode, DirectLinker};
use kvcr_foundation::hint::FetchMode;
use kvcr_foundation::runner::PeerOptions;
use kvcr_foundation::{AttemptLedger, BlockKey, FetchHint, RequestId};
use kvcr_linker_contracts::{
    DeviceSlot, Linker, LinkerEvent, PrefixQuery, RequestContext, RequestHooks,
};

use crate::fixture::{Fixture, config, gpu, gpu_required};
use crate::restore::{
    Backend, NAMESPACE, PEER_PAGES, PEER_SEED, Source, first_layer_reports, fixture, incarnation,
    keys, page_bytes, peer_layout, restore_landed,
};

/// The destination: a GPU pool and a peer-enabled linker with `options`
/// and a deadline of `timeout`.
fn destination(options: PeerOptions, timeout: Duration) -> Fixture {
    let _ = gpu();
    let mut f = fixture(Backend::Cuda(CopyMode::default()), peer_layout(), 8);
    let memory = f.linker.memory().clone();
    let mut cfg = config(f.layout.clone(), 8, incarnation(5));
    cfg.peer = Some(options);
    cfg.operation_timeout = timeout;
    // SAFETY: (test) the fixture's buffers outlive the new linker (fields
    // drop linker first).
    f.linker = unsafe { DirectLinker::new(cfg, memory) }.unwrap();
    f
}

fn hint(source: &Source, keys: &[BlockKey]) -> FetchHint {
    FetchHint {
        source: source.endpoint.clone(),
        block_hashes: keys.to_vec(),
        mode: FetchMode::Copy,
        action_id: None,
    }
}

/// Proves the route to `source` before the restore under test: a prepare,
/// on a hint, of a key the source does not hold (the metadata exchange, in
/// which the source opens our device regions, happens once per route).
fn warm_route(dest: &mut Fixture, ledger: &mut AttemptLedger, source: &Source) {
    let absent = BlockKey::from_u64(0x0dea_d000);
    let query = PrefixQuery {
        namespace: NAMESPACE,
        device_prefix_pages: 0,
        tail: vec![absent],
    };
    let (context, _) = RequestContext::begin(
        ledger,
        RequestId("warm".into()),
        vec![hint(source, &[absent])],
        query,
    );
    dest.linker.request_started(&context).unwrap();
    let _ = dest.linker.settle(Duration::from_secs(5));
    dest.linker.request_finished(context.attempt()).unwrap();
}

/// Starts a pipelined restore of `wanted` into slots `0..` on a hint.
fn restore(
    dest: &mut Fixture,
    ledger: &mut AttemptLedger,
    source: &Source,
    request: &str,
    wanted: &[BlockKey],
) -> kvcr_linker_contracts::LoadTicket {
    let query = PrefixQuery {
        namespace: NAMESPACE,
        device_prefix_pages: 0,
        tail: wanted.to_vec(),
    };
    let (context, _) = RequestContext::begin(
        ledger,
        RequestId(request.into()),
        vec![hint(source, wanted)],
        query,
    );
    let slots: Vec<DeviceSlot> = (0..wanted.len() as u32).map(DeviceSlot).collect();
    dest.linker.restore_hinted(&context, &slots).unwrap()
}

fn signal(source: &Source, signal: &str) {
    let status = Command::new("kill")
        .args([signal, &source.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {signal} failed");
}

/// A pipelined restore from a same-host source process lands in one hop:
/// every present page byte-exact in its slot (one write per page), the
/// slot of the key the source lacks untouched and the prefix ending there,
/// nothing of it in this rank's KVCR DRAM, nothing sent through it.
#[test]
fn a_same_host_peer_restores_straight_into_this_gpu() {
    if !gpu_required() {
        return;
    }
    let source = Source::spawn("cuda");
    let page = peer_layout().page_bytes() as usize;
    let mut options = PeerOptions::loopback();
    options.write_batch_bytes = page as u64;
    let mut dest = destination(options, Duration::from_secs(30));
    let sentinel = vec![0x5a; page];
    for slot in 0..8 {
        dest.write_page(DeviceSlot(slot), &sentinel);
    }
    let mut ledger = AttemptLedger::new();
    warm_route(&mut dest, &mut ledger, &source);
    let present = keys(PEER_PAGES);
    let missing = BlockKey::from_u64(0xdead);
    let mut wanted = present[..3].to_vec();
    wanted.push(missing);
    wanted.extend_from_slice(&present[3..]);
    let ticket = restore(&mut dest, &mut ledger, &source, "one-hop", &wanted);
    assert_eq!(
        restore_landed(&mut dest, ticket),
        (3, wanted.len() as u32),
        "the prefix before the missing key"
    );
    let counters = dest.linker.runner().peers().stats().counters;
    assert_eq!(
        counters.one_hop_writes,
        wanted.len() as u64,
        "one one-hop write per page"
    );
    assert_eq!(
        counters.one_hop_pages, PEER_PAGES,
        "every present page, checked"
    );
    assert_eq!(counters.one_hop_fallbacks, 0, "nothing through KVCR DRAM");
    for (i, key) in wanted.iter().enumerate() {
        let expected = if *key == missing {
            sentinel.clone()
        } else {
            page_bytes(key.as_u64(), PEER_SEED, page)
        };
        assert_eq!(dest.read_page(DeviceSlot(i as u32)), expected, "slot {i}");
    }
    for key in &present {
        assert!(
            !dest.linker.stores(NAMESPACE, *key),
            "{key:?} stopped in this rank's KVCR DRAM"
        );
    }
    assert_eq!(dest.linker.accounting().transfers_in_flight, 0);
    assert_eq!(dest.linker.accounting().claims_held, 0);
}

/// A one-hop restore reports its first layer (layer 0's K and V of every
/// page, which the source copies first) before the restore lands, once,
/// over every page: `FirstLayerLanded` comes ahead of `RestoreDone` in the
/// events, and the pages are byte-exact when the restore lands. Whether
/// the restore goes to the runner whole or in parts (of 4 pages: 4 and 2),
/// the engine hears one report over every page.
#[rstest::rstest]
#[case::one_part(64)]
#[case::two_parts(4)]
fn a_one_hop_restore_reports_its_first_layer_before_it_lands(#[case] part_pages: usize) {
    if !gpu_required() {
        return;
    }
    let source = Source::spawn("cuda");
    let mut dest = destination(PeerOptions::loopback(), Duration::from_secs(30));
    dest.linker
        .set_restore_part_pages(std::num::NonZeroUsize::new(part_pages).unwrap());
    let mut ledger = AttemptLedger::new();
    warm_route(&mut dest, &mut ledger, &source);
    let present = keys(PEER_PAGES);
    let refused = dest.linker.runner().peers().stats().counters.refused;
    let ticket = restore(&mut dest, &mut ledger, &source, "first-layer", &present);
    let events = dest.linker.settle(Duration::from_secs(60));
    let first = first_layer_reports(&events, ticket);
    let done = events.iter().position(|e| {
        matches!(e, LinkerEvent::RestoreDone { ticket: t, restored, .. }
            if *t == ticket && u64::from(*restored) == PEER_PAGES)
    });
    let Some(done) = done else {
        panic!("the restore did not land whole: {events:?}");
    };
    assert_eq!(first.len(), 1, "one first-layer report: {events:?}");
    let (at, pages) = first[0];
    assert_eq!(u64::from(pages), PEER_PAGES, "over every page");
    assert!(at < done, "the first layer before the restore: {events:?}");
    let counters = dest.linker.runner().peers().stats().counters;
    assert_eq!(counters.one_hop_pages, PEER_PAGES, "in one hop");
    assert_eq!(counters.refused, refused, "no report came late or wrong");
    let page = dest.layout.page_bytes() as usize;
    for (i, key) in present.iter().enumerate() {
        assert_eq!(
            dest.read_page(DeviceSlot(i as u32)),
            page_bytes(key.as_u64(), PEER_SEED, page),
            "slot {i}"
        );
    }
}

/// A source that does not open our device memory (its one-hop route off,
/// as a source without a GPU or in another IPC namespace): the restore
/// takes two hops, counted, byte-exact, and the pages stay in this rank's
/// KVCR DRAM as the two-hop path leaves them.
#[test]
fn a_source_that_cannot_open_our_gpu_falls_back_to_two_hops() {
    if !gpu_required() {
        return;
    }
    let source = Source::spawn("cuda-two-hop");
    let mut dest = destination(PeerOptions::loopback(), Duration::from_secs(30));
    let mut ledger = AttemptLedger::new();
    warm_route(&mut dest, &mut ledger, &source);
    let present = keys(PEER_PAGES);
    let ticket = restore(&mut dest, &mut ledger, &source, "fallback", &present);
    assert_eq!(
        restore_landed(&mut dest, ticket),
        (PEER_PAGES as u32, PEER_PAGES as u32)
    );
    let counters = dest.linker.runner().peers().stats().counters;
    assert_eq!(counters.one_hop_pages, 0);
    assert_eq!(counters.one_hop_writes, 0);
    assert_eq!(counters.one_hop_fallbacks, PEER_PAGES, "each page counted");
    let page = dest.layout.page_bytes() as usize;
    for (i, key) in present.iter().enumerate() {
        assert_eq!(
            dest.read_page(DeviceSlot(i as u32)),
            page_bytes(key.as_u64(), PEER_SEED, page),
            "slot {i}"
        );
        assert!(dest.linker.stores(NAMESPACE, *key), "{key:?} through DRAM");
    }
}

/// A source stopped before it could answer a one-hop grant, then killed:
/// past three deadlines the restore is still not reported (the engine's
/// slots stay granted until proof, which only the source's incarnation or
/// a guard's death report could give), and nothing landed in them.
#[test]
fn a_source_killed_with_a_one_hop_write_outstanding_leaves_the_slots_granted() {
    if !gpu_required() {
        return;
    }
    let source = Source::spawn("cuda");
    let mut dest = destination(PeerOptions::loopback(), Duration::from_secs(1));
    let page = dest.layout.page_bytes() as usize;
    let sentinel = vec![0xa5; page];
    for slot in 0..8 {
        dest.write_page(DeviceSlot(slot), &sentinel);
    }
    let mut ledger = AttemptLedger::new();
    warm_route(&mut dest, &mut ledger, &source);
    signal(&source, "-STOP");
    let present = keys(PEER_PAGES);
    let ticket = restore(&mut dest, &mut ledger, &source, "killed", &present);
    // The premise: the grant went out as one hop, to a source that cannot
    // have copied anything yet.
    let counters = dest.linker.runner().peers().stats().counters;
    assert!(
        counters.one_hop_writes > 0,
        "the grant took the two-hop path"
    );
    signal(&source, "-KILL");
    let events = dest.linker.settle(Duration::from_secs(3));
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, LinkerEvent::RestoreDone { ticket: t, .. } if *t == ticket)),
        "a restore reported without proof: {events:?}"
    );
    assert_eq!(dest.linker.accounting().transfers_in_flight, 1);
    for slot in 0..PEER_PAGES as u32 {
        assert_eq!(dest.read_page(DeviceSlot(slot)), sentinel, "slot {slot}");
    }
}
