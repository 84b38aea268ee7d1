//! The one-hop route's CUDA side: a same-host source process copies its
//! KVCR DRAM straight into the target's GPU, in one PCIe pass.
//!
//! The target names its device KV memory with [`CudaCopier::export`] (a
//! legacy CUDA IPC handle on the allocation around it, in an
//! [`ExportName`]); the runner carries the name over the authenticated
//! session. The source opens it once per route with [`CudaCopier::import`]
//! and copies its pinned pool's pages into the granted slots with
//! [`CudaImport::copy`], on its copier's streams and with its copier's
//! machinery (one driver batch or kernel launch per span index, layer 0
//! first), finishing on a blocking-sync event so the source's CPU sleeps
//! while the copy engines work.
//!
//! Everything in a name comes from a peer: [`ExportName::parse`] checks it
//! field by field, and the import checks the rest (this host's devices, not
//! this very process, the extent inside what the handle opened) before a
//! byte is copied. Each span of a copy is checked against the extent and the
//! attached pools before anything is issued.

use std::sync::Arc;

use kvcr_foundation::runner::{CopySpan, DeviceImport};

use crate::copier::{Core, CudaCopier};
use crate::cuda::{DeviceUuid, IPC_HANDLE_BYTES, IpcMapping, PinnedRegistration, device_uuids};
use crate::error::{Error, NameRefusal, Result};

/// The first bytes of every export record.
const MAGIC: [u8; 4] = *b"KVDX";

/// The record format [`ExportName::encode`] writes and
/// [`ExportName::parse`] reads.
pub const EXPORT_VERSION: u16 = 1;

/// Bytes of an export record: magic 4, version 2, reserved 2, handle 64,
/// offset 8, length 8, device UUID 16, pid 4, reserved 4 (integers
/// little-endian).
pub const EXPORT_NAME_BYTES: usize = 112;

/// What a target tells a same-host source about its device memory: an
/// extent of `len` bytes at `offset` into the allocation `handle` opens, on
/// device `device`, exported by process `pid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportName {
    /// The legacy CUDA IPC handle of the allocation.
    pub handle: [u8; IPC_HANDLE_BYTES],
    /// Where the extent starts in the allocation.
    pub offset: u64,
    /// Bytes of the extent.
    pub len: u64,
    /// The UUID of the device holding the allocation.
    pub device: DeviceUuid,
    /// The exporting process (CUDA cannot open a handle in the process
    /// that made it).
    pub pid: u32,
}

/// Reads the bytes `at .. at + N` of a record whose size was checked.
fn field<const N: usize>(bytes: &[u8], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    if let Some(src) = bytes.get(at..at + N) {
        out.copy_from_slice(src);
    }
    out
}

impl ExportName {
    /// The fixed-size record ([`EXPORT_NAME_BYTES`]).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(EXPORT_NAME_BYTES);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&EXPORT_VERSION.to_le_bytes());
        out.extend_from_slice(&[0; 2]);
        out.extend_from_slice(&self.handle);
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.device);
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        out
    }

    /// Reads a peer's record, which must name exactly `len` bytes: every
    /// check that needs no driver (size, magic, version, reserved bytes,
    /// length, an extent that is empty or overflows) is a typed refusal.
    pub fn parse(bytes: &[u8], len: u64) -> Result<Self> {
        let refuse = |refusal| Err(Error::ExportName { refusal });
        if bytes.len() != EXPORT_NAME_BYTES {
            return refuse(NameRefusal::Size { got: bytes.len() });
        }
        if field::<4>(bytes, 0) != MAGIC {
            return refuse(NameRefusal::Magic);
        }
        let version = u16::from_le_bytes(field(bytes, 4));
        if version != EXPORT_VERSION {
            return refuse(NameRefusal::Version { got: version });
        }
        if field::<2>(bytes, 6) != [0; 2] || field::<4>(bytes, 108) != [0; 4] {
            return refuse(NameRefusal::Reserved);
        }
        let name = Self {
            handle: field(bytes, 8),
            offset: u64::from_le_bytes(field(bytes, 72)),
            len: u64::from_le_bytes(field(bytes, 80)),
            device: field(bytes, 88),
            pid: u32::from_le_bytes(field(bytes, 104)),
        };
        if name.len != len {
            return refuse(NameRefusal::Length {
                named: name.len,
                expected: len,
            });
        }
        if name.len == 0 || name.offset.checked_add(name.len).is_none() {
            return refuse(NameRefusal::Extent);
        }
        Ok(name)
    }
}

impl CudaCopier {
    /// Names device memory `[base, base + len)` for a same-host peer
    /// ([`ExportName`]); `None` where it cannot be shared with legacy IPC
    /// (a VMM allocation, a range over more than one allocation, a driver
    /// that refuses). An address the driver does not know is an error.
    pub fn export(&self, base: u64, len: u64) -> Result<Option<Vec<u8>>> {
        let device = self.core.device();
        let Some((start, size)) = device.allocation_of(base)? else {
            return Err(Error::Layout {
                field: "export",
                why: "is not device memory the CUDA driver knows",
            });
        };
        let offset = base - start;
        if len == 0 || offset.checked_add(len).is_none_or(|end| end > size) {
            return Ok(None);
        }
        let Some(handle) = device.ipc_handle(start)? else {
            return Ok(None);
        };
        let name = ExportName {
            handle,
            offset,
            len,
            device: device.uuid()?,
            pid: std::process::id(),
        };
        Ok(Some(name.encode()))
    }

    /// Opens a peer's [`CudaCopier::export`] name of `len` bytes. Refused
    /// with [`Error::ExportName`], nothing left open: a malformed name, a
    /// device this host does not report, this process's own export, an
    /// extent past the opened allocation.
    pub fn import(&self, export: &[u8], len: u64) -> Result<CudaImport> {
        let name = ExportName::parse(export, len)?;
        let refuse = |refusal| Err(Error::ExportName { refusal });
        if name.pid == std::process::id() {
            return refuse(NameRefusal::OwnProcess);
        }
        if !device_uuids()?.contains(&name.device) {
            return refuse(NameRefusal::UnknownDevice);
        }
        let mapping = IpcMapping::open(self.core.device(), &name.handle)?;
        // `parse` checked that this does not overflow.
        let end = name.offset.saturating_add(name.len);
        if end > mapping.len() {
            // Dropping the mapping closes it again.
            return refuse(NameRefusal::PastAllocation {
                end,
                allocation: mapping.len(),
            });
        }
        let start = mapping.base() + name.offset;
        self.core.open_imports().push((start, start + name.len));
        Ok(CudaImport {
            mapping,
            offset: name.offset,
            len: name.len,
            core: Arc::clone(&self.core),
        })
    }

    /// Copies every span of every key in one pass over several imports:
    /// `src` inside an attached pool, `dst` an address
    /// [`CudaImport::resolve`] returned. Every span is checked against the
    /// attached pools and the extents of the imports open now before
    /// anything is issued (outside: an error, nothing written). The caller
    /// keeps the imports open until this returns.
    pub fn copy_to_imports(&self, keys: &[&[CopySpan]]) -> Result<()> {
        self.copy_to_imports_led(keys, 0, &mut || {})
    }

    /// As [`Self::copy_to_imports`], calling `landed` once span indices
    /// `0..lead` of every key have landed, while the rest still copies (the
    /// first layer of a layer-first page); never for `lead` 0, nor when a
    /// copy could not be issued or the driver reported an error.
    pub fn copy_to_imports_led(
        &self,
        keys: &[&[CopySpan]],
        lead: usize,
        landed: &mut dyn FnMut(),
    ) -> Result<()> {
        {
            let pinned = self.core.pinned();
            let open = OpenExtents::new(&self.core.open_imports());
            for span in keys.iter().flat_map(|k| k.iter()) {
                if !open.cover(span.dst, span.len) {
                    return Err(Error::OutsideImports {
                        dst: span.dst,
                        len: span.len,
                    });
                }
                check_attached(&pinned, span)?;
            }
        }
        // The copier translates each source to its mapped address (and
        // refuses one a detach removed meanwhile); the destinations lie in
        // extents open now, checked above, which the caller keeps open.
        self.core
            .run_led(keys, false, Some((lead, landed)))
            .map(drop)
    }

    /// Each key's page digest (xxh3-64 of its spans in order, as
    /// `kvcr_sys::digest`), hashed on the device from device memory (every
    /// `src` device memory of this copier's device); `None` without the
    /// digest kernel or where a span is not 16-byte aligned and whole
    /// 1 KiB blocks.
    pub fn digest_device(&self, keys: &[&[CopySpan]]) -> Result<Option<Vec<u64>>> {
        self.core.digest_device(keys)
    }
}

/// The extents of the imports open when a pass began, to check each of its
/// spans against: sorted by start, beside the furthest end reached so far,
/// so one binary search answers where a scan of every import did (a
/// per-layer engine's 128 imports, for each of a restore's 232,000 spans).
struct OpenExtents {
    /// `(start, end)` of each open import, by start.
    sorted: Vec<(u64, u64)>,
    /// Per position in `sorted`, the furthest end of it and those before.
    reach: Vec<u64>,
}

impl OpenExtents {
    fn new(open: &[(u64, u64)]) -> Self {
        let mut sorted = open.to_vec();
        sorted.sort_unstable();
        let reach = sorted
            .iter()
            .scan(0u64, |furthest, &(_, end)| {
                *furthest = (*furthest).max(end);
                Some(*furthest)
            })
            .collect();
        Self { sorted, reach }
    }

    /// Whether `[dst, dst + len)` lies inside one open import: one starting
    /// at or before `dst` ends at or after its end (extents may overlap).
    fn cover(&self, dst: u64, len: u64) -> bool {
        let Some(end) = dst.checked_add(len) else {
            return false;
        };
        let starts_before = self.sorted.partition_point(|&(start, _)| start <= dst);
        starts_before
            .checked_sub(1)
            .and_then(|last| self.reach.get(last))
            .is_some_and(|&furthest| furthest >= end)
    }
}

/// Refuses a span whose source is not inside one of the copier's attached
/// (pinned) pools: a one-hop copy reads only KVCR DRAM.
fn check_attached(pinned: &[PinnedRegistration], span: &CopySpan) -> Result<()> {
    if pinned
        .iter()
        .any(|p| p.translate(span.src, span.len).is_some())
    {
        return Ok(());
    }
    Err(Error::UnattachedSpan {
        src: span.src,
        dst: span.dst,
        len: span.len,
    })
}

/// A peer's device extent opened in this process, copied into from the
/// pools attached to the copier that opened it.
///
/// Field order is drop order: the mapping is closed (an error is recorded
/// with the device's other drop errors, [`crate::cuda::Device::take_drop_errors`])
/// while the copier's state, and with it the context, is still held.
#[derive(Debug)]
pub struct CudaImport {
    mapping: IpcMapping,
    offset: u64,
    len: u64,
    core: Arc<Core>,
}

impl CudaImport {
    /// Bytes of the extent.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the extent is empty (never: an empty name is refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where bytes `offset .. offset + len` of the extent are in this
    /// process's device address space (for [`CudaCopier::copy_to_imports`]);
    /// `None` outside the extent.
    pub fn resolve(&self, offset: u64, len: u64) -> Option<u64> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then(|| self.mapping.base() + self.offset + offset)
    }

    /// Copies every span of every key: `src` inside a pool attached to the
    /// copier, `dst` a byte offset into the extent. Every span is checked
    /// before anything is issued (a span outside is an error, nothing
    /// written); returns only when no copy of this call can touch memory.
    pub fn copy(&self, keys: &[&[CopySpan]]) -> Result<()> {
        let base = self.mapping.base() + self.offset;
        let mut moved: Vec<Vec<CopySpan>> = Vec::with_capacity(keys.len());
        {
            let pinned = self.core.pinned();
            for key in keys {
                let mut spans = Vec::with_capacity(key.len());
                for span in *key {
                    if span
                        .dst
                        .checked_add(span.len)
                        .is_none_or(|end| end > self.len)
                    {
                        return Err(Error::OutsideImport {
                            offset: span.dst,
                            len: span.len,
                            extent: self.len,
                        });
                    }
                    check_attached(&pinned, span)?;
                    spans.push(CopySpan {
                        src: span.src,
                        dst: base + span.dst,
                        len: span.len,
                    });
                }
                moved.push(spans);
            }
        }
        let keys: Vec<&[CopySpan]> = moved.iter().map(Vec::as_slice).collect();
        // The copier translates each source to its mapped address (and
        // refuses one a detach removed meanwhile); the destinations are
        // device addresses of the opened extent, checked above.
        self.core.run(&keys, false).map(drop)
    }
}

impl DeviceImport for CudaImport {
    fn len(&self) -> u64 {
        self.len
    }

    fn copy_into(&self, keys: &[&[CopySpan]]) -> kvcr_foundation::runner::Result<()> {
        self.copy(keys)
            .map_err(kvcr_foundation::runner::Error::from)
    }

    fn resolve(&self, offset: u64, len: u64) -> Option<u64> {
        CudaImport::resolve(self, offset, len)
    }
}

impl Drop for CudaImport {
    /// Forgets the extent before the mapping (the first field) closes, so
    /// no later one-pass copy may name it.
    fn drop(&mut self) {
        let start = self.mapping.base() + self.offset;
        let mut open = self.core.open_imports();
        if let Some(at) = open.iter().position(|&e| e == (start, start + self.len)) {
            open.swap_remove(at);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name() -> ExportName {
        ExportName {
            handle: std::array::from_fn(|i| i as u8 ^ 0x5a),
            offset: 4096,
            len: 1 << 20,
            device: std::array::from_fn(|i| 0xf0 | i as u8),
            pid: 4242,
        }
    }

    fn refusal(bytes: &[u8], len: u64) -> NameRefusal {
        match ExportName::parse(bytes, len) {
            Err(Error::ExportName { refusal }) => refusal,
            other => panic!("not refused: {other:?}"),
        }
    }

    /// A span passes only inside one open import (overlapping ones
    /// included), never across two that merely touch, nor past the end of
    /// the address space.
    #[rstest::rstest]
    #[case::inside_the_first(100, 10, true)]
    #[case::exactly_the_second(300, 100, true)]
    #[case::inside_the_overlapping_one(150, 120, true)]
    #[case::across_two_that_touch(380, 40, false)]
    #[case::before_every_import(50, 10, false)]
    #[case::in_a_gap(285, 10, false)]
    #[case::past_the_last(490, 20, false)]
    #[case::wrapping(u64::MAX - 4, 10, false)]
    fn a_span_is_covered_only_by_one_import(
        #[case] dst: u64,
        #[case] len: u64,
        #[case] covered: bool,
    ) {
        // [100, 200), [140, 280) overlapping it, [300, 400), [400, 500)
        // touching it; handed over unsorted.
        let open = OpenExtents::new(&[(400, 500), (100, 200), (300, 400), (140, 280)]);
        assert_eq!(open.cover(dst, len), covered);
        let naive = [(400u64, 500u64), (100, 200), (300, 400), (140, 280)]
            .iter()
            .any(|&(start, end)| dst >= start && dst.checked_add(len).is_some_and(|e| e <= end));
        assert_eq!(covered, naive, "the table agrees with a scan");
    }

    #[test]
    fn a_name_survives_its_record() {
        let bytes = name().encode();
        assert_eq!(bytes.len(), EXPORT_NAME_BYTES);
        assert!(bytes.len() <= kvcr_foundation::runner::MAX_DEVICE_EXPORT);
        assert_eq!(ExportName::parse(&bytes, 1 << 20).unwrap(), name());
    }

    #[test]
    fn a_record_of_another_size_is_refused() {
        let bytes = name().encode();
        for got in [0, 1, EXPORT_NAME_BYTES - 1] {
            assert_eq!(refusal(&bytes[..got], 1 << 20), NameRefusal::Size { got });
        }
        for extra in [1, 256] {
            let mut long = bytes.clone();
            long.resize(EXPORT_NAME_BYTES + extra, 0);
            let got = long.len();
            assert_eq!(refusal(&long, 1 << 20), NameRefusal::Size { got });
        }
    }

    #[test]
    fn garbled_headers_are_refused() {
        let mut bytes = name().encode();
        bytes[0] ^= 1;
        assert_eq!(refusal(&bytes, 1 << 20), NameRefusal::Magic);
        let mut bytes = name().encode();
        bytes[4] = 2;
        assert_eq!(refusal(&bytes, 1 << 20), NameRefusal::Version { got: 2 });
        for at in [6, 7, 108, 111] {
            let mut bytes = name().encode();
            bytes[at] = 1;
            assert_eq!(refusal(&bytes, 1 << 20), NameRefusal::Reserved, "byte {at}");
        }
    }

    #[test]
    fn a_name_of_another_length_or_a_bad_extent_is_refused() {
        let bytes = name().encode();
        let other = refusal(&bytes, 1 << 21);
        assert_eq!(
            other,
            NameRefusal::Length {
                named: 1 << 20,
                expected: 1 << 21
            }
        );
        let empty = ExportName { len: 0, ..name() }.encode();
        assert_eq!(refusal(&empty, 0), NameRefusal::Extent);
        let overflow = ExportName {
            offset: u64::MAX - 10,
            ..name()
        };
        assert_eq!(refusal(&overflow.encode(), 1 << 20), NameRefusal::Extent);
    }

    /// Whatever one bit a peer flips, parsing returns without panicking,
    /// and what it accepts is exactly the record it was given (no field
    /// read loosely): flips of the handle, offset, device and pid parse,
    /// every other one is refused.
    #[test]
    fn every_single_bit_flip_is_read_exactly_or_refused() {
        let bytes = name().encode();
        for at in 0..bytes.len() {
            for bit in 0..8 {
                let mut flipped = bytes.clone();
                flipped[at] ^= 1 << bit;
                let free = (8..80).contains(&at) || (88..108).contains(&at);
                match ExportName::parse(&flipped, 1 << 20) {
                    Ok(parsed) => {
                        assert!(free, "byte {at} bit {bit} accepted");
                        assert_eq!(parsed.encode(), flipped);
                    }
                    Err(Error::ExportName { .. }) => assert!(!free, "byte {at} bit {bit}"),
                    Err(other) => panic!("byte {at}: {other}"),
                }
            }
        }
    }
}
