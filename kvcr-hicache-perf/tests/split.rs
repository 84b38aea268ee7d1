//! UCX split sizing end to end: a source whose puts are cut into chunks
//! restores the same bytes as one that puts whole spans, over shared memory
//! and tcp, between two real runners in one process.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::time::Duration;

use kvcr_foundation::hint::FetchMode;
use kvcr_foundation::protocol::{ElementRef, OpHandle, RegionId};
use kvcr_foundation::runner::{
    DepositEntry, OpResult, PeerOptions, PutSplit, RegionDesc, Runner, RunnerConfig,
};
use kvcr_foundation::{
    BlockKey, CompatDigest, FetchHint, Namespace, NamespaceId, RequestId, ScopedKey,
};
use rstest::rstest;

const BLOCK: u64 = 256 << 10;

/// Runner pairs busy-poll UCX workers: one pair at a time, so 2 cores do not
/// push a transfer past its deadline.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
const KEYS: u64 = 6;

struct Node {
    runner: Runner,
    ns: NamespaceId,
    region: RegionId,
    host: Vec<u8>,
}

fn node(tls: &str, split: PutSplit, max_puts_in_flight: usize) -> Node {
    let mut options = PeerOptions::loopback();
    options.ucx_tls = Some(tls.to_owned());
    options.put_split = split;
    options.max_puts_in_flight = max_puts_in_flight;
    // Splitting is about UCX puts: keep the same-host one-copy path out.
    options.same_host_mapping = false;
    let config = RunnerConfig {
        operation_timeout: Duration::from_secs(10),
        ..RunnerConfig::single_pool("kv", BLOCK, KEYS as u32)
    };
    let runner = Runner::start_with_peers(config, None, &options).unwrap();
    let ns = runner.register_namespace(Namespace::base(CompatDigest(77)));
    let mut host: Vec<u8> = (0..BLOCK * KEYS)
        .map(|i| ((i * 131) >> 5) as u8 ^ (i / BLOCK) as u8)
        .collect();
    // SAFETY: (test) `host` lives in the Node beside the runner (dropped
    // after it by the test's order) and is untouched while operations run.
    let region = unsafe {
        runner.register_region(RegionDesc {
            label: "kv".into(),
            base: host.as_mut_ptr() as u64,
            size: BLOCK,
            stride: 0,
            count: KEYS,
        })
    }
    .unwrap();
    Node {
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

fn wait(runner: &mut Runner, op: OpHandle) -> OpResult {
    for _ in 0..600 {
        for r in runner.wait_completed(Duration::from_millis(50)) {
            if r.op == op {
                return r;
            }
        }
    }
    panic!("operation {op:?} did not complete");
}

#[rstest]
#[case::shm_chunks("posix,cma,self", PutSplit::chunks_of(64 << 10), 0)]
#[case::shm_odd_chunks_two_in_flight("posix,cma,self", PutSplit { chunk_bytes: 100_000, max_chunks_in_flight: 2 }, 0)]
#[case::tcp_chunks("tcp,self", PutSplit::chunks_of(64 << 10), 0)]
#[case::tcp_defaults(
    "tcp,self",
    kvcr_hicache_perf::placement::split_for(Some("tcp,self")),
    0
)]
#[case::tcp_unconfigured("tcp,self", PutSplit::default(), 0)]
#[case::tcp_whole_puts("tcp,self", PutSplit::default(), 2)]
fn split_puts_restore_every_byte(
    #[case] tls: &str,
    #[case] split: PutSplit,
    #[case] max_puts_in_flight: usize,
) {
    let _serial = serial();
    let mut source = node(tls, split, max_puts_in_flight);
    let mut target = node(tls, PutSplit::default(), 0);
    let keys: Vec<u64> = (0..KEYS).collect();
    let op = source
        .runner
        .deposit(
            keys.iter()
                .map(|&k| DepositEntry {
                    key: key(source.ns, k),
                    spans: vec![ElementRef {
                        region: source.region,
                        index: k,
                    }],
                    page: None,
                })
                .collect(),
            false,
        )
        .unwrap();
    assert!(
        wait(&mut source.runner, op)
            .entries
            .iter()
            .all(|(_, e)| e.is_success())
    );
    let request = RequestId("split".into());
    target.runner.hints().submit(
        request.clone(),
        &FetchHint {
            source: source.runner.peers().endpoint().unwrap().clone(),
            block_hashes: keys.iter().map(|k| BlockKey::from_u64(*k)).collect(),
            mode: FetchMode::Copy,
            action_id: None,
        },
    );
    let scoped: Vec<ScopedKey> = keys.iter().map(|k| key(target.ns, *k)).collect();
    let pool = target.runner.pool("kv").unwrap();
    let op = target
        .runner
        .hints()
        .fetch(&request, &scoped, &[pool])
        .unwrap();
    let result = wait(&mut target.runner, op);
    for (k, (_, entry)) in keys.iter().zip(&result.entries) {
        assert!(entry.is_success(), "key {k}: {:?}", entry.status);
        let bytes = target
            .runner
            .read_claimed(entry.release.unwrap(), 0)
            .unwrap();
        let at = (k * BLOCK) as usize;
        assert_eq!(bytes, source.host[at..at + BLOCK as usize], "key {k}");
    }
    let handles: Vec<_> = result
        .entries
        .iter()
        .filter_map(|(_, e)| e.release)
        .collect();
    target.runner.release(&handles);
    drop(target.runner);
    drop(source.runner);
    drop((target.host, source.host));
}
