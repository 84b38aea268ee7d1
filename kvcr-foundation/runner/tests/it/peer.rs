//! Peer restore between real runners over real UCX and real TCP control
//! channels (loopback only), in one process.

use std::os::unix::fs::FileExt;
use std::time::Duration;

use kvcr_contracts::{RequestId, ScopedKey};
use kvcr_runner::{
    DataStream, EntryStatus, FailReason, LandingCheck, PeerOptions, QueryStatus, Runner,
};
use rstest::rstest;

use crate::nodes::{
    BLOCK, Node, assert_restored, fetch_on_hint, hint, key, node_with, restore_all, stock, wait,
};

fn node(tls: &str, blocks: u32, timeout: Duration) -> Node {
    node_mapped(tls, true, blocks, timeout)
}

/// A node whose pools a same-host peer maps (`mapping`) or not.
fn node_mapped(tls: &str, mapping: bool, blocks: u32, timeout: Duration) -> Node {
    let mut options = PeerOptions::loopback();
    options.ucx_tls = Some(tls.to_owned());
    options.same_host_mapping = mapping;
    node_with(&options, blocks, timeout)
}

/// Keeps this process's runners in their contended mode while alive.
struct Crowded;

impl Crowded {
    fn start() -> Self {
        kvcr_runner::force_contended(true);
        Self
    }
}

impl Drop for Crowded {
    fn drop(&mut self) {
        kvcr_runner::force_contended(false);
    }
}

/// On a crowded host the runners stop waiting awake (no linger, no spin for
/// a reply, a transfer that finds nothing to do naps at once): every thread
/// then sleeps on its events. Restores one page at a time, each fetch a
/// fresh request, so every hop of each round trip starts from a sleeping
/// thread, over both routes; every page arrives whole.
#[rstest]
#[case::shm_one_copy("sm,self", true)]
#[case::tcp_ucx("tcp,self", false)]
fn restores_on_a_crowded_host_wait_asleep_and_lose_nothing(
    #[case] tls: &str,
    #[case] mapping: bool,
) {
    let _serial = crate::serial();
    let _crowded = Crowded::start();
    let mut source = node_mapped(tls, mapping, 16, Duration::from_secs(5));
    let mut target = node_mapped(tls, mapping, 16, Duration::from_secs(5));
    let keys: Vec<u64> = (0..12).collect();
    stock(&mut source, &keys);
    let endpoint = source.runner.peers().endpoint().unwrap().clone();
    for k in &keys {
        let pages = restore_all(&mut target, &format!("crowded-{k}"), &endpoint, &[*k]);
        let at = *k as usize * BLOCK;
        assert_eq!(
            pages[0],
            source.host[at..at + BLOCK],
            "key {k} bytes differ"
        );
    }
    assert_eq!(target.runner.peers().stats().counters.keys_received, 12);
}

/// Full, partial and empty deliveries over shared memory and TCP, with the
/// same-host one-copy mapping and through UCX alone; every restored byte
/// equals the source's, and the route took the path it should.
#[rstest]
#[case::shm_one_copy("sm,self", true)]
// `sm` lists sysv beside cma, which a route cannot bind to the worker its
// nonce reaches: same-host UCX routes are posix and cma alone.
#[case::shm_ucx("posix,cma,self", false)]
#[case::tcp_one_copy("tcp,self", true)]
#[case::tcp_ucx("tcp,self", false)]
fn hinted_fetch_restores_bytes(#[case] tls: &str, #[case] mapping: bool) {
    let _serial = crate::serial();
    let mut source = node_mapped(tls, mapping, 16, Duration::from_secs(5));
    let mut target = node_mapped(tls, mapping, 16, Duration::from_secs(5));
    stock(&mut source, &[0, 1, 2, 3, 4, 5]);
    let request = RequestId("req-1".into());
    // The hint names 0..8, but the source only holds 0..6: a partial delivery.
    let wanted: Vec<u64> = (0..8).collect();
    target
        .runner
        .hints()
        .submit(request.clone(), &hint(&source, &wanted));
    let keys: Vec<ScopedKey> = wanted.iter().map(|k| key(target.ns, *k)).collect();
    assert_eq!(
        target.runner.hints().query(&request, &keys[0]),
        QueryStatus::Fetchable(kvcr_contracts::Tier::External)
    );
    let pool = target.runner.pool("kv").unwrap();
    let op = target
        .runner
        .hints()
        .fetch(&request, &keys, &[pool])
        .unwrap();
    let result = wait(&mut target.runner, op);
    for (i, (_, entry)) in result.entries.iter().enumerate() {
        if i < 6 {
            assert!(entry.is_success(), "key {i}: {entry:?}");
            let bytes = target
                .runner
                .read_claimed(entry.release.unwrap(), 0)
                .unwrap();
            assert_eq!(
                bytes,
                source.host[i * BLOCK..(i + 1) * BLOCK],
                "key {i} bytes differ"
            );
        } else {
            assert_eq!(
                entry.status,
                EntryStatus::Failed(FailReason::NoSource),
                "key {i}"
            );
        }
    }
    let target_counters = target.runner.peers().stats().counters;
    assert_eq!(target_counters.keys_received, 6);
    // The target may complete on the source's doorbell before the source
    // has counted its own completion.
    crate::wait_until(
        "the source to count its sent keys",
        Duration::from_secs(5),
        || source.runner.peers().stats().counters.keys_sent == 6,
    );
    let source_counters = source.runner.peers().stats().counters;
    // A one-copy write rings the target's doorbell as its copies end; a
    // write through UCX never does.
    let rung = source.runner.peers().control_stats().doorbells_rung;
    assert_eq!(rung > 0, mapping, "doorbells rung: {rung}");
    let routes = (source_counters.one_copy_routes, source_counters.ucx_routes);
    assert_eq!(routes, if mapping { (1, 0) } else { (0, 1) });
    // Missing keys are remembered: the next query is a miss, not fetchable.
    assert_eq!(
        target.runner.hints().query(&request, &keys[7]),
        QueryStatus::Miss
    );
    // An empty delivery: a hint for keys the source never had.
    let request2 = RequestId("req-2".into());
    target
        .runner
        .hints()
        .submit(request2.clone(), &hint(&source, &[100, 101]));
    let op = target
        .runner
        .hints()
        .fetch(
            &request2,
            &[key(target.ns, 100), key(target.ns, 101)],
            &[pool],
        )
        .unwrap();
    let result = wait(&mut target.runner, op);
    assert!(
        result
            .entries
            .iter()
            .all(|(_, e)| e.status == EntryStatus::Failed(FailReason::NoSource))
    );
    drop(target);
    drop(source);
}

/// A whole write through UCX small enough leaves as a message that
/// carries its bytes and its completion (no put, no flush, no `write_done`),
/// in parts of at most the part size; a larger one, or one from a source
/// with messages off, goes as puts. Both restore byte-exact, and nothing is
/// refused.
#[rstest]
#[case::tcp_message_in_64kib_parts("tcp,self", PeerOptions::DEFAULT_WRITE_MESSAGE_BYTES, 64 << 10, 4)]
#[case::tcp_message_whole("tcp,self", PeerOptions::DEFAULT_WRITE_MESSAGE_BYTES, 4 * BLOCK as u64, 1)]
#[case::tcp_message_in_uneven_parts(
    "tcp,self",
    PeerOptions::DEFAULT_WRITE_MESSAGE_BYTES,
    100_000,
    3
)]
#[case::tcp_too_large_for_one("tcp,self", 3 * BLOCK as u64, 64 << 10, 0)]
#[case::tcp_too_many_parts("tcp,self", PeerOptions::DEFAULT_WRITE_MESSAGE_BYTES, 512, 0)]
#[case::tcp_messages_off("tcp,self", 0, 64 << 10, 0)]
#[case::shm_message("posix,cma,self", PeerOptions::DEFAULT_WRITE_MESSAGE_BYTES, 64 << 10, 4)]
fn small_whole_writes_through_ucx_go_as_one_message(
    #[case] tls: &str,
    #[case] largest_message: u64,
    #[case] part_bytes: u64,
    #[case] parts: u64,
) {
    let _serial = crate::serial();
    let mut options = PeerOptions::loopback();
    options.ucx_tls = Some(tls.to_owned());
    options.same_host_mapping = false;
    // Through UCX only: a data stream would carry these writes instead.
    options.data_stream = DataStream::Off;
    let target = node_with(&options, 16, Duration::from_secs(5));
    options.write_message_max_bytes = largest_message;
    options.write_message_part_bytes = part_bytes;
    let mut source = node_with(&options, 16, Duration::from_secs(5));
    let keys = [0, 1, 2, 3];
    stock(&mut source, &keys);
    let mut target = target;
    let result = fetch_on_hint(&mut target, "one-message", &hint(&source, &keys), &keys);
    assert_restored(&target, &source, &result, &keys);
    crate::wait_until(
        "the source to count its sent keys",
        Duration::from_secs(5),
        || source.runner.peers().stats().counters.keys_sent == 4,
    );
    let sent = source.runner.peers().control_stats().write_messages_sent;
    let taken = target.runner.peers().control_stats().write_messages_taken;
    assert_eq!((sent, taken), (parts, parts));
    assert_eq!(
        target.runner.peers().control_stats().write_messages_refused,
        0
    );
    assert_eq!(target.runner.peers().stats().counters.keys_received, 4);
    target.runner.check_invariants().unwrap();
    source.runner.check_invariants().unwrap();
}

/// A target that reaches its source through UCX over tcp dials it a data
/// stream once the source has acknowledged its metadata; the source's
/// writes then come on it, one frame each, read straight into the granted
/// elements: byte-exact, one key or many (a write of 256 keys is 16 MiB).
/// With data streams off, or over shared memory (`Auto`), they go through
/// UCX and no stream is dialed. A source that maps its target's pools
/// writes with one copy over tcp too, and binds no stream (the target dials
/// one beside its metadata, before it knows; it is dropped).
#[rstest]
#[case::tcp_one_key("tcp,self", false, DataStream::Auto, 1, true)]
#[case::tcp_16mib("tcp,self", false, DataStream::Auto, 256, true)]
#[case::tcp_off("tcp,self", false, DataStream::Off, 8, false)]
#[case::shm_auto("posix,cma,self", false, DataStream::Auto, 8, false)]
#[case::tcp_one_copy("tcp,self", true, DataStream::Auto, 8, false)]
fn writes_over_tcp_come_on_a_data_stream(
    #[case] tls: &str,
    #[case] mapping: bool,
    #[case] mode: DataStream,
    #[case] keys_per_write: u64,
    #[case] streamed: bool,
) {
    let _serial = crate::serial();
    let mut options = PeerOptions::loopback();
    options.ucx_tls = Some(tls.to_owned());
    options.same_host_mapping = mapping;
    options.data_stream = mode;
    let blocks = u32::try_from(1 + 2 * keys_per_write).unwrap();
    let mut source = node_with(&options, blocks, Duration::from_secs(10));
    let mut target = node_with(&options, blocks, Duration::from_secs(10));
    let all: Vec<u64> = (0..u64::from(blocks)).collect();
    stock(&mut source, &all);
    // The first restore builds the route; the stream is dialed behind it.
    let first = fetch_on_hint(&mut target, "first", &hint(&source, &[0]), &[0]);
    assert_restored(&target, &source, &first, &[0]);
    if streamed {
        crate::wait_until(
            "both ends to bind the data stream",
            Duration::from_secs(10),
            || {
                target.runner.peers().control_stats().streams_opened == 1
                    && source.runner.peers().control_stats().streams_opened == 1
            },
        );
    }
    let before = target.runner.peers().control_stats().stream_writes_taken;
    for round in 0..2 {
        let keys: Vec<u64> =
            (1 + round * keys_per_write..1 + (round + 1) * keys_per_write).collect();
        let result = fetch_on_hint(
            &mut target,
            &format!("round-{round}"),
            &hint(&source, &keys),
            &keys,
        );
        assert_restored(&target, &source, &result, &keys);
        for (_, entry) in &result.entries {
            assert_eq!(target.runner.release(&[entry.release.unwrap()]), vec![true]);
        }
    }
    let (t, s) = (
        target.runner.peers().control_stats(),
        source.runner.peers().control_stats(),
    );
    if streamed {
        assert_eq!(t.stream_writes_taken - before, 2, "each round one frame");
        assert_eq!(t.stream_writes_taken, s.stream_writes_sent);
        assert_eq!(t.stream_writes_refused, 0);
        assert_eq!(s.streams_refused, 0);
    } else if mapping {
        // The target's dial may have finished before the acknowledgement
        // came (then it counted the stream, and dropped it on it).
        assert_eq!(s.streams_opened, 0, "a one-copy route binds no stream");
        assert_eq!((t.stream_writes_taken, s.stream_writes_sent), (0, 0));
        assert_eq!(source.runner.peers().stats().counters.one_copy_routes, 1);
    } else {
        assert_eq!((t.streams_opened, s.streams_opened), (0, 0));
        assert_eq!((t.stream_writes_taken, s.stream_writes_sent), (0, 0));
    }
    assert_eq!(
        target.runner.peers().stats().counters.keys_received,
        1 + 2 * keys_per_write
    );
    target.runner.check_invariants().unwrap();
    source.runner.check_invariants().unwrap();
}

/// Removing a peer closes its control socket.
#[test]
fn forgetting_a_peer_closes_its_socket() {
    let _serial = crate::serial();
    let mut source = node("sm,self", 4, Duration::from_secs(5));
    let mut target = node("sm,self", 4, Duration::from_secs(5));
    stock(&mut source, &[0]);
    let request = RequestId("r".into());
    target
        .runner
        .hints()
        .submit(request.clone(), &hint(&source, &[0]));
    let pool = target.runner.pool("kv").unwrap();
    let op = target
        .runner
        .hints()
        .fetch(&request, &[key(target.ns, 0)], &[pool])
        .unwrap();
    assert!(wait(&mut target.runner, op).entries[0].1.is_success());
    let sockets = |r: &Runner| r.peers().stats().open_sockets;
    assert_eq!(
        sockets(&target.runner),
        1,
        "one session dialed to the source; its replies come back on it"
    );
    assert_eq!(sockets(&source.runner), 1, "the source dialed nothing back");
    target
        .runner
        .peers()
        .forget(source.runner.peers().endpoint().unwrap());
    // Socket closure has no completion to wait on: poll the counts, bounded.
    crate::wait_until(
        "the dialed socket to close",
        Duration::from_secs(10),
        || sockets(&target.runner) == 0,
    );
    crate::wait_until(
        "the source to see it close",
        Duration::from_secs(10),
        || sockets(&source.runner) == 0,
    );
}

/// A same-host source hashes each page of a one-copy write as it copies it
/// and says so in the doorbell record and the `write_done`: by default the
/// target then does not read the landed bytes again (a page completed by
/// the record takes its digest from the `write_done` behind it); with
/// [`LandingCheck::Always`] it reads every page again. Both restore
/// byte-exact, and every restored page ends up with its source's digest
/// (served on with it).
#[rstest]
#[case::trust_the_copy_check(LandingCheck::TrustCopyCheck)]
#[case::always_read_again(LandingCheck::Always)]
fn pages_checked_in_the_sources_copy_are_not_read_again(#[case] check: LandingCheck) {
    let _serial = crate::serial();
    let mut options = PeerOptions::loopback();
    options.ucx_tls = Some("sm,self".to_owned());
    let mut source = node_with(&options, 32, Duration::from_secs(5));
    options.landing_check = check;
    let mut target = node_with(&options, 32, Duration::from_secs(5));
    let keys: Vec<u64> = (0..24).collect();
    stock(&mut source, &keys);
    // A write completes by its doorbell record or by its `write_done`,
    // whichever the target reads first; a record's pages take their
    // digests from the `write_done` behind it (`sim::scenarios::`
    // `late_digests`).
    let rounds = keys.chunks(3).len() as u64;
    for (round, keys) in keys.chunks(3).enumerate() {
        let request = format!("r{round}");
        let result = fetch_on_hint(&mut target, &request, &hint(&source, keys), keys);
        assert_restored(&target, &source, &result, keys);
    }
    crate::wait_until(
        "the source to count its pages",
        Duration::from_secs(5),
        || source.runner.peers().control_stats().pages_checked_in_copy == keys.len() as u64,
    );
    let stats = target.runner.peers().control_stats();
    // Each write completes once, by its record or its `write_done`.
    let trusted = match check {
        LandingCheck::TrustCopyCheck => rounds,
        LandingCheck::Always => 0,
    };
    assert_eq!(stats.landings_checked_in_copy, trusted);
    assert_eq!(
        source
            .runner
            .peers()
            .control_stats()
            .pages_altered_at_source,
        0
    );
    crate::wait_until(
        "every restored page's digest",
        Duration::from_secs(5),
        || {
            keys.iter().all(|k| {
                let digest = target.runner.page_digest(&key(target.ns, *k));
                digest.is_some() && digest == source.runner.page_digest(&key(source.ns, *k))
            })
        },
    );
    assert_eq!(target.runner.peers().stats().counters.digest_mismatches, 0);
}

/// A page whose bytes changed in the source's pool after its deposit (a
/// fault at rest) is caught by the source's own copy: its write fails, the
/// target completes no key of it with those bytes, and the source counts it.
#[test]
fn a_page_altered_in_the_sources_pool_is_never_written_as_success() {
    let _serial = crate::serial();
    let mut options = PeerOptions::loopback();
    options.ucx_tls = Some("sm,self".to_owned());
    let mut source = node_with(&options, 16, Duration::from_secs(5));
    let mut target = node_with(&options, 16, Duration::from_secs(5));
    let keys: Vec<u64> = (0..4).collect();
    stock(&mut source, &keys);
    // Key 2's page, found in the source's pool by its bytes, gets one bit
    // flipped through this process's own memory file (nothing of the
    // source's is in flight; the pool is this process's memory).
    let page = &source.host[2 * BLOCK..3 * BLOCK];
    let memory = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/proc/self/mem")
        .unwrap();
    let mut flipped = 0;
    for range in source.runner.pools().ranges() {
        let mut pool = vec![0u8; range.len as usize];
        memory.read_exact_at(&mut pool, range.base).unwrap();
        for (i, slot) in pool.chunks_exact(BLOCK).enumerate() {
            if slot == page {
                let at = range.base + (i * BLOCK) as u64 + 1000;
                memory.write_all_at(&[slot[1000] ^ 0x10], at).unwrap();
                flipped += 1;
            }
        }
    }
    assert_eq!(flipped, 1, "the page is in the source's pool once");
    let result = fetch_on_hint(&mut target, "altered", &hint(&source, &keys), &keys);
    for ((scoped, entry), k) in result.entries.iter().zip(&keys) {
        if entry.is_success() {
            let bytes = target
                .runner
                .read_claimed(entry.release.unwrap(), 0)
                .unwrap();
            let at = *k as usize * BLOCK;
            assert!(
                bytes == source.host[at..at + BLOCK],
                "{scoped:?}: wrong bytes"
            );
        } else {
            assert_ne!(
                target.runner.query(scoped),
                QueryStatus::Hit,
                "{scoped:?} served"
            );
        }
    }
    assert!(
        !result.entries[2].1.is_success(),
        "the altered page succeeded"
    );
    let stats = source.runner.peers().control_stats();
    assert_eq!(stats.pages_altered_at_source, 1);
}
