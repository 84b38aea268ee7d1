//! The residency journal: which KVCR DRAM pages a runner holds READY, kept in
//! a byte region that outlives the runner (issue 21, the Guard).
//!
//! The runner (the primary) appends a [`JournalRecord`] for every change that
//! matters to a restart: a namespace registered, a page READY with all its
//! bytes, a page's residency ended (journaled before its slots can be written
//! again), slots granted to a peer's remote write and freed again. The region
//! is a slice of a shared memfd mapping that a guard process keeps open; this
//! module only ever sees `&[u8]` / `&mut [u8]` (no I/O, no unsafe).
//!
//! When the primary dies (SIGKILL at any instant, so a record may be half
//! written), a restarted primary or the guard calls [`recover`](fn@recover) on the same
//! bytes and gets back exactly the pages whose records were complete, plus the
//! slots it must never reuse ([`Recovered::held`]). Recovering fewer pages is
//! allowed; recovering a page whose slots were reused or never fully written is
//! not, so anything the reader cannot explain as a torn tail is
//! [`JournalError::Corrupt`]. A warm restart then continues with
//! [`JournalWriter::resume`].
//!
//! # Format (version 1, all integers little-endian)
//!
//! ```text
//! region = header (64 bytes) | half 0 | half 1 | (< 16 unused bytes)
//! half   = ((region length - 64) / 2) rounded down to a multiple of 8
//!
//! header:  0  magic "KVCRJNL1"
//!          8  version u32 (1)
//!         12  state u32: 0 = Ok, anything else = Disabled (1 Overflow, 2 Requested)
//!         16  region length u64
//!         24  half length u64
//!         32  commit slot of half 0: epoch u64 | crc32 u32 | 0 u32
//!         48  commit slot of half 1: epoch u64 | crc32 u32 | 0 u32
//!
//! record frame (8-byte aligned inside its half, zero padded to 8 bytes):
//!          0  len u32     payload length, 1..=MAX_PAYLOAD
//!          4  crc32 u32   over epoch u64 | len u32 | seq u64 | payload
//!          8  seq u64     1 for a half's first record, then +1 each
//!         16  payload     tag u8, then the fields below
//!
//! payloads:  1 Namespace  id u64 | compat u64 | lora_name opt-str | cache_salt opt-str
//!            2 Ready      namespace u64 | key u64 | layout u16 | parent opt-u64
//!                         | slots u32-list | token_ids u32-list
//!            3 Removed    namespace u64 | key u64
//!            4 Held       slots u32-list
//!            5 Freed      slots u32-list
//! opt-str  = 0 | 1, len u32 (<= MAX_STRING), UTF-8 bytes
//! opt-u64  = 0 | 1, u64
//! u32-list = count u32 (<= MAX_SLOTS slots, <= MAX_TOKEN_IDS tokens), count u32s
//! ```
//!
//! A commit slot is valid when its epoch is at least 1, its reserved word is
//! zero and its crc32 (over `"KVCRSLOT"`, the half's index as one byte and the
//! epoch) matches. The active half is the one whose slot is valid with the
//! higher epoch; the checksum makes a torn slot write read as invalid, never as
//! another epoch. A frame's checksum covers its half's epoch, so a stale frame
//! never passes in another epoch.
//!
//! # Writing
//!
//! [`JournalWriter::format`] zeroes the region, writes the header and commits
//! half 0 at epoch 1. Appends go to the active half: the payload, then the
//! frame header (a compiler fence after each record keeps program order, which
//! is the order a killed process leaves its stores in). A half is all zeroes
//! past its last record, so the end of the records is well defined.
//!
//! Compaction: when a record does not fit in the active half, the writer
//! zeroes the other half, writes its mirror of the live state there as a
//! snapshot (namespaces, then the held slots, then every live page, oldest
//! first), commits that half by writing its slot with the epoch plus one (the
//! flip: one 16-byte write), invalidates the old half's slot, and then appends
//! the record. A crash before the flip leaves the old half active and intact;
//! after it, the new half holds the same state.
//!
//! If the snapshot plus the record does not fit in a half, the journal is
//! overflowed: the state word becomes `Disabled(Overflow)` and every later
//! append is refused with [`JournalError::Disabled`]; [`recover`](fn@recover) then answers
//! `Disabled` too, so a restart is cold (the runner keeps serving, only
//! without warm recovery).
//!
//! # Reading
//!
//! [`recover`](fn@recover) checks the header, picks the active half and reads its records
//! in order, checking each against the state so far (a Ready of a page live
//! already, of an unknown namespace, or on slots another page or a hold owns;
//! a Removed of a page not live; a Freed of a slot not held: all corrupt). The
//! records end at the first frame that is not complete and in sequence. If the
//! rest of the half is zero, that is the clean end; if not, it is a torn tail
//! (the record being written when the writer died) unless a complete frame
//! numbered at or after the expected one starts at any 8-byte boundary after
//! it, which only damage in the middle of the half can cause: that is corrupt,
//! because dropping a record in the middle (a Removed, say) could serve a page
//! whose slots were written again. (A LoRA name or salt crafted to hold such a
//! frame inside a torn record can only make a restart cold, never wrong.)
//!
//! No length read from the region is trusted before it is checked against its
//! cap and against the bytes that remain, so no input makes the reader panic or
//! allocate more than the input's size.

mod codec;
mod crc;
mod error;
mod layout;
mod live;
mod record;
mod recover;
mod writer;

#[cfg(test)]
mod tests;

pub use error::{DisabledReason, JournalError, Refusal};
pub use layout::{
    FRAME_HEADER_LEN, HEADER_LEN, MAGIC, MAX_PAYLOAD, MAX_SLOTS, MAX_STRING, MAX_TOKEN_IDS,
    MIN_HALF_LEN, MIN_REGION_LEN, VERSION,
};
pub use record::{JournalRecord, Recovered, RecoveredNamespace, RecoveredPage};
pub use recover::recover;
pub use writer::{JournalStats, JournalWriter};
