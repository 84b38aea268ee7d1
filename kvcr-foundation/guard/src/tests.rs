//! Tests of the guard: real sockets, real descriptors, real processes.
//!
//! Every test starts its own guard in this process on a socket of its own.
//! A lease is fenced by the claimant's process, and this process never
//! exits during the tests, so a claimant that must die is a child: this
//! test binary run again with `KVCR_GUARD_CHILD` set (see [`child_entry`]),
//! killed with `SIGKILL`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvcr_runner::guard::protocol::{self, ClaimMsg, Reply, Request};
use kvcr_runner::guard::{GuardClaim, GuardGrant, GuardLease, claim};
use kvcr_sys::fd_passing;

use self::fixtures::*;
use super::*;

/// The runner's guard-test fixtures, shared by path: the same scratch
/// directories, layout and claims on both sides of the socket.
#[path = "../../runner/src/guard/tests/fixtures.rs"]
mod fixtures;

const TIMEOUT: Duration = Duration::from_secs(10);

fn quiet() -> GuardConfig {
    GuardConfig {
        log: GuardLog::Discard,
        ..GuardConfig::default()
    }
}

fn fd_name(fd: &impl AsRawFd) -> String {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

fn refusal(result: Result<(GuardLease, GuardGrant), GuardError>) -> Refusal {
    match result {
        Err(GuardError::Refused(refusal)) => refusal,
        Err(other) => panic!("expected a refusal, got {other:?}"),
        Ok((_, grant)) => panic!("expected a refusal, got a grant {grant:?}"),
    }
}

/// A guard never binds in a directory others may write (sticky or not):
/// another user could have bound the path first, or replace the socket.
#[test]
fn a_shared_socket_directory_is_refused() {
    let dir = Scratch::new();
    for mode in [0o1777, 0o777, 0o775] {
        std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(mode)).unwrap();
        match GuardService::start_with(&dir.socket(), quiet()) {
            Err(GuardError::SharedDirectory { path, .. }) => {
                assert_eq!(path, std::fs::canonicalize(&dir.0).unwrap(), "{mode:#o}");
            }
            other => panic!("{mode:#o}: {:?}", other.map(|g| g.socket_path().to_owned())),
        }
        assert!(!dir.socket().exists(), "{mode:#o}: nothing was bound");
    }
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o700)).unwrap();
    let _guard = GuardService::start_with(&dir.socket(), quiet()).unwrap();
}

#[test]
fn a_claim_is_granted_the_groups_memory_and_listener() {
    let dir = Scratch::new();
    let guard = GuardService::start_with(&dir.socket(), quiet()).unwrap();
    let mode = std::fs::metadata(guard.socket_path())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "the socket is private");

    let (lease, grant) = claim(&dir.socket(), &claim_of(7, 0xabc), TIMEOUT).unwrap();
    assert_eq!(lease.group(), 7);
    assert!(!grant.warm, "a group's first grant is fresh");
    assert_eq!(grant.previous_incarnation, None);
    assert!(grant.dead_incarnations.is_empty());

    // The journal: its size, zeroed, close-on-exec.
    assert_eq!(grant.journal.metadata().unwrap().len(), 3 * 4096);
    let mut journal = vec![1u8; 3 * 4096];
    grant.journal.read_exact_at(&mut journal, 0).unwrap();
    assert!(journal.iter().all(|b| *b == 0));
    assert!(is_cloexec(&grant.journal));
    assert!(fd_name(&grant.journal).starts_with("/memfd:kvcr-journal-"));

    // The pools: made like a runner's own, so it adopts them.
    assert_eq!(grant.pools.len(), 2);
    assert_ne!(grant.pools[0].1, grant.pools[1].1, "tokens are distinct");
    for ((file, token), len) in grant.pools.iter().zip([4 * 4096, 2 * 8192]) {
        assert_eq!(file.metadata().unwrap().len(), len);
        assert!(is_cloexec(file));
        assert_eq!(
            fd_name(file),
            format!("/memfd:kvcr-pool-{} (deleted)", protocol::token_hex(token))
        );
        let file = file.try_clone().unwrap();
        kvcr_sys::memfd::SharedPool::adopt(file, *token, len, false).unwrap();
    }

    // The listener: bound where the grant says, listening.
    assert!(is_cloexec(&grant.listener));
    assert_eq!(grant.control.ip().to_string(), "127.0.0.1");
    assert_ne!(grant.control.port(), 0);
    assert_eq!(grant.listener.local_addr().unwrap(), grant.control);
    let mut dialed = TcpStream::connect(grant.control).unwrap();
    let (mut accepted, _) = grant.listener.accept().unwrap();
    dialed.write_all(b"hi").unwrap();
    let mut got = [0u8; 2];
    accepted.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"hi");
    lease.release().unwrap();
}

#[test]
fn a_live_holder_keeps_the_group_and_a_release_hands_it_on_warm() {
    let dir = Scratch::new();
    let _guard = GuardService::start_with(&dir.socket(), quiet()).unwrap();
    let (lease, first) = claim(&dir.socket(), &claim_of(1, 0x11), TIMEOUT).unwrap();
    first.pools[0].0.write_all_at(b"still here", 100).unwrap();

    // Held by this very process: refused, whatever the incarnation.
    let held = refusal(claim(&dir.socket(), &claim_of(1, 0x12), TIMEOUT));
    assert_eq!(
        held,
        Refusal::Held {
            group: 1,
            pid: std::process::id()
        }
    );
    assert_eq!(
        held.to_string(),
        format!("group 1 is held by pid {}", std::process::id())
    );
    // Another group is free.
    let (other, _) = claim(&dir.socket(), &claim_of(2, 0x21), TIMEOUT).unwrap();

    lease.release().unwrap();
    drop(first);
    let (again, second) = claim(&dir.socket(), &claim_of(1, 0x13), TIMEOUT).unwrap();
    assert!(second.warm);
    assert_eq!(second.previous_incarnation, Some(0x11));
    assert!(second.dead_incarnations.is_empty(), "a release is no death");
    let mut bytes = [0u8; 10];
    second.pools[0].0.read_exact_at(&mut bytes, 100).unwrap();
    assert_eq!(&bytes, b"still here");
    again.release().unwrap();
    other.release().unwrap();
}

#[test]
fn closing_the_connection_does_not_end_the_lease() {
    let dir = Scratch::new();
    let _guard = GuardService::start_with(&dir.socket(), quiet()).unwrap();
    let (lease, grant) = claim(&dir.socket(), &claim_of(3, 0x31), TIMEOUT).unwrap();
    drop(lease);
    drop(grant);
    // Still held after the connection closed (give the guard time to see
    // the EOF: a claim after it must still be refused).
    for _ in 0..3 {
        let held = refusal(claim(&dir.socket(), &claim_of(3, 0x32), TIMEOUT));
        assert!(matches!(held, Refusal::Held { group: 3, .. }), "{held:?}");
    }
}

#[test]
fn a_claim_that_differs_from_the_first_is_refused_naming_the_field() {
    let dir = Scratch::new();
    let _guard = GuardService::start_with(&dir.socket(), quiet()).unwrap();
    let (lease, grant) = claim(&dir.socket(), &claim_of(4, 0x41), TIMEOUT).unwrap();
    let bound = grant.control;
    lease.release().unwrap();

    type Change = Box<dyn Fn(&mut GuardClaim)>;
    let cases: Vec<(&str, Change)> = vec![
        ("compat_digest", Box::new(|c| c.compat_digest += 1)),
        (
            "layout.journal_bytes",
            Box::new(|c| c.layout.journal_bytes += 4096),
        ),
        (
            "layout.pools (count)",
            Box::new(|c| drop(c.layout.pools.pop())),
        ),
        (
            "layout.pools[1].name",
            Box::new(|c| c.layout.pools[1].name = "other".into()),
        ),
        (
            "layout.pools[0].block_bytes",
            Box::new(|c| c.layout.pools[0].block_bytes *= 2),
        ),
        (
            "layout.pools[1].blocks",
            Box::new(|c| c.layout.pools[1].blocks += 1),
        ),
        ("control", Box::new(|c| c.control = "127.0.0.2:0".into())),
    ];
    for (field, change) in cases {
        let mut changed = claim_of(4, 0x42);
        change(&mut changed);
        let refused = refusal(claim(&dir.socket(), &changed, TIMEOUT));
        assert_eq!(
            refused,
            Refusal::Mismatch {
                group: 4,
                field: field.into()
            }
        );
        assert!(refused.to_string().contains(field));
    }
    // The first claim's control string, or the bound address: both match.
    let mut by_address = claim_of(4, 0x43);
    by_address.control = bound.to_string();
    let (lease, grant) = claim(&dir.socket(), &by_address, TIMEOUT).unwrap();
    assert_eq!(grant.control, bound);
    lease.release().unwrap();
    let (lease, grant) = claim(&dir.socket(), &claim_of(4, 0x44), TIMEOUT).unwrap();
    assert_eq!(grant.control, bound);
    lease.release().unwrap();
}

#[test]
fn claims_outside_the_limits_are_refused() {
    let dir = Scratch::new();
    let config = GuardConfig {
        max_groups: 2,
        max_pools: 3,
        max_group_bytes: 1 << 20,
        ..quiet()
    };
    let _guard = GuardService::start_with(&dir.socket(), config).unwrap();
    let invalid = |change: &dyn Fn(&mut GuardClaim)| {
        let mut c = claim_of(9, 0x91);
        change(&mut c);
        match refusal(claim(&dir.socket(), &c, TIMEOUT)) {
            Refusal::Invalid { why } => why,
            other => panic!("{other:?}"),
        }
    };
    let pool = |blocks| PoolSpec {
        name: "p".into(),
        block_bytes: 4096,
        blocks,
    };
    assert!(invalid(&|c| c.layout.pools = vec![pool(1); 4]).contains("4 pools"));
    assert!(invalid(&|c| c.layout.pools.clear()).contains("at least one pool"));
    assert!(invalid(&|c| c.layout.pools[0].blocks = 0).contains("layout.pools[0]"));
    assert!(invalid(&|c| c.layout.journal_bytes = 0).contains("journal_bytes"));
    assert!(invalid(&|c| c.layout.pools[1] = pool(256)).contains("over 1048576 bytes"));
    assert!(invalid(&|c| c.layout.pools[0].name = "n".repeat(65)).contains("65 bytes"));
    assert!(invalid(&|c| c.control = "localhost:0".into()).contains("not ip:port"));
    assert_eq!(
        claim(&dir.socket(), &claim_of(9, 0), TIMEOUT).unwrap_err(),
        GuardError::InvalidClaim {
            why: "incarnation 0"
        }
    );

    let (a, _) = claim(&dir.socket(), &claim_of(1, 1), TIMEOUT).unwrap();
    let (b, _) = claim(&dir.socket(), &claim_of(2, 2), TIMEOUT).unwrap();
    assert_eq!(
        refusal(claim(&dir.socket(), &claim_of(3, 3), TIMEOUT)),
        Refusal::TooManyGroups { limit: 2 }
    );
    // Released groups still count: the guard keeps their memory.
    a.release().unwrap();
    b.release().unwrap();
    assert_eq!(
        refusal(claim(&dir.socket(), &claim_of(3, 3), TIMEOUT)),
        Refusal::TooManyGroups { limit: 2 }
    );
}

/// Sends `bytes` raw and returns the reply, if any, after which the guard
/// must have closed the connection.
fn raw_exchange(socket: &Path, bytes: &[u8]) -> Option<Reply> {
    let mut stream = UnixStream::connect(socket).unwrap();
    stream.set_read_timeout(Some(TIMEOUT)).unwrap();
    stream.write_all(bytes).unwrap();
    let mut header = [0u8; 4];
    let reply = match stream.read_exact(&mut header) {
        Ok(()) => {
            let mut payload = vec![0u8; protocol::payload_len(header).unwrap()];
            stream.read_exact(&mut payload).unwrap();
            Some(serde_json::from_slice(&payload).unwrap())
        }
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => None,
        Err(e) => panic!("{e}"),
    };
    let mut rest = Vec::new();
    match stream.read_to_end(&mut rest) {
        Ok(_) => assert!(rest.is_empty(), "more after the reply"),
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset),
    }
    reply
}

fn framed(payload: &[u8]) -> Vec<u8> {
    let mut frame = (payload.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(payload);
    frame
}

fn refused_invalid(reply: Option<Reply>) -> String {
    match reply {
        Some(Reply::Refused {
            refusal: Refusal::Invalid { why },
        }) => why,
        other => panic!("{other:?}"),
    }
}

#[test]
fn bad_frames_are_refused_and_closed_and_the_guard_keeps_serving() {
    let dir = Scratch::new();
    let _guard = GuardService::start_with(&dir.socket(), quiet()).unwrap();
    let socket = dir.socket();

    // A header over the limit: nothing is read past it.
    let mut huge = (protocol::MAX_FRAME as u32 + 1).to_le_bytes().to_vec();
    huge.extend_from_slice(&[b'x'; 64]);
    assert!(refused_invalid(raw_exchange(&socket, &huge)).contains("65537 bytes"));
    assert!(refused_invalid(raw_exchange(&socket, &u32::MAX.to_le_bytes())).contains("bytes"));
    // Not JSON, empty, not a request.
    assert!(
        refused_invalid(raw_exchange(&socket, &framed(b"\xff not json"))).contains("not a request")
    );
    assert!(refused_invalid(raw_exchange(&socket, &framed(b""))).contains("not a request"));
    assert!(
        refused_invalid(raw_exchange(&socket, &framed(br#"{"type":"granted"}"#)))
            .contains("not a request")
    );
    // Unknown fields, at the top and inside.
    let mut extra = claim_json(1);
    extra["extra"] = 1.into();
    let why = refused_invalid(raw_exchange(&socket, &framed(extra.to_string().as_bytes())));
    assert!(why.contains("unknown field"), "{why}");
    let mut nested = claim_json(1);
    nested["layout"]["pools"][0]["stride"] = 1.into();
    let why = refused_invalid(raw_exchange(
        &socket,
        &framed(nested.to_string().as_bytes()),
    ));
    assert!(why.contains("unknown field"), "{why}");
    // Another version, even with fields this one does not know.
    let mut v2 = claim_json(1);
    v2["version"] = 2.into();
    assert_eq!(
        raw_exchange(&socket, &framed(v2.to_string().as_bytes())),
        Some(Reply::Refused {
            refusal: Refusal::Version { got: 2 }
        })
    );
    v2["g3"] = true.into();
    assert_eq!(
        raw_exchange(&socket, &framed(v2.to_string().as_bytes())),
        Some(Reply::Refused {
            refusal: Refusal::Version { got: 2 }
        })
    );
    // A release with nothing to release.
    let release = serde_json::to_vec(&Request::Release { version: 1 }).unwrap();
    assert!(refused_invalid(raw_exchange(&socket, &framed(&release))).contains("no lease"));
    // A frame cut short, then closed: no reply.
    let cut = framed(claim_json(1).to_string().as_bytes());
    let mut stream = UnixStream::connect(&socket).unwrap();
    stream.write_all(&cut[..cut.len() / 2]).unwrap();
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    stream.set_read_timeout(Some(TIMEOUT)).unwrap();
    stream.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());

    // After all that, a claim works.
    let (lease, grant) = claim(&socket, &claim_of(1, 0x99), TIMEOUT).unwrap();
    assert!(!grant.warm);
    // A second request on a granted connection that is not a release: refused,
    // closed, and the lease stands.
    let mut stream = UnixStream::from(lease.as_fd().try_clone_to_owned().unwrap());
    stream
        .write_all(&framed(claim_json(2).to_string().as_bytes()))
        .unwrap();
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).unwrap();
    let reply: Reply = serde_json::from_slice(&reply[4..]).unwrap();
    assert!(matches!(
        reply,
        Reply::Refused {
            refusal: Refusal::Invalid { .. }
        }
    ));
    assert!(matches!(
        refusal(claim(&socket, &claim_of(1, 0x9a), TIMEOUT)),
        Refusal::Held { group: 1, .. }
    ));
}

/// Reads until EOF (true) or until `within` passes (false).
fn closed_within(stream: &mut UnixStream, within: Duration) -> bool {
    stream.set_read_timeout(Some(within)).unwrap();
    let mut byte = [0u8; 1];
    match stream.read(&mut byte) {
        Ok(0) => true,
        Ok(_) => panic!("the guard said something to a silent connection"),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => true,
        Err(e) => {
            assert!(
                matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ),
                "{e}"
            );
            false
        }
    }
}

#[test]
fn connections_beyond_the_limit_are_closed_at_once() {
    let dir = Scratch::new();
    let config = GuardConfig {
        max_pending: 4,
        claim_timeout: Duration::from_secs(60),
        ..quiet()
    };
    let _guard = GuardService::start_with(&dir.socket(), config).unwrap();
    let mut waiting: Vec<UnixStream> = (0..4)
        .map(|_| UnixStream::connect(dir.socket()).unwrap())
        .collect();
    let mut extra: Vec<UnixStream> = (0..12)
        .map(|_| UnixStream::connect(dir.socket()).unwrap())
        .collect();
    for stream in &mut extra {
        assert!(
            closed_within(stream, TIMEOUT),
            "a connection over the limit stays open"
        );
    }
    for stream in &mut waiting {
        assert!(!closed_within(stream, Duration::from_millis(200)));
    }
    // A claim over the limit fails too (closed, not answered).
    let over = claim(&dir.socket(), &claim_of(1, 1), TIMEOUT).unwrap_err();
    assert!(
        matches!(over, GuardError::Protocol { .. } | GuardError::Os { .. }),
        "{over:?}"
    );
    // Once they go, claims are served again (the guard notices the closes
    // asynchronously: a few tries).
    waiting.clear();
    #[allow(clippy::disallowed_methods)]
    let deadline = Instant::now() + TIMEOUT;
    let (lease, _) = loop {
        match claim(&dir.socket(), &claim_of(1, 1), TIMEOUT) {
            Ok(granted) => break granted,
            #[allow(clippy::disallowed_methods)]
            Err(e) if Instant::now() < deadline => {
                assert!(!matches!(e, GuardError::Refused(_)), "{e:?}");
            }
            Err(e) => panic!("{e:?}"),
        }
    };
    lease.release().unwrap();
}

#[test]
fn a_granted_connection_does_not_count_against_the_pending_limit() {
    let dir = Scratch::new();
    let config = GuardConfig {
        max_pending: 1,
        claim_timeout: Duration::from_secs(60),
        ..quiet()
    };
    let _guard = GuardService::start_with(&dir.socket(), config).unwrap();
    // The grant's connection gave its place back before the grant arrived
    // here (the guard drops it in the same step as the last write).
    let (lease, _) = claim(&dir.socket(), &claim_of(1, 1), TIMEOUT).unwrap();
    let mut waiting = UnixStream::connect(dir.socket()).unwrap();
    let mut over = UnixStream::connect(dir.socket()).unwrap();
    assert!(closed_within(&mut over, TIMEOUT), "the one place is taken");
    assert!(!closed_within(&mut waiting, Duration::from_millis(200)));
    lease.release().unwrap();
}

#[test]
fn a_connection_silent_past_the_claim_timeout_is_closed() {
    let dir = Scratch::new();
    let config = GuardConfig {
        claim_timeout: Duration::from_millis(300),
        ..quiet()
    };
    let _guard = GuardService::start_with(&dir.socket(), config).unwrap();
    #[allow(clippy::disallowed_methods)]
    let start = Instant::now();
    let mut silent = UnixStream::connect(dir.socket()).unwrap();
    let mut slow = UnixStream::connect(dir.socket()).unwrap();
    slow.write_all(&[10, 0]).unwrap(); // half a header
    assert!(closed_within(&mut silent, TIMEOUT));
    assert!(closed_within(&mut slow, TIMEOUT));
    assert!(start.elapsed() >= Duration::from_millis(300));
    let (lease, _) = claim(&dir.socket(), &claim_of(1, 1), TIMEOUT).unwrap();
    lease.release().unwrap();
}

#[test]
fn a_guard_refuses_a_socket_another_guard_serves_and_replaces_a_stale_one() {
    let dir = Scratch::new();
    let socket = dir.socket();
    let first = GuardService::start_with(&socket, quiet()).unwrap();
    assert_eq!(
        GuardService::start_with(&socket, quiet()).unwrap_err(),
        GuardError::AlreadyRunning {
            path: socket.clone()
        }
    );
    drop(first);
    assert!(!socket.exists(), "a stopped guard removes its socket");

    // A socket file nobody serves: stale, replaced.
    drop(UnixListener::bind(&socket).unwrap());
    assert!(socket.exists());
    let second = GuardService::start_with(&socket, quiet()).unwrap();
    let (lease, _) = claim(&socket, &claim_of(1, 1), TIMEOUT).unwrap();
    lease.release().unwrap();
    drop(second);

    // Anything else at the path is left alone.
    std::fs::write(&socket, b"precious").unwrap();
    let err = GuardService::start_with(&socket, quiet()).unwrap_err();
    assert!(
        matches!(
            err,
            GuardError::Socket {
                why: "exists and is not a socket",
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(std::fs::read(&socket).unwrap(), b"precious");
}

/// Re-runs this binary as a claimant child (see [`child_entry`]).
fn spawn_claimant(socket: &Path, group: u32, incarnation: u128) -> (Child, String) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "tests::child_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("KVCR_GUARD_CHILD", socket)
        .env("KVCR_GUARD_GROUP", group.to_string())
        .env("KVCR_GUARD_INCARNATION", protocol::hex128(incarnation))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let report = BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.split_once("GUARDCHILD ").map(|(_, r)| r.to_owned()))
        .unwrap_or_default();
    (child, report)
}

const PATTERN: &[u8] = b"written by a claimant that was killed";

/// Not a test of its own: the body of the claimant child (a no-op unless
/// `KVCR_GUARD_CHILD` is set). It claims, writes [`PATTERN`] into pool 0
/// through a shared mapping and into the journal, says `ready <control>`,
/// and waits to be killed.
#[test]
fn child_entry() {
    let Some(socket) = std::env::var_os("KVCR_GUARD_CHILD") else {
        return;
    };
    let group = std::env::var("KVCR_GUARD_GROUP").unwrap().parse().unwrap();
    let incarnation =
        protocol::parse_hex128(&std::env::var("KVCR_GUARD_INCARNATION").unwrap()).unwrap();
    let say = |what: &str| {
        println!("\nGUARDCHILD {what}");
        std::io::stdout().flush().unwrap();
    };
    match claim(Path::new(&socket), &claim_of(group, incarnation), TIMEOUT) {
        Ok((_lease, grant)) => {
            // A shared mapping of the pool's memfd, as a runner writes it:
            // kvcr-sys's journal mapping takes any file sealed against
            // shrinking, and the guard reads it only once this lease ends.
            let mut map = kvcr_sys::memfd::JournalMap::new(&grant.pools[0].0, 0).unwrap();
            map.bytes_mut()[4096..4096 + PATTERN.len()].copy_from_slice(PATTERN);
            grant.journal.write_all_at(PATTERN, 0).unwrap();
            say(&format!("ready {}", grant.control));
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
            // Never released: the parent kills this process.
        }
        Err(e) => say(&format!("failed {e}")),
    }
}

#[test]
fn the_memory_outlives_a_claimant_killed_without_release() {
    let dir = Scratch::new();
    let (log, lines) = mpsc::channel();
    let config = GuardConfig {
        log: GuardLog::Channel(log),
        ..GuardConfig::default()
    };
    let _guard = GuardService::start_with(&dir.socket(), config).unwrap();
    let dead: u128 = 0x0123_4567_89ab_cdef_0011_2233_4455_6677;
    let (mut child, report) = spawn_claimant(&dir.socket(), 5, dead);
    let control = report
        .strip_prefix("ready ")
        .unwrap_or_else(|| panic!("child: {report:?}"))
        .to_owned();

    // While it lives, it holds the group.
    assert_eq!(
        refusal(claim(&dir.socket(), &claim_of(5, 0x55), TIMEOUT)),
        Refusal::Held {
            group: 5,
            pid: child.id()
        }
    );

    child.kill().unwrap();
    child.wait().unwrap();
    let (lease, grant) = claim(&dir.socket(), &claim_of(5, 0x56), TIMEOUT).unwrap();
    assert!(grant.warm);
    assert_eq!(grant.previous_incarnation, Some(dead));
    assert_eq!(grant.dead_incarnations, vec![dead]);
    let mut bytes = vec![0u8; PATTERN.len()];
    grant.pools[0].0.read_exact_at(&mut bytes, 4096).unwrap();
    assert_eq!(bytes, PATTERN, "the pool kept the dead claimant's bytes");
    grant.journal.read_exact_at(&mut bytes, 0).unwrap();
    assert_eq!(bytes, PATTERN, "the journal too");
    // The same listener, still bound.
    assert_eq!(grant.control.to_string(), control);
    let _dialed = TcpStream::connect(grant.control).unwrap();
    grant.listener.accept().unwrap();

    let died = format!(
        "primary pid {} (incarnation {}) of group 5 died",
        child.id(),
        protocol::hex128(dead)
    );
    assert!(
        lines.try_iter().any(|line| line == died),
        "the guard did not log {died:?}"
    );

    // A second death is remembered after the first.
    lease.release().unwrap();
    let second: u128 = 0x5ec0;
    let (mut child, report) = spawn_claimant(&dir.socket(), 5, second);
    assert!(report.starts_with("ready "), "child: {report:?}");
    child.kill().unwrap();
    child.wait().unwrap();
    let (lease, grant) = claim(&dir.socket(), &claim_of(5, 0x57), TIMEOUT).unwrap();
    assert_eq!(grant.previous_incarnation, Some(second));
    assert_eq!(grant.dead_incarnations, vec![dead, second]);
    lease.release().unwrap();
}

#[test]
fn a_death_is_seen_without_a_claim() {
    // The lease task sees the exit on its own (epoll on the pidfd), not
    // only when a claim asks.
    let dir = Scratch::new();
    let (log, lines) = mpsc::channel();
    let config = GuardConfig {
        log: GuardLog::Channel(log),
        ..GuardConfig::default()
    };
    let _guard = GuardService::start_with(&dir.socket(), config).unwrap();
    let (mut child, report) = spawn_claimant(&dir.socket(), 6, 0x66);
    assert!(report.starts_with("ready "), "child: {report:?}");
    let pid = child.id();
    child.kill().unwrap();
    child.wait().unwrap();
    let died = format!(
        "primary pid {pid} (incarnation {}) of group 6 died",
        protocol::hex128(0x66)
    );
    // `recv_timeout` bounds the wait.
    loop {
        match lines.recv_timeout(TIMEOUT) {
            Ok(line) if line == died => break,
            Ok(_) => {}
            Err(e) => panic!("no death logged: {e}"),
        }
    }
}

#[test]
fn a_peer_is_known_by_its_pidfd_and_its_exit_is_seen() {
    let (left, _right) = UnixStream::pair().unwrap();
    let me = fd_passing::peer_process(left.as_fd()).unwrap();
    assert_eq!(me.pid, std::process::id());
    assert_eq!(me.uid, fd_passing::effective_uid());
    assert!(!fd_passing::has_exited(me.pidfd.as_fd()).unwrap());

    // The pre-6.5 path: pidfd_open on the pid.
    let mut child = Command::new("sleep").arg("60").spawn().unwrap();
    let pidfd = fd_passing::pidfd_open(child.id()).unwrap();
    assert!(is_cloexec(&pidfd));
    assert!(!fd_passing::has_exited(pidfd.as_fd()).unwrap());
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(fd_passing::has_exited(pidfd.as_fd()).unwrap());
}
