//! Tests of the guard's client and wire: a fake guard of the test's making
//! that answers one claim, real sockets and real descriptors. The guard's
//! own tests (its service, leases, deaths) are the `kvcr-guard` crate's.

use std::fs::File;
use std::io::Read;
use std::net::TcpListener;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::Duration;

use kvcr_sys::fd_passing;

use self::fixtures::*;
use super::protocol::{self, ClaimMsg, GrantedMsg, Reply, Request};
use super::*;

mod fixtures;

const TIMEOUT: Duration = Duration::from_secs(10);

/// A guard of the test's making: answers one claim with `reply` and `fds`.
fn fake_guard(socket: &Path, reply: Reply, fds: Vec<OwnedFd>) -> std::thread::JoinHandle<()> {
    let listener = UnixListener::bind(socket).unwrap();
    std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut header = [0u8; 4];
        stream.read_exact(&mut header).unwrap();
        let mut payload = vec![0u8; protocol::payload_len(header).unwrap()];
        stream.read_exact(&mut payload).unwrap();
        let frame = protocol::encode(&reply).unwrap();
        let borrowed: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
        let sent = fd_passing::send_with_fds(stream.as_fd(), &frame, &borrowed).unwrap();
        assert_eq!(sent, frame.len());
        drop(fds);
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest);
    })
}

fn memfd(len: u64) -> OwnedFd {
    let (file, _) = kvcr_sys::memfd::create_pool_file(len).unwrap();
    OwnedFd::from(file)
}

/// A grant that matches [`claim_of`]`(1, 1)`.
fn good_granted(control: &str) -> GrantedMsg {
    GrantedMsg {
        version: 1,
        group: 1,
        layout: layout(),
        pool_tokens: vec![protocol::hex128(1), protocol::hex128(2)],
        control: control.into(),
        warm: false,
        previous_incarnation: None,
        dead_incarnations: vec![],
        member_key: protocol::MemberKeyHex("11".repeat(32)),
    }
}

#[test]
fn a_grant_that_does_not_match_the_claim_is_refused_and_its_descriptors_closed() {
    let good_fds = |listener: &TcpListener| {
        vec![
            memfd(3 * 4096),
            memfd(4 * 4096),
            memfd(2 * 8192),
            OwnedFd::from(listener.try_clone().unwrap()),
        ]
    };
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let control = listener.local_addr().unwrap().to_string();
    let run = |reply: GrantedMsg, fds: Vec<OwnedFd>| {
        let dir = Scratch::new();
        let fake = fake_guard(&dir.socket(), Reply::Granted(reply), fds);
        // The lease goes first: the fake waits for the connection to close.
        let result = claim(&dir.socket(), &claim_of(1, 1), TIMEOUT).map(|(_, grant)| grant);
        fake.join().unwrap();
        result
    };
    // The fake itself is a good guard.
    let grant = run(good_granted(&control), good_fds(&listener)).unwrap();
    assert_eq!(grant.pools[1].1, 2u128.to_be_bytes());
    assert_eq!(
        Some(grant.member_key),
        crate::net::StaticKey::from_private([0x11; 32])
    );

    let bad = |reply: GrantedMsg, fds: Vec<OwnedFd>| match run(reply, fds) {
        Err(GuardError::BadGrant { why }) => why,
        other => panic!("{other:?}"),
    };
    let mut wrong = good_granted(&control);
    wrong.group = 2;
    assert!(bad(wrong, good_fds(&listener)).contains("group 2"));
    let mut wrong = good_granted(&control);
    wrong.layout.pools[0].blocks = 5;
    assert!(bad(wrong, good_fds(&listener)).contains("layout"));
    let mut wrong = good_granted(&control);
    wrong.pool_tokens[0] = "xyz".into();
    assert!(bad(wrong, good_fds(&listener)).contains("token"));
    let mut wrong = good_granted(&control);
    wrong.member_key = protocol::MemberKeyHex("11".repeat(31));
    assert!(bad(wrong, good_fds(&listener)).contains("member key"));
    let mut wrong = good_granted(&control);
    wrong.dead_incarnations = vec!["12".into()];
    assert!(bad(wrong, good_fds(&listener)).contains("incarnation"));
    let mut wrong = good_granted(&control);
    wrong.control = "127.0.0.1:1".into();
    assert!(bad(wrong, good_fds(&listener)).contains("bound at"));
    // One descriptor too few, one too many.
    let mut fds = good_fds(&listener);
    fds.pop();
    assert!(bad(good_granted(&control), fds).contains("3 descriptors"));
    let mut fds = good_fds(&listener);
    fds.push(memfd(4096));
    assert!(bad(good_granted(&control), fds).contains("5 descriptors"));
    // A pool of the wrong size.
    let mut fds = good_fds(&listener);
    fds[2] = memfd(8192);
    assert!(bad(good_granted(&control), fds).contains("pool 1"));
    // Not a TCP socket where the listener goes.
    let mut fds = good_fds(&listener);
    fds[3] = memfd(4096);
    assert!(bad(good_granted(&control), fds).contains("not a TCP socket"));

    // A pool that is a pipe: refused, and the client closed every
    // descriptor it got (the pipe's reader sees EOF once the client's copy
    // of the writer is gone).
    let (mut reader, writer) = std::io::pipe().unwrap();
    let mut fds = good_fds(&listener);
    fds[1] = OwnedFd::from(writer);
    assert!(bad(good_granted(&control), fds).contains("pool 0"));
    let mut rest = Vec::new();
    reader.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
}

#[test]
fn descriptors_pass_whole_and_close_on_exec() {
    let (left, right) = UnixStream::pair().unwrap();
    let files: Vec<File> = (0..3)
        .map(|i| {
            let (file, _) = kvcr_sys::memfd::create_pool_file(4096).unwrap();
            file.write_all_at(&[i as u8 + 1], 0).unwrap();
            file
        })
        .collect();
    let borrowed: Vec<_> = files.iter().map(AsFd::as_fd).collect();
    assert_eq!(
        fd_passing::send_with_fds(left.as_fd(), b"abc", &borrowed).unwrap(),
        3
    );
    let mut buf = [0u8; 8];
    let got = fd_passing::recv_with_fds(right.as_fd(), &mut buf).unwrap();
    assert_eq!(got.bytes, 3);
    assert!(!got.truncated);
    assert_eq!(&buf[..3], b"abc");
    assert_eq!(got.fds.len(), 3);
    for (i, fd) in got.fds.into_iter().enumerate() {
        assert!(is_cloexec(&fd));
        let file = File::from(fd);
        let mut byte = [0u8];
        file.read_exact_at(&mut byte, 0).unwrap();
        assert_eq!(byte[0], i as u8 + 1);
    }
    let too_many: Vec<_> = std::iter::repeat_n(files[0].as_fd(), fd_passing::MAX_FDS + 1).collect();
    assert!(fd_passing::send_with_fds(left.as_fd(), b"x", &too_many).is_err());
}

#[test]
fn the_wire_is_strict_and_round_trips() {
    // Hex: exactly 32 digits.
    assert_eq!(
        protocol::parse_hex128(&protocol::hex128(0xabc)),
        Some(0xabc)
    );
    assert_eq!(protocol::parse_hex128("abc"), None);
    assert_eq!(
        protocol::parse_hex128(&format!("+{}", "0".repeat(31))),
        None
    );
    assert_eq!(protocol::parse_hex128(&"g".repeat(32)), None);
    let token = [7u8; 16];
    assert_eq!(
        protocol::parse_token(&protocol::token_hex(&token)),
        Some(token)
    );
    // Frames.
    assert_eq!(
        protocol::header(protocol::MAX_FRAME),
        Some((protocol::MAX_FRAME as u32).to_le_bytes())
    );
    assert_eq!(protocol::header(protocol::MAX_FRAME + 1), None);
    assert_eq!(
        protocol::payload_len((protocol::MAX_FRAME as u32 + 1).to_le_bytes()),
        None
    );
    // Every message round-trips, tagged.
    let granted = Reply::Granted(good_granted("127.0.0.1:1"));
    for reply in [
        granted,
        Reply::Released,
        Reply::Refused {
            refusal: Refusal::Held { group: 1, pid: 2 },
        },
    ] {
        let frame = protocol::encode(&reply).unwrap();
        assert_eq!(serde_json::from_slice::<Reply>(&frame[4..]).unwrap(), reply);
    }
    assert_eq!(
        serde_json::to_string(&Request::Release { version: 1 }).unwrap(),
        r#"{"type":"release","version":1}"#
    );
    let claim = claim_json(3);
    assert_eq!(claim["type"], "claim");
    assert!(protocol::decode_request(claim.to_string().as_bytes()).is_ok());
    // Unknown fields anywhere in a reply are refused too.
    let mut reply = serde_json::to_value(Reply::Granted(good_granted("127.0.0.1:1"))).unwrap();
    reply["layout"]["surprise"] = 1.into();
    assert!(serde_json::from_value::<Reply>(reply).is_err());
    // The runner's error wraps the guard's.
    let e = crate::Error::from(GuardError::Refused(Refusal::Held { group: 1, pid: 2 }));
    assert_eq!(e.to_string(), "guard refused: group 1 is held by pid 2");
}
