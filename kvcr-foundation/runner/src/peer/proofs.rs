//! Route ownership: a UCX route is used only once the worker it connects
//! to proved it belongs to the target whose session advertised it. As a
//! source, we send that worker a fresh nonce ([`NonceMessage`]) and hold
//! the route until the nonce comes back, as a `route_proof`, on the very
//! session the advert came on (else it fails as unproven at the handshake
//! deadline). As a target, a nonce our worker receives goes back only on
//! the session we dialed to the source it names, and only when that
//! session proved the incarnation it names. A member that advertises
//! another process's worker address (a replay, with bases of its choosing)
//! never learns the nonce: the process it names answers on its own session
//! or not at all.

use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::protocol::{Body, Header, Message, RouteGeneration};
use kvcr_runner_core::ConnectFailure;
use kvcr_ucx::{ActiveMessage, Completion};

use super::State;
use super::routes::{Route, retire};
use crate::shared::Shared;
use crate::wire::route_proof::{NonceMessage, ROUTE_PROOF};

/// A UCX route waiting for its worker's proof.
pub(super) struct UnprovenRoute {
    route: Rc<Route>,
    generation: u64,
    nonce: [u8; 32],
    /// The session the advert came on: the proof counts only there.
    session: u64,
    /// When it fails as unproven.
    deadline: Instant,
    /// The nonce's send (dropped with the route).
    _sent: Completion,
}

impl State {
    /// Holds `route` (of `generation`, a UCX route to `peer`) until its
    /// worker proves it is `peer`'s: the nonce goes out now. A route that
    /// cannot be proven (no advert session known, no randomness, the send
    /// refused) fails at once.
    pub(super) fn prove_route(
        &mut self,
        shared: &Arc<Shared>,
        peer: ControlEndpoint,
        generation: u64,
        route: Rc<Route>,
    ) {
        let session = self.advert_sessions.get(&peer).copied();
        let nonce = NonceMessage::generate(self.incarnation, self.endpoint.clone());
        let sent = match (session, nonce, route.ucx_endpoint()) {
            (Some(session), Some(nonce), Some(endpoint)) => endpoint
                .send_message(ROUTE_PROOF, &nonce.encode(), &[])
                .ok()
                .map(|sent| (session, nonce.nonce, sent)),
            _ => None,
        };
        let Some((session, nonce, sent)) = sent else {
            retire(Some(route));
            self.route_failed(shared, &peer, generation, ConnectFailure::Unproven);
            return;
        };
        // The peer thread is the driver: its deadlines read the clock.
        #[allow(clippy::disallowed_methods)]
        let now = Instant::now();
        let unproven = UnprovenRoute {
            route,
            generation,
            nonce,
            session,
            deadline: now + self.stream_limits.0,
            _sent: sent,
        };
        // A newer advert's route replaces one still unproven.
        if let Some(old) = self.unproven.insert(peer, unproven) {
            retire(Some(old.route));
        }
    }

    /// A `route_proof` from `from` on `session`: the route waiting for it
    /// is built when the nonce is the one we sent and the session the one
    /// its advert came on; anything else is counted and ignored.
    pub(super) fn on_route_proof(
        &mut self,
        shared: &Arc<Shared>,
        from: &ControlEndpoint,
        session: u64,
        nonce: &[u8; 32],
    ) {
        let proven = self
            .unproven
            .get(from)
            .is_some_and(|u| u.session == session && u.nonce == *nonce);
        // A stray proof leaves the waiting route as it is: it may be another
        // route's nonce, handed back here by the process that route named.
        if !proven {
            self.control
                .stats
                .route_proofs_refused
                .fetch_add(1, Ordering::Relaxed);
            return;
        }
        if let Some(unproven) = self.unproven.remove(from) {
            self.route_built(shared, from.clone(), unproven.generation, unproven.route);
        }
    }

    /// Routes whose proof did not come by their deadline fail as unproven
    /// (counted by the core, and acknowledged as no route).
    pub(super) fn expire_unproven(&mut self, shared: &Arc<Shared>) {
        #[allow(clippy::disallowed_methods)]
        let now = Instant::now();
        let expired: Vec<ControlEndpoint> = self
            .unproven
            .iter()
            .filter(|(_, u)| u.deadline <= now)
            .map(|(peer, _)| peer.clone())
            .collect();
        for peer in expired {
            if let Some(unproven) = self.unproven.remove(&peer) {
                retire(Some(unproven.route));
                self.route_failed(shared, &peer, unproven.generation, ConnectFailure::Unproven);
            }
        }
    }

    /// Drops `peer`'s unproven route, if any (its session ended).
    pub(super) fn forget_unproven(&mut self, peer: &ControlEndpoint) {
        if let Some(unproven) = self.unproven.remove(peer) {
            retire(Some(unproven.route));
        }
    }

    /// A nonce our worker received: handed back as a `route_proof` on the
    /// session we dialed to the source it names, when that session proved
    /// the incarnation it names; anything else is counted and dropped.
    ///
    /// The session task writes our metadata as soon as its handshake ends
    /// and only then tells this thread, so the source's nonce can come
    /// first. One for a session we dialed that this thread has not heard
    /// proven yet is held (a few, briefly) and answered by the same rule
    /// once it has: refused then, the source's route failed as unproven and
    /// a fresh pair's first restore with it (`NoSource`, seen under load).
    pub(super) fn answer_nonce(&mut self, message: &ActiveMessage) {
        let asked = NonceMessage::decode(message.header()).filter(|_| message.data().is_empty());
        match asked {
            // The peer thread reads the clock.
            #[allow(clippy::disallowed_methods)]
            Some(asked) => self.answer_asked(asked, Instant::now()),
            None => self.refuse_proof(),
        }
    }

    /// Answers the held nonces whose session has proven who answered, and
    /// refuses those whose session closed or whose time is up.
    pub(super) fn answer_held_nonces(&mut self) {
        for held in std::mem::take(&mut self.held_nonces) {
            if held.at.elapsed() < self.stream_limits.0 {
                self.answer_asked(held.asked, held.at);
            } else {
                self.refuse_proof();
            }
        }
    }

    fn answer_asked(&mut self, asked: NonceMessage, at: Instant) {
        // The source names itself with its member key; we may have dialed
        // it by its address alone (keyless sources allowed), and then any
        // key there is the one we accepted.
        let names = [asked.endpoint.clone(), asked.endpoint.with_key(None)];
        let proven = names.iter().find(|dialed| {
            self.control
                .dialed_peer(dialed)
                .is_some_and(|(_, answered)| answered == asked.source)
        });
        let Some(dialed) = proven.cloned() else {
            let handshaking = names.iter().any(|d| self.control.dialed_unproven(d));
            if handshaking && self.held_nonces.len() < MAX_HELD_NONCES {
                self.held_nonces.push(HeldNonce { asked, at });
            } else {
                self.refuse_proof();
            }
            return;
        };
        let proof = Message {
            // The channel names the sender from the session; the header's
            // own claims are never read.
            header: Header {
                sender: self.incarnation,
                route_generation: RouteGeneration(0),
                sender_endpoint: self.endpoint.clone(),
            },
            body: Body::RouteProof { nonce: asked.nonce },
        };
        if self.control.send(&dialed, &proof).is_some() {
            self.control
                .stats
                .route_proofs_answered
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    fn refuse_proof(&self) {
        self.control
            .stats
            .route_proofs_refused
            .fetch_add(1, Ordering::Relaxed);
    }
}

/// Most nonces held for sessions still handshaking: a route is proven once
/// per source, and a worker flooding nonces gets the rest refused.
const MAX_HELD_NONCES: usize = 16;

/// A nonce waiting for its dialed session's handshake to reach this thread.
pub(super) struct HeldNonce {
    asked: NonceMessage,
    /// When it came: held at most the handshake time.
    at: Instant,
}

/// Whether a received message is a route proof's nonce.
pub(super) fn is_nonce(message: &ActiveMessage) -> bool {
    message.id() == ROUTE_PROOF
}
