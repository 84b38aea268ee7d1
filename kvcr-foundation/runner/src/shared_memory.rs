//! Compat shim, kept only for `guard/` and `warm.rs` (being moved into
//! their own crate by another change; they switch to `kvcr_sys::memfd`
//! then and this file goes): the memfd pool and journal files.

#[cfg(test)]
pub(crate) use kvcr_sys::memfd::SharedPool;
pub(crate) use kvcr_sys::memfd::{JournalMap, create_journal_file, create_pool_file};
