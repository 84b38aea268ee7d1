//! The coalesced restore fast path over a real runner: page_first host
//! memory, K and V pools, byte-checked, against the normal path.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::time::Duration;

use kvcr_foundation::protocol::ElementRef;
use kvcr_foundation::runner::{
    DeliverEntry, DepositEntry, PoolConfig, RegionDesc, Runner, RunnerConfig,
};
use kvcr_foundation::{BlockKey, CompatDigest, Namespace, NamespaceId, ScopedKey};
use kvcr_hicache_perf::coalesce::CoalesceOptions;
use kvcr_hicache_perf::restore::{HostRegion, RestoreReport, restore};
use rstest::rstest;

const RUN: u64 = 64 * 1024;
const PAGES: u64 = 8;

/// A page_first host buffer: K half then V half, `PAGES` pages each.
struct Host {
    buf: Vec<u8>,
    k: HostRegion,
    v: HostRegion,
}

impl Host {
    fn new(runner: &mut Runner, part: &str, seed: u8) -> Self {
        let mut buf: Vec<u8> = (0..2 * PAGES * RUN)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect();
        let base = buf.as_mut_ptr() as u64;
        let region = |pool: &str, offset: u64| {
            let desc = RegionDesc {
                label: format!("{pool}:{part}"),
                base: base + offset,
                size: RUN,
                stride: 0,
                count: PAGES,
            };
            // SAFETY: (test) `buf` outlives the runner (each test drops the
            // runner first) and is untouched while operations run.
            let id = unsafe { runner.register_region(desc.clone()) }.unwrap();
            HostRegion { id, desc }
        };
        let k = region("k", 0);
        let v = region("v", PAGES * RUN);
        Self { buf, k, v }
    }

    fn page(&self, p: u64) -> (&[u8], &[u8]) {
        let (p, r, half) = (p as usize, RUN as usize, (PAGES * RUN) as usize);
        (
            &self.buf[p * r..(p + 1) * r],
            &self.buf[half + p * r..half + (p + 1) * r],
        )
    }

    fn at(&self, p: u64) -> Vec<ElementRef> {
        vec![
            ElementRef {
                region: self.k.id,
                index: p,
            },
            ElementRef {
                region: self.v.id,
                index: p,
            },
        ]
    }
}

fn start() -> (Runner, NamespaceId) {
    let pool = |name: &str| PoolConfig {
        name: name.into(),
        block_size: RUN,
        blocks: PAGES as u32,
    };
    let runner = Runner::start(
        RunnerConfig {
            pools: vec![pool("k"), pool("v")],
            ..RunnerConfig::default()
        },
        None,
    )
    .unwrap();
    let ns = runner.register_namespace(Namespace::base(CompatDigest(5)));
    (runner, ns)
}

fn key(ns: NamespaceId, k: u64) -> ScopedKey {
    ScopedKey {
        namespace: ns,
        key: BlockKey::from_u64(k),
    }
}

fn deposit(runner: &mut Runner, src: &Host, ns: NamespaceId, pages: &[u64]) {
    let op = runner
        .deposit(
            pages
                .iter()
                .map(|&p| DepositEntry {
                    key: key(ns, p),
                    spans: src.at(p),
                    page: None,
                })
                .collect(),
            false,
        )
        .unwrap();
    loop {
        if let Some(r) = runner
            .wait_completed(Duration::from_millis(100))
            .into_iter()
            .find(|r| r.op == op)
        {
            assert!(r.entries.iter().all(|(_, e)| e.is_success()));
            return;
        }
    }
}

/// Restores keys `keys[i]` into destination pages `dst_pages[i]`.
fn run(coalesce: bool, keys: &[u64], dst_pages: &[u64]) -> (RestoreReport, Vec<bool>) {
    let (mut runner, ns) = start();
    let src = Host::new(&mut runner, "src", 1);
    let dst = Host::new(&mut runner, "dst", 2);
    deposit(&mut runner, &src, ns, &[0, 1, 2, 3, 4, 5]);
    let layout = [runner.pool("k").unwrap(), runner.pool("v").unwrap()];
    let entries = keys
        .iter()
        .zip(dst_pages)
        .map(|(&k, &p)| DeliverEntry {
            key: key(ns, k),
            destinations: dst.at(p),
        })
        .collect();
    let options = if coalesce {
        CoalesceOptions::on()
    } else {
        CoalesceOptions::default()
    };
    let hosts = [dst.k.clone(), dst.v.clone()];
    let report = restore(&runner, &hosts, &layout, entries, None, options).unwrap();
    let bytes_ok = keys
        .iter()
        .zip(dst_pages)
        .zip(&report.restored)
        .map(|((&k, &p), &restored)| restored && src.page(k) == dst.page(p))
        .collect();
    assert_eq!(runner.stats().public_claims, 0, "every claim released");
    runner.check_invariants().unwrap();
    drop(runner);
    (report, bytes_ok)
}

#[rstest]
#[case::adjacent(&[0, 1, 2, 3], &[4, 5, 6, 7], 8, 2)]
#[case::scattered(&[0, 1, 2, 3], &[7, 2, 3, 0], 8, 6)]
#[case::one(&[5], &[0], 2, 2)]
fn coalesced_and_plain_plans_restore_the_same_bytes(
    #[case] keys: &[u64],
    #[case] dst_pages: &[u64],
    #[case] plain_ops: usize,
    #[case] coalesced_ops: usize,
) {
    let (plain, plain_bytes) = run(false, keys, dst_pages);
    let (merged, merged_bytes) = run(true, keys, dst_pages);
    assert!(plain_bytes.iter().all(|b| *b), "{plain:?}");
    assert_eq!(plain_bytes, merged_bytes);
    assert_eq!(plain.restored, merged.restored);
    assert_eq!((plain.ops, plain.ops_uncoalesced), (plain_ops, plain_ops));
    assert_eq!(
        (merged.ops, merged.ops_uncoalesced),
        (coalesced_ops, plain_ops)
    );
    assert_eq!(merged.fallback, 0);
}

#[test]
fn keys_not_resident_take_the_normal_path_and_fail_there_alone() {
    // Key 9 was never deposited: the fast path restores 0 and 1, the normal
    // path reports 9 as a miss (no source), and nothing else is affected.
    let (report, bytes_ok) = run(true, &[0, 9, 1], &[0, 1, 2]);
    assert_eq!(report.fallback, 1);
    assert_eq!(report.restored, vec![true, false, true]);
    assert_eq!(bytes_ok, vec![true, false, true]);
    assert_eq!(
        report.ops, 4,
        "K and V of 0, 1: not adjacent on the host (0, 2)"
    );
}

#[test]
fn bad_destinations_are_refused_before_anything_is_claimed() {
    let (mut runner, ns) = start();
    let dst = Host::new(&mut runner, "dst", 2);
    let layout = [runner.pool("k").unwrap(), runner.pool("v").unwrap()];
    let entries = vec![DeliverEntry {
        key: key(ns, 0),
        destinations: vec![
            ElementRef {
                region: dst.k.id,
                index: PAGES,
            };
            2
        ],
    }];
    let hosts = [dst.k.clone(), dst.v.clone()];
    let err = restore(
        &runner,
        &hosts,
        &layout,
        entries,
        None,
        CoalesceOptions::on(),
    );
    assert!(err.is_err());
    assert_eq!(runner.stats().public_claims, 0);
}
