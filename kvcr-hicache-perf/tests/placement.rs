//! Anonymous pool memory through a real runner: huge pages, NUMA binding,
//! refusals, and the audit reading back what the kernel actually did.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::time::Duration;

use kvcr_foundation::protocol::{ElementRef, OpHandle};
use kvcr_foundation::runner::error::{PoolMemoryReason, RunnerReason};
use kvcr_foundation::runner::{
    DeliverEntry, DepositEntry, OpResult, PeerOptions, RegionDesc, Runner, RunnerConfig,
};
use kvcr_foundation::{BlockKey, CompatDigest, Namespace, ScopedKey};
use kvcr_hicache_perf::audit::PoolAudit;
use kvcr_hicache_perf::placement::{
    self, AnonymousMemory, HugePages, NumaBinding, NumaMode, PlacementDowngrade, PoolMemory,
};

const BLOCK: u64 = 1 << 20;
const BLOCKS: u32 = 16;

fn config(memory: PoolMemory) -> RunnerConfig {
    RunnerConfig {
        pool_memory: memory,
        ..RunnerConfig::single_pool("kv", BLOCK, BLOCKS)
    }
}

fn audit(runner: &Runner) -> PoolAudit {
    let mut audits = placement::audit_runner(runner, 4096).unwrap();
    assert_eq!(audits.len(), 1);
    audits.remove(0)
}

fn thp_usable() -> bool {
    matches!(
        placement::transparent_huge_page_mode().as_deref(),
        Some("always" | "madvise")
    )
}

#[test]
fn the_default_backing_reports_no_placement() {
    let runner = Runner::start(RunnerConfig::single_pool("kv", BLOCK, BLOCKS), None).unwrap();
    let info = &runner.pools().memory()[0];
    assert_eq!(
        (info.name.as_str(), info.len),
        ("kv", BLOCK * u64::from(BLOCKS))
    );
    assert_eq!(info.placement, None);
}

#[test]
fn preferred_huge_pages_take_on_a_thp_host_and_the_audit_sees_them() {
    let runner = Runner::start(config(placement::anonymous(HugePages::Prefer)), None).unwrap();
    let audit = audit(&runner);
    let placement = audit.placement.clone().unwrap();
    if thp_usable() {
        assert!(placement.huge_pages_advised);
        assert!(placement.downgrades.is_empty());
        // The pool is 2 MiB aligned and pre-faulted after MADV_HUGEPAGE.
        assert!(audit.huge_pages_took(), "{audit:?}");
    } else {
        assert!(!placement.huge_pages_advised);
        assert!(matches!(
            placement.downgrades.as_slice(),
            [PlacementDowngrade::HugePages(_)]
        ));
    }
    assert_eq!(audit.pages_absent, 0, "pre-faulted: {audit:?}");
}

#[test]
fn without_huge_pages_the_audit_finds_none() {
    let runner = Runner::start(config(placement::anonymous(HugePages::Off)), None).unwrap();
    let audit = audit(&runner);
    // In `madvise` mode (these hosts) THP backs only advised mappings.
    if placement::transparent_huge_page_mode().as_deref() == Some("madvise") {
        assert!(!audit.huge_pages_took(), "{audit:?}");
    }
    assert!(!audit.placement.unwrap().huge_pages_advised);
}

#[test]
fn a_pool_smaller_than_a_huge_page_downgrades_or_refuses_as_asked() {
    let small = |huge| RunnerConfig {
        pool_memory: placement::anonymous(huge),
        ..RunnerConfig::single_pool("kv", 4096, 4)
    };
    let runner = Runner::start(small(HugePages::Prefer), None).unwrap();
    let outcome = runner.pools().memory()[0].placement.clone().unwrap();
    assert!(!outcome.huge_pages_advised);
    assert_eq!(outcome.downgrades.len(), 1);
    drop(runner);

    let err = Runner::start(small(HugePages::Require), None).unwrap_err();
    let kvcr_foundation::runner::Error::Startup { cause, .. } = &err else {
        panic!("{err}");
    };
    assert!(matches!(
        cause.runner_reason(),
        Some(RunnerReason::PoolMemory(
            PoolMemoryReason::HugePagesUnavailable(_)
        ))
    ));
}

#[test]
fn binding_to_an_online_node_puts_every_page_there() {
    let node = placement::online_nodes()[0];
    let runner = Runner::start(
        config(placement::anonymous_on_node(HugePages::Off, node)),
        None,
    )
    .unwrap();
    let audit = audit(&runner);
    assert_eq!(audit.policy.mode, "bind");
    assert_eq!(audit.policy.nodes, vec![node]);
    assert!(audit.all_on(&[node]), "{audit:?}");
    assert_eq!(audit.pages_sampled, 4096);
}

#[test]
fn a_node_that_does_not_exist_is_a_typed_startup_error() {
    let err = Runner::start(
        config(placement::anonymous_on_node(HugePages::Off, 999)),
        None,
    )
    .unwrap_err();
    let kvcr_foundation::runner::Error::Startup { cause, .. } = &err else {
        panic!("{err}");
    };
    match cause.runner_reason() {
        Some(RunnerReason::PoolMemory(PoolMemoryReason::NoSuchNode { node, online })) => {
            assert_eq!(*node, 999);
            assert_eq!(online, &placement::online_nodes());
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_preferred_policy_with_two_nodes_is_refused() {
    let memory = PoolMemory::Anonymous(AnonymousMemory {
        huge_pages: HugePages::Off,
        numa: Some(NumaBinding {
            mode: NumaMode::Preferred,
            nodes: vec![0, 1],
        }),
    });
    assert!(Runner::start(config(memory), None).is_err());
}

#[test]
fn without_prefault_the_audit_sees_untouched_pages() {
    let runner = Runner::start(
        RunnerConfig {
            prefault: false,
            ..config(placement::anonymous(HugePages::Off))
        },
        None,
    )
    .unwrap();
    let audit = audit(&runner);
    assert_eq!(audit.pages_absent, audit.pages_sampled, "{audit:?}");
}

fn wait(runner: &mut Runner, op: OpHandle) -> OpResult {
    for _ in 0..200 {
        if let Some(r) = runner
            .wait_completed(Duration::from_millis(50))
            .into_iter()
            .find(|r| r.op == op)
        {
            return r;
        }
    }
    panic!("operation {op:?} did not complete");
}

/// Deposit and deliver through an anonymous huge-page pool, byte-checked.
fn round_trip(runner: &mut Runner) {
    let ns = runner.register_namespace(Namespace::base(CompatDigest(3)));
    let pages = 4usize;
    let len = BLOCK as usize;
    let mut src: Vec<u8> = (0..pages * len).map(|i| (i * 31 / 7) as u8).collect();
    let mut dst = vec![0u8; pages * len];
    let region = |runner: &mut Runner, label: &str, buf: &mut Vec<u8>| {
        // SAFETY: (test) both buffers outlive the runner (dropped at the end
        // of the caller, after `runner`'s last operation completed).
        unsafe {
            runner.register_region(RegionDesc {
                label: label.into(),
                base: buf.as_mut_ptr() as u64,
                size: BLOCK,
                stride: 0,
                count: pages as u64,
            })
        }
        .unwrap()
    };
    let src_region = region(runner, "kv:src", &mut src);
    let dst_region = region(runner, "kv:dst", &mut dst);
    let key = |i: usize| ScopedKey {
        namespace: ns,
        key: BlockKey::from_u64(100 + i as u64),
    };
    let at = |region, i: usize| ElementRef {
        region,
        index: i as u64,
    };
    let op = runner
        .deposit(
            (0..pages)
                .map(|i| DepositEntry {
                    key: key(i),
                    spans: vec![at(src_region, i)],
                    page: None,
                })
                .collect(),
            false,
        )
        .unwrap();
    assert!(wait(runner, op).entries.iter().all(|(_, e)| e.is_success()));
    let op = runner
        .deliver(
            (0..pages)
                .map(|i| DeliverEntry {
                    key: key(pages - 1 - i),
                    destinations: vec![at(dst_region, i)],
                })
                .collect(),
        )
        .unwrap();
    assert!(wait(runner, op).entries.iter().all(|(_, e)| e.is_success()));
    for i in 0..pages {
        let j = pages - 1 - i;
        assert_eq!(dst[i * len..(i + 1) * len], src[j * len..(j + 1) * len]);
    }
}

#[test]
fn bytes_round_trip_through_an_anonymous_huge_page_pool() {
    let mut runner = Runner::start(config(placement::anonymous(HugePages::Prefer)), None).unwrap();
    round_trip(&mut runner);
}

#[test]
fn peer_mode_registers_the_placed_mapping_with_ucx() {
    let node = placement::online_nodes()[0];
    let mut runner = Runner::start_with_peers(
        config(placement::anonymous_on_node(HugePages::Prefer, node)),
        None,
        &PeerOptions::loopback(),
    )
    .unwrap();
    let audit = audit(&runner);
    assert_eq!(audit.policy.mode, "bind");
    assert!(audit.all_on(&[node]), "{audit:?}");
    if thp_usable() {
        assert!(audit.huge_pages_took(), "{audit:?}");
    }
    round_trip(&mut runner);
}

#[test]
fn peer_mode_refuses_a_missing_node_with_the_same_typed_error() {
    let err = Runner::start_with_peers(
        config(placement::anonymous_on_node(HugePages::Off, 999)),
        None,
        &PeerOptions::loopback(),
    )
    .unwrap_err();
    let kvcr_foundation::runner::Error::Startup { stage, cause, .. } = &err else {
        panic!("{err}");
    };
    assert_eq!(*stage, "start peer");
    assert!(
        matches!(
            cause.runner_reason(),
            Some(RunnerReason::PoolMemory(PoolMemoryReason::NoSuchNode {
                node: 999,
                ..
            }))
        ),
        "{err}"
    );
}
