//! Admission between real runners: connections that never finish a
//! handshake take their own places, apart from members' sessions, so a
//! flood of them from many addresses stops no member, whether its session
//! predates the flood or is dialed during it.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use kvcr_runner::PeerOptions;
use rstest::rstest;

use crate::nodes::{Node, assert_restored, fetch_on_hint, hint, node_with, stock};

const SECRET: &[u8] = b"admission-tests-cluster-secret-0123456789";

fn member_options(tls: &str) -> PeerOptions {
    let mut options = PeerOptions::loopback();
    options.ucx_tls = Some(tls.to_owned());
    options.secret = Some(SECRET.to_vec());
    options
}

fn member(tls: &str, blocks: u32) -> Node {
    node_with(&member_options(tls), blocks, Duration::from_secs(5))
}

/// Connections that connect and never say a word, `per_address` from each
/// of `addresses` loopback addresses (127.0.0.2 on), each re-opened when the
/// source drops it, until dropped.
struct SilentFlood {
    stop: Arc<AtomicBool>,
    /// Connections the first round opened.
    opened: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SilentFlood {
    fn start(to: SocketAddr, addresses: u8, per_address: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let opened = Arc::new(AtomicUsize::new(0));
        let thread = {
            let (stop, opened) = (Arc::clone(&stop), Arc::clone(&opened));
            std::thread::spawn(move || {
                let froms: Vec<Ipv4Addr> = (0..addresses)
                    .flat_map(|a| std::iter::repeat_n(Ipv4Addr::new(127, 0, 0, 2 + a), per_address))
                    .collect();
                let mut held: Vec<Option<std::net::TcpStream>> = Vec::new();
                for from in &froms {
                    held.push(connect_from(*from, to));
                    opened.fetch_add(1, Ordering::Relaxed);
                }
                while !stop.load(Ordering::Relaxed) {
                    // Paced: the flood is the held connections, not a storm
                    // of new ones (this paces the attacker; nothing waits
                    // on it).
                    #[allow(clippy::disallowed_methods)]
                    std::thread::sleep(Duration::from_millis(20));
                    for (slot, from) in held.iter_mut().zip(&froms) {
                        if slot.as_ref().is_none_or(closed) {
                            *slot = connect_from(*from, to);
                        }
                    }
                }
            })
        };
        Self {
            stop,
            opened,
            thread: Some(thread),
        }
    }

    fn opened(&self) -> usize {
        self.opened.load(Ordering::Relaxed)
    }
}

impl Drop for SilentFlood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap();
        }
    }
}

/// A connection to `to` from the loopback address `from` (loopback has all
/// of 127.0.0.0/8), non-blocking; `None` if it failed.
fn connect_from(from: Ipv4Addr, to: SocketAddr) -> Option<std::net::TcpStream> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ok()?;
    let stream = runtime.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().ok()?;
        socket.bind(SocketAddr::new(from.into(), 0)).ok()?;
        socket.connect(to).await.ok()
    })?;
    let stream = stream.into_std().ok()?;
    stream.set_nonblocking(true).ok()?;
    Some(stream)
}

/// Whether the other end closed `stream` (the source never writes to a
/// connection that did not start a handshake).
fn closed(stream: &std::net::TcpStream) -> bool {
    let mut byte = [0u8; 1];
    match std::io::Read::read(&mut &*stream, &mut byte) {
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
        Ok(_) => true,
    }
}

/// 16 addresses × 16 connections that never start a handshake, held (and
/// re-opened when dropped) throughout: a member whose session predates the
/// flood and a member that first dials during it both restore every page,
/// byte-exact. The strangers' connections never take a member's place:
/// they wait in places of their own, and a member's new connection takes
/// the oldest of them when those are full.
#[rstest]
#[case::shm("posix,cma,self")]
#[case::tcp("tcp,self")]
fn honest_restores_complete_during_a_silent_connection_flood(#[case] tls: &str) {
    let _serial = crate::serial();
    let mut options = member_options(tls);
    // The strangers are never cut off by the handshake deadline here: only
    // admission can make room for a member.
    options.limits.handshake_timeout = Duration::from_secs(600);
    let mut source = node_with(&options, 32, Duration::from_secs(5));
    let all: Vec<u64> = (0..32).collect();
    stock(&mut source, &all);
    let endpoint = source.runner.peers().endpoint().unwrap().clone();
    let to = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), endpoint.port());

    // A member with a session from before the flood.
    let mut early = member(tls, 32);
    let result = fetch_on_hint(&mut early, "early-0", &hint(&source, &all[..8]), &all[..8]);
    assert_restored(&early, &source, &result, &all[..8]);

    let flood = SilentFlood::start(to, 16, 16);
    crate::wait_until("the flood's connections", Duration::from_secs(60), || {
        flood.opened() == 256
    });
    // The source accepts in arrival order: every stranger is in, filling
    // the waiting places, before a member dials below.
    let waiting = || source.runner.peers().control_stats().handshakes_waiting;
    crate::wait_until(
        "the source to hold the strangers",
        Duration::from_secs(60),
        || waiting() == 256,
    );

    // The early member's session carries on; a new member dials during the
    // flood; both restore everything asked, twice.
    let mut late = member(tls, 32);
    for (round, keys) in all[8..].chunks(6).enumerate() {
        let (node, name) = if round % 2 == 0 {
            (&mut late, "late")
        } else {
            (&mut early, "early")
        };
        let request = format!("{name}-{round}");
        let result = fetch_on_hint(node, &request, &hint(&source, keys), keys);
        assert_restored(node, &source, &result, keys);
    }
    // The strangers held their places throughout, but for those the
    // members' connections displaced (and the flood re-opened).
    let control = source.runner.peers().control_stats();
    assert!(control.handshakes_waiting >= 240, "{control:?}");
    assert!(control.evicted_handshakes >= 1, "{control:?}");
    assert_eq!(control.refused_connections, 0);
    source.runner.check_invariants().unwrap();
    drop(flood);
}
