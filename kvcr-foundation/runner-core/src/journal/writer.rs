//! The primary's side: appends, compaction into the other half, and the
//! flip that commits it.

use std::borrow::Cow;
use std::sync::atomic::{Ordering, compiler_fence};

use super::codec::View;
use super::crc::{frame_crc, slot_crc};
use super::error::{DisabledReason, JournalError};
use super::layout::{
    FRAME_HEADER_LEN, HEADER_LEN, Half, MAGIC, MAX_SLOTS, MIN_REGION_LEN, OFF_SLOTS, OFF_STATE,
    SLOT_LEN, STATE_OK, VERSION, frame_len, half_len, half_start, len_u32, read_header,
};
use super::live::Live;
use super::record::{JournalRecord, Recovered};

/// A writer's counters and sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct JournalStats {
    /// Records in the active half (what [`recover`](fn@super::recover) would count).
    pub records: u64,
    /// Records appended since format or resume (no-op duplicates not counted).
    pub appended: u64,
    /// Compactions (snapshots written and committed), the resume's included.
    pub compactions: u64,
    /// Bytes used in the active half.
    pub bytes_used: u64,
    /// Bytes of one half.
    pub half_bytes: u64,
    /// The active half's epoch.
    pub epoch: u64,
    /// Registered namespaces.
    pub namespaces: u64,
    /// Live pages.
    pub live_pages: u64,
    /// Held slots.
    pub held_slots: u64,
    /// Whether appends are refused.
    pub disabled: bool,
}

/// Where the writer's bytes go: the region (`[u8]`), or in tests a recorder
/// that keeps every write in order so a crash can be cut at any byte.
pub(super) trait Region {
    fn bytes(&self) -> &[u8];
    fn put(&mut self, at: usize, bytes: &[u8]) -> Result<(), JournalError>;
    fn zero(&mut self, at: usize, len: usize) -> Result<(), JournalError>;
    /// Keeps the writes before it before the writes after it.
    fn fence(&mut self);
}

/// A write past the end of the region (`needed` bytes long at least).
fn outside(region_len: usize, needed: Option<usize>) -> JournalError {
    JournalError::RegionLength {
        got: region_len,
        expected: needed.unwrap_or(usize::MAX),
    }
}

impl Region for [u8] {
    fn bytes(&self) -> &[u8] {
        self
    }

    fn put(&mut self, at: usize, bytes: &[u8]) -> Result<(), JournalError> {
        let len = self.len();
        let end = at.checked_add(bytes.len());
        self.get_mut(at..end.unwrap_or(usize::MAX))
            .ok_or_else(|| outside(len, end))?
            .copy_from_slice(bytes);
        Ok(())
    }

    fn zero(&mut self, at: usize, n: usize) -> Result<(), JournalError> {
        let len = self.len();
        let end = at.checked_add(n);
        self.get_mut(at..end.unwrap_or(usize::MAX))
            .ok_or_else(|| outside(len, end))?
            .fill(0);
        Ok(())
    }

    fn fence(&mut self) {
        // The stores of a process killed by a signal are those before the
        // instruction it was stopped at, so program order is crash order, as
        // long as the compiler keeps it.
        compiler_fence(Ordering::SeqCst);
    }
}

/// Writes one frame at `at`: the payload, then the header. Returns its length.
fn write_frame<R: Region + ?Sized>(
    region: &mut R,
    scratch: &mut Vec<u8>,
    at: usize,
    epoch: u64,
    seq: u64,
    view: View<'_>,
) -> Result<usize, JournalError> {
    scratch.clear();
    view.encode(scratch);
    let len = len_u32(scratch.len());
    let mut header = [0u8; FRAME_HEADER_LEN];
    header[..4].copy_from_slice(&len.to_le_bytes());
    header[4..8].copy_from_slice(&frame_crc(epoch, len, seq, scratch).to_le_bytes());
    header[8..].copy_from_slice(&seq.to_le_bytes());
    region.put(at + FRAME_HEADER_LEN, scratch)?;
    region.put(at, &header)?;
    // The padding is zero already: a half is zero past its last record.
    Ok(frame_len(scratch.len()))
}

fn write_slot<R: Region + ?Sized>(
    region: &mut R,
    half: Half,
    epoch: u64,
) -> Result<(), JournalError> {
    let mut slot = [0u8; SLOT_LEN];
    slot[..8].copy_from_slice(&epoch.to_le_bytes());
    slot[8..12].copy_from_slice(&slot_crc(half, epoch).to_le_bytes());
    region.put(half.slot_offset(), &slot)
}

/// The primary's side: appends records to a region and compacts it when a
/// half fills up.
///
/// It keeps its own mirror of the live state (namespaces, live pages by
/// `(namespace, key)`, held slots), which is what a compaction snapshots.
/// Every call takes the region: the same bytes each time (the runner owns one
/// mapping); a region of another length is refused.
#[derive(Debug, Clone)]
pub struct JournalWriter {
    /// The region's length.
    total: usize,
    /// One half's length.
    half: usize,
    active: Half,
    epoch: u64,
    /// Bytes used in the active half.
    cursor: usize,
    next_seq: u64,
    /// Per half, bytes from its start that may be nonzero.
    dirty: [usize; 2],
    live: Live,
    disabled: Option<DisabledReason>,
    compactions: u64,
    appended: u64,
    scratch: Vec<u8>,
}

impl JournalWriter {
    /// Formats `region` as an empty journal (zeroes it) and returns a writer.
    ///
    /// A region under [`MIN_REGION_LEN`] bytes is refused.
    pub fn format(region: &mut [u8]) -> Result<Self, JournalError> {
        Self::format_in(region)
    }

    /// Continues a recovered journal: writes `recovered`'s state (or any
    /// subset the runner kept: namespaces, held slots, pages) as a snapshot
    /// into the half that is not active and commits it, so a warm restart
    /// keeps journaling. If the region does not hold a valid journal (or a
    /// disabled one) it is formatted first.
    ///
    /// A crash during `resume` leaves the journal that was there (or, once
    /// formatting began, no journal); a state that does not fit in a half
    /// disables the journal (`Err(Disabled(Overflow))`), and an inconsistent
    /// one is refused before any byte is written.
    pub fn resume(region: &mut [u8], recovered: &Recovered) -> Result<Self, JournalError> {
        Self::resume_in(region, recovered)
    }

    /// Appends `record`.
    ///
    /// A record that does not follow the state ([`Refusal`](super::Refusal)) is refused and
    /// the region left unchanged; a namespace registered already with the same
    /// values is a no-op. When the active half is full the journal compacts
    /// first; when even that does not fit it is disabled
    /// (`Err(Disabled(Overflow))`), as are all later appends.
    pub fn append(
        &mut self,
        region: &mut [u8],
        record: &JournalRecord,
    ) -> Result<(), JournalError> {
        self.append_in(region, Cow::Borrowed(record))
    }

    /// [`Self::append`] of a record the caller gives up (its mirror keeps it
    /// without a copy).
    pub fn append_owned(
        &mut self,
        region: &mut [u8],
        record: JournalRecord,
    ) -> Result<(), JournalError> {
        self.append_in(region, Cow::Owned(record))
    }

    /// Turns the journal off: the header's state says `Disabled(reason)`, so
    /// [`recover`](fn@super::recover) answers `Disabled` and a restart is cold; later appends are
    /// refused. Keeps the first reason when called again.
    pub fn disable(&mut self, region: &mut [u8], reason: DisabledReason) {
        self.disable_in(region, reason);
    }

    /// Whether appends are refused.
    pub fn is_disabled(&self) -> bool {
        self.disabled.is_some()
    }

    /// Counters and sizes.
    pub fn stats(&self) -> JournalStats {
        let n = |v: usize| u64::try_from(v).unwrap_or(u64::MAX);
        JournalStats {
            records: self.next_seq - 1,
            appended: self.appended,
            compactions: self.compactions,
            bytes_used: n(self.cursor),
            half_bytes: n(self.half),
            epoch: self.epoch,
            namespaces: n(self.live.namespaces.len()),
            live_pages: n(self.live.pages.len()),
            held_slots: n(self.live.held.len()),
            disabled: self.disabled.is_some(),
        }
    }

    pub(super) fn format_in<R: Region + ?Sized>(region: &mut R) -> Result<Self, JournalError> {
        let total = region.bytes().len();
        if total < MIN_REGION_LEN {
            return Err(JournalError::RegionTooSmall {
                len: total,
                min: MIN_REGION_LEN,
            });
        }
        let half = half_len(total);
        // The header first, so a crash while formatting leaves no journal
        // rather than an old header over zeroed records.
        region.zero(0, HEADER_LEN)?;
        region.fence();
        region.zero(HEADER_LEN, total - HEADER_LEN)?;
        // Magic, version, state, region length, half length (OFF_*).
        let mut header = Vec::with_capacity(OFF_SLOTS[0]);
        header.extend_from_slice(&MAGIC);
        header.extend_from_slice(&VERSION.to_le_bytes());
        header.extend_from_slice(&STATE_OK.to_le_bytes());
        header.extend_from_slice(&(total as u64).to_le_bytes());
        header.extend_from_slice(&(half as u64).to_le_bytes());
        region.put(0, &header)?;
        region.fence();
        write_slot(region, Half::Zero, 1)?;
        region.fence();
        Ok(Self {
            total,
            half,
            active: Half::Zero,
            epoch: 1,
            cursor: 0,
            next_seq: 1,
            dirty: [0, 0],
            live: Live::default(),
            disabled: None,
            compactions: 0,
            appended: 0,
            scratch: Vec::new(),
        })
    }

    pub(super) fn resume_in<R: Region + ?Sized>(
        region: &mut R,
        recovered: &Recovered,
    ) -> Result<Self, JournalError> {
        let live = Live::from_recovered(recovered).map_err(JournalError::Refused)?;
        let total = region.bytes().len();
        if total < MIN_REGION_LEN {
            return Err(JournalError::RegionTooSmall {
                len: total,
                min: MIN_REGION_LEN,
            });
        }
        let mut writer = match read_header(region.bytes()) {
            // (An epoch this high was never written by a writer.)
            Ok(head) if head.epoch < u64::MAX / 2 => Self {
                total,
                half: head.half_len,
                active: head.active,
                epoch: head.epoch,
                // Nothing is appended to this half before the snapshot below
                // replaces it; what either half holds is unknown.
                cursor: head.half_len,
                next_seq: 1,
                dirty: [head.half_len, head.half_len],
                live: Live::default(),
                disabled: None,
                compactions: 0,
                appended: 0,
                scratch: Vec::new(),
            },
            Ok(_) | Err(_) => Self::format_in(region)?,
        };
        writer.live = live;
        if writer.live.snapshot_len() > writer.half {
            writer.disable_in(region, DisabledReason::Overflow);
            return Err(JournalError::Disabled(DisabledReason::Overflow));
        }
        writer.compact_in(region)?;
        Ok(writer)
    }

    pub(super) fn append_in<R: Region + ?Sized>(
        &mut self,
        region: &mut R,
        record: Cow<'_, JournalRecord>,
    ) -> Result<(), JournalError> {
        let record_ref: &JournalRecord = &record;
        self.same_region(region)?;
        if let Some(reason) = self.disabled {
            return Err(JournalError::Disabled(reason));
        }
        if !self.live.check(record_ref).map_err(JournalError::Refused)? {
            return Ok(());
        }
        let view = record_ref.view();
        let need = frame_len(view.payload_len());
        if self.cursor.saturating_add(need) > self.half {
            if self.live.snapshot_len().saturating_add(need) > self.half {
                self.disable_in(region, DisabledReason::Overflow);
                return Err(JournalError::Disabled(DisabledReason::Overflow));
            }
            self.compact_in(region)?;
        }
        let at = half_start(self.active, self.half) + self.cursor;
        let written = write_frame(
            region,
            &mut self.scratch,
            at,
            self.epoch,
            self.next_seq,
            view,
        )?;
        region.fence();
        self.cursor += written;
        self.next_seq += 1;
        let cursor = self.cursor;
        let dirty = self.dirty_mut(self.active);
        *dirty = (*dirty).max(cursor);
        self.appended += 1;
        self.live.apply(record.into_owned());
        Ok(())
    }

    fn disable_in<R: Region + ?Sized>(&mut self, region: &mut R, reason: DisabledReason) {
        let reason = *self.disabled.get_or_insert(reason);
        // Only a region too short for a header can refuse this write, and
        // such a region was never formatted by this writer.
        let _ = region.put(OFF_STATE, &reason.code().to_le_bytes());
        region.fence();
    }

    /// Writes the mirror into the other half and commits it.
    fn compact_in<R: Region + ?Sized>(&mut self, region: &mut R) -> Result<(), JournalError> {
        let target = self.active.other();
        let start = half_start(target, self.half);
        let epoch = self.epoch + 1;
        region.zero(start, *self.dirty_mut(target))?;
        *self.dirty_mut(target) = 0;
        let mut at = 0usize;
        let mut seq = 1u64;
        for ns in &self.live.namespaces {
            at += write_frame(region, &mut self.scratch, start + at, epoch, seq, ns.view())?;
            seq += 1;
        }
        for chunk in self.live.held_list().chunks(MAX_SLOTS) {
            at += write_frame(
                region,
                &mut self.scratch,
                start + at,
                epoch,
                seq,
                View::Held(chunk),
            )?;
            seq += 1;
        }
        for page in self.live.pages_in_order() {
            at += write_frame(
                region,
                &mut self.scratch,
                start + at,
                epoch,
                seq,
                page.view(),
            )?;
            seq += 1;
        }
        *self.dirty_mut(target) = at;
        region.fence();
        // The flip.
        write_slot(region, target, epoch)?;
        region.fence();
        let old = self.active;
        self.active = target;
        self.epoch = epoch;
        self.cursor = at;
        self.next_seq = seq;
        self.compactions += 1;
        // A later damage to the new slot must not make the stale half active.
        region.zero(old.slot_offset(), SLOT_LEN)?;
        region.fence();
        Ok(())
    }

    fn dirty_mut(&mut self, half: Half) -> &mut usize {
        match half {
            Half::Zero => &mut self.dirty[0],
            Half::One => &mut self.dirty[1],
        }
    }

    fn same_region<R: Region + ?Sized>(&self, region: &R) -> Result<(), JournalError> {
        let got = region.bytes().len();
        if got != self.total {
            return Err(JournalError::RegionLength {
                got,
                expected: self.total,
            });
        }
        Ok(())
    }
}
