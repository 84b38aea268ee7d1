//! The wire logic, sans-I/O: what the peer protocol's records, parts and
//! numbering mean, apart from the sockets and memory that carry them. No
//! module here opens a socket, starts a thread, reads a clock or uses
//! `unsafe`; the drivers ([`crate::net`] and the peer thread) feed them
//! what arrived and act on what they decide.
//!
//! * [`record`]: record keys ([`record::RecordKey`]) and what they seal: a
//!   doorbell slot's record, a write message's header, a data stream's
//!   proof.
//! * [`part`]: how a write is cut into message parts, and which landed.
//! * [`region`]: the doorbell region's layout (slots, then mailboxes).
//! * [`mailbox`]: request records and how a source reads its mailbox.
//! * [`doorbell`]: a target's keys and awaited operations, a source's
//!   doorbell on a route.
//! * [`numbering`]: a control session's messages counted on both ends
//!   ([`numbering::MessageCount`]), so a request taken early from a mailbox
//!   is handled once and its copy dropped.
//! * [`frame`]: a data stream's hello and frames, and how a target lands
//!   them.
//! * [`route_proof`]: the nonce a source sends an advertised UCX worker
//!   before it puts anything through it.
//! * [`sealing`]: a data stream's AEAD records: its key, derived from the
//!   session it proved, and the numbers its records are sealed under.

pub(crate) mod doorbell;
pub(crate) mod frame;
pub(crate) mod mailbox;
pub(crate) mod numbering;
pub(crate) mod part;
pub(crate) mod record;
pub(crate) mod region;
pub(crate) mod route_proof;
pub(crate) mod sealing;
