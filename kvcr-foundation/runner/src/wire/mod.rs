//! The wire logic, sans-I/O: what the peer protocol's records, parts and
//! numbering mean, apart from the sockets and memory that carry them. No
//! module here opens a socket, starts a thread, reads a clock or uses
//! `unsafe`; the drivers in [`crate::net`] and the peer thread feed them
//! what arrived and act on what they decide.
//!
//! * [`numbering`]: a control session's messages counted on both ends
//!   ([`numbering::MessageCount`]), so a request taken early from a mailbox
//!   is handled once and its copy dropped.

pub(crate) mod numbering;
