//! Compat shim: removed once the split lands. Same-host one-copy writes
//! between runners: memfd pools and files ([`kvcr_sys::memfd`]), peers'
//! mapped segments ([`kvcr_sys::segment`]) and the volatile loads and
//! stores of shared records ([`kvcr_sys::seqlock`]) live in `kvcr_sys`;
//! this module keeps the crate-internal paths the driver modules use.

pub(crate) use kvcr_sys::memfd::{HostScope, JournalMap, SharedPool};
pub(crate) use kvcr_sys::segment::PeerSegment;
pub(crate) use kvcr_sys::seqlock::{publish_shared, read_shared};
