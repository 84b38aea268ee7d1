//! The KV-event sockets against peers that ask and never read (issue 40's
//! probe: silent DEALERs asking the replay socket for whole-range replays
//! grew a runner from 89 to 2,744 MiB). Real ZMQ sockets on loopback; the
//! process's resident memory is read where it is the claim, in a child
//! process that runs the one test alone.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvcr_contracts::{BindAddress, InventorySink, Medium, Owner};
use kvcr_publisher::{
    BindScope, OwnershipWire, Publisher, PublisherConfig, PublisherReason, PublisherStats,
};

use super::publisher::support::wait_until;
use super::publisher::{
    BS, config, dial, private_netns, query, real_client, register, scope, sockets_lock,
    start_indexer, stored, sub, tier, until_received,
};

/// Batches in the replay buffer (one store each, about 5 KiB): twice what
/// the kernel buffers for one TCP connection at most (`tcp_wmem`'s maximum),
/// so a peer that never reads stops short of the end of a whole-range reply.
fn batches() -> u64 {
    let wmem_max: u64 = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_wmem")
        .ok()
        .and_then(|s| s.split_whitespace().nth(2)?.parse().ok())
        .unwrap_or(4 << 20);
    (2 * wmem_max).div_ceil(5 << 10).max(1500)
}
/// Tokens per stored block: ids past 65,535 take five bytes each.
const TOKENS: usize = 1024;

/// Runs `name` alone in a child process (its memory is then its own) and
/// returns whether this call is that child.
fn alone(name: &str) -> bool {
    const ALONE: &str = "KVCR_TEST_ALONE";
    if std::env::var(ALONE).is_ok() {
        return true;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--test-threads=1", "--nocapture"])
        .env(ALONE, "1")
        .output()
        .unwrap();
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("1 passed"),
        "isolated run failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    false
}

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib << 10
}

/// A publisher with replay whose buffer holds [`batches`] batches of about
/// 5 KiB after the attach barrier, one store per batch.
fn filled(mut cfg: PublisherConfig) -> Publisher {
    cfg.limits.max_events = 1;
    let publisher = Publisher::start(cfg).unwrap();
    let mut sink = publisher.sink();
    for k in 1..=batches() {
        sink.publish(&stored(
            scope(Owner::Kvcr, 1, Medium::CpuPinned),
            &[k],
            None,
            vec![70_000; TOKENS],
            TOKENS as u32,
            None,
        ));
    }
    wait_until("every store sequenced", Duration::from_secs(60), || {
        publisher.stats().core.batches > batches()
    });
    publisher
}

/// A DEALER that asks for a replay from `start` and never reads; its own
/// buffers are tiny, so what it is sent piles up at the publisher.
fn silent_peer(ctx: &zmq::Context, replay_ep: &str, start: u64) -> zmq::Socket {
    let d = ctx.socket(zmq::DEALER).unwrap();
    d.set_rcvhwm(1).unwrap();
    d.set_rcvbuf(4096).unwrap();
    d.set_linger(0).unwrap();
    d.connect(replay_ep).unwrap();
    d.send_multipart([&b""[..], &start.to_be_bytes()], 0)
        .unwrap();
    d
}

/// Asks for a replay from `start` and reads it to the end marker: the
/// sequence numbers received.
fn replay(d: &zmq::Socket, start: u64) -> Vec<u64> {
    d.send_multipart([&b""[..], &start.to_be_bytes()], 0)
        .unwrap();
    read_to_end(d)
}

/// Reads a reply to its end marker: the sequence numbers received.
fn read_to_end(d: &zmq::Socket) -> Vec<u64> {
    let mut seqs = Vec::new();
    loop {
        let f = d.recv_multipart(0).expect("a replay reply");
        assert_eq!(f.len(), 4, "[\"\", topic, seq, payload]");
        if f[2] == [0xff; 8] {
            assert!(f[1].is_empty() && f[3].is_empty(), "end marker");
            return seqs;
        }
        seqs.push(u64::from_be_bytes(f[2].as_slice().try_into().unwrap()));
    }
}

fn honest_dealer(ctx: &zmq::Context, replay_ep: &str) -> zmq::Socket {
    let d = ctx.socket(zmq::DEALER).unwrap();
    d.set_rcvtimeo(30_000).unwrap();
    d.set_linger(0).unwrap();
    d.connect(replay_ep).unwrap();
    d
}

const SILENT_TEST: &str = "bounds::silent_replay_peers_cannot_grow_the_publisher";

/// Names the replay endpoint the attacker process dials.
const ATTACK: &str = "KVCR_TEST_REPLAY_ATTACK";

/// The attacker, in a process of its own (this test binary again): 64
/// silent DEALERs ask `replay_ep` for the whole buffer, `ATTACKING` is
/// printed, and they stay until stdin closes.
fn attack(replay_ep: &str) {
    let ctx = zmq::Context::new();
    let silent: Vec<zmq::Socket> = (0..64).map(|_| silent_peer(&ctx, replay_ep, 0)).collect();
    println!("ATTACKING");
    std::io::stdout().flush().unwrap();
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop((silent, ctx));
}

/// Starts the attacker process and returns once its requests are sent.
fn spawn_attacker(replay_ep: &str) -> Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", SILENT_TEST, "--test-threads=1", "--nocapture"])
        .env("KVCR_TEST_ALONE", "1")
        .env(ATTACK, replay_ep)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // libtest has printed the test's name on the same line.
    let attacking = lines
        .by_ref()
        .map_while(Result::ok)
        .any(|l| l.ends_with("ATTACKING"));
    // The rest is drained, so the attacker's last words find a reader.
    std::thread::spawn(move || lines.for_each(drop));
    assert!(attacking, "the attacker process did not start");
    child
}

/// 64 silent DEALERs in another process each ask for the whole buffer
/// (twice the kernel's socket buffering): what the publisher holds for them
/// stays under the byte cap, in its own count and in its process's resident
/// memory, while an honest DEALER replays the whole range and an honest
/// subscriber gets every live batch; when the silent peers leave, nothing
/// stays charged.
#[test]
fn silent_replay_peers_cannot_grow_the_publisher() {
    if let Ok(replay_ep) = std::env::var(ATTACK) {
        attack(&replay_ep);
        return;
    }
    if !alone(SILENT_TEST) {
        return;
    }
    let _g = sockets_lock();
    const CAP: usize = 1 << 20;
    let mut cfg = config(40);
    cfg.replay_limits.queued_bytes = CAP;
    let publisher = filled(cfg);
    let replay_ep = dial(publisher.bound().replay_bound.as_ref().unwrap());
    let (_sub_ctx, subscriber) = sub(&dial(publisher.bound().pub_bound.as_ref().unwrap()));
    let mut sink = publisher.sink();
    let mut key = 10 * batches();
    let first = until_received(&mut sink, &subscriber, &mut key);
    let mut live_seq = u64::from_be_bytes(first[1].as_slice().try_into().unwrap());
    let before = rss_bytes();

    let mut attacker = spawn_attacker(&replay_ep);
    // Each silent peer takes what the kernel's buffers hold, then stops.
    wait_until_stats(&publisher, "every silent peer stopped reading", |s| {
        s.replay_requests >= 64 && s.replay_stalled == s.replay_open
    });
    // An honest replayer gets the whole range, in order, beside them.
    let ctx = zmq::Context::new();
    let honest = honest_dealer(&ctx, &replay_ep);
    let newest = publisher.stats().core.batches - 1;
    let seqs = replay(&honest, 0);
    assert_eq!(seqs.first(), Some(&0));
    assert!(
        seqs.last().is_some_and(|&l| l >= newest),
        "{:?}",
        seqs.last()
    );
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "contiguous");
    // An honest subscriber gets every live batch.
    for _ in 0..100 {
        key += 1;
        sink.publish(&stored(
            scope(Owner::Kvcr, 1, Medium::CpuPinned),
            &[key],
            None,
            vec![1, 2],
            2,
            None,
        ));
        let mut got = None;
        wait_until("a live batch", Duration::from_secs(10), || {
            got = subscriber.recv_multipart(0).ok();
            got.is_some()
        });
        let seq = u64::from_be_bytes(got.unwrap()[1].as_slice().try_into().unwrap());
        assert_eq!(seq, live_seq + 1, "no live batch lost");
        live_seq = seq;
    }
    // Every silent peer has been offered the whole range by now (the honest
    // replay ran after them): the memory they cost is bounded by the cap
    // plus ZMQ's own per-connection buffers (a few tens of KiB each).
    let grown = rss_bytes().saturating_sub(before);
    println!(
        "resident memory grew by {} KiB; {:?}",
        grown >> 10,
        publisher.stats()
    );
    let slack = 32 << 20;
    assert!(
        grown <= (CAP + slack) as u64,
        "resident memory grew by {} KiB with 64 silent replay peers",
        grown >> 10
    );
    let s = publisher.stats();
    assert!(s.replay_displaced <= 1 && s.replay_refused == 0, "{s:?}");
    assert!(s.replay_queued_peak <= CAP as u64, "{s:?}");
    // What one 8-byte request costs while its peer does not read: two
    // messages at most (each a batch and its frames).
    let message = (5 + 64 + 8 + 6 * TOKENS) as u64;
    assert!(s.replay_queued_bytes <= 64 * 2 * message, "{s:?}");
    assert!(s.replay_queued_bytes > 0, "the silent peers are charged");

    // The silent peers leave: nothing stays charged.
    drop(attacker.stdin.take());
    assert!(attacker.wait().unwrap().success());
    // The honest replayer is still connected: at most its last batch and
    // end marker stay charged.
    wait_until_stats(&publisher, "the silent peers released", |s| {
        s.replay_queued_bytes <= message + 64 && s.replay_open == 0
    });
    drop((honest, ctx));
    wait_until_stats(&publisher, "everything released", |s| {
        s.replay_queued_bytes == 0
    });
    publisher.close().unwrap();
}

fn wait_until_stats(publisher: &Publisher, what: &str, cond: impl Fn(&PublisherStats) -> bool) {
    wait_until(what, Duration::from_secs(30), || cond(&publisher.stats()));
}

/// Past `max_replies` replies in progress, a new requester takes the place
/// of the peer that has gone longest without reading; that peer, when it
/// reads, finds its reply cut short by the end marker (it is not left
/// waiting), and the others get theirs whole.
#[test]
fn past_the_reply_cap_the_longest_unread_peer_makes_room() {
    let _g = sockets_lock();
    let mut cfg = config(41);
    cfg.replay_limits.max_replies = 4;
    let publisher = filled(cfg);
    let replay_ep = dial(publisher.bound().replay_bound.as_ref().unwrap());
    let ctx = zmq::Context::new();
    let silent: Vec<zmq::Socket> = (0..4).map(|_| silent_peer(&ctx, &replay_ep, 0)).collect();
    wait_until_stats(&publisher, "four silent peers stopped reading", |s| {
        s.replay_stalled == 4
    });
    let honest = honest_dealer(&ctx, &replay_ep);
    let whole: Vec<u64> = (0..=batches()).collect();
    assert!(replay(&honest, 0) == whole, "the newcomer's reply is whole");
    let s = publisher.stats();
    assert_eq!((s.replay_displaced, s.replay_refused), (1, 0), "{s:?}");
    let mut cut = 0;
    for d in &silent {
        d.set_rcvtimeo(30_000).unwrap();
        let seqs = read_to_end(d);
        assert_eq!(seqs.first(), Some(&0));
        assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "contiguous");
        if seqs != whole {
            cut += 1;
        }
    }
    assert_eq!(cut, 1, "one reply was given up, the others completed");
    drop((silent, honest, ctx));
    publisher.close().unwrap();
}

/// The sockets bind loopback only unless the configuration says otherwise:
/// a wildcard or another address is a typed error before anything binds.
#[test]
fn binding_beyond_loopback_needs_an_explicit_scope() {
    let _g = sockets_lock();
    for addr in [
        "tcp://*:0",
        "tcp://0.0.0.0:0",
        "tcp://[::]:0",
        "tcp://10.1.2.3:0",
    ] {
        let bind = BindAddress::parse(addr).unwrap();
        let mut replay_wide = config(42);
        replay_wide.replay = Some(bind.clone());
        let mut pub_wide = config(42);
        pub_wide.pub_socket = kvcr_publisher::PubSocket::Bind(bind);
        for cfg in [replay_wide, pub_wide] {
            let err = Publisher::start(cfg).unwrap_err();
            assert!(
                matches!(
                    err.publisher_reason(),
                    Some(PublisherReason::NotLoopback(_))
                ),
                "{addr}: {err}"
            );
        }
    }
    let mut wide = config(43);
    wide.replay = Some(BindAddress::parse("tcp://*:0").unwrap());
    wide.bind_scope = BindScope::AnyAddress;
    let p = Publisher::start(wide).unwrap();
    assert!(p.bound().replay_bound.as_ref().unwrap().is_wildcard());
    p.close().unwrap();
}

/// Dynamo's standalone indexer, registered late beside 64 silent DEALERs
/// that asked for the whole buffer, replays its gap through the same
/// socket and answers exactly what was published.
#[test]
fn dynamo_indexer_converges_beside_silent_replay_peers() {
    let _g = sockets_lock();
    let Some(py) = real_client("KVCR_TEST_DYNAMO", "import dynamo.llm") else {
        return;
    };
    if !private_netns(std::env::var("KVCR_TEST_DYNAMO").is_ok_and(|v| v == "1")) {
        return;
    }
    let ix = start_indexer(&py, 18092, "indexer-bounds");
    let mut cfg = config(45);
    cfg.ownership = OwnershipWire::Stream;
    cfg.heartbeat = Some(Duration::from_millis(20));
    // The filler batches' block size is not the indexer's: it decodes and
    // skips them, so its replay carries the whole buffer.
    let publisher = filled(cfg);
    let tokens: Vec<u32> = (1..=16).collect();
    let cpu = scope(Owner::Kvcr, 1, Medium::CpuPinned);
    // Keys past the fillers' (a live key would not be published again).
    let first = batches() + 1;
    publisher.sink().publish(&stored(
        cpu,
        &[first, first + 1, first + 2, first + 3],
        None,
        tokens.clone(),
        BS,
        None,
    ));
    let replay_ep = dial(publisher.bound().replay_bound.as_ref().unwrap());
    let ctx = zmq::Context::new();
    let silent: Vec<zmq::Socket> = (0..64).map(|_| silent_peer(&ctx, &replay_ep, 0)).collect();
    wait_until_stats(&publisher, "every silent peer stopped reading", |s| {
        s.replay_requests >= 64 && s.replay_stalled == s.replay_open
    });
    register(&ix, 45, &publisher);
    let want = serde_json::json!({"45": tier(16, 16, 16)});
    let mut got = serde_json::Value::Null;
    let converged = super::publisher::support::wait_for(Duration::from_secs(60), || {
        got = query(&ix, &tokens, None);
        got == want
    });
    assert!(
        converged,
        "got {got}, want {want}\nindexer log:\n{}",
        ix.log_tail()
    );
    let s = publisher.stats();
    assert!(s.replay_requests > 64, "the indexer replayed: {s:?}");
    assert!(s.replay_queued_peak <= 64 << 20, "{s:?}");
    drop((silent, ctx));
    publisher.close().unwrap();
}
