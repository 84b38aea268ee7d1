//! Delivery windows over a real runner: refill, limits, and a refusal that
//! still drains every accepted operation.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::time::Duration;

use kvcr_foundation::protocol::{ElementRef, RegionId};
use kvcr_foundation::runner::{DeliverEntry, DepositEntry, RegionDesc, Runner, RunnerConfig};
use kvcr_foundation::{BlockKey, CompatDigest, Namespace, NamespaceId, ScopedKey};
use kvcr_hicache_perf::window::{ChunkState, WindowLimits, deliver_windowed};
use rstest::rstest;

const BLOCK: u64 = 64 * 1024;
const PAGES: u64 = 24;

struct Fixture {
    runner: Runner,
    ns: NamespaceId,
    region: RegionId,
    host: Vec<u8>,
}

fn fixture() -> Fixture {
    let runner = Runner::start(RunnerConfig::single_pool("kv", BLOCK, 16), None).unwrap();
    let ns = runner.register_namespace(Namespace::base(CompatDigest(4)));
    let mut host: Vec<u8> = (0..PAGES * BLOCK).map(|i| (i * 7 / 5) as u8).collect();
    // SAFETY: (test) `host` lives in the fixture, whose runner is dropped
    // first (field order), and is read only after operations complete.
    let region = unsafe {
        runner.register_region(RegionDesc {
            label: "kv:host".into(),
            base: host.as_mut_ptr() as u64,
            size: BLOCK,
            stride: 0,
            count: PAGES,
        })
    }
    .unwrap();
    let entries = (0..12)
        .map(|k| DepositEntry {
            key: key(ns, k),
            spans: vec![ElementRef { region, index: k }],
            page: None,
        })
        .collect();
    let op = runner.deposit(entries, false).unwrap();
    loop {
        if runner
            .wait_completed(Duration::from_millis(100))
            .iter()
            .any(|r| r.op == op)
        {
            break;
        }
    }
    Fixture {
        runner,
        ns,
        region,
        host,
    }
}

fn key(ns: NamespaceId, k: u64) -> ScopedKey {
    ScopedKey {
        namespace: ns,
        key: BlockKey::from_u64(k),
    }
}

/// Four chunks of three keys; key k goes to host page 12 + k.
fn chunks(f: &Fixture) -> Vec<Vec<DeliverEntry>> {
    (0..4)
        .map(|c| {
            (c * 3..c * 3 + 3)
                .map(|k| DeliverEntry {
                    key: key(f.ns, k),
                    destinations: vec![ElementRef {
                        region: f.region,
                        index: 12 + k,
                    }],
                })
                .collect()
        })
        .collect()
}

fn page(f: &Fixture, p: u64) -> &[u8] {
    &f.host[(p * BLOCK) as usize..((p + 1) * BLOCK) as usize]
}

#[rstest]
#[case::off(WindowLimits::default())]
#[case::one_op(WindowLimits { max_ops: 1, max_bytes: 0 })]
#[case::two_ops(WindowLimits { max_ops: 2, max_bytes: 0 })]
#[case::bytes(WindowLimits { max_ops: 0, max_bytes: 4 * BLOCK })]
fn every_chunk_lands_whatever_the_window(#[case] limits: WindowLimits) {
    let f = fixture();
    let c = chunks(&f);
    let out = deliver_windowed(&f.runner, c, vec![3 * BLOCK; 4], limits, None);
    assert!(out.refusal.is_none());
    assert_eq!(out.states, vec![ChunkState::Done(true); 4]);
    assert!(out.results.iter().all(Option::is_some));
    assert_eq!(f.runner.stats().ops_in_flight, 0);
    for k in 0..12 {
        assert_eq!(page(&f, 12 + k), page(&f, k), "key {k}");
    }
}

#[test]
fn a_refused_refill_drains_accepted_operations_first() {
    let f = fixture();
    let mut c = chunks(&f);
    // Chunk 2 names an element outside the region: the runner refuses it.
    c[2][0].destinations[0].index = PAGES + 5;
    let limits = WindowLimits {
        max_ops: 2,
        max_bytes: 0,
    };
    let out = deliver_windowed(&f.runner, c, vec![3 * BLOCK; 4], limits, None);
    assert!(out.refusal.is_some());
    assert_eq!(
        out.states,
        vec![
            ChunkState::Done(true),
            ChunkState::Done(true),
            ChunkState::Refused,
            ChunkState::Skipped
        ]
    );
    // Both accepted chunks completed before the call returned.
    let stats = f.runner.stats();
    assert_eq!((stats.ops_in_flight, stats.copies_in_flight), (0, 0));
    for k in 0..6 {
        assert_eq!(page(&f, 12 + k), page(&f, k), "key {k}");
    }
    // Nothing of chunks 2 and 3 was written (pages 18..24 keep their bytes).
    let untouched: Vec<u8> = (18 * BLOCK..PAGES * BLOCK)
        .map(|i| (i * 7 / 5) as u8)
        .collect();
    assert_eq!(&f.host[(18 * BLOCK) as usize..], &untouched[..]);
}
