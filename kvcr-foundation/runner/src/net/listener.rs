//! The listener: accepts connections on the control port under the
//! channel's caps (in total and per remote address, with a back-off when
//! `accept` fails), reads each connection's preamble, and hands it on: a
//! control session to its Noise handshake ([`super::session`]), a data
//! stream to [`super::stream`] (whose hello it does not read itself). What
//! an accepted connection turned out to be goes to the peer thread as an
//! [`Inbound`] item.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};

use super::channel::{Inbound, Link, SessionOut, Shared, Side};
use super::limits::SocketGuard;
use super::session::{self, LocalMember, PREAMBLE, PeerIdentity, Refusal, run_session};
use super::stream::{self, AcceptedStream, StreamHello, StreamHold};

/// Holds one accepted connection's place under the caps.
pub(super) struct AdmissionGuard {
    shared: Arc<Shared>,
    address: IpAddr,
}

impl AdmissionGuard {
    fn admit(shared: &Arc<Shared>, address: IpAddr) -> Option<Self> {
        let mut per_address = shared.per_address.lock().unwrap_or_else(|e| e.into_inner());
        let here = per_address.entry(address).or_insert(0);
        let total = shared.accepted.load(Ordering::Relaxed);
        if *here >= shared.limits.max_sessions_per_address || total >= shared.limits.max_sessions {
            if *here == 0 {
                per_address.remove(&address);
            }
            return None;
        }
        *here += 1;
        shared.accepted.fetch_add(1, Ordering::Relaxed);
        Some(Self {
            shared: Arc::clone(shared),
            address,
        })
    }
}

impl Drop for AdmissionGuard {
    fn drop(&mut self) {
        let mut per_address = self
            .shared
            .per_address
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(here) = per_address.get_mut(&self.address) {
            *here -= 1;
            if *here == 0 {
                per_address.remove(&self.address);
            }
        }
        self.shared.accepted.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Accepts connections until the channel is dropped.
pub(super) async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(pair) => pair,
            Err(_) => {
                // Out of descriptors (or a transient error): back off rather
                // than spin; sessions closing will free descriptors.
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        if shared.inbound.is_closed() {
            return;
        }
        let Some(admission) = AdmissionGuard::admit(&shared, from.ip()) else {
            shared
                .stats
                .refused_connections
                .fetch_add(1, Ordering::Relaxed);
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(accept_session(stream, admission, Arc::clone(&shared)));
    }
}

/// Answers one admitted connection and, for a control session, runs it.
async fn accept_session(mut stream: TcpStream, admission: AdmissionGuard, shared: Arc<Shared>) {
    let socket = SocketGuard::new(&shared.stats);
    let handshake = tokio::time::timeout(
        shared.limits.handshake_timeout,
        answer(&mut stream, &shared.psk, &shared.local_member()),
    )
    .await;
    let (transport, peer) = match handshake {
        Ok(Ok(Accepted::Session(transport, peer))) => (transport, peer),
        Ok(Ok(Accepted::Stream(hello))) => {
            // Proven (or not) on the peer thread, which holds the keys.
            let hold = StreamHold::new((admission, socket));
            let accepted = AcceptedStream::new(hello, stream, hold);
            let _ = shared.inbound.send(Inbound::Stream(accepted));
            return;
        }
        refused => {
            if let Ok(Err(Refusal::ForeignClaim)) = refused {
                shared.stats.claims_refused.fetch_add(1, Ordering::Relaxed);
            }
            shared
                .stats
                .refused_handshakes
                .fetch_add(1, Ordering::Relaxed);
            return;
        }
    };
    let _admission = admission;
    let _socket = socket;
    let id = shared.next_session.fetch_add(1, Ordering::Relaxed);
    let stream = Arc::new(stream);
    let out = SessionOut::new(Some(Link {
        stream: Arc::clone(&stream),
        transport,
    }));
    let opened = Inbound::Opened {
        session: id,
        side: Side::Accepted,
        peer: peer.clone(),
        out: Some(Arc::clone(&out)),
    };
    if shared.inbound.send(opened).is_err() {
        return;
    }
    run_session(&stream, (id, Side::Accepted), &peer, &out, &shared).await;
    out.close();
    let _ = shared.inbound.send(Inbound::Closed {
        session: id,
        side: Side::Accepted,
        peer,
    });
}

/// What an accepted connection turned out to be.
pub(crate) enum Accepted {
    /// A control session, its handshake done: its transport and the dialer.
    Session(snow::TransportState, PeerIdentity),
    /// A data stream, its hello read (its proof not yet checked).
    Stream(StreamHello),
}

/// Acceptor side of an accepted connection: reads its preamble, then
/// answers a control session's handshake (as `me`, under `psk`) or
/// challenges a data stream. A refusal for anything else.
pub(crate) async fn answer(
    stream: &mut TcpStream,
    psk: &[u8; 32],
    me: &LocalMember<'_>,
) -> Result<Accepted, Refusal> {
    let mut preamble = [0u8; PREAMBLE.len()];
    stream
        .read_exact(&mut preamble)
        .await
        .map_err(|_| Refusal::Handshake)?;
    if &preamble == stream::PREAMBLE {
        return stream::accept(stream)
            .await
            .map(Accepted::Stream)
            .ok_or(Refusal::Handshake);
    }
    if &preamble != PREAMBLE {
        return Err(Refusal::Handshake);
    }
    let (transport, dialer) = session::respond(stream, psk, me).await?;
    Ok(Accepted::Session(transport, dialer))
}
