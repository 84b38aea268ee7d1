//! The one-hop route between two processes: a source's KVCR DRAM straight
//! into the target's "device" memory. The device is host memory in a
//! `memfd` behind a test copier, so that a second process can open it the
//! way a CUDA copier opens an IPC handle: the export names the target's
//! pid, the file's descriptor, the offset and a random token (which the
//! importer finds in the file's name, as `/proc/<pid>/fd/<n>` shows it).
//! That is the seam's contract; the CUDA copier is tested on a GPU in
//! `kvcr-direct-linker`.

use std::io::BufRead;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kvcr_contracts::hint::{FetchHint, FetchMode, RequestId};
use kvcr_contracts::protocol::{ElementRef, OpHandle, RegionId};
use kvcr_contracts::{BlockKey, CompatDigest, ControlEndpoint, Namespace, NamespaceId};
use kvcr_runner::{
    DeliverEntry, DepositEntry, DeviceCopier, EntryStatus, FailReason, OpResult, PeerNotice,
    PeerOptions, RegionDesc, Runner, RunnerConfig,
};

use crate::device::memfd::MemfdCopier;
use crate::nodes::key;
use crate::processes::{TestChild, poll_until, say, statuses, wait_op};

const CHILD_ENV: &str = "KVCR_ONE_HOP_CHILD";
const CHILD_TEST: &str = "one_hop::one_hop_source_process";
const TAG: &str = "KVCR-ONE-HOP";
const BLOCK: usize = 64 << 10;
const KEYS: u64 = 6;
const SEED: u64 = 11;

fn page(key: u64) -> Vec<u8> {
    let mut x = (SEED.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ key.wrapping_mul(0x2545_f491)) | 1;
    let mut out = vec![0u8; BLOCK];
    for chunk in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    out
}

// ------------------------------------------------------------ processes

fn options() -> PeerOptions {
    let mut options = PeerOptions::loopback();
    options.ucx_tls = Some("posix,cma,self".into());
    options.same_host_mapping = true;
    options
}

fn namespace() -> Namespace {
    Namespace::base(CompatDigest(43))
}

/// The child: a source runner with a memfd copier holding keys `0..KEYS`;
/// `refuse` in its environment makes it refuse every import. Commands on
/// stdin: `stats` → `STATS <keys_sent> <one_hop_refused>`. EOF ends it.
#[test]
fn one_hop_source_process() {
    let Ok(mode) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut host: Vec<u8> = (0..KEYS).flat_map(page).collect();
    let config = RunnerConfig {
        operation_timeout: Duration::from_secs(5),
        ..RunnerConfig::single_pool("kv", BLOCK as u64, KEYS as u32)
    };
    let mut runner = Runner::start_with_peers(config, None, &options()).unwrap();
    let copier = Arc::new(MemfdCopier::default());
    copier
        .refuse_imports
        .store(mode == "refuse", Ordering::SeqCst);
    copier
        .corrupt_imports
        .store(mode == "corrupt", Ordering::SeqCst);
    copier.hang_imports.store(mode == "hang", Ordering::SeqCst);
    copier
        .one_pass_imports
        .store(mode == "one-pass", Ordering::SeqCst);
    let passes = Arc::clone(&copier);
    runner.pools().set_device_copier(copier).unwrap();
    let ns = runner.register_namespace(namespace());
    // SAFETY: (test) `host` outlives the runner (dropped first, below) and
    // is not touched while the deposit runs.
    let region = unsafe {
        runner.register_region(RegionDesc {
            label: "kv".into(),
            base: host.as_mut_ptr() as u64,
            size: BLOCK as u64,
            stride: 0,
            count: KEYS,
        })
    }
    .unwrap();
    let entries = (0..KEYS)
        .map(|k| DepositEntry {
            key: key(ns, k),
            spans: vec![ElementRef { region, index: k }],
            page: None,
        })
        .collect();
    let op = runner.deposit(entries, false).unwrap();
    assert!(
        wait_op(&mut runner, op)
            .entries
            .iter()
            .all(|(_, e)| e.is_success())
    );
    say(
        TAG,
        &format!("READY {}", runner.peers().endpoint().unwrap()),
    );
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        if line == "stats" {
            let c = runner.peers().stats().counters;
            let passes = passes.passes.load(Ordering::SeqCst);
            say(
                TAG,
                &format!("STATS {} {} {passes}", c.keys_sent, c.one_hop_refused),
            );
        } else if line == "imports" {
            let gauge = runner.peers().control_stats().device_imports_open;
            let live = passes.live_imports.load(Ordering::SeqCst);
            say(TAG, &format!("IMPORTS {gauge} {live}"));
        }
    }
    drop(runner);
    drop(host);
}

/// A child source; killed (and reaped) on drop.
struct Source {
    process: TestChild,
    endpoint: ControlEndpoint,
}

impl Source {
    fn spawn(mode: &str) -> Self {
        let process = TestChild::spawn(CHILD_TEST, CHILD_ENV, mode, TAG);
        let ready = process.expect("READY");
        let endpoint = ControlEndpoint::parse(&ready).unwrap();
        Self { process, endpoint }
    }

    fn expect(&self, word: &str) -> String {
        self.process.expect(word)
    }

    /// `(keys_sent, one_hop_refused)` of the child's runner.
    /// `(keys sent, one-hop routes refused, one-pass copies)`.
    fn stats(&mut self) -> (u64, u64, u64) {
        self.process.command("stats");
        let line = self.expect("STATS");
        let mut parts = line.split_whitespace().map(|p| p.parse::<u64>().unwrap());
        (
            parts.next().unwrap(),
            parts.next().unwrap(),
            parts.next().unwrap(),
        )
    }
}

impl Source {
    /// `(the runner's device_imports_open gauge, imports the child's copier
    /// holds open)`.
    fn imports(&mut self) -> (u64, u64) {
        self.process.command("imports");
        let line = self.expect("IMPORTS");
        let mut parts = line.split_whitespace().map(|p| p.parse::<u64>().unwrap());
        (parts.next().unwrap(), parts.next().unwrap())
    }

    /// SIGKILL and reap: the process is gone when this returns.
    fn kill(&mut self) {
        self.process.child.kill().unwrap();
        let _ = self.process.child.wait().unwrap();
    }
}

/// The target: a runner with a memfd "device" region of `elements` pages.
struct Target {
    runner: Runner,
    copier: Arc<MemfdCopier>,
    ns: NamespaceId,
    region: RegionId,
    base: u64,
}

impl Target {
    fn start(elements: u64) -> Self {
        Self::start_with(elements, Duration::from_secs(5), Duration::from_secs(10))
    }

    /// With this operation timeout and abandonment budget.
    fn start_with(elements: u64, timeout: Duration, abandon: Duration) -> Self {
        Self::start_led(elements, timeout, abandon, 0)
    }

    /// As [`Target::start_with`], asking one-hop writes to report each
    /// page's first `lead` elements landed.
    fn start_led(elements: u64, timeout: Duration, abandon: Duration, lead: u16) -> Self {
        let config = RunnerConfig {
            operation_timeout: timeout,
            ..RunnerConfig::single_pool("kv", BLOCK as u64, 16)
        };
        let mut peer_options = options();
        peer_options.abandon_timeout = Some(abandon);
        let runner = Runner::start_with_peers(config, None, &peer_options).unwrap();
        runner.set_lead_elements(lead);
        let copier = Arc::new(MemfdCopier::default());
        runner
            .pools()
            .set_device_copier(Arc::clone(&copier) as Arc<dyn DeviceCopier>)
            .unwrap();
        let base = copier.alloc(elements as usize * BLOCK);
        let ns = runner.register_namespace(namespace());
        // SAFETY: (test) the buffer lives in the copier, which the runner
        // keeps until it is dropped; no element is touched in flight.
        let region = unsafe {
            runner.register_device_region(RegionDesc {
                label: "kv:gpu".into(),
                base,
                size: BLOCK as u64,
                stride: 0,
                count: elements,
            })
        }
        .unwrap();
        Self {
            runner,
            copier,
            ns,
            region,
            base,
        }
    }

    /// Delivers `keys` from `source` into elements `first..`, under a
    /// fresh request; the result.
    fn restore(
        &mut self,
        name: &str,
        source: &ControlEndpoint,
        keys: &[u64],
        first: u64,
    ) -> OpResult {
        let op = self.start_restore(name, source, keys, first);
        wait_op(&mut self.runner, op)
    }

    /// As [`Target::restore`], without waiting.
    fn start_restore(
        &mut self,
        name: &str,
        source: &ControlEndpoint,
        keys: &[u64],
        first: u64,
    ) -> OpHandle {
        let request = RequestId(name.into());
        let hint = FetchHint {
            source: source.clone(),
            block_hashes: keys.iter().map(|k| BlockKey::from_u64(*k)).collect(),
            mode: FetchMode::Copy,
            action_id: None,
        };
        self.runner.hints().submit(request.clone(), &hint);
        let entries = keys
            .iter()
            .enumerate()
            .map(|(i, k)| DeliverEntry {
                key: key(self.ns, *k),
                destinations: vec![ElementRef {
                    region: self.region,
                    index: first + i as u64,
                }],
            })
            .collect();
        self.runner.hints().deliver(&request, entries).unwrap()
    }

    /// Whether element `index` holds `key`'s page.
    fn holds(&self, index: u64, key: u64) -> bool {
        let at = self.base + index * BLOCK as u64;
        self.copier.read(at, BLOCK as u64) == Some(page(key))
    }
}

/// Regions of an engine that keeps each layer's K and V apart: a 64-layer
/// model's page is 128 spans, one per device region.
const LAYER_REGIONS: usize = 128;

/// A target whose "device" pool is `LAYER_REGIONS` regions of `elements`
/// spans each (a page is one span of every region, in region order), as a
/// per-layer engine registers it; the regions and their buffers' bases.
fn per_layer_target(
    elements: u64,
) -> (Runner, Arc<MemfdCopier>, NamespaceId, Vec<(RegionId, u64)>) {
    // Its own pool's blocks are spans too, as the direct linker's are.
    let span = (BLOCK / LAYER_REGIONS) as u64;
    let config = RunnerConfig {
        operation_timeout: Duration::from_secs(5),
        ..RunnerConfig::single_pool("kv", span, 16 * LAYER_REGIONS as u32)
    };
    let runner = Runner::start_with_peers(config, None, &options()).unwrap();
    let copier = Arc::new(MemfdCopier::default());
    runner
        .pools()
        .set_device_copier(Arc::clone(&copier) as Arc<dyn DeviceCopier>)
        .unwrap();
    let ns = runner.register_namespace(namespace());
    let regions = (0..LAYER_REGIONS)
        .map(|layer| {
            let base = copier.alloc((span * elements) as usize);
            // SAFETY: (test) the buffer lives in the copier, which the
            // runner keeps until it is dropped; nothing touches it in flight.
            let region = unsafe {
                runner.register_device_region(RegionDesc {
                    label: format!("kv:gpu{layer}"),
                    base,
                    size: span,
                    stride: 0,
                    count: elements,
                })
            }
            .unwrap();
            (region, base)
        })
        .collect();
    (runner, copier, ns, regions)
}

/// A pool split per layer (128 device regions, twice the bound on a
/// target's pool regions) still takes the one-hop route: the source opens
/// every region and writes each page's 128 spans into their own regions,
/// byte-exact, nothing stopping in the target's KVCR DRAM. (A source once
/// left such metadata unacknowledged, and every restore from it waited out
/// its deadline.)
#[test]
fn a_pool_split_per_layer_restores_in_one_hop() {
    let _serial = crate::serial();
    let source = Source::spawn("one-pass");
    let (mut runner, copier, ns, regions) = per_layer_target(4);
    let keys = [1u64, 2, 3];
    let request = RequestId("per-layer".into());
    let hint = FetchHint {
        source: source.endpoint.clone(),
        block_hashes: keys.iter().map(|k| BlockKey::from_u64(*k)).collect(),
        mode: FetchMode::Copy,
        action_id: None,
    };
    runner.hints().submit(request.clone(), &hint);
    let entries = keys
        .iter()
        .enumerate()
        .map(|(slot, k)| DeliverEntry {
            key: key(ns, *k),
            destinations: regions
                .iter()
                .map(|(region, _)| ElementRef {
                    region: *region,
                    index: slot as u64,
                })
                .collect(),
        })
        .collect();
    let op = runner.hints().deliver(&request, entries).unwrap();
    let result = wait_op(&mut runner, op);
    assert_eq!(statuses(&result), vec![EntryStatus::Success; keys.len()]);
    let span = BLOCK / LAYER_REGIONS;
    for (slot, k) in keys.iter().enumerate() {
        let page = page(*k);
        for (layer, (_, base)) in regions.iter().enumerate() {
            let at = base + (slot * span) as u64;
            assert_eq!(
                copier.read(at, span as u64).as_deref(),
                Some(&page[layer * span..(layer + 1) * span]),
                "key {k}, layer region {layer}"
            );
        }
    }
    let counters = runner.peers().stats().counters;
    assert_eq!(
        (counters.one_hop_pages, counters.one_hop_fallbacks),
        (3, 0),
        "{counters:?}"
    );
    // Every completion was hashed on the "device", at most one launch each
    // (those that came together shared one).
    let launches = runner.peers().control_stats().device_check_launches;
    assert!(
        (1..=counters.one_hop_writes).contains(&launches),
        "{launches} launches for {} one-hop writes",
        counters.one_hop_writes
    );
    assert_eq!(runner.pools().resident_blocks(), 0, "nothing in KVCR DRAM");
}

/// A source in another process writes the pages straight into the target's
/// device elements: byte-exact, counted as one-hop pages, and nothing of
/// them ever lands in the target's KVCR DRAM (its pool stays empty). The
/// first restore waits for the route's set-up, then goes in one hop too.
/// Copied import by import, or in one pass over every import a write
/// spans (`copy_to_imports`, as the CUDA copier does).
#[rstest::rstest]
#[case::import_by_import("import")]
#[case::one_pass("one-pass")]
fn a_one_hop_restore_between_processes_is_byte_exact_and_skips_dram(#[case] mode: &str) {
    let _serial = crate::serial();
    let mut source = Source::spawn(mode);
    let mut target = Target::start(16);
    let from = source.endpoint.clone();
    let warm = target.restore("warm", &from, &[0], 0);
    assert_eq!(statuses(&warm), vec![EntryStatus::Success]);
    assert!(target.holds(0, 0));
    let first = target.runner.peers().stats().counters;
    assert_eq!(
        (first.one_hop_pages, first.one_hop_fallbacks),
        (1, 0),
        "the first restore waited for the route and went in one hop"
    );
    let resident = target.runner.pools().resident_blocks();
    let before = target.runner.peers().stats().counters;
    let keys = [1, 2, 3, 4, 5];
    let result = target.restore("one-hop", &from, &keys, 8);
    assert_eq!(statuses(&result), vec![EntryStatus::Success; 5]);
    for (i, k) in keys.iter().enumerate() {
        assert!(
            target.holds(8 + i as u64, *k),
            "element {} holds key {k}",
            8 + i
        );
    }
    let after = target.runner.peers().stats().counters;
    assert_eq!(after.one_hop_pages - before.one_hop_pages, 5, "{after:?}");
    assert!(after.one_hop_writes > before.one_hop_writes);
    assert_eq!(after.digest_mismatches, 0);
    assert_eq!(
        target.runner.pools().resident_blocks(),
        resident,
        "no page stopped in the target's KVCR DRAM"
    );
    let (_, refused, passes) = source.stats();
    assert_eq!(refused, 0, "the source opened the region");
    assert_eq!(
        passes > 0,
        mode == "one-pass",
        "one-pass copies: {passes} ({mode})"
    );
    target.runner.check_invariants().unwrap();
}

/// With `lead_elements` set, a write copied in one pass reports its lead
/// landed ahead of its `write_done`: the runner hands the deliver's first
/// layer to the engine once (every page of it), before or with the
/// deliver's result, and the source's report is never refused as late.
/// Copied import by import, a write says nothing early. Without
/// `lead_elements`, nothing is reported.
#[rstest::rstest]
#[case::one_pass("one-pass", 1, true)]
#[case::import_by_import("import", 1, false)]
#[case::not_asked("one-pass", 0, false)]
fn a_one_hop_restore_reports_its_first_layer(
    #[case] mode: &str,
    #[case] lead: u16,
    #[case] reported: bool,
) {
    let _serial = crate::serial();
    let mut source = Source::spawn(mode);
    let mut target = Target::start_led(16, Duration::from_secs(5), Duration::from_secs(10), lead);
    let from = source.endpoint.clone();
    let warm = target.restore("warm", &from, &[0], 0);
    assert_eq!(statuses(&warm), vec![EntryStatus::Success]);
    let _ = target.runner.poll_leads_landed();
    let refused = target.runner.peers().stats().counters.refused;
    let keys = [1, 2, 3, 4, 5];
    let op = target.start_restore("led", &from, &keys, 8);
    let result = wait_op(&mut target.runner, op);
    assert_eq!(statuses(&result), vec![EntryStatus::Success; 5]);
    let leads = target.runner.poll_leads_landed();
    if reported {
        assert_eq!(leads, [(op, 5)], "the whole deliver's first layer, once");
    } else {
        assert!(leads.is_empty(), "{leads:?}");
    }
    let counters = target.runner.peers().stats().counters;
    assert_eq!(counters.refused, refused, "no lead report came late");
    assert_eq!(counters.one_hop_pages, 6, "{counters:?}");
    let (_, import_refused, _) = source.stats();
    assert_eq!(import_refused, 0);
    target.runner.check_invariants().unwrap();
}

/// A source whose copies land the wrong bytes while claiming success: the
/// target hashes every landed key on the device before the core hears of
/// it, and those keys fail `DigestMismatch`, counted, never a success.
#[test]
fn a_one_hop_copy_that_lands_wrong_bytes_fails_its_keys() {
    let _serial = crate::serial();
    let source = Source::spawn("corrupt");
    let mut target = Target::start(16);
    let from = source.endpoint.clone();
    let _warm = target.restore("warm", &from, &[0], 0);
    let before = target.runner.peers().stats().counters;
    let result = target.restore("corrupt", &from, &[1, 2], 8);
    let after = target.runner.peers().stats().counters;
    assert_eq!(after.one_hop_writes - before.one_hop_writes, 1, "{after:?}");
    assert_eq!(
        statuses(&result),
        vec![EntryStatus::Failed(FailReason::DigestMismatch); 2]
    );
    assert_eq!(after.digest_mismatches - before.digest_mismatches, 2);
    assert_eq!(after.one_hop_pages, before.one_hop_pages);
    target.runner.check_invariants().unwrap();
}

/// A source killed in the middle of a one-hop copy (part of the page in
/// the engine's element already): past the operation deadline and the
/// abandonment deadline (its `Uncertain` notice) the deliver is still not
/// reported, success or failure: without proof of the source's end the
/// engine's elements stay held.
#[test]
fn a_source_killed_mid_copy_leaves_the_deliver_pending() {
    let _serial = crate::serial();
    let mut source = Source::spawn("hang");
    let mut target = Target::start_with(16, Duration::from_millis(300), Duration::from_millis(600));
    let from = source.endpoint.clone();
    // The route first (a key the source lacks: granted in one hop once
    // the route is acked, refused, nothing copied), then a restore in one
    // hop, which hangs mid-copy.
    let warm = target.restore("warm", &from, &[KEYS + 100], 0);
    assert!(
        statuses(&warm).iter().all(|s| *s != EntryStatus::Success),
        "{warm:?}"
    );
    let op = target.start_restore("hangs", &from, &[1, 2], 8);
    source.expect("COPYING");
    source.kill();
    let notices = poll_until("the quarantine notice", || {
        let n = target.runner.peers().take_notices();
        (!n.is_empty()).then_some(n)
    });
    assert!(
        notices
            .iter()
            .all(|n| matches!(n, PeerNotice::Uncertain { .. })),
        "{notices:?}"
    );
    let reported = target.runner.wait_completed(Duration::ZERO);
    assert!(
        reported.iter().all(|r| r.op != op),
        "the deliver was reported without proof: {reported:?}"
    );
    assert_eq!(target.runner.peers().stats().counters.quarantined, 1);
    target.runner.check_invariants().unwrap();
}

/// A source that cannot open the target's device memory says so (counted
/// there), and the restore goes through the target's KVCR DRAM: it
/// succeeds byte-exact, counted as a fallback.
#[test]
fn a_source_that_cannot_import_falls_back_to_two_hops() {
    let _serial = crate::serial();
    let mut source = Source::spawn("refuse");
    let mut target = Target::start(16);
    let from = source.endpoint.clone();
    let warm = target.restore("warm", &from, &[0], 0);
    assert_eq!(statuses(&warm), vec![EntryStatus::Success]);
    let keys = [1, 2, 3];
    let result = target.restore("two-hop", &from, &keys, 4);
    assert_eq!(statuses(&result), vec![EntryStatus::Success; 3]);
    for (i, k) in keys.iter().enumerate() {
        assert!(target.holds(4 + i as u64, *k));
    }
    let counters = target.runner.peers().stats().counters;
    assert_eq!(counters.one_hop_pages, 0, "{counters:?}");
    assert!(counters.one_hop_fallbacks >= 3, "{counters:?}");
    assert!(source.stats().1 >= 1, "the source counted its refusal");
    target.runner.check_invariants().unwrap();
}

/// A target that goes away takes its one-hop route with it: the source
/// closes its import of every device region the target advertised (a GPU
/// allocation is freed only once every process that imported it has closed
/// it, so an import left open would hold a departed engine's KV pool), and
/// its `device_imports_open` gauge says so.
#[test]
fn a_target_that_goes_away_leaves_no_import_open_at_the_source() {
    let _serial = crate::serial();
    let mut source = Source::spawn("one-pass");
    let mut target = Target::start(16);
    let from = source.endpoint.clone();
    let warm = target.restore("warm", &from, &[0], 0);
    assert_eq!(statuses(&warm), vec![EntryStatus::Success]);
    assert_eq!(target.runner.peers().stats().counters.one_hop_pages, 1);
    assert_eq!(
        source.imports(),
        (1, 1),
        "the route opened the target's one device region"
    );
    drop(target);
    // The source hears of the session's end on its own thread.
    crate::processes::poll_until("the source to close its imports", || {
        (source.imports() == (0, 0)).then_some(())
    });
}
