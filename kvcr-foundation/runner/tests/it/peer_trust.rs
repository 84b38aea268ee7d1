//! The trust rules between real runners (loopback, real UCX, real sessions),
//! tried as an attacker would: without the secret, forging completions as a
//! member, forging data streams and the frames on them, forging and
//! replaying requests in a source's mailbox, flooding while an honest
//! destination restores, and hinting a rank towards a stranger.

use std::io::Read;
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use kvcr_contracts::protocol::{
    Body, CompletedIndices, ElementRef, ElementRuns, Header, Message, OpHandle, RegionId,
    RouteGeneration, WriteOutcome,
};
use kvcr_contracts::{
    BlockKey, ControlEndpoint, FetchHint, Incarnation, NamespaceId, RequestId, ScopedKey,
};
use kvcr_runner::client::{ControlClient, Dialed, seal_write_header, seal_write_header_digested};
use kvcr_runner::{
    DataStream, EntryStatus, FailReason, OpResult, PeerOptions, QueryStatus, StaticKey,
};
use kvcr_runner_core::MAX_FENCES_PER_TARGET;
use rstest::rstest;

use crate::nodes::{
    BLOCK, Node, assert_restored, fetch_on_hint, hint, key, node_with, stock, wait,
};

pub(crate) const SECRET: &[u8] = b"trust-tests-cluster-secret-0123456789";

pub(crate) fn options(tls: &str, secret: Option<&[u8]>) -> PeerOptions {
    let mut options = PeerOptions::loopback();
    options.ucx_tls = Some(tls.to_owned());
    options.secret = secret.map(<[u8]>::to_vec);
    options
}

/// A member's options where every byte goes through UCX over tcp (no
/// mapping of a same-host peer's pools).
pub(crate) fn through_tcp() -> PeerOptions {
    let mut options = options("tcp,self", Some(SECRET));
    options.same_host_mapping = false;
    options
}

pub(crate) fn member(tls: &str, blocks: u32) -> Node {
    node_with(&options(tls, Some(SECRET)), blocks, Duration::from_secs(5))
}

pub(crate) fn assert_nothing_restored(target: &Node, result: &OpResult) {
    for (key, entry) in &result.entries {
        assert!(
            matches!(
                entry.status,
                EntryStatus::Failed(FailReason::Timeout | FailReason::NoSource)
            ),
            "{key:?}: {entry:?}"
        );
        assert_ne!(target.runner.query(key), QueryStatus::Hit);
    }
}

/// Page hashes are public (the KV-event stream carries them); the pages are
/// not: a runner without the cluster secret restores nothing, and the source
/// sees only failed handshakes.
#[rstest]
#[case::no_secret(None)]
#[case::wrong_secret(Some(&b"another-cluster-secret-0123456789"[..]))]
fn a_runner_without_the_secret_restores_nothing(#[case] secret: Option<&'static [u8]>) {
    let _serial = crate::serial();
    let mut source = member("posix,cma,self", 8);
    stock(&mut source, &[0, 1, 2, 3]);
    let mut intruder = node_with(
        &options("posix,cma,self", secret),
        8,
        Duration::from_millis(500),
    );
    let result = fetch_on_hint(
        &mut intruder,
        "steal",
        &hint(&source, &[0, 1, 2, 3]),
        &[0, 1, 2, 3],
    );
    assert_nothing_restored(&intruder, &result);
    assert!(source.runner.peers().control_stats().refused_handshakes >= 1);
    assert_eq!(source.runner.peers().stats().counters.keys_sent, 0);
    let mut friend = member("posix,cma,self", 8);
    let result = fetch_on_hint(
        &mut friend,
        "ok",
        &hint(&source, &[0, 1, 2, 3]),
        &[0, 1, 2, 3],
    );
    assert_restored(&friend, &source, &result, &[0, 1, 2, 3]);
    source.runner.check_invariants().unwrap();
    intruder.runner.check_invariants().unwrap();
}

/// A member that knows the secret forges completions to a destination whose
/// hinted source never answers, claiming to be that source: replies are only
/// taken on the session the destination dialed, so its session is cut, no key
/// is reported restored, and nothing is served afterwards.
#[test]
fn forged_completions_never_succeed() {
    let _serial = crate::serial();
    // The hinted source: accepts connections and never says a word.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_endpoint =
        ControlEndpoint::parse(&format!("tcp://{}", silent.local_addr().unwrap())).unwrap();
    let (done, until_done) = std::sync::mpsc::channel::<()>();
    let held = std::thread::spawn(move || {
        let (stream, _) = silent.accept().unwrap();
        // Held open, silent, until the test ends.
        let _ = until_done.recv_timeout(Duration::from_secs(60));
        drop(stream);
    });
    let mut target = node_with(
        &options("posix,cma,self", Some(SECRET)),
        32,
        Duration::from_secs(1),
    );
    let keys: Vec<u64> = (0..16).collect();
    let request = RequestId("forged".into());
    // The hint names the key of the member expected there (no one holds
    // it; the silent listener never gets that far).
    let silent_key = StaticKey::generate().unwrap().public();
    let the_hint = FetchHint {
        source: silent_endpoint.with_key(Some(silent_key)),
        block_hashes: keys.iter().map(|k| BlockKey::from_u64(*k)).collect(),
        mode: kvcr_contracts::hint::FetchMode::Copy,
        action_id: None,
    };
    target.runner.hints().submit(request.clone(), &the_hint);
    let op = crate::nodes::fetch_hinted(&target.runner, target.ns, &request, &keys);
    let mut forger = ControlClient::connect(
        target.runner.peers().endpoint().unwrap(),
        Some(SECRET),
        silent_endpoint.clone(),
        Incarnation::generate(),
    )
    .unwrap();
    let header = Header {
        sender: Incarnation::generate(),
        route_generation: RouteGeneration(0),
        sender_endpoint: silent_endpoint,
    };
    for op in 0..64 {
        let done = Message {
            header: header.clone(),
            body: Body::WriteDone {
                op_handle: OpHandle(op),
                outcome: WriteOutcome::Completed(CompletedIndices::new((0..16).collect())),
            },
        };
        // The session may be cut after the first: later sends can fail.
        if forger.send(&done).is_err() {
            break;
        }
    }
    assert!(forger.closed_by_peer(Duration::from_secs(5)));
    let result = wait(&mut target.runner, op);
    assert_nothing_restored(&target, &result);
    assert!(target.runner.peers().control_stats().bad_frames >= 1);
    assert_eq!(target.runner.peers().stats().counters.keys_received, 0);
    target.runner.check_invariants().unwrap();
    drop(done);
    held.join().unwrap();
}

/// The doorbell files of this process's runners: memfds named like pools,
/// of the doorbell's size (1024 slots of 64 bytes), opened for writing the
/// way any process of this user could, with their inode numbers.
fn doorbell_files() -> Vec<(u64, std::fs::File)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|entry| {
            let path = entry.ok()?.path();
            let link = std::fs::read_link(&path).ok()?;
            if !link.to_string_lossy().starts_with("/memfd:kvcr-pool-") {
                return None;
            }
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .ok()?;
            let meta = file.metadata().ok()?;
            (meta.len() == DOORBELL_FILE_BYTES).then_some((meta.ino(), file))
        })
        .collect()
}

/// A source holding `keys` and a target, members on one host (the source
/// maps the target's pools), and the doorbell files of these two runners
/// (another test's runner may still be alive in this process).
fn same_host_pair_and_doorbells(keys: &[u64]) -> (Node, Node, Vec<(u64, std::fs::File)>) {
    let before: Vec<u64> = doorbell_files().into_iter().map(|(ino, _)| ino).collect();
    let mut source = member("posix,cma,self", 32);
    let target = member("posix,cma,self", 32);
    stock(&mut source, keys);
    let files: Vec<_> = doorbell_files()
        .into_iter()
        .filter(|(ino, _)| !before.contains(ino))
        .collect();
    assert_eq!(files.len(), 2, "one doorbell per runner");
    (source, target, files)
}

/// Restores key `k` from `source` as `request`, byte-exact, and releases it.
fn restore_and_release(target: &mut Node, source: &Node, request: &str, k: u64) {
    let result = fetch_on_hint(target, request, &hint(source, &[k]), &[k]);
    assert_restored(target, source, &result, &[k]);
    let handles: Vec<_> = result
        .entries
        .iter()
        .filter_map(|(_, e)| e.release)
        .collect();
    target.runner.release(&handles);
}

/// A doorbell file: 1024 slots of 64 bytes, then 128 mailboxes of 4 KiB.
const DOORBELL_FILE_BYTES: u64 = 1024 * 64 + MAILBOXES * MAILBOX_BYTES;
const MAILBOXES: u64 = 128;
const MAILBOX_BYTES: u64 = 4096;

/// What a forger who can open a doorbell file does to every mailbox in it.
#[derive(Debug, Clone, Copy)]
enum MailboxForgery {
    /// Bytes of its own, published (the sequence word moved on, even).
    Garbage,
    /// What the mailbox holds (an honest request of an earlier operation),
    /// published again.
    Replay,
    /// The sequence word left odd: a record forever half written.
    Torn,
}

fn forge_mailboxes(files: &[(u64, std::fs::File)], forgery: MailboxForgery, round: u64) {
    use std::os::unix::fs::FileExt;
    for (_, file) in files {
        for mailbox in 0..MAILBOXES {
            let at = 1024 * 64 + mailbox * MAILBOX_BYTES;
            let mut word = [0u8; 8];
            file.read_exact_at(&mut word, at).unwrap();
            let seq = u64::from_le_bytes(word);
            let next = match forgery {
                MailboxForgery::Garbage => {
                    let garbage: Vec<u8> = (0..200u64)
                        .map(|i| (i * 31 + mailbox * 7 + round) as u8)
                        .collect();
                    file.write_all_at(&garbage, at + 8).unwrap();
                    (seq | 1) + 1
                }
                MailboxForgery::Replay => (seq | 1) + 1,
                MailboxForgery::Torn => (seq | 1) + 2,
            };
            file.write_all_at(&next.to_le_bytes(), at).unwrap();
        }
    }
}

/// Fills every slot `i` with a record for operation `i` that claims no key
/// landed, under a tag the forger made up (it has no session's key).
fn forge_records(files: &[(u64, std::fs::File)], round: u64) {
    use std::os::unix::fs::FileExt;
    let mut slots = vec![0u8; 1024 * 64];
    for (i, slot) in slots.chunks_mut(64).enumerate() {
        slot[..8].copy_from_slice(&(i as u64).to_le_bytes());
        slot[12] = 1;
        for (j, byte) in slot[16..48].iter_mut().enumerate() {
            *byte = (i as u64 * 131 + j as u64 * 7 + round) as u8;
        }
    }
    for (_, file) in files {
        file.write_all_at(&slots, 0).unwrap();
    }
}

/// A forger's data stream to `source` claiming `claim` with `proof`
/// (`None`: a fresh random one), left open: the socket and the challenge
/// it was sent (`None` when the source hung up before one).
fn open_forged_stream(
    source: &Node,
    claim: &[u8],
    proof: Option<[u8; 32]>,
) -> (std::net::TcpStream, Option<[u8; 32]>) {
    use std::io::{Read, Write};
    let port = source.runner.peers().endpoint().unwrap().port();
    let mut socket = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut hello = b"KVCR-D2\0".to_vec();
    hello.extend_from_slice(&u16::try_from(claim.len()).unwrap().to_be_bytes());
    hello.extend_from_slice(claim);
    // A source that refused the connection may have reset it already.
    if socket.write_all(&hello).is_err() {
        return (socket, None);
    }
    let mut challenge = [0u8; 32];
    if socket.read_exact(&mut challenge).is_err() {
        return (socket, None);
    }
    let proof = proof.unwrap_or_else(|| {
        use std::hash::BuildHasher;
        let state = std::collections::hash_map::RandomState::new();
        std::array::from_fn(|i| state.hash_one(i).to_le_bytes()[0])
    });
    // The terms it asks for: sealed records, a nonce of its own.
    let mut answer = proof.to_vec();
    answer.push(1);
    answer.extend_from_slice(&[0x33; 32]);
    let _ = socket.write_all(&answer);
    (socket, Some(challenge))
}

/// What a forger at `source` gets for a data stream claiming `claim` with
/// `proof` (`None`: a fresh random one): the challenge it was sent (`None`
/// when the source hung up before one) and whether the source then hung up
/// rather than send anything.
fn forge_stream(source: &Node, claim: &[u8], proof: Option<[u8; 32]>) -> (Option<[u8; 32]>, bool) {
    use std::io::Read;
    let (mut socket, challenge) = open_forged_stream(source, claim, proof);
    if challenge.is_none() {
        return (None, true);
    }
    let mut after = [0u8; 1];
    // A stream that bound would stay open (the read times out).
    let hung_up = match socket.read(&mut after) {
        Ok(0) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        Ok(_) => false,
    };
    (challenge, hung_up)
}

/// A source holding keys 0..16 and a target that restored key 0 from it
/// on the data stream it dialed, which the source has bound.
fn streaming_pair(options: &PeerOptions) -> (Node, Node) {
    let mut source = node_with(options, 16, Duration::from_secs(10));
    let mut target = node_with(options, 16, Duration::from_secs(10));
    let all: Vec<u64> = (0..16).collect();
    stock(&mut source, &all);
    let first = fetch_on_hint(&mut target, "first", &hint(&source, &[0]), &[0]);
    assert_restored(&target, &source, &first, &[0]);
    crate::wait_until(
        "the honest data stream to bind",
        Duration::from_secs(10),
        || source.runner.peers().control_stats().streams_opened == 1,
    );
    (source, target)
}

/// A data stream binds only with a proof of the key of the session the
/// claimed target holds with the source (sent only inside that encrypted
/// session): a stream claiming the target with a guessed or replayed proof,
/// claiming an endpoint the source has no route from, or not naming an
/// endpoint at all is dropped unserved, counted, and never replaces the
/// target's own stream, which keeps carrying its restores byte-exact.
#[test]
fn forged_data_streams_are_refused() {
    let _serial = crate::serial();
    let options = through_tcp();
    let (source, mut target) = streaming_pair(&options);
    let claim = target.runner.peers().endpoint().unwrap().to_string();
    let refused = |source: &Node| source.runner.peers().control_stats().streams_refused;
    // A guessed proof, twice the same (a replay answers a fresh challenge).
    let guessed = [0x42u8; 32];
    let (first_challenge, hung_up) = forge_stream(&source, claim.as_bytes(), Some(guessed));
    assert!(hung_up);
    let (second_challenge, hung_up) = forge_stream(&source, claim.as_bytes(), Some(guessed));
    assert!(hung_up);
    assert_ne!(first_challenge, second_challenge, "challenges are fresh");
    crate::wait_until("two refusals", Duration::from_secs(10), || {
        refused(&source) == 2
    });
    // A random proof; a stranger's endpoint (no route to bind).
    assert!(forge_stream(&source, claim.as_bytes(), None).1);
    assert!(forge_stream(&source, b"tcp://127.0.0.1:9", None).1);
    crate::wait_until("four refusals", Duration::from_secs(10), || {
        refused(&source) == 4
    });
    // Not an endpoint at all: no challenge is sent.
    let handshakes = source.runner.peers().control_stats().refused_handshakes;
    assert_eq!(
        forge_stream(&source, b"\xff\xfe not an endpoint", None),
        (None, true)
    );
    crate::wait_until("the handshake refusal", Duration::from_secs(10), || {
        source.runner.peers().control_stats().refused_handshakes == handshakes + 1
    });
    assert_eq!(source.runner.peers().control_stats().streams_opened, 1);
    // The target's own stream still carries its restores.
    let taken = target.runner.peers().control_stats().stream_writes_taken;
    let keys = [1, 2, 3, 4, 5];
    let result = fetch_on_hint(&mut target, "after", &hint(&source, &keys), &keys);
    assert_restored(&target, &source, &result, &keys);
    assert_eq!(
        target.runner.peers().control_stats().stream_writes_taken,
        taken + 1
    );
    assert_eq!(
        target.runner.peers().control_stats().stream_writes_refused,
        0
    );
    target.runner.check_invariants().unwrap();
    source.runner.check_invariants().unwrap();
}

/// A hand-driven member's listener, its endpoint naming `key` (so a hint
/// to it is followed under the default keyless policy).
fn member_listener(key: &StaticKey) -> (TcpListener, ControlEndpoint) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = ControlEndpoint::parse(&format!("tcp://{}", listener.local_addr().unwrap()))
        .unwrap()
        .with_key(Some(key.public()));
    (listener, endpoint)
}

/// The next session or data stream the runner dials to `listener`, as
/// the member at `endpoint` holding `key`.
fn accept_dialed(listener: &TcpListener, endpoint: &ControlEndpoint, key: &StaticKey) -> Dialed {
    ControlClient::accept(
        listener,
        Some(SECRET),
        (endpoint.clone(), Incarnation::generate()),
        key,
        Duration::from_secs(10),
    )
    .unwrap()
}

/// Reads `session` until the target asks for a write: acknowledges its
/// metadata (a route that is not one-copy, so its bytes come on the data
/// stream), keeps the record key it advertised, and returns the write's
/// operation and granted elements.
fn next_start_write(
    session: &mut ControlClient,
    as_source: &ControlEndpoint,
    record_key: &mut Option<[u8; 32]>,
) -> (OpHandle, usize) {
    loop {
        let message = session
            .recv(Duration::from_secs(10))
            .unwrap()
            .expect("the target asks for a write");
        match message.body {
            Body::TargetMetadata { doorbell, .. } => {
                *record_key = Some(doorbell.expect("a doorbell advert").key);
                let ack = Message {
                    header: Header {
                        sender: Incarnation::generate(),
                        route_generation: RouteGeneration(0),
                        sender_endpoint: as_source.clone(),
                    },
                    body: Body::TargetMetadataAck {
                        op_handle: None,
                        one_copy: false,
                        device: false,
                    },
                };
                session.send(&ack).unwrap();
            }
            Body::StartWrite {
                op_handle,
                destinations,
                ..
            } => return (op_handle, destinations.iter().map(ElementRuns::len).sum()),
            _ => {}
        }
    }
}

/// A member the router hints as the source takes the target's session and
/// the data stream the target dials (which proves the session's key), and
/// then answers on the stream with frames a source must not be able to
/// land: headers sealed under a key of its own, for an operation never
/// granted, claiming more keys than were asked, with a payload one byte
/// short, one element long or empty. Each is read past (the stream keeps
/// its framing) and counted refused; the write's own frame then lands and
/// completes it with exactly its bytes; replayed, it lands nowhere, neither
/// for its own finished write nor for the next. A frame claiming 2⁶⁴ − 1
/// bytes, and the member hanging up, end only that stream: the target goes
/// on restoring from an honest source byte-exact.
#[test]
fn forged_frames_on_a_hinted_sources_data_stream_are_refused() {
    let _serial = crate::serial();
    let forger_key = StaticKey::generate().unwrap();
    let (listener, forger) = member_listener(&forger_key);
    let mut options = through_tcp();
    options.data_stream = DataStream::On;
    let mut target = node_with(&options, 16, Duration::from_secs(20));
    let pool = target.runner.pool("kv").unwrap();
    let fetch = |target: &mut Node, request: &str, keys: &[u64]| {
        let request = RequestId(request.into());
        target
            .runner
            .hints()
            .submit(request.clone(), &crate::nodes::hint_to(&forger, keys));
        let scoped: Vec<ScopedKey> = keys.iter().map(|k| key(target.ns, *k)).collect();
        target
            .runner
            .hints()
            .fetch(&request, &scoped, &[pool])
            .unwrap()
    };
    let first = fetch(&mut target, "first", &[0, 1]);
    // The session and the stream, in whichever order they come (the stream
    // is dialed beside the metadata, and again on the acknowledgement).
    let (mut session, mut stream) = (None, None);
    while session.is_none() {
        match accept_dialed(&listener, &forger, &forger_key) {
            Dialed::Session(s) => session = Some(*s),
            Dialed::DataStream(d) => stream = Some(d),
        }
    }
    let mut session = session.unwrap();
    let mut record_key = None;
    let (op, elements) = next_start_write(&mut session, &forger, &mut record_key);
    let record_key = record_key.expect("the metadata came before the write");
    let mut stream = match stream {
        Some(stream) => stream,
        None => match accept_dialed(&listener, &forger, &forger_key) {
            Dialed::DataStream(d) => d,
            Dialed::Session(_) => panic!("a second session instead of a data stream"),
        },
    };
    assert_eq!(stream.claim(), target.runner.peers().endpoint().unwrap());
    assert!(
        stream.proves(&record_key),
        "the target proves its session's key"
    );
    assert!(!stream.proves(&[7u8; 32]));
    // It asked for sealed records (a cluster secret is set): the member
    // seals its frames as an honest source does.
    assert!(stream.asks_sealed());
    stream.keyed(&record_key).unwrap();
    assert_eq!(elements, 2);
    let total = (2 * BLOCK) as u64;
    let honest: Vec<u8> = (0..total).map(|i| (i * 7 % 251) as u8).collect();
    let forged = vec![0xEEu8; total as usize + BLOCK];
    let seal =
        |key: &[u8; 32], op: OpHandle, keys: u32| seal_write_header(key, op, keys, 0, 1).unwrap();
    let refused = |target: &Node| target.runner.peers().control_stats().stream_writes_refused;
    let attempts: [(&str, u64, [u8; 64]); 6] = [
        ("sealed under its own key", total, seal(&[9u8; 32], op, 2)),
        (
            "an operation never granted",
            total,
            seal(&record_key, OpHandle(op.0 + 1000), 2),
        ),
        ("more keys than asked", total, seal(&record_key, op, 3)),
        ("one byte short", total - 1, seal(&record_key, op, 2)),
        (
            "one element long",
            total + BLOCK as u64,
            seal(&record_key, op, 2),
        ),
        ("empty", 0, seal(&record_key, op, 2)),
    ];
    for (i, (what, len, header)) in attempts.iter().enumerate() {
        stream
            .send_frame(*len, header, &forged[..*len as usize])
            .unwrap();
        crate::wait_until(what, Duration::from_secs(10), || {
            refused(&target) == i as u64 + 1
        });
    }
    assert_eq!(target.runner.peers().control_stats().stream_writes_taken, 0);
    let own = seal(&record_key, op, 2);
    stream.send_frame(total, &own, &honest).unwrap();
    let result = wait(&mut target.runner, first);
    let landed: Vec<u8> = result
        .entries
        .iter()
        .flat_map(|(key, entry)| {
            assert!(entry.is_success(), "{key:?}: {entry:?}");
            target
                .runner
                .read_claimed(entry.release.unwrap(), 0)
                .unwrap()
        })
        .collect();
    assert!(landed == honest, "exactly the write's own bytes landed");
    assert_eq!(target.runner.peers().control_stats().stream_writes_taken, 1);
    // Replayed: for the finished write, then in place of the next one.
    stream
        .send_frame(total, &own, &forged[..total as usize])
        .unwrap();
    let second = fetch(&mut target, "second", &[2]);
    let (next, elements) = next_start_write(&mut session, &forger, &mut None);
    assert_eq!(elements, 1);
    stream
        .send_frame(BLOCK as u64, &own, &forged[..BLOCK])
        .unwrap();
    crate::wait_until("both replays refused", Duration::from_secs(10), || {
        refused(&target) == 8
    });
    stream
        .send_frame(BLOCK as u64, &seal(&record_key, next, 1), &honest[..BLOCK])
        .unwrap();
    let result = wait(&mut target.runner, second);
    let (_, entry) = &result.entries[0];
    assert!(entry.is_success(), "{entry:?}");
    let bytes = target
        .runner
        .read_claimed(entry.release.unwrap(), 0)
        .unwrap();
    assert!(bytes == honest[..BLOCK]);
    assert_eq!(target.runner.peers().control_stats().stream_writes_taken, 2);
    // A frame no write could be, then the member hangs up.
    stream.send_frame(u64::MAX, &own, &forged).unwrap();
    drop(stream);
    drop(session);
    crate::wait_until("the endless frame refused", Duration::from_secs(10), || {
        refused(&target) == 9
    });
    target.runner.check_invariants().unwrap();
    let mut source = member("tcp,self", 16);
    let keys = [3, 4, 5];
    stock(&mut source, &keys);
    let result = fetch_on_hint(&mut target, "honest", &hint(&source, &keys), &keys);
    assert_restored(&target, &source, &result, &keys);
    assert_eq!(refused(&target), 9);
    target.runner.check_invariants().unwrap();
}

/// A flood of data streams claiming targets the source has no route from
/// (held while a route might still come) is bounded by the waiting places
/// per address (an unproven stream never takes a session's place; a newer
/// one displaces the oldest) and by the handshake deadline: every one is
/// refused (displaced, or dropped at the deadline), the source's sockets
/// return to what its honest peers hold, and the target's own stream keeps
/// carrying its restores byte-exact.
#[test]
fn a_flood_of_unbound_data_streams_is_bounded_and_expires() {
    let _serial = crate::serial();
    let mut options = through_tcp();
    options.limits.handshake_timeout = Duration::from_secs(1);
    let (source, mut target) = streaming_pair(&options);
    let honest_sockets = source.runner.peers().stats().open_sockets;
    const FLOOD: u64 = 40;
    let forged: Vec<_> = (0..FLOOD)
        .map(|i| {
            open_forged_stream(
                &source,
                format!("tcp://127.0.0.1:{}", 1000 + i).as_bytes(),
                None,
            )
        })
        .collect();
    crate::wait_until(
        "every forged stream to be refused",
        Duration::from_secs(20),
        || {
            let stats = source.runner.peers().control_stats();
            stats.streams_refused + stats.refused_connections + stats.refused_handshakes >= FLOOD
        },
    );
    let control = source.runner.peers().control_stats();
    assert!(
        control.evicted_handshakes > 0,
        "newer streams displace older ones past the per-address cap: {control:?}"
    );
    assert_eq!(control.refused_connections, 0, "no session's place taken");
    assert_eq!(source.runner.peers().control_stats().streams_opened, 1);
    drop(forged);
    crate::wait_until(
        "the source's sockets to return to its honest peers'",
        Duration::from_secs(10),
        || source.runner.peers().stats().open_sockets == honest_sockets,
    );
    let taken = target.runner.peers().control_stats().stream_writes_taken;
    let keys = [1, 2, 3];
    let result = fetch_on_hint(&mut target, "after", &hint(&source, &keys), &keys);
    assert_restored(&target, &source, &result, &keys);
    assert_eq!(
        target.runner.peers().control_stats().stream_writes_taken,
        taken + 1
    );
    source.runner.check_invariants().unwrap();
}

/// Whoever can open a runner's files (its user, on its host) can write its
/// doorbell's slots, as it can its pools: a record not sealed with the key
/// of the session the operation went out on is refused (had one been taken,
/// its claim of no key landed would fail the restore), and every restore
/// completes byte-exact on the source's own record or its `write_done`,
/// whichever the target sees first.
#[test]
fn forged_doorbell_records_are_refused() {
    let _serial = crate::serial();
    let keys: Vec<u64> = (0..24).collect();
    let (source, mut target, files) = same_host_pair_and_doorbells(&keys);
    for k in &keys {
        forge_records(&files, *k);
        restore_and_release(&mut target, &source, &format!("forged-doorbell-{k}"), *k);
    }
    // Every write rang over a forged record (the source counts a ring just
    // after writing it, so the target may have finished first), and the
    // target read forged records and refused them. Whether the target then
    // took the source's own record or its `write_done` is a race it runs
    // only while it spins; a target on a contended host sleeps on its
    // socket instead, so the count of records taken is not asserted here
    // (`doorbell::tests::a_record_is_taken_only_as_its_sessions_reply`
    // covers taking). Either way the restores above were byte-exact.
    crate::wait_until(
        "the source to count its rings",
        Duration::from_secs(5),
        || source.runner.peers().control_stats().doorbells_rung == keys.len() as u64,
    );
    let stats = target.runner.peers().control_stats();
    assert!(stats.doorbells_refused >= 1, "{stats:?}");
    assert!(
        stats.doorbells_taken <= keys.len() as u64,
        "more records taken than operations: {stats:?}"
    );
    target.runner.check_invariants().unwrap();
}

/// Whoever can open a runner's files can also write the mailboxes in its
/// doorbell file, where it posts requests for its same-host sources. Before
/// each restore the forger fills every mailbox with garbage, publishes an
/// honest request of an earlier operation again, or leaves every mailbox
/// half written. The source takes nothing it should not: every restore is
/// byte-exact and written once, no duplicate request reaches the source's
/// core (it would refuse a finished operation's), garbage is counted as
/// refused, and every request taken from a mailbox had its control copy
/// dropped on arrival (none handled twice, none lost).
#[test]
fn forged_mailbox_records_are_refused() {
    let _serial = crate::serial();
    let keys: Vec<u64> = (0..16).collect();
    let (source, mut target, files) = same_host_pair_and_doorbells(&keys);
    let refused = |source: &Node| {
        source
            .runner
            .peers()
            .control_stats()
            .mailbox_requests_refused
    };
    for k in &keys {
        // The first restore builds the route the mailbox is read on.
        let forgery = [
            MailboxForgery::Garbage,
            MailboxForgery::Replay,
            MailboxForgery::Torn,
        ][*k as usize % 3];
        if *k > 0 {
            let was = refused(&source);
            forge_mailboxes(&files, forgery, *k);
            // The source looks at its mailbox every turn, and turns at
            // least once a second however idle it is.
            if matches!(forgery, MailboxForgery::Garbage) {
                crate::wait_until(
                    "the source to refuse the garbage",
                    Duration::from_secs(10),
                    || refused(&source) > was,
                );
            }
        }
        restore_and_release(&mut target, &source, &format!("forged-mailbox-{k}"), *k);
    }
    let posted = target
        .runner
        .peers()
        .control_stats()
        .mailbox_requests_posted;
    assert!(posted >= 1, "the target posted requests to the mailbox");
    crate::wait_until(
        "every request taken early to have its copy dropped",
        Duration::from_secs(5),
        || {
            let stats = source.runner.peers().control_stats();
            stats.early_copies_dropped == stats.mailbox_requests_taken
        },
    );
    let stats = source.runner.peers().control_stats();
    assert!(stats.mailbox_requests_taken <= posted, "{stats:?}");
    let counters = source.runner.peers().stats().counters;
    assert_eq!(counters.refused, 0, "no request reached the core twice");
    assert_eq!(
        counters.keys_sent,
        keys.len() as u64,
        "each key written once"
    );
    source.runner.check_invariants().unwrap();
    target.runner.check_invariants().unwrap();
}

/// A member that learned a destination's UCX worker address (every source
/// it dials receives it) floods it with write messages while it restores
/// from an honest source over tcp: records for every operation number it
/// may have, sealed under a key the forger made up, carrying bytes of its
/// own, and headers of every wrong size. None is taken: every restore is
/// byte-exact from the honest source's own message, the forged ones are
/// counted as refused, and the destination keeps serving.
#[test]
fn forged_write_messages_are_refused() {
    use kvcr_ucx::{Context, ContextConfig, WorkerAddress};
    let _serial = crate::serial();
    let mut options = through_tcp();
    // Write messages through UCX are what is forged here: no data stream.
    options.data_stream = DataStream::Off;
    let mut source = node_with(&options, 16, Duration::from_secs(5));
    let mut target = node_with(&options, 16, Duration::from_secs(5));
    let all: Vec<u64> = (0..16).collect();
    stock(&mut source, &all);
    let address =
        WorkerAddress::from_bytes(target.runner.peers().worker_address().unwrap()).unwrap();
    let context = Context::with_config(&ContextConfig::new().loopback_tls("tcp,self")).unwrap();
    let worker = context.create_worker().unwrap();
    let endpoint = worker.connect(&address).unwrap();
    let forged_bytes = context.register_vec(vec![0xab; 4 * BLOCK]).unwrap();
    let id = kvcr_runner::WRITE_MESSAGE_ID;
    let mut sent = Vec::new();
    let mut rounds = 0;
    for round in 0..4u64 {
        let keys: Vec<u64> = (4 * round..4 * round + 4).collect();
        let request = format!("flooded-{round}");
        let the_hint = hint(&source, &keys);
        target
            .runner
            .hints()
            .submit(RequestId(request.clone()), &the_hint);
        let scoped: Vec<ScopedKey> = keys.iter().map(|k| key(target.ns, *k)).collect();
        let pool = target.runner.pool("kv").unwrap();
        let op = target
            .runner
            .hints()
            .fetch(&RequestId(request), &scoped, &[pool])
            .unwrap();
        // Records for the likely operation numbers (a record is op, key
        // count, version, then a tag), and every wrong header size.
        for forged_op in 0..64u64 {
            let mut header = [0u8; 64];
            header[..8].copy_from_slice(&forged_op.to_le_bytes());
            header[8..12].copy_from_slice(&4u32.to_le_bytes());
            header[12] = 1;
            header[16..48].fill(forged_op as u8 ^ 0x5a);
            sent.push(
                endpoint
                    .send_message(id, &header, &[(&forged_bytes, 0, 4 * BLOCK)])
                    .unwrap(),
            );
        }
        for len in [0usize, 8, 63, 65, 200] {
            let header = vec![1u8; len];
            sent.push(
                endpoint
                    .send_message(id, &header, &[(&forged_bytes, 0, BLOCK)])
                    .unwrap(),
            );
        }
        while worker.progress() > 0 {}
        let result = wait(&mut target.runner, op);
        // Every restored byte is the honest source's.
        for ((_, entry), &k) in result.entries.iter().zip(&keys) {
            assert!(entry.is_success(), "round {round}, key {k}: {entry:?}");
            let release = entry.release.unwrap();
            let bytes = target.runner.read_claimed(release, 0).unwrap();
            let at = k as usize * BLOCK;
            assert!(
                bytes == source.host[at..at + BLOCK],
                "round {round}, key {k}: bytes differ"
            );
            assert_eq!(target.runner.release(&[release]), vec![true]);
        }
        rounds += 1;
    }
    // Let the forger's last messages arrive and be judged.
    crate::wait_until(
        "the forger's sends to leave",
        Duration::from_secs(10),
        || {
            worker.progress();
            sent.iter().all(kvcr_ucx::Completion::is_done)
        },
    );
    crate::wait_until(
        "the forged messages to be judged",
        Duration::from_secs(10),
        || target.runner.peers().control_stats().write_messages_refused >= 64,
    );
    // Each round's write is 4 keys, in parts of the default size.
    let parts = (4 * BLOCK as u64).div_ceil(PeerOptions::DEFAULT_WRITE_MESSAGE_PART_BYTES);
    let stats = target.runner.peers().control_stats();
    assert_eq!(
        stats.write_messages_taken,
        rounds * parts,
        "only the honest source's"
    );
    assert_eq!(
        source.runner.peers().control_stats().write_messages_sent,
        rounds * parts
    );
    target.runner.check_invariants().unwrap();
    drop(endpoint);
}

/// While strangers hold connections open, a member floods probes and
/// ungranted writes without reading a reply, and another stalls mid-frame, an
/// honest destination restores every page byte-exact; the source's per-peer
/// state stays within its bounds.
#[rstest]
#[case::shm("posix,cma,self")]
#[case::tcp("tcp,self")]
fn honest_restores_complete_during_floods(#[case] tls: &str) {
    let _serial = crate::serial();
    let mut source = member(tls, 48);
    let all: Vec<u64> = (0..48).collect();
    stock(&mut source, &all);
    let source_endpoint = source.runner.peers().endpoint().unwrap().clone();
    let port = source_endpoint.port();

    // Strangers: 64 connections from one address that never handshake.
    let strangers: Vec<std::net::TcpStream> = (0..64)
        .filter_map(|_| {
            let socket = socket2_like_connect("127.0.0.2", port)?;
            Some(socket)
        })
        .collect();
    assert!(!strangers.is_empty());
    // The cap is judged as they arrive (before the handshake timeout frees
    // any place): all but the per-address allowance of waiting connections
    // are displaced by newer ones from their address.
    crate::wait_until(
        "the strangers past the per-address cap to be displaced",
        Duration::from_secs(10),
        || source.runner.peers().control_stats().evicted_handshakes >= 64 - 16,
    );

    // A member flooding requests and never reading.
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let flood = {
        let (stop, sent) = (Arc::clone(&stop), Arc::clone(&sent));
        let to = source_endpoint.clone();
        let ns = source.ns;
        std::thread::spawn(move || flood_requests(&to, ns, &stop, &sent))
    };
    // The restores below run during the flood, not before it got going.
    crate::wait_until("the flood to get going", Duration::from_secs(10), || {
        sent.load(Ordering::Relaxed) > 100
    });
    // A member that starts a large frame and stalls.
    let mut staller = ControlClient::connect(
        &source_endpoint,
        Some(SECRET),
        ControlEndpoint::parse("tcp://127.0.0.4:1").unwrap(),
        Incarnation::generate(),
    )
    .unwrap();
    staller.send_plain(&(1u32 << 20).to_be_bytes()).unwrap();
    staller.send_plain(&[0u8; 1000]).unwrap();

    // Three rounds, 16 different pages each, all through the peer path.
    let mut target = member(tls, 48);
    for keys in all.chunks(16) {
        let request = format!("honest-{}", keys[0]);
        let result = fetch_on_hint(&mut target, &request, &hint(&source, keys), keys);
        assert_restored(&target, &source, &result, keys);
    }
    assert_eq!(target.runner.peers().stats().counters.keys_received, 48);
    stop.store(true, Ordering::Relaxed);
    flood.join().unwrap();
    let sizes = source.runner.peers().state_sizes();
    assert!(sizes.fences <= MAX_FENCES_PER_TARGET, "{sizes:?}");
    assert!(sizes.routes <= 2, "{sizes:?}");
    source.runner.check_invariants().unwrap();
    target.runner.check_invariants().unwrap();
    drop(strangers);
}

/// A TCP connection from a chosen loopback address (a second "host").
fn socket2_like_connect(from: &str, port: u16) -> Option<std::net::TcpStream> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ok()?;
    rt.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().ok()?;
        socket.bind(format!("{from}:0").parse().ok()?).ok()?;
        let stream = socket
            .connect(format!("127.0.0.1:{port}").parse().ok()?)
            .await
            .ok()?;
        stream.into_std().ok()
    })
}

/// Sends probes and ungranted writes to `to` as fast as the session takes
/// them, never reading, until `stop`; counts the frames that went out in
/// `sent`.
fn flood_requests(to: &ControlEndpoint, ns: NamespaceId, stop: &AtomicBool, sent: &AtomicU64) {
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut client) = ControlClient::connect(
            to,
            Some(SECRET),
            ControlEndpoint::parse("tcp://127.0.0.3:1").unwrap(),
            Incarnation::generate(),
        ) else {
            continue;
        };
        let header = Header {
            sender: Incarnation::generate(),
            route_generation: RouteGeneration(0),
            sender_endpoint: to.clone(),
        };
        for op in 1.. {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            let body = if op % 2 == 0 {
                Body::WriteProbe {
                    op_handle: OpHandle(op),
                    source_incarnation: None,
                }
            } else {
                Body::StartWrite {
                    lead_elements: 0,
                    op_handle: OpHandle(op),
                    remaining_timeout_ms: 5000,
                    source_incarnation: None,
                    namespace: ns,
                    keys: vec![BlockKey::from_u64(op % 16)],
                    destinations: vec![
                        vec![ElementRef {
                            region: RegionId(0),
                            index: op,
                        }]
                        .into(),
                    ],
                }
            };
            let message = Message {
                header: header.clone(),
                body,
            };
            if client.send(&message).is_err() {
                break;
            }
            sent.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A router hint naming a process that is not a member makes the rank dial
/// it, but all it ever receives is the first handshake message: no worker
/// address, no pool base, no rkey.
#[test]
fn a_hint_to_a_stranger_reveals_nothing() {
    let _serial = crate::serial();
    let stranger = TcpListener::bind("127.0.0.1:0").unwrap();
    let stranger_endpoint =
        ControlEndpoint::parse(&format!("tcp://{}", stranger.local_addr().unwrap())).unwrap();
    let heard = std::thread::spawn(move || {
        let (mut stream, _) = stranger.accept().unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(3)))
            .unwrap();
        let mut heard = Vec::new();
        let _ = stream.read_to_end(&mut heard);
        heard
    });
    let mut target = node_with(
        &options("posix,cma,self", Some(SECRET)),
        8,
        Duration::from_millis(500),
    );
    let the_hint = FetchHint {
        source: stranger_endpoint.with_key(Some(StaticKey::generate().unwrap().public())),
        block_hashes: vec![BlockKey::from_u64(1)],
        mode: kvcr_contracts::hint::FetchMode::Copy,
        action_id: None,
    };
    let result = fetch_on_hint(&mut target, "stranger", &the_hint, &[1]);
    assert_nothing_restored(&target, &result);
    let heard = heard.join().unwrap();
    // Preamble, a 2-byte length, and 48 bytes: an ephemeral key and a tag.
    assert_eq!(&heard[..8], b"KVCR-N2\0");
    assert_eq!(heard.len(), 8 + 2 + 48, "{heard:?}");
    target.runner.check_invariants().unwrap();
}

/// A real destination's UCX blobs, from a worker that is never progressed
/// (it lives as long as this value).
pub(crate) struct SilentDestination {
    registration: kvcr_ucx::Registration<'static>,
    pub(crate) address: Vec<u8>,
    pub(crate) rkey: Vec<u8>,
    _worker: kvcr_ucx::Worker,
}

impl SilentDestination {
    pub(crate) fn new(tls: &str) -> Self {
        use kvcr_ucx::{AnonOptions, Context, ContextConfig};
        let context = Context::with_config(&ContextConfig::new().loopback_tls(tls)).unwrap();
        let worker = context.create_worker().unwrap();
        let registration = context
            .register_anon(BLOCK * 4, AnonOptions::new())
            .unwrap();
        Self {
            address: worker.address().unwrap().as_bytes().to_vec(),
            rkey: registration.pack_rkey().unwrap().as_bytes().to_vec(),
            registration,
            _worker: worker,
        }
    }

    /// Its one region, advertised as `label` with `rkey`.
    pub(crate) fn advert(
        &self,
        label: String,
        rkey: Vec<u8>,
    ) -> kvcr_contracts::protocol::RegionAdvert {
        kvcr_contracts::protocol::RegionAdvert {
            id: RegionId(0),
            label,
            base: self.registration.as_ptr() as u64,
            element_size: BLOCK as u64,
            stride: BLOCK as u64,
            count: 4,
            rkey,
        }
    }
}

/// Metadata advertising `region` at `worker_address`, as a member sends it
/// (the header's claims are the channel's to overwrite).
pub(crate) fn metadata_from(
    source: &Node,
    worker_address: Vec<u8>,
    region: kvcr_contracts::protocol::RegionAdvert,
) -> Message {
    Message {
        header: Header {
            sender: Incarnation::generate(),
            route_generation: RouteGeneration(0),
            sender_endpoint: source.runner.peers().endpoint().unwrap().clone(),
        },
        body: Body::TargetMetadata {
            worker_address,
            regions: vec![region],
            shared_memory: None,
            doorbell: None,
            device_regions: Vec::new(),
        },
    }
}

/// A fresh honest member restores keys 0..4 of `source` byte-exact.
pub(crate) fn a_member_restores_from(source: &Node, tls: &str, request: &str) {
    let mut friend = member(tls, 8);
    let keys = [0, 1, 2, 3];
    let result = fetch_on_hint(&mut friend, request, &hint(source, &keys), &keys);
    assert_restored(&friend, source, &result, &keys);
}

/// A member sends worker addresses and rkeys that are correctly framed and
/// sealed but mutated: the 16 bytes starting `0x0f` that made UCX 1.13 abort
/// in `ucp_address_unpack`, truncations, and single-bit flips of a real
/// address's header and of a real rkey (the fuzz target `ucx_envelope` covers
/// the rest), and valid blobs of a destination that never progresses,
/// replacing each other. A flipped rkey fails after the endpoint exists:
/// that endpoint is closed without waiting (a flush-mode close waited a
/// second per blob on tcp, and the honest fetch below timed out). The
/// runner (this very process) must not abort; every route it could not
/// validate is dropped, and an honest destination still restores
/// byte-exact.
#[rstest]
#[case::shm("posix,cma,self")]
#[case::tcp("tcp,self")]
fn mutated_ucx_blobs_never_reach_ucx(#[case] tls: &str) {
    let _serial = crate::serial();
    // Every blob a route change: each must reach the validator (and UCX),
    // not the route budget.
    let mut generous = options(tls, Some(SECRET));
    generous.route_budget.burst = u32::MAX;
    let mut source = node_with(&generous, 8, Duration::from_secs(5));
    stock(&mut source, &[0, 1, 2, 3]);
    let source_endpoint = source.runner.peers().endpoint().unwrap().clone();

    // A real destination's blobs to mutate.
    let destination = SilentDestination::new(tls);
    let (address, rkey) = (destination.address.clone(), destination.rkey.clone());
    let mut blobs: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    let mut abort_case = vec![0x0f];
    abort_case.extend_from_slice(&[0u8; 15]);
    blobs.push((abort_case, rkey.clone()));
    for cut in [1, 8, address.len() / 2, address.len() - 1] {
        blobs.push((address[..cut].to_vec(), rkey.clone()));
    }
    // Flips in the header, flags and worker id only: a flip further in can
    // turn a transport address into another host's, and these tests reach
    // loopback only.
    for i in 0..address.len().min(10) {
        let mut flipped = address.clone();
        flipped[i] ^= 1 << (i % 8);
        blobs.push((flipped, rkey.clone()));
    }
    for i in 0..rkey.len().min(24) {
        let mut flipped = rkey.clone();
        flipped[i] ^= 1 << (i % 8);
        blobs.push((address.clone(), flipped));
    }
    // And the real pair, again and again: each replaces the route (one per
    // session) to a destination that never progresses.
    for _ in 0..8 {
        blobs.push((address.clone(), rkey.clone()));
    }
    let mut client = ControlClient::connect(
        &source_endpoint,
        Some(SECRET),
        ControlEndpoint::parse("tcp://127.0.0.5:1").unwrap(),
        Incarnation::generate(),
    )
    .unwrap();
    for (worker_address, rkey) in &blobs {
        let region = destination.advert("victim".into(), rkey.clone());
        client
            .send(&metadata_from(&source, worker_address.clone(), region))
            .unwrap();
        // Each is answered (acknowledged or not) before the next replaces it.
        while let Some(reply) = client.recv(Duration::from_millis(20)).unwrap() {
            assert!(
                matches!(reply.body, Body::TargetMetadataAck { .. }),
                "{reply:?}"
            );
        }
    }
    // Still alive, still serving.
    a_member_restores_from(&source, tls, "after-blobs");
    let counters = source.runner.peers().stats().counters;
    assert!(
        counters.refused >= 1,
        "the blobs UCX could not take were counted"
    );
    assert_eq!(counters.routes_refused, 0, "{counters:?}");
    source.runner.check_invariants().unwrap();
}

/// Lines of this process's memory map (what `vm.max_map_count` bounds).
pub(crate) fn mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .count()
}

/// Sends `rounds` metadata adverts of a real destination's worker and
/// region to `source` over one member session per name in `names` (a
/// member may claim any name), each with a new label (so each is a route
/// change), draining replies between them. The destination's worker is
/// never progressed.
pub(crate) fn churn_routes(source: &Node, tls: &str, names: &[&str], rounds: usize) {
    let destination = SilentDestination::new(tls);
    let source_endpoint = source.runner.peers().endpoint().unwrap().clone();
    for name in names {
        let mut client = ControlClient::connect(
            &source_endpoint,
            Some(SECRET),
            ControlEndpoint::parse(name).unwrap(),
            Incarnation::generate(),
        )
        .unwrap();
        for round in 0..rounds {
            let region = destination.advert(format!("churn-{round}"), destination.rkey.clone());
            client
                .send(&metadata_from(source, destination.address.clone(), region))
                .unwrap();
            while client.recv(Duration::from_millis(5)).unwrap().is_some() {}
        }
    }
}

/// A member that changes its route in a loop (each advert unlike the last,
/// over one authenticated session) gets its burst of routes and then one
/// a second: the rest are refused and counted, the source's memory map
/// does not grow with them, and an honest destination still restores
/// byte-exact.
#[rstest]
#[case::shm("posix,cma,self")]
#[case::tcp("tcp,self")]
fn route_churn_is_rate_limited(#[case] tls: &str) {
    let _serial = crate::serial();
    let mut source = member(tls, 8);
    stock(&mut source, &[0, 1, 2, 3]);
    let budget = options(tls, Some(SECRET)).route_budget;
    let adverts: u64 = 200;
    let mappings_before = mappings();
    // Not a threshold: the budget's bound grows with the time it had.
    #[allow(clippy::disallowed_methods)]
    let started = std::time::Instant::now();
    churn_routes(&source, tls, &["tcp://127.0.0.6:1"], adverts as usize);
    // However late the source handles them: by then at most its burst and
    // one per second since the first were built, every other one refused.
    let refused_enough = || {
        let elapsed_ns = u64::try_from(started.elapsed().as_nanos()).unwrap();
        let admitted_at_most = u64::from(budget.burst) + elapsed_ns / budget.refill_ns + 1;
        source.runner.peers().stats().counters.routes_refused + admitted_at_most >= adverts
    };
    crate::wait_until(
        "the route changes past the budget to be refused",
        Duration::from_secs(30),
        refused_enough,
    );
    let grown = mappings().saturating_sub(mappings_before);
    assert!(
        grown < 64,
        "{grown} more mappings after {adverts} route changes"
    );
    a_member_restores_from(&source, tls, "after-churn");
    source.runner.check_invariants().unwrap();
}

/// A source short of memory mappings builds no route through UCX (UCX
/// would keep some of its mappings until the runner stops): the target is
/// answered at once that it has none and restores nothing, counted; a
/// same-host target whose pools the source maps itself is not affected.
#[rstest]
#[case::mapped(true)]
#[case::through_ucx(false)]
fn no_ucx_route_while_short_of_mappings(#[case] mapped: bool) {
    let _serial = crate::serial();
    let mut starved = options("posix,cma,self", Some(SECRET));
    // Any process holds more than one mapping.
    starved.ucx_route_mapping_limit = 1;
    let mut source = node_with(&starved, 8, Duration::from_secs(5));
    stock(&mut source, &[0, 1]);
    let mut target_options = options("posix,cma,self", Some(SECRET));
    target_options.same_host_mapping = mapped;
    let mut target = node_with(&target_options, 8, Duration::from_secs(5));
    let result = fetch_on_hint(&mut target, "starved", &hint(&source, &[0, 1]), &[0, 1]);
    let counters = source.runner.peers().stats().counters;
    if mapped {
        assert_restored(&target, &source, &result, &[0, 1]);
        assert_eq!((counters.one_copy_routes, counters.routes_refused), (1, 0));
    } else {
        assert_nothing_restored(&target, &result);
        // Refused at least once: a target left unacknowledged re-sends its
        // metadata on its tick, and each is refused while still short.
        assert_eq!(counters.ucx_routes, 0);
        assert!(counters.routes_refused >= 1, "{counters:?}");
    }
    source.runner.check_invariants().unwrap();
    target.runner.check_invariants().unwrap();
}

/// Members churning routes under many names, each name within its budget,
/// to a worker that never progresses: UCX 1.13 on the source then holds
/// wire-up sends into that worker's full queue for good, and its worker
/// can no longer be armed. The source still serves an honest destination,
/// and stops when dropped (its peer thread spun on the unarmable worker,
/// never took another message or the stop, and the drop hung).
#[test]
fn a_source_churned_under_many_names_keeps_serving_and_stops() {
    let _serial = crate::serial();
    // All of it on its own thread, bounded: with the spinning peer thread
    // the source answered nothing (its sessions run on that thread), so a
    // member's handshake, the honest fetch and the drop each hung.
    let (done_tx, done) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let tls = "posix,cma,self";
        let mut source = member(tls, 8);
        stock(&mut source, &[0, 1, 2, 3]);
        let burst = options(tls, Some(SECRET)).route_budget.burst as usize;
        let names: Vec<String> = (1..=40).map(|i| format!("tcp://127.0.0.7:{i}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        churn_routes(&source, tls, &names, burst);
        a_member_restores_from(&source, tls, "after-many-names");
        source.runner.check_invariants().unwrap();
        drop(source);
        let _ = done_tx.send(());
    });
    assert!(
        done.recv_timeout(Duration::from_secs(120)).is_ok(),
        "the churned source did not serve and stop within two minutes (or a check failed: see above)"
    );
}

/// An on-path outsider alters a data stream's payload (plain TCP) while
/// its sealed header, with the write's digest, stays the source's: the
/// destination hashes the landed bytes before Success, so both keys fail
/// `DigestMismatch`, are counted, and are never served; the same frame
/// unaltered lands byte-exact.
#[test]
fn an_altered_data_stream_payload_never_succeeds() {
    let _serial = crate::serial();
    let source_key = StaticKey::generate().unwrap();
    let (listener, source) = member_listener(&source_key);
    let mut options = through_tcp();
    options.data_stream = DataStream::On;
    let mut target = node_with(&options, 16, Duration::from_secs(20));
    let pool = target.runner.pool("kv").unwrap();
    let fetch = |target: &mut Node, request: &str, keys: &[u64]| {
        let request = RequestId(request.into());
        let hint = crate::nodes::hint_to(&source, keys);
        target.runner.hints().submit(request.clone(), &hint);
        let scoped: Vec<ScopedKey> = keys.iter().map(|k| key(target.ns, *k)).collect();
        let op = target.runner.hints().fetch(&request, &scoped, &[pool]);
        op.unwrap()
    };
    let total = 2 * BLOCK;
    let honest: Vec<u8> = (0..total).map(|i| (i * 7 % 251) as u8).collect();
    let digest = kvcr_sys::combine_digests(&[
        kvcr_sys::digest::digest_bytes(&honest[..BLOCK]),
        kvcr_sys::digest::digest_bytes(&honest[BLOCK..]),
    ]);
    let mut altered = honest.clone();
    altered[BLOCK + 17] ^= 0x40;
    let (mut session, mut stream, mut record_key) = (None, None, None);
    for (round, payload) in [(0u64, &altered), (1, &honest)] {
        let keys = [2 * round, 2 * round + 1];
        let pending = fetch(&mut target, &format!("round-{round}"), &keys);
        // The session and the stream, dialed for the first round.
        while session.is_none() || stream.is_none() {
            match accept_dialed(&listener, &source, &source_key) {
                Dialed::Session(s) => session = Some(*s),
                Dialed::DataStream(d) => stream = Some(d),
            }
        }
        let (session, stream) = (session.as_mut().unwrap(), stream.as_mut().unwrap());
        let (op, elements) = next_start_write(session, &source, &mut record_key);
        assert_eq!(elements, 2);
        let record_key = record_key.unwrap();
        if round == 0 {
            stream.keyed(&record_key).unwrap();
        }
        let header = seal_write_header_digested(&record_key, op, 2, 0, 1, Some(digest)).unwrap();
        stream.send_frame(total as u64, &header, payload).unwrap();
        let result = wait(&mut target.runner, pending);
        let mismatches = target.runner.peers().stats().counters.digest_mismatches;
        if round == 0 {
            for (key, entry) in &result.entries {
                let status = entry.status;
                assert_eq!(
                    status,
                    EntryStatus::Failed(FailReason::DigestMismatch),
                    "{key:?}"
                );
                assert_ne!(target.runner.query(key), QueryStatus::Hit, "never served");
            }
            assert_eq!(mismatches, 2);
        } else {
            let landed: Vec<u8> = result
                .entries
                .iter()
                .flat_map(|(key, entry)| {
                    assert!(entry.is_success(), "{key:?}: {entry:?}");
                    let handle = entry.release.unwrap();
                    target.runner.read_claimed(handle, 0).unwrap()
                })
                .collect();
            assert!(landed == honest, "the unaltered frame lands byte-exact");
            assert_eq!(mismatches, 2, "nothing more counted");
            let digested = target.runner.page_digest(&key(target.ns, 2));
            assert_eq!(
                digested,
                Some(kvcr_sys::digest::digest_bytes(&honest[..BLOCK]))
            );
        }
    }
}

/// Bytes the relay lets through on each data stream from the source
/// before it flips one: well inside the first frame's first page.
const FLIP_AT: usize = 32 << 10;

/// An on-path relay in front of `listening` (the source's bound address),
/// reached at `at`: it forwards every connection both ways (closing both
/// ends once either ends, as a middlebox forwards a close) and, on a data
/// stream (its dialer writes the stream preamble first), flips the bit 0x20
/// of byte [`FLIP_AT`] the source sends. Counts the bytes it flipped and
/// the data streams whose dialer's end it saw close (and closed the
/// source's).
fn flipping_relay(
    at: std::net::SocketAddr,
    listening: std::net::SocketAddr,
) -> (Arc<AtomicU64>, Arc<AtomicU64>) {
    use std::io::Write;
    let (flipped, closed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let relay = TcpListener::bind(at).unwrap();
    let (count, closes) = (Arc::clone(&flipped), Arc::clone(&closed));
    std::thread::spawn(move || {
        for dialer in relay.incoming() {
            let Ok(mut dialer) = dialer else { return };
            let Ok(mut source) = std::net::TcpStream::connect(listening) else {
                continue;
            };
            let (mut dialer_in, mut source_in) =
                (dialer.try_clone().unwrap(), source.try_clone().unwrap());
            let (count, closes) = (Arc::clone(&count), Arc::clone(&closes));
            std::thread::spawn(move || {
                let mut first = [0u8; 8];
                if dialer_in.read_exact(&mut first).is_err() || source.write_all(&first).is_err() {
                    return;
                }
                let stream = &first == b"KVCR-D2\0";
                let (dialer_end, source_end) =
                    (dialer.try_clone().unwrap(), source.try_clone().unwrap());
                std::thread::spawn(move || {
                    let mut seen = 0usize;
                    let mut buf = vec![0u8; 16 << 10];
                    loop {
                        let n = match source_in.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if stream && (seen..seen + n).contains(&FLIP_AT) {
                            buf[FLIP_AT - seen] ^= 0x20;
                            count.fetch_add(1, Ordering::Relaxed);
                        }
                        seen += n;
                        if dialer.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = dialer.shutdown(std::net::Shutdown::Both);
                    let _ = source_in.shutdown(std::net::Shutdown::Both);
                });
                let _ = std::io::copy(&mut dialer_in, &mut source);
                let _ = source_end.shutdown(std::net::Shutdown::Both);
                let _ = dialer_end.shutdown(std::net::Shutdown::Both);
                if stream {
                    closes.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
    });
    (flipped, closed)
}

/// The probe of issue 40: an on-path outsider (no secret) flips a byte of a
/// data stream between two real runners (UCX over tcp, as with `--host`).
/// The stream's records are sealed: the altered one does not open, which
/// ends the stream (counted) and fails the write it carried; its keys fail
/// `DigestMismatch`, counted, never served; no key reports Success with
/// wrong bytes; the source sees the close, and the next restore through
/// the same relay (nothing flipped any more) lands byte-exact.
#[test]
fn a_byte_flipped_on_a_data_stream_never_succeeds() {
    let _serial = crate::serial();
    let mut options = through_tcp();
    options.data_stream = DataStream::On;
    // The source listens on 127.0.0.1 and tells peers 127.0.0.2, where the
    // relay listens on the same port.
    let mut source_options = options.clone();
    source_options.advertise_host = kvcr_contracts::Host::Ip([127, 0, 0, 2].into());
    let mut source = node_with(&source_options, 40, Duration::from_secs(10));
    let mut target = node_with(&options, 40, Duration::from_secs(10));
    let port = source.runner.peers().endpoint().unwrap().port();
    let (flipped, closed) =
        flipping_relay(([127, 0, 0, 2], port).into(), ([127, 0, 0, 1], port).into());
    let all: Vec<u64> = (0..40).collect();
    stock(&mut source, &all);
    // The stream is dialed beside the route's metadata: the first restore
    // may already come on it.
    let keys: Vec<u64> = (0..16).collect();
    let result = fetch_on_hint(&mut target, "flipped", &hint(&source, &keys), &keys);
    crate::wait_until("the data stream to bind", Duration::from_secs(10), || {
        target.runner.peers().control_stats().streams_opened == 1
    });
    if flipped.load(Ordering::Relaxed) == 0 {
        // It came through UCX: the next one comes on the stream.
        let keys: Vec<u64> = (16..20).collect();
        let first = fetch_on_hint(&mut target, "first", &hint(&source, &keys), &keys);
        check_flipped(&target, &source, &first, &keys, &flipped);
    } else {
        check_flipped(&target, &source, &result, &keys, &flipped);
    }
    assert_eq!(
        target.runner.peers().control_stats().stream_records_refused,
        1
    );
    // The target ended the stream; the relay closes the source's end too.
    crate::wait_until("the stream to close", Duration::from_secs(10), || {
        closed.load(Ordering::SeqCst) == 1
    });
    let again: Vec<u64> = (20..36).collect();
    let result = fetch_on_hint(&mut target, "again", &hint(&source, &again), &again);
    assert_restored(&target, &source, &result, &again);
    // The altered write never landed as a frame; the next came through UCX.
    assert_eq!(target.runner.peers().control_stats().stream_writes_taken, 0);
}

/// The restore of `keys` that the relay flipped a byte of: no key succeeds
/// with wrong bytes, the altered ones fail `DigestMismatch`, counted and
/// never served.
fn check_flipped(
    target: &Node,
    source: &Node,
    result: &OpResult,
    keys: &[u64],
    flipped: &AtomicU64,
) {
    assert_eq!(
        flipped.load(Ordering::Relaxed),
        1,
        "the relay flipped one byte"
    );
    let mut altered = 0;
    for ((key, entry), k) in result.entries.iter().zip(keys) {
        match entry.status {
            EntryStatus::Success => {
                let bytes = target
                    .runner
                    .read_claimed(entry.release.unwrap(), 0)
                    .unwrap();
                let k = *k as usize;
                assert!(
                    bytes == source.host[k * BLOCK..(k + 1) * BLOCK],
                    "{key:?}: wrong bytes"
                );
            }
            EntryStatus::Failed(FailReason::DigestMismatch) => {
                altered += 1;
                assert_ne!(target.runner.query(key), QueryStatus::Hit, "{key:?} served");
            }
            other => panic!("{key:?}: {other:?}"),
        }
    }
    assert!(altered >= 1, "the altered page failed");
    let counted = target.runner.peers().stats().counters.digest_mismatches;
    assert_eq!(counted, altered);
}
