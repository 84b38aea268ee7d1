//! Data streams between two real runners (UCX over tcp, as with `--host`)
//! through an on-path relay that holds no secret and sees every byte: with
//! sealed records (the default with a cluster secret) the KV pages never
//! cross in the clear, and a record altered, reordered or replayed on the
//! way ends the stream, fails the write it carried (never Success with
//! wrong bytes), is counted, and the next restore lands byte-exact.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvcr_runner::{
    DataStream, EntryStatus, FailReason, OpResult, PeerOptions, QueryStatus, StreamSealing,
};
use rstest::rstest;

use crate::nodes::{BLOCK, Node, assert_restored, fetch_on_hint, hint, node_with, stock};

const SECRET: &[u8] = b"sealing-tests-cluster-secret-0123456789";
/// Bytes of a sealed frame's prefix and its tag.
const SEALED_PREFIX: usize = 80 + 16;
/// Bytes of one sealed record of a page (records are cut to the pages).
const SEALED_RECORD: usize = BLOCK + 16;

/// Every byte goes through UCX over tcp or a data stream (no mapping of a
/// same-host peer's pools), with a cluster secret.
fn options(sealing: StreamSealing) -> PeerOptions {
    let mut options = PeerOptions::loopback();
    options.ucx_tls = Some("tcp,self".to_owned());
    options.secret = Some(SECRET.to_vec());
    options.same_host_mapping = false;
    options.data_stream = DataStream::On;
    options.stream_sealing = sealing;
    options
}

/// What the relay does to the first frame a source sends on a data stream
/// once it is armed.
#[derive(Debug, Clone, Copy)]
enum Tamper {
    /// Nothing (it only records).
    Nothing,
    /// Flips bit 0x20 of this byte of the frame.
    Flip(usize),
    /// Sends the frame's second record before its first.
    SwapRecords,
    /// Sends the frame (of this many bytes), then the same bytes again.
    Replay(usize),
}

impl Tamper {
    /// Bytes of the frame it holds back before it acts.
    fn holds(self) -> usize {
        match self {
            Self::Nothing => usize::MAX,
            Self::Flip(at) => at + 1,
            Self::SwapRecords => SEALED_PREFIX + 2 * SEALED_RECORD,
            Self::Replay(frame) => frame,
        }
    }

    /// `held` (at least [`Tamper::holds`] bytes), as it goes on.
    fn apply(self, held: &[u8]) -> Vec<u8> {
        match self {
            Self::Nothing => held.to_vec(),
            Self::Flip(at) => {
                let mut out = held.to_vec();
                out[at] ^= 0x20;
                out
            }
            Self::SwapRecords => {
                let (first, second) = (SEALED_PREFIX, SEALED_PREFIX + SEALED_RECORD);
                let end = second + SEALED_RECORD;
                [
                    &held[..first],
                    &held[second..end],
                    &held[first..second],
                    &held[end..],
                ]
                .concat()
            }
            Self::Replay(frame) => [&held[..frame], held].concat(),
        }
    }
}

/// An on-path relay in front of a source: forwards every connection both
/// ways (closing both ends once either ends, as a middlebox forwards a
/// close), records what sources send on data streams, and tampers with the
/// first frame sent after it is armed.
struct Relay {
    /// Every byte sources sent on data streams, in order.
    seen: Arc<Mutex<Vec<u8>>>,
    armed: Arc<AtomicBool>,
    /// Frames it tampered with.
    tampered: Arc<AtomicU64>,
}

impl Relay {
    /// A relay reached at `at`, in front of a source listening at
    /// `listening`.
    fn start(at: SocketAddr, listening: SocketAddr, tamper: Tamper) -> Self {
        let relay = Self {
            seen: Arc::default(),
            armed: Arc::default(),
            tampered: Arc::default(),
        };
        let listener = TcpListener::bind(at).unwrap();
        let (seen, armed, tampered) = (
            Arc::clone(&relay.seen),
            Arc::clone(&relay.armed),
            Arc::clone(&relay.tampered),
        );
        std::thread::spawn(move || {
            for dialer in listener.incoming() {
                let Ok(dialer) = dialer else { return };
                let Ok(source) = TcpStream::connect(listening) else {
                    continue;
                };
                let taps = (Arc::clone(&seen), Arc::clone(&armed), Arc::clone(&tampered));
                std::thread::spawn(move || forward(dialer, source, tamper, taps));
            }
        });
        relay
    }

    fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }
}

type Taps = (Arc<Mutex<Vec<u8>>>, Arc<AtomicBool>, Arc<AtomicU64>);

/// Forwards one connection both ways until either end closes it.
fn forward(mut dialer: TcpStream, mut source: TcpStream, tamper: Tamper, taps: Taps) {
    let mut first = [0u8; 8];
    if dialer.read_exact(&mut first).is_err() || source.write_all(&first).is_err() {
        return;
    }
    let stream = &first == b"KVCR-D2\0";
    let (mut source_in, mut dialer_out) =
        (source.try_clone().unwrap(), dialer.try_clone().unwrap());
    std::thread::spawn(move || {
        let (seen, armed, tampered) = taps;
        let mut held: Option<Vec<u8>> = None;
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match source_in.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let mut out = buf[..n].to_vec();
            if stream {
                seen.lock().unwrap().extend_from_slice(&out);
                // Armed between frames: what comes next starts a frame.
                if held.is_none() && armed.swap(false, Ordering::SeqCst) {
                    held = Some(Vec::new());
                }
                if let Some(frame) = &mut held {
                    frame.extend_from_slice(&out);
                    if frame.len() < tamper.holds() {
                        continue;
                    }
                    out = tamper.apply(frame);
                    tampered.fetch_add(1, Ordering::SeqCst);
                    held = None;
                }
            }
            if dialer_out.write_all(&out).is_err() {
                break;
            }
        }
        let _ = source_in.shutdown(Shutdown::Both);
        let _ = dialer_out.shutdown(Shutdown::Both);
    });
    let _ = std::io::copy(&mut dialer, &mut source);
    let _ = source.shutdown(Shutdown::Both);
    let _ = dialer.shutdown(Shutdown::Both);
}

/// A source (listening on 127.0.0.1, telling peers 127.0.0.2, where the
/// relay listens on the same port), a target and the relay; keys 0..64
/// stocked at the source, and 0..16 restored once (the data stream is
/// dialed beside that route's metadata), the stream then bound.
fn relayed_pair(sealing: StreamSealing, tamper: Tamper) -> (Node, Node, Relay) {
    let options = options(sealing);
    let mut source_options = options.clone();
    source_options.advertise_host = kvcr_contracts::Host::Ip([127, 0, 0, 2].into());
    let mut source = node_with(&source_options, 64, Duration::from_secs(10));
    let mut target = node_with(&options, 64, Duration::from_secs(10));
    let port = source.runner.peers().endpoint().unwrap().port();
    let relay = Relay::start(
        ([127, 0, 0, 2], port).into(),
        ([127, 0, 0, 1], port).into(),
        tamper,
    );
    let all: Vec<u64> = (0..64).collect();
    stock(&mut source, &all);
    let first: Vec<u64> = (0..16).collect();
    let result = fetch_on_hint(&mut target, "first", &hint(&source, &first), &first);
    assert_restored(&target, &source, &result, &first);
    crate::wait_until("the data stream to bind", Duration::from_secs(10), || {
        source.runner.peers().control_stats().streams_opened == 1
    });
    (source, target, relay)
}

/// Whether `seen` holds any 64-byte window of the source's pages `keys`
/// (at the start, in the middle and near the end of each).
fn any_page_in(seen: &[u8], source: &Node, keys: &[u64]) -> bool {
    keys.iter().any(|k| {
        let page = &source.host[*k as usize * BLOCK..(*k as usize + 1) * BLOCK];
        [0, BLOCK / 2 + 13, BLOCK - 64].iter().any(|at| {
            let window = &page[*at..*at + 64];
            seen.windows(64).any(|w| w == window)
        })
    })
}

/// The probe of issue 40, item 3: an on-path observer (no secret) records a
/// data stream carrying a restore. Sealed (the default with a secret), no
/// page's bytes appear on the wire, though every page crossed it and landed
/// byte-exact; with sealing turned off they do (the observer is real).
#[rstest]
#[case::sealed_by_default(StreamSealing::Auto, false)]
#[case::turned_off(StreamSealing::Off, true)]
fn kv_pages_cross_a_data_stream_in_the_clear_only_when_sealing_is_off(
    #[case] sealing: StreamSealing,
    #[case] in_the_clear: bool,
) {
    let _serial = crate::serial();
    let (source, mut target, relay) = relayed_pair(sealing, Tamper::Nothing);
    let taken = target.runner.peers().control_stats().stream_writes_taken;
    let keys: Vec<u64> = (16..32).collect();
    let result = fetch_on_hint(&mut target, "observed", &hint(&source, &keys), &keys);
    assert_restored(&target, &source, &result, &keys);
    assert_eq!(
        target.runner.peers().control_stats().stream_writes_taken,
        taken + 1,
        "the restore came on the data stream"
    );
    let seen = relay.seen.lock().unwrap().clone();
    assert!(
        seen.len() >= keys.len() * BLOCK,
        "every page crossed the relay"
    );
    assert_eq!(any_page_in(&seen, &source, &keys), in_the_clear);
    assert_eq!(
        target.runner.peers().control_stats().stream_records_refused,
        0
    );
}

/// An on-path relay (no secret) alters a data stream's records as they
/// cross: a flipped ciphertext byte, two records swapped, a whole frame
/// replayed. The record that does not open ends the stream, counted
/// (`stream_records_refused`); no key reports Success with wrong bytes (a
/// write the torn stream was landing fails every key `DigestMismatch`,
/// never served; a replay comes after its write landed whole); the source
/// sees the close, and the next restore lands byte-exact.
#[rstest]
#[case::a_flipped_byte(Tamper::Flip(SEALED_PREFIX + 20_000), false)]
#[case::two_records_swapped(Tamper::SwapRecords, false)]
#[case::a_frame_replayed(Tamper::Replay(SEALED_PREFIX + 16 * SEALED_RECORD), true)]
fn a_data_stream_altered_on_the_way_ends_without_a_wrong_success(
    #[case] tamper: Tamper,
    #[case] lands: bool,
) {
    let _serial = crate::serial();
    let (source, mut target, relay) = relayed_pair(StreamSealing::Auto, tamper);
    let sockets = source.runner.peers().control_stats().open_sockets;
    relay.arm();
    let keys: Vec<u64> = (16..32).collect();
    let result = fetch_on_hint(&mut target, "altered", &hint(&source, &keys), &keys);
    assert_eq!(relay.tampered.load(Ordering::SeqCst), 1, "the relay acted");
    if lands {
        assert_restored(&target, &source, &result, &keys);
    } else {
        assert_all_failed_unserved(&target, &result);
        let mismatches = target.runner.peers().stats().counters.digest_mismatches;
        assert_eq!(mismatches, keys.len() as u64);
    }
    crate::wait_until("the stream to end", Duration::from_secs(10), || {
        target.runner.peers().control_stats().stream_records_refused == 1
    });
    crate::wait_until(
        "the source to see it closed",
        Duration::from_secs(10),
        || source.runner.peers().control_stats().open_sockets < sockets,
    );
    let again: Vec<u64> = (32..48).collect();
    let result = fetch_on_hint(&mut target, "again", &hint(&source, &again), &again);
    assert_restored(&target, &source, &result, &again);
    assert_eq!(
        target.runner.peers().control_stats().stream_records_refused,
        1
    );
    target.runner.check_invariants().unwrap();
    source.runner.check_invariants().unwrap();
}

/// Every key of `result` failed `DigestMismatch` and is not served.
fn assert_all_failed_unserved(target: &Node, result: &OpResult) {
    for (key, entry) in &result.entries {
        assert_eq!(
            entry.status,
            EntryStatus::Failed(FailReason::DigestMismatch),
            "{key:?}"
        );
        assert_ne!(target.runner.query(key), QueryStatus::Hit, "{key:?} served");
    }
}
