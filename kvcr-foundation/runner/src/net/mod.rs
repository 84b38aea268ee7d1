//! The peer network: the control channel (authenticated, encrypted
//! sessions over tokio TCP, carrying the foundation codec's frames) and the
//! data streams beside it.
//!
//! # Sessions
//! * Every connection starts with a Noise `XXpsk0` handshake (X25519,
//!   ChaCha20-Poly1305, BLAKE2s; the `snow` crate) whose pre-shared key is
//!   derived from the cluster secret, and in which each side proves its
//!   static member key ([`StaticKey`]). Only a process that knows the secret
//!   completes it; an ephemeral key exchange gives each session its own keys,
//!   so nothing recorded from one session can be replayed into another.
//! * The acceptor's identity (its control endpoint and incarnation) travels in
//!   the handshake's second message; the dialer's in the third. The acceptor
//!   treats a session as open only once that message decrypts: a replayed
//!   first handshake message gets nowhere.
//! * **Identity is a member key.** A runner's advertised endpoint names its
//!   key (`tcp://host:port?key=…`). A dialer refuses an acceptor proving
//!   another key than the dialed endpoint names, and dials an endpoint naming
//!   none only as [`KeylessSources`] allows; an acceptor refuses a claimed
//!   endpoint naming another key than the dialer proved and adds the proven
//!   key to one naming none, so accepted sessions are keyed by member.
//! * After the handshake every byte is a Noise transport record (`u16` length,
//!   ciphertext with a 16-byte tag, implicit counter nonce). A forged, altered,
//!   replayed, reordered or dropped record fails to decrypt and closes the
//!   session.
//! * **Identity comes from the session.** Each inbound message's header is
//!   rewritten with the session's peer (for a session we dialed: the endpoint
//!   we dialed and the incarnation that answered; for one we accepted: the
//!   identity the dialer authenticated), whatever the frame claimed.
//! * **One direction per role.** A session we dial carries our requests as a
//!   target (metadata, `start_write`, probes) and brings back only the
//!   source's replies; a session we accept brings only a target's requests and
//!   carries our replies back on the same session. A message in the wrong
//!   direction closes the session. So a completion can only come from the
//!   process we asked, on the connection we asked on.
//! * Without a cluster secret the key is a fixed public one: the runner then
//!   listens on loopback only (`config::control_bind_address` enforces it),
//!   and everything above still holds between local processes.
//!
//! # Bounds (per [`ControlLimits`])
//! Connections still in their handshake wait in places of their own, in
//! total and per remote address, a newcomer displacing the oldest of the
//! fullest address when they are full ([`admission`]); sessions (and data
//! streams) in total and per remote address once the handshake is done, a
//! handshake deadline, a deadline for a started frame to complete, an idle
//! timeout on accepted sessions, a maximum frame length, and a per-session
//! budget of inbound bytes not yet handled by the runner (a flooding peer is
//! slowed by TCP backpressure; other peers' budgets are their own), and a
//! per-session bound of sealed bytes not yet written to the peer. Outgoing
//! queues drop (and count) on overflow; the protocol's deadlines and probes
//! recover. A failed `accept` (e.g. out of file descriptors) backs off instead
//! of spinning.
//!
//! # Sending
//! A message is sealed in the sender's turn onto its session's
//! [`SessionOut`](channel::SessionOut) and written by
//! [`ControlChannel::flush`] at the end of that turn (all of a turn's
//! messages to one peer in one write), not handed to the session
//! task first: from the peer thread's send to the socket write took 5–9 µs
//! through the task, 3–4 µs now (encoding and sealing), twice per one-block
//! restore. What the socket does not take at once (and anything sent while
//! no one flushes) the session task writes as the socket drains, under the
//! frame deadline; at most [`ControlLimits::outbound_bytes_per_session`]
//! bytes wait per session. Sealing
//! and writing happen under the session's lock, so records leave in nonce
//! order whoever writes them.
//!
//! # Where things are
//! * [`listener`]: the accept loop and the preamble that tells a control
//!   session from a data stream (handed to [`stream`] whole).
//! * [`admission`]: the places a connection holds while its handshake runs
//!   and after it (the caps, and who is displaced when they are full).
//! * [`session`]: the Noise handshake, [`PeerIdentity`], sealing and
//!   opening records, and `run_session`, the task of one session.
//! * [`channel`]: [`ControlChannel`] (the peer thread's handle), each
//!   session's [`SessionOut`](channel::SessionOut) and its queue.
//! * [`limits`]: [`ControlLimits`] and the counters ([`ControlCounters`]).
//! * [`stream`]: data streams (a target's frames straight into its slots).
//! * [`client`]: a blocking client for tools and tests.
//! * [`doorbell`]: doorbell slots and mailboxes in shared memory (a
//!   same-host shortcut beside the control session).
//!
//! The record formats, mailbox numbering and frame landing these carry are
//! sans-I/O, in [`crate::wire`].

mod admission;
mod channel;
pub mod client;
pub(crate) mod doorbell;
mod limits;
mod listener;
pub(crate) mod member;
mod session;
pub(crate) mod stream;
#[cfg(test)]
mod tests;

pub(crate) use self::channel::{ChannelEvent, ControlChannel, Inbound};
pub(crate) use self::limits::ControlStats;
pub use self::limits::{ControlCounters, ControlLimits};
pub use self::member::{KeylessSources, StaticKey};
pub(crate) use self::session::PeerIdentity;
pub(crate) use self::stream::AcceptedStream;
