//! Reading peer control frames: [`FrameCodec::decode`], [`FrameCodec::decode_frame`]
//! and the bounds-checked `Reader` they parse with.
//!
//! Every count is checked against its bound and the bytes left before anything
//! is allocated, so a hostile length costs no more memory than the frame itself.

use bytes::{Buf, BytesMut};

use super::validate::{check_device_regions, check_doorbell, check_regions, check_segments};
use super::{
    FrameCodec, KIND_ROUTE_PROOF, KIND_START_WRITE, KIND_TARGET_METADATA, KIND_TARGET_METADATA_ACK,
    KIND_WRITE_DONE, KIND_WRITE_LEAD_LANDED, KIND_WRITE_PROBE, KIND_WRITE_REFUSED, LEN_PREFIX,
    MAGIC, MAX_DEVICE_EXPORT, MAX_DEVICE_REGIONS, MAX_ELEMENTS_PER_WRITE, MAX_KEYS_PER_WRITE,
    MAX_REGIONS, MAX_RKEY, MAX_SPANS_PER_KEY, MAX_WORKER_ADDRESS, OUTCOME_COMPLETED,
    OUTCOME_COMPLETED_CHECKED_IN_COPY, OUTCOME_FAILED_NONTERMINAL, OUTCOME_FAILED_TERMINAL,
    PREAMBLE, VERSION, bound, frame, lead_within,
};
use crate::endpoint::ControlEndpoint;
use crate::error::{FrameReason, Result};
use crate::incarnation::Incarnation;
use crate::key::{BlockKey, NamespaceId};
use crate::protocol::{
    Body, CompletedIndices, DeviceRegionAdvert, DoorbellAdvert, ElementRun, ElementRuns, Header,
    Message, OpHandle, RegionAdvert, RegionId, RouteGeneration, SegmentAdvert, SharedMemoryAdvert,
    WriteOutcome,
};

impl FrameCodec {
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
    if !(KIND_TARGET_METADATA..=KIND_WRITE_LEAD_LANDED).contains(&kind) {
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
        KIND_WRITE_LEAD_LANDED => {
            let op_handle = OpHandle(r.u64()?);
            let elements = r.u16()?;
            if elements == 0 {
                return Err(frame(FrameReason::Zero("lead elements")));
            }
            Body::WriteLeadLanded {
                op_handle,
                elements,
            }
        }
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

/// One encoded run of destination elements: region, regions, index.
const RUN_BYTES: usize = 4 + 2 + 8;
/// Smallest encoded key entry: key, run count, one run.
const MIN_KEY_ENTRY_BYTES: usize = 8 + 2 + RUN_BYTES;

fn decode_start_write(r: &mut Reader<'_>) -> Result<Body> {
    let op_handle = OpHandle(r.u64()?);
    let remaining_timeout_ms = r.u32()?;
    if remaining_timeout_ms == 0 {
        return Err(frame(FrameReason::Zero("remaining_timeout_ms")));
    }
    let source_incarnation = r.opt_incarnation("source_incarnation")?;
    let namespace = NamespaceId(r.u64()?);
    let lead_elements = r.u16()?;
    let n = r.u32()? as usize;
    if n == 0 {
        return Err(frame(FrameReason::Empty("keys")));
    }
    r.count("keys", n, MAX_KEYS_PER_WRITE, MIN_KEY_ENTRY_BYTES)?;
    let mut keys = Vec::with_capacity(n);
    let mut destinations = Vec::with_capacity(n);
    let mut elements = 0usize;
    for _ in 0..n {
        keys.push(BlockKey::from_u64(r.u64()?));
        let runs = usize::from(r.u16()?);
        if runs == 0 {
            return Err(frame(FrameReason::Empty("destinations of a key")));
        }
        r.count("destinations of a key", runs, MAX_SPANS_PER_KEY, RUN_BYTES)?;
        // Taken whole (`count` saw they fit), then cut; kept as runs, not
        // expanded: a restore's `start_write`s carry ~230,000 elements.
        let raw = r.take(runs.saturating_mul(RUN_BYTES))?;
        // Every run is checked and the key's and the write's element counts
        // bounded before anything is kept.
        let mut dests = ElementRuns::new();
        for bytes in raw.chunks_exact(RUN_BYTES) {
            dests.push_run(run(bytes)?);
        }
        let spans = dests.len();
        bound("destinations of a key", spans, MAX_SPANS_PER_KEY)?;
        elements += spans;
        bound("destinations of a write", elements, MAX_ELEMENTS_PER_WRITE)?;
        lead_within(lead_elements, spans)?;
        destinations.push(dests);
    }
    Ok(Body::StartWrite {
        op_handle,
        remaining_timeout_ms,
        source_incarnation,
        namespace,
        keys,
        destinations,
        lead_elements,
    })
}

/// One run as the wire carries it (`region:u32 regions:u16 index:u64`,
/// big-endian, [`RUN_BYTES`] of them): at least one region, none past
/// `u32::MAX`.
fn run(bytes: &[u8]) -> Result<ElementRun> {
    let truncated = || frame(FrameReason::Truncated { needed: RUN_BYTES });
    let (first, rest) = bytes.split_first_chunk::<4>().ok_or_else(truncated)?;
    let (regions, rest) = rest.split_first_chunk::<2>().ok_or_else(truncated)?;
    let index = rest.first_chunk::<8>().ok_or_else(truncated)?;
    let (first, regions) = (u32::from_be_bytes(*first), u16::from_be_bytes(*regions));
    if regions == 0 {
        return Err(frame(FrameReason::Zero("regions of a run")));
    }
    ElementRun::new(RegionId(first), regions, u64::from_be_bytes(*index))
        .ok_or_else(|| frame(FrameReason::RegionRun { first, regions }))
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
