//! The listener: accepts connections on the control port (with a back-off
//! when `accept` fails), each first in a place of its own while its
//! handshake runs, then, once done, under the caps on sessions
//! ([`super::admission`]); reads each connection's preamble, and hands it
//! on: a control session to its Noise handshake ([`super::session`]), a data
//! stream to [`super::stream`] (whose hello it does not read itself). What
//! an accepted connection turned out to be goes to the peer thread as an
//! [`Inbound`] item.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};

use super::admission::{AdmissionGuard, WaitingPlace};
use super::channel::{Inbound, Link, SessionOut, Shared, Side};
use super::limits::SocketGuard;
use super::session::{self, LocalMember, PREAMBLE, PeerIdentity, Refusal, run_session};
use super::stream::{self, AcceptedStream, StreamHello, StreamHold};

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
        // Never refused here: it waits in a place of its own (displacing
        // the oldest waiting one when those are full), apart from sessions.
        let waiting = WaitingPlace::take(&shared, from.ip());
        let _ = stream.set_nodelay(true);
        tokio::spawn(accept_session(stream, waiting, Arc::clone(&shared)));
    }
}

/// Answers one accepted connection and, for a control session, runs it.
async fn accept_session(mut stream: TcpStream, waiting: WaitingPlace, shared: Arc<Shared>) {
    let socket = SocketGuard::new(&shared.stats);
    let me = shared.local_member();
    let answered = tokio::select! {
        answered = tokio::time::timeout(
            shared.limits.handshake_timeout,
            answer(&mut stream, &shared.psk, &me),
        ) => answered,
        // A newer connection took its place (counted then).
        () = waiting.displaced() => return,
    };
    let (transport, peer) = match answered {
        Ok(Ok(Accepted::Session(transport, peer))) => (transport, peer),
        Ok(Ok(Accepted::Stream(hello))) => {
            // Proven (or not) on the peer thread, which holds the keys; it
            // waits in its place until then.
            let hold = StreamHold::new(waiting, socket);
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
    // Done waiting: from here it holds a session's place, if one is free.
    let Some(admission) = AdmissionGuard::admit(&shared, waiting.address()) else {
        shared
            .stats
            .refused_connections
            .fetch_add(1, Ordering::Relaxed);
        return;
    };
    drop(waiting);
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
