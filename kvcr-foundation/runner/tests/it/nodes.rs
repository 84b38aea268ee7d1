//! Runner nodes for the peer tests: a runner with one pool and a host region
//! of deterministic pages, stocked, hinted and restored from another node.
//! The guard's tests (`kvcr-guard`'s `tests/it`) include this file too (`#[path]`),
//! so it names the runner's own crates only.

use std::time::Duration;

use kvcr_contracts::hint::FetchMode;
use kvcr_contracts::protocol::{ElementRef, OpHandle, RegionId};
use kvcr_contracts::{
    BlockKey, CompatDigest, ControlEndpoint, FetchHint, Namespace, NamespaceId, RequestId,
    ScopedKey,
};
use kvcr_runner::{DepositEntry, OpResult, PeerOptions, RegionDesc, Runner, RunnerConfig};

pub(crate) const BLOCK: usize = 64 << 10;

pub(crate) struct Node {
    pub(crate) runner: Runner,
    pub(crate) ns: NamespaceId,
    pub(crate) host: Vec<u8>,
    region: RegionId,
}

/// A runner with `options`, one pool of `blocks` slots and a host region of
/// as many pages of deterministic bytes.
pub(crate) fn node_with(options: &PeerOptions, blocks: u32, timeout: Duration) -> Node {
    let config = RunnerConfig {
        operation_timeout: timeout,
        ..RunnerConfig::single_pool("kv", BLOCK as u64, blocks)
    };
    let runner = Runner::start_with_peers(config, None, options).unwrap();
    let ns = runner.register_namespace(Namespace::base(CompatDigest(42)));
    let mut host = vec![0u8; BLOCK * blocks as usize];
    for (i, b) in host.iter_mut().enumerate() {
        *b = ((i * 131) >> 5) as u8 ^ (i / BLOCK) as u8;
    }
    // SAFETY: (test) `host` lives in the Node next to the runner and is not
    // touched while operations on it are in flight.
    let region = unsafe {
        runner.register_region(RegionDesc {
            label: "kv".into(),
            base: host.as_mut_ptr() as u64,
            size: BLOCK as u64,
            stride: 0,
            count: u64::from(blocks),
        })
    }
    .unwrap();
    Node {
        runner,
        ns,
        host,
        region,
    }
}

/// Every key restored, each byte equal to the source's.
pub(crate) fn assert_restored(target: &Node, source: &Node, result: &OpResult, keys: &[u64]) {
    assert_eq!(result.entries.len(), keys.len());
    for ((_, entry), k) in result.entries.iter().zip(keys) {
        assert!(entry.is_success(), "key {k}: {entry:?}");
        let bytes = target
            .runner
            .read_claimed(entry.release.unwrap(), 0)
            .unwrap();
        let k = *k as usize;
        assert!(
            bytes == source.host[k * BLOCK..(k + 1) * BLOCK],
            "key {k}: bytes differ"
        );
    }
}

pub(crate) fn key(ns: NamespaceId, k: u64) -> ScopedKey {
    ScopedKey {
        namespace: ns,
        key: BlockKey::from_u64(k),
    }
}

pub(crate) fn wait(runner: &mut Runner, op: OpHandle) -> OpResult {
    for _ in 0..400 {
        for result in runner.wait_completed(Duration::from_millis(50)) {
            if result.op == op {
                return result;
            }
        }
    }
    panic!("operation {op:?} did not complete");
}

pub(crate) fn stock(source: &mut Node, keys: &[u64]) {
    let entries = keys
        .iter()
        .map(|k| DepositEntry {
            key: key(source.ns, *k),
            spans: vec![ElementRef {
                region: source.region,
                index: *k,
            }],
            page: None,
        })
        .collect();
    let op = source.runner.deposit(entries, false).unwrap();
    let result = wait(&mut source.runner, op);
    assert!(result.entries.iter().all(|(_, e)| e.is_success()));
}

pub(crate) fn hint(source: &Node, keys: &[u64]) -> FetchHint {
    hint_to(source.runner.peers().endpoint().unwrap(), keys)
}

/// A copy hint naming `keys` at the runner listening at `source`.
pub(crate) fn hint_to(source: &ControlEndpoint, keys: &[u64]) -> FetchHint {
    FetchHint {
        source: source.clone(),
        block_hashes: keys.iter().map(|k| BlockKey::from_u64(*k)).collect(),
        mode: FetchMode::Copy,
        action_id: None,
    }
}

/// `target` submits `hint` under `request`, fetches `keys` (one span each,
/// into its pool `kv`) and waits for the outcome.
pub(crate) fn fetch_on_hint(
    target: &mut Node,
    request: &str,
    hint: &FetchHint,
    keys: &[u64],
) -> OpResult {
    let request = RequestId(request.into());
    target.runner.hints().submit(request.clone(), hint);
    let op = fetch_hinted(&target.runner, target.ns, &request, keys);
    wait(&mut target.runner, op)
}

/// Starts fetching `keys` of namespace `ns` (one span each, into the pool
/// `kv`) under the hint submitted for `request`.
pub(crate) fn fetch_hinted(
    runner: &Runner,
    ns: NamespaceId,
    request: &RequestId,
    keys: &[u64],
) -> OpHandle {
    let scoped: Vec<ScopedKey> = keys.iter().map(|k| key(ns, *k)).collect();
    let pool = runner.pool("kv").unwrap();
    runner.hints().fetch(request, &scoped, &[pool]).unwrap()
}

/// `target` restores `keys` from the runner at `source` on a hint (request
/// `request`); every key must succeed. Returns each page's bytes, in order.
pub(crate) fn restore_all(
    target: &mut Node,
    request: &str,
    source: &ControlEndpoint,
    keys: &[u64],
) -> Vec<Vec<u8>> {
    let result = fetch_on_hint(target, request, &hint_to(source, keys), keys);
    result
        .entries
        .iter()
        .enumerate()
        .map(|(i, (_, entry))| {
            assert!(entry.is_success(), "page {i}: {entry:?}");
            target
                .runner
                .read_claimed(entry.release.unwrap(), 0)
                .unwrap()
        })
        .collect()
}
