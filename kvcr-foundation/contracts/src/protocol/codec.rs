//! The versioned, length-prefixed binary frame codec of the peer control protocol.
//!
//! ```text
//! frame   := len:u32be  body[len]
//! body    := magic:u16be=0x4B56 ("KV")  version:u8=6  kind:u8  header  fields(kind)
//! header  := incarnation:u128be  route_generation:u64be  endpoint:str8
//! str8    := n:u8 utf8[n]          bytes16 := n:u16be u8[n]
//! opt<T>  := 0 | 1 T               bool    := 0 | 1
//! list<T> := n:(u16be|u32be) T[n]  (width per field, see below)
//! ```
//!
//! Field layouts per kind (all integers big-endian):
//!
//! | kind | message | fields |
//! |---|---|---|
//! | 1 | `target_metadata` | `worker_address:bytes16, regions:list16<region>, shared_memory:opt<shared>, doorbell:opt<(region:u32, key:u8[32])>, device_regions:list16<device>` |
//! | 2 | `target_metadata_ack` | `op_handle:opt<u64>, one_copy:bool, device:bool` |
//! | 3 | `start_write` | `op:u64, remaining_ms:u32, source_inc:opt<u128>, namespace:u64, entries:list32<(key:u64, dests:list16<(region:u32, index:u64)>)>` |
//! | 4 | `write_refused` | `op:u64` |
//! | 5 | `write_done` | `op:u64, outcome:u8` (0 completed, 1 failed-terminal, 2 failed-nonterminal, 3 completed with each page checked in the source's copy), then `indices:list32<u32>, digests:list32<u64>` when completed (no digests, or one page digest per index; with 3, one per index) |
//! | 6 | `write_probe` | `op:u64, source_inc:opt<u128>` |
//! | 7 | `write_probe_ack` | `op:u64, terminal:bool, dead_inc:opt<u128>` |
//! | 8 | `route_proof` | `nonce:u8[32]` |
//!
//! `region := id:u32 label:str8 base:u64 element_size:u64 stride:u64 count:u64 rkey:bytes16`.
//! `shared := boot_id:u8[16] pid_namespace:u64 pid:u32 segments:list16<(region:u32, fd:u32, token:u8[16])>`
//! (at most one segment per advertised region, each naming one of them; the
//! doorbell names an advertised region too).
//! `device := id:u32 base:u64 element_size:u64 stride:u64 count:u64 export:bytes16`
//! (ids distinct from each other and from the regions', extents as regions',
//! `export` of 1..=256 bytes).
//!
//! Decoding validates every field (bounds, UTF-8, endpoint grammar, non-zero
//! incarnations and timeouts, region extents, ascending indices, no trailing
//! bytes) and never allocates more than the frame's own length justifies.
//! Encoding applies the same rules, so a frame this codec writes is one it reads.

use bytes::{Buf, BufMut, BytesMut};

use super::{
    Body, CompletedIndices, DeviceRegionAdvert, DoorbellAdvert, ElementRef, Header, Message,
    OpHandle, RegionAdvert, RegionId, RouteGeneration, SegmentAdvert, SharedMemoryAdvert,
    WriteOutcome,
};
use crate::endpoint::ControlEndpoint;
use crate::error::{Echo, Error, FrameReason, Result};
use crate::incarnation::Incarnation;
use crate::key::{BlockKey, NamespaceId};

/// Frame magic: `"KV"`.
pub const MAGIC: u16 = 0x4B56;
/// The codec version this build writes and reads.
pub const VERSION: u8 = 6;
/// Default bound on one frame's length (after the length prefix).
pub const DEFAULT_MAX_FRAME_LEN: usize = 16 << 20;
/// Most keys in one `start_write` (and completed indices in one `write_done`).
pub const MAX_KEYS_PER_WRITE: usize = 1 << 16;
/// Most destination elements for one key (spans of one page).
pub const MAX_SPANS_PER_KEY: usize = 4096;
/// Most regions in one advertisement.
pub const MAX_REGIONS: usize = 1024;
/// Largest packed UCX worker address.
pub const MAX_WORKER_ADDRESS: usize = 16 << 10;
/// Largest packed remote key.
pub const MAX_RKEY: usize = 4096;
/// Longest region label.
pub const MAX_LABEL: usize = 64;
/// Most device regions in one advertisement (a 64-layer model registers 128:
/// a K and a V per layer).
pub const MAX_DEVICE_REGIONS: usize = 1024;
/// Largest exported name of one device region.
pub const MAX_DEVICE_EXPORT: usize = 256;

const LEN_PREFIX: usize = 4;
/// magic + version + kind
const PREAMBLE: usize = 4;

const KIND_TARGET_METADATA: u8 = 1;
const KIND_TARGET_METADATA_ACK: u8 = 2;
const KIND_START_WRITE: u8 = 3;
const KIND_WRITE_REFUSED: u8 = 4;
const KIND_WRITE_DONE: u8 = 5;
const KIND_WRITE_PROBE: u8 = 6;
const KIND_WRITE_PROBE_ACK: u8 = 7;
const KIND_ROUTE_PROOF: u8 = 8;

const OUTCOME_COMPLETED: u8 = 0;
const OUTCOME_FAILED_TERMINAL: u8 = 1;
const OUTCOME_FAILED_NONTERMINAL: u8 = 2;
const OUTCOME_COMPLETED_CHECKED_IN_COPY: u8 = 3;

/// Encoder and streaming decoder with a configurable frame bound.
#[derive(Debug, Clone, Copy)]
pub struct FrameCodec {
    max_frame_len: usize,
}

impl Default for FrameCodec {
    fn default() -> Self {
        Self {
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
        }
    }
}

impl FrameCodec {
    /// A codec refusing frames longer than `max_frame_len` bytes.
    pub fn new(max_frame_len: usize) -> Self {
        Self {
            max_frame_len: max_frame_len.min(u32::MAX as usize),
        }
    }

    /// The frame bound.
    pub fn max_frame_len(&self) -> usize {
        self.max_frame_len
    }

    /// Appends one frame for `message` to `dst`. Refuses (and writes nothing)
    /// if the message breaks a bound or rule the decoder enforces.
    pub fn encode(&self, message: &Message, dst: &mut BytesMut) -> Result<()> {
        let mut body = BytesMut::with_capacity(64);
        body.put_u16(MAGIC);
        body.put_u8(VERSION);
        body.put_u8(kind_of(&message.body));
        put_header(&mut body, &message.header)?;
        put_body(&mut body, &message.body)?;
        if body.len() > self.max_frame_len {
            return Err(frame(FrameReason::TooLarge {
                len: body.len(),
                max: self.max_frame_len,
            }));
        }
        let len = u32::try_from(body.len()).map_err(|_| {
            frame(FrameReason::TooLarge {
                len: body.len(),
                max: self.max_frame_len,
            })
        })?;
        dst.reserve(LEN_PREFIX + body.len());
        dst.put_u32(len);
        dst.extend_from_slice(&body);
        Ok(())
    }

    /// Encodes one message into a fresh buffer.
    pub fn encode_to_vec(&self, message: &Message) -> Result<Vec<u8>> {
        let mut buf = BytesMut::new();
        self.encode(message, &mut buf)?;
        Ok(buf.to_vec())
    }

    /// Streaming decode: takes one complete frame off the front of `src`.
    /// `Ok(None)` means "need more bytes" (nothing consumed). On error the
    /// offending frame is consumed when its length was readable, so a caller
    /// may log and continue with the next frame; a bad length is fatal for the
    /// stream and nothing is consumed.
    pub fn decode(&self, src: &mut BytesMut) -> Result<Option<Message>> {
        let Some(len) = self.peek_len(src)? else {
            return Ok(None);
        };
        if src.len() < LEN_PREFIX + len {
            src.reserve(LEN_PREFIX + len - src.len());
            return Ok(None);
        }
        src.advance(LEN_PREFIX);
        let frame_bytes = src.split_to(len);
        decode_body(&frame_bytes).map(Some)
    }

    /// Decodes exactly one whole frame (length prefix included) from `bytes`.
    pub fn decode_frame(&self, bytes: &[u8]) -> Result<Message> {
        let mut reader = Reader::new(bytes);
        let len = reader.u32()? as usize;
        self.check_len(len)?;
        let body = reader.take(len)?;
        reader.finish()?;
        decode_body(body)
    }

    fn peek_len(&self, src: &BytesMut) -> Result<Option<usize>> {
        let Some(prefix) = src.get(..LEN_PREFIX) else {
            return Ok(None);
        };
        let mut raw = [0u8; LEN_PREFIX];
        raw.copy_from_slice(prefix);
        let len = u32::from_be_bytes(raw) as usize;
        self.check_len(len)?;
        Ok(Some(len))
    }

    fn check_len(&self, len: usize) -> Result<()> {
        if len > self.max_frame_len {
            return Err(frame(FrameReason::TooLarge {
                len,
                max: self.max_frame_len,
            }));
        }
        if len < PREAMBLE {
            return Err(frame(FrameReason::TooShort { len, min: PREAMBLE }));
        }
        Ok(())
    }
}

fn frame(reason: FrameReason) -> Error {
    Error::frame(reason)
}

fn kind_of(body: &Body) -> u8 {
    match body {
        Body::TargetMetadata { .. } => KIND_TARGET_METADATA,
        Body::TargetMetadataAck { .. } => KIND_TARGET_METADATA_ACK,
        Body::StartWrite { .. } => KIND_START_WRITE,
        Body::WriteRefused { .. } => KIND_WRITE_REFUSED,
        Body::WriteDone { .. } => KIND_WRITE_DONE,
        Body::WriteProbe { .. } => KIND_WRITE_PROBE,
        Body::WriteProbeAck { .. } => KIND_WRITE_PROBE_ACK,
        Body::RouteProof { .. } => KIND_ROUTE_PROOF,
    }
}

// ---------------------------------------------------------------- encoding

fn bound(field: &'static str, count: usize, max: usize) -> Result<()> {
    if count > max {
        return Err(frame(FrameReason::Bound { field, count, max }));
    }
    Ok(())
}

fn put_str8(dst: &mut BytesMut, field: &'static str, s: &str) -> Result<()> {
    bound(field, s.len(), u8::MAX as usize)?;
    dst.put_u8(s.len() as u8);
    dst.extend_from_slice(s.as_bytes());
    Ok(())
}

fn put_bytes16(dst: &mut BytesMut, field: &'static str, b: &[u8], max: usize) -> Result<()> {
    bound(field, b.len(), max.min(u16::MAX as usize))?;
    dst.put_u16(b.len() as u16);
    dst.extend_from_slice(b);
    Ok(())
}

fn put_opt_incarnation(dst: &mut BytesMut, inc: Option<Incarnation>) {
    match inc {
        None => dst.put_u8(0),
        Some(inc) => {
            dst.put_u8(1);
            dst.put_u128(inc.raw());
        }
    }
}

fn put_header(dst: &mut BytesMut, header: &Header) -> Result<()> {
    dst.put_u128(header.sender.raw());
    dst.put_u64(header.route_generation.0);
    put_str8(dst, "sender_endpoint", &header.sender_endpoint.to_string())
}

fn put_body(dst: &mut BytesMut, body: &Body) -> Result<()> {
    match body {
        Body::TargetMetadata {
            worker_address,
            regions,
            shared_memory,
            doorbell,
            device_regions,
        } => {
            if worker_address.is_empty() {
                return Err(frame(FrameReason::Empty("worker_address")));
            }
            put_bytes16(dst, "worker_address", worker_address, MAX_WORKER_ADDRESS)?;
            check_regions(regions)?;
            dst.put_u16(regions.len() as u16);
            for region in regions {
                dst.put_u32(region.id.0);
                put_str8(dst, "region label", &region.label)?;
                dst.put_u64(region.base);
                dst.put_u64(region.element_size);
                dst.put_u64(region.stride);
                dst.put_u64(region.count);
                put_bytes16(dst, "rkey", &region.rkey, MAX_RKEY)?;
            }
            match shared_memory {
                None => dst.put_u8(0),
                Some(shared) => {
                    check_segments(regions, &shared.segments)?;
                    dst.put_u8(1);
                    dst.extend_from_slice(&shared.boot_id);
                    dst.put_u64(shared.pid_namespace);
                    dst.put_u32(shared.pid);
                    dst.put_u16(shared.segments.len() as u16);
                    for segment in &shared.segments {
                        dst.put_u32(segment.region.0);
                        dst.put_u32(segment.fd);
                        dst.extend_from_slice(&segment.token);
                    }
                }
            }
            match doorbell {
                None => dst.put_u8(0),
                Some(doorbell) => {
                    check_doorbell(regions, doorbell)?;
                    dst.put_u8(1);
                    dst.put_u32(doorbell.region.0);
                    dst.extend_from_slice(&doorbell.key);
                }
            }
            check_device_regions(regions, device_regions)?;
            dst.put_u16(device_regions.len() as u16);
            for device in device_regions {
                dst.put_u32(device.id.0);
                dst.put_u64(device.base);
                dst.put_u64(device.element_size);
                dst.put_u64(device.stride);
                dst.put_u64(device.count);
                put_bytes16(dst, "device export", &device.export, MAX_DEVICE_EXPORT)?;
            }
        }
        Body::TargetMetadataAck {
            op_handle,
            one_copy,
            device,
        } => {
            match op_handle {
                None => dst.put_u8(0),
                Some(op) => {
                    dst.put_u8(1);
                    dst.put_u64(op.0);
                }
            }
            dst.put_u8(u8::from(*one_copy));
            dst.put_u8(u8::from(*device));
        }
        Body::StartWrite {
            op_handle,
            remaining_timeout_ms,
            source_incarnation,
            namespace,
            keys,
            destinations,
        } => {
            if *remaining_timeout_ms == 0 {
                return Err(frame(FrameReason::Zero("remaining_timeout_ms")));
            }
            if keys.len() != destinations.len() {
                return Err(frame(FrameReason::LengthMismatch {
                    keys: keys.len(),
                    destinations: destinations.len(),
                }));
            }
            if keys.is_empty() {
                return Err(frame(FrameReason::Empty("keys")));
            }
            bound("keys", keys.len(), MAX_KEYS_PER_WRITE)?;
            dst.put_u64(op_handle.0);
            dst.put_u32(*remaining_timeout_ms);
            put_opt_incarnation(dst, *source_incarnation);
            dst.put_u64(namespace.0);
            dst.put_u32(keys.len() as u32);
            for (key, dests) in keys.iter().zip(destinations) {
                if dests.is_empty() {
                    return Err(frame(FrameReason::Empty("destinations of a key")));
                }
                bound("destinations of a key", dests.len(), MAX_SPANS_PER_KEY)?;
                dst.put_u64(key.as_u64());
                dst.put_u16(dests.len() as u16);
                for element in dests {
                    dst.put_u32(element.region.0);
                    dst.put_u64(element.index);
                }
            }
        }
        Body::WriteRefused { op_handle } => dst.put_u64(op_handle.0),
        Body::WriteDone { op_handle, outcome } => {
            dst.put_u64(op_handle.0);
            match outcome {
                WriteOutcome::Completed(completed) => {
                    let indices = completed.as_slice();
                    bound("completed indices", indices.len(), MAX_KEYS_PER_WRITE)?;
                    if indices.windows(2).any(|w| w.first() >= w.get(1)) {
                        return Err(frame(FrameReason::IndicesOrder));
                    }
                    dst.put_u8(if completed.is_checked_in_copy() {
                        OUTCOME_COMPLETED_CHECKED_IN_COPY
                    } else {
                        OUTCOME_COMPLETED
                    });
                    dst.put_u32(indices.len() as u32);
                    for index in indices {
                        dst.put_u32(*index);
                    }
                    let digests = completed.digests().unwrap_or_default();
                    dst.put_u32(digests.len() as u32);
                    for digest in digests {
                        dst.put_u64(*digest);
                    }
                }
                WriteOutcome::Failed { terminal: true } => dst.put_u8(OUTCOME_FAILED_TERMINAL),
                WriteOutcome::Failed { terminal: false } => {
                    dst.put_u8(OUTCOME_FAILED_NONTERMINAL);
                }
            }
        }
        Body::WriteProbe {
            op_handle,
            source_incarnation,
        } => {
            dst.put_u64(op_handle.0);
            put_opt_incarnation(dst, *source_incarnation);
        }
        Body::WriteProbeAck {
            op_handle,
            terminal,
            dead_incarnation,
        } => {
            dst.put_u64(op_handle.0);
            dst.put_u8(u8::from(*terminal));
            put_opt_incarnation(dst, *dead_incarnation);
        }
        Body::RouteProof { nonce } => dst.extend_from_slice(nonce),
    }
    Ok(())
}

/// The rules every advertised region set obeys (shared by encode and decode).
fn check_regions(regions: &[RegionAdvert]) -> Result<()> {
    bound("regions", regions.len(), MAX_REGIONS)?;
    let mut ids: Vec<u32> = regions.iter().map(|r| r.id.0).collect();
    ids.sort_unstable();
    if let Some(w) = ids.windows(2).find(|w| w.first() == w.get(1)) {
        return Err(frame(FrameReason::DuplicateRegion(
            w.first().copied().unwrap_or_default(),
        )));
    }
    regions.iter().try_for_each(check_region)
}

/// Each segment names an advertised region, and no region twice.
fn check_segments(regions: &[RegionAdvert], segments: &[SegmentAdvert]) -> Result<()> {
    bound("segments", segments.len(), regions.len())?;
    let mut ids: Vec<u32> = segments.iter().map(|s| s.region.0).collect();
    ids.sort_unstable();
    if let Some(w) = ids.windows(2).find(|w| w.first() == w.get(1)) {
        return Err(frame(FrameReason::DuplicateRegion(
            w.first().copied().unwrap_or_default(),
        )));
    }
    match segments
        .iter()
        .find(|s| !regions.iter().any(|r| r.id == s.region))
    {
        Some(stray) => Err(frame(FrameReason::UnknownSegmentRegion(stray.region.0))),
        None => Ok(()),
    }
}

/// The doorbell names an advertised region.
fn check_doorbell(regions: &[RegionAdvert], doorbell: &DoorbellAdvert) -> Result<()> {
    if regions.iter().any(|r| r.id == doorbell.region) {
        Ok(())
    } else {
        Err(frame(FrameReason::UnknownDoorbellRegion(doorbell.region.0)))
    }
}

/// Device regions: bounded, ids unique among themselves and apart from the
/// regions' (an element names one region), extents that fit, a named export.
fn check_device_regions(regions: &[RegionAdvert], devices: &[DeviceRegionAdvert]) -> Result<()> {
    bound("device regions", devices.len(), MAX_DEVICE_REGIONS)?;
    let mut ids: Vec<u32> = devices.iter().map(|d| d.id.0).collect();
    ids.extend(regions.iter().map(|r| r.id.0));
    ids.sort_unstable();
    if let Some(w) = ids.windows(2).find(|w| w.first() == w.get(1)) {
        return Err(frame(FrameReason::DuplicateRegion(
            w.first().copied().unwrap_or_default(),
        )));
    }
    for device in devices {
        if device.element_size == 0 {
            return Err(frame(FrameReason::Zero("device element_size")));
        }
        if device.count == 0 {
            return Err(frame(FrameReason::Zero("device count")));
        }
        if device.export.is_empty() {
            return Err(frame(FrameReason::Empty("device export")));
        }
        bound("device export", device.export.len(), MAX_DEVICE_EXPORT)?;
        let overlapping = device.count > 1 && device.stride < device.element_size;
        let end = device
            .extent()
            .and_then(|extent| device.base.checked_add(extent));
        if overlapping || end.is_none() {
            return Err(frame(FrameReason::DeviceRegionExtent(device.id.0)));
        }
    }
    Ok(())
}

fn check_region(region: &RegionAdvert) -> Result<()> {
    let label_ok = !region.label.is_empty()
        && region.label.len() <= MAX_LABEL
        && region
            .label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'/' | b'-'));
    if !label_ok {
        return Err(frame(FrameReason::Label(Echo::new(&region.label))));
    }
    if region.element_size == 0 {
        return Err(frame(FrameReason::Zero("region element_size")));
    }
    if region.count == 0 {
        return Err(frame(FrameReason::Zero("region count")));
    }
    if region.rkey.is_empty() {
        return Err(frame(FrameReason::Empty("rkey")));
    }
    bound("rkey", region.rkey.len(), MAX_RKEY)?;
    let overlapping = region.count > 1 && region.stride < region.element_size;
    let end = region
        .stride
        .checked_mul(region.count - 1)
        .and_then(|last| last.checked_add(region.element_size))
        .and_then(|extent| region.base.checked_add(extent));
    if overlapping || end.is_none() {
        return Err(frame(FrameReason::RegionExtent(Echo::new(&region.label))));
    }
    Ok(())
}

// ---------------------------------------------------------------- decoding

/// A bounds-checked cursor over one frame's bytes.
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self { rest: bytes }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.rest.len() < n {
            return Err(frame(FrameReason::Truncated {
                needed: n - self.rest.len(),
            }));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(u8::from_be_bytes(self.array()?))
    }

    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    fn u128(&mut self) -> Result<u128> {
        Ok(u128::from_be_bytes(self.array()?))
    }

    fn bool(&mut self, field: &'static str) -> Result<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            value => Err(frame(FrameReason::Bool { field, value })),
        }
    }

    fn option_tag(&mut self, field: &'static str) -> Result<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            value => Err(frame(FrameReason::OptionTag { field, value })),
        }
    }

    fn incarnation(&mut self, field: &'static str) -> Result<Incarnation> {
        Incarnation::from_raw(self.u128()?).ok_or(frame(FrameReason::Zero(field)))
    }

    fn opt_incarnation(&mut self, field: &'static str) -> Result<Option<Incarnation>> {
        if self.option_tag(field)? {
            self.incarnation(field).map(Some)
        } else {
            Ok(None)
        }
    }

    fn str8(&mut self, field: &'static str) -> Result<&'a str> {
        let n = usize::from(self.u8()?);
        std::str::from_utf8(self.take(n)?).map_err(|_| frame(FrameReason::Utf8(field)))
    }

    fn bytes16(&mut self, field: &'static str, max: usize) -> Result<Vec<u8>> {
        let n = usize::from(self.u16()?);
        bound(field, n, max)?;
        Ok(self.take(n)?.to_vec())
    }

    /// Checks a list count against its bound and against the bytes left (each
    /// item needs at least `min_item` bytes), before anything is allocated.
    fn count(&self, field: &'static str, count: usize, max: usize, min_item: usize) -> Result<()> {
        bound(field, count, max)?;
        let needed = count.saturating_mul(min_item);
        if needed > self.rest.len() {
            return Err(frame(FrameReason::Truncated {
                needed: needed - self.rest.len(),
            }));
        }
        Ok(())
    }

    fn finish(&self) -> Result<()> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(frame(FrameReason::Trailing(self.rest.len())))
        }
    }
}

fn decode_body(bytes: &[u8]) -> Result<Message> {
    let mut r = Reader::new(bytes);
    let magic = r.u16()?;
    if magic != MAGIC {
        return Err(frame(FrameReason::Magic(magic)));
    }
    let version = r.u8()?;
    if version != VERSION {
        return Err(frame(FrameReason::Version(version)));
    }
    let kind = r.u8()?;
    if !(KIND_TARGET_METADATA..=KIND_ROUTE_PROOF).contains(&kind) {
        return Err(frame(FrameReason::Kind(kind)));
    }
    let header = Header {
        sender: r.incarnation("sender incarnation")?,
        route_generation: RouteGeneration(r.u64()?),
        sender_endpoint: {
            let text = r.str8("sender_endpoint")?;
            ControlEndpoint::parse(text).map_err(|e| {
                frame(FrameReason::Endpoint {
                    field: "sender_endpoint",
                    source: Box::new(e),
                })
            })?
        },
    };
    let body = match kind {
        KIND_TARGET_METADATA => decode_target_metadata(&mut r)?,
        KIND_TARGET_METADATA_ACK => Body::TargetMetadataAck {
            op_handle: if r.option_tag("op_handle")? {
                Some(OpHandle(r.u64()?))
            } else {
                None
            },
            one_copy: r.bool("one_copy")?,
            device: r.bool("device")?,
        },
        KIND_START_WRITE => decode_start_write(&mut r)?,
        KIND_WRITE_REFUSED => Body::WriteRefused {
            op_handle: OpHandle(r.u64()?),
        },
        KIND_WRITE_DONE => decode_write_done(&mut r)?,
        KIND_WRITE_PROBE => Body::WriteProbe {
            op_handle: OpHandle(r.u64()?),
            source_incarnation: r.opt_incarnation("source_incarnation")?,
        },
        KIND_ROUTE_PROOF => Body::RouteProof { nonce: r.array()? },
        _ => Body::WriteProbeAck {
            op_handle: OpHandle(r.u64()?),
            terminal: r.bool("terminal")?,
            dead_incarnation: r.opt_incarnation("dead_incarnation")?,
        },
    };
    r.finish()?;
    Ok(Message { header, body })
}

/// An encoded segment: region id, fd, token.
const SEGMENT_BYTES: usize = 4 + 4 + 16;

/// Smallest encoded device region: id, four u64s, the export's length (an
/// empty export still decodes, for its own typed error).
const DEVICE_REGION_BYTES: usize = 4 + 8 * 4 + 2;

/// Smallest encoded region: id, empty label, four u64s, one-byte rkey.
const MIN_REGION_BYTES: usize = 4 + 1 + 8 * 4 + 2 + 1;

fn decode_target_metadata(r: &mut Reader<'_>) -> Result<Body> {
    let worker_address = r.bytes16("worker_address", MAX_WORKER_ADDRESS)?;
    if worker_address.is_empty() {
        return Err(frame(FrameReason::Empty("worker_address")));
    }
    let n = usize::from(r.u16()?);
    r.count("regions", n, MAX_REGIONS, MIN_REGION_BYTES)?;
    let mut regions = Vec::with_capacity(n);
    for _ in 0..n {
        regions.push(RegionAdvert {
            id: RegionId(r.u32()?),
            label: r.str8("region label")?.to_owned(),
            base: r.u64()?,
            element_size: r.u64()?,
            stride: r.u64()?,
            count: r.u64()?,
            rkey: r.bytes16("rkey", MAX_RKEY)?,
        });
    }
    check_regions(&regions)?;
    let shared_memory = if r.option_tag("shared_memory")? {
        let boot_id = r.array::<16>()?;
        let pid_namespace = r.u64()?;
        let pid = r.u32()?;
        let n = usize::from(r.u16()?);
        r.count("segments", n, regions.len(), SEGMENT_BYTES)?;
        let mut segments = Vec::with_capacity(n);
        for _ in 0..n {
            segments.push(SegmentAdvert {
                region: RegionId(r.u32()?),
                fd: r.u32()?,
                token: r.array::<16>()?,
            });
        }
        check_segments(&regions, &segments)?;
        Some(SharedMemoryAdvert {
            boot_id,
            pid_namespace,
            pid,
            segments,
        })
    } else {
        None
    };
    let doorbell = if r.option_tag("doorbell")? {
        let doorbell = DoorbellAdvert {
            region: RegionId(r.u32()?),
            key: r.array::<32>()?,
        };
        check_doorbell(&regions, &doorbell)?;
        Some(doorbell)
    } else {
        None
    };
    let n = usize::from(r.u16()?);
    r.count("device regions", n, MAX_DEVICE_REGIONS, DEVICE_REGION_BYTES)?;
    let mut device_regions = Vec::with_capacity(n);
    for _ in 0..n {
        device_regions.push(DeviceRegionAdvert {
            id: RegionId(r.u32()?),
            base: r.u64()?,
            element_size: r.u64()?,
            stride: r.u64()?,
            count: r.u64()?,
            export: r.bytes16("device export", MAX_DEVICE_EXPORT)?,
        });
    }
    check_device_regions(&regions, &device_regions)?;
    Ok(Body::TargetMetadata {
        worker_address,
        regions,
        shared_memory,
        doorbell,
        device_regions,
    })
}

/// Smallest encoded key entry: key, destination count, one element.
const MIN_KEY_ENTRY_BYTES: usize = 8 + 2 + 12;
const ELEMENT_BYTES: usize = 12;

fn decode_start_write(r: &mut Reader<'_>) -> Result<Body> {
    let op_handle = OpHandle(r.u64()?);
    let remaining_timeout_ms = r.u32()?;
    if remaining_timeout_ms == 0 {
        return Err(frame(FrameReason::Zero("remaining_timeout_ms")));
    }
    let source_incarnation = r.opt_incarnation("source_incarnation")?;
    let namespace = NamespaceId(r.u64()?);
    let n = r.u32()? as usize;
    if n == 0 {
        return Err(frame(FrameReason::Empty("keys")));
    }
    r.count("keys", n, MAX_KEYS_PER_WRITE, MIN_KEY_ENTRY_BYTES)?;
    let mut keys = Vec::with_capacity(n);
    let mut destinations = Vec::with_capacity(n);
    for _ in 0..n {
        keys.push(BlockKey::from_u64(r.u64()?));
        let spans = usize::from(r.u16()?);
        if spans == 0 {
            return Err(frame(FrameReason::Empty("destinations of a key")));
        }
        r.count(
            "destinations of a key",
            spans,
            MAX_SPANS_PER_KEY,
            ELEMENT_BYTES,
        )?;
        let mut dests = Vec::with_capacity(spans);
        for _ in 0..spans {
            dests.push(ElementRef {
                region: RegionId(r.u32()?),
                index: r.u64()?,
            });
        }
        destinations.push(dests);
    }
    Ok(Body::StartWrite {
        op_handle,
        remaining_timeout_ms,
        source_incarnation,
        namespace,
        keys,
        destinations,
    })
}

fn decode_write_done(r: &mut Reader<'_>) -> Result<Body> {
    let op_handle = OpHandle(r.u64()?);
    let outcome = match r.u8()? {
        tag @ (OUTCOME_COMPLETED | OUTCOME_COMPLETED_CHECKED_IN_COPY) => {
            let checked = tag == OUTCOME_COMPLETED_CHECKED_IN_COPY;
            let n = r.u32()? as usize;
            r.count("completed indices", n, MAX_KEYS_PER_WRITE, 4)?;
            let mut indices = Vec::with_capacity(n);
            for _ in 0..n {
                let index = r.u32()?;
                if indices.last().is_some_and(|prev| *prev >= index) {
                    return Err(frame(FrameReason::IndicesOrder));
                }
                indices.push(index);
            }
            let m = r.u32()? as usize;
            if (m != 0 || checked) && m != n {
                return Err(frame(FrameReason::DigestCount));
            }
            r.count("page digests", m, MAX_KEYS_PER_WRITE, 8)?;
            let mut digests = Vec::with_capacity(m);
            for _ in 0..m {
                digests.push(r.u64()?);
            }
            WriteOutcome::Completed(CompletedIndices::from_ascending(indices, digests, checked))
        }
        OUTCOME_FAILED_TERMINAL => WriteOutcome::Failed { terminal: true },
        OUTCOME_FAILED_NONTERMINAL => WriteOutcome::Failed { terminal: false },
        value => {
            return Err(frame(FrameReason::OptionTag {
                field: "write outcome",
                value,
            }));
        }
    };
    Ok(Body::WriteDone { op_handle, outcome })
}
