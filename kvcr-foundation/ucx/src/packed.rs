//! Structural validation of the two blobs UCX 1.13 parses from a bare
//! pointer, with no length and no parse safety: a packed worker address
//! (`ucp_ep_create`) and a packed remote key (`ucp_ep_rkey_unpack`). No unsafe
//! code here.
//!
//! UCX 1.13 trusts these bytes completely: a wrong version nibble is an
//! `assert` (SIGABRT) in its address parser, a wrong length walks its parser
//! off the end, a wrong count or index reaches arrays it sizes for well-formed
//! input. So a peer's blob is walked here, field by field, and refused with a
//! typed [`UcxReason`] unless it has exactly the shape 1.13 itself produces
//! (`ucp_worker_get_address` / `ucp_rkey_pack`); only then does UCX see it.
//! [`WorkerAddress::from_bytes`](crate::WorkerAddress::from_bytes) and
//! [`RkeyBuffer::from_bytes`](crate::RkeyBuffer::from_bytes) run the checks
//! that need no context; [`Worker::connect`](crate::Worker::connect) and
//! [`Endpoint::unpack_rkey`](crate::Endpoint::unpack_rkey) run them again with
//! the local context's [`Limits`] before calling UCX.
//!
//! # The worker address (UCX 1.13, `src/ucp/wireup/address.c`)
//!
//! Little-endian; "ext" marks a field that address version 2 widens with one
//! more byte when the bits in the first byte are all ones.
//!
//! ```text
//! header      v1: 1 byte, low nibble version 0, high nibble flags
//!             v2: 2 bytes, low nibble version 1 (high nibble 0), then a flags byte
//!             flags: 1 debug info (worker name follows), 2 worker uuid,
//!                    4 client id, 8 active-message lanes only
//! uuid        u64                     (flag 2)
//! client id   u64                     (flag 4)
//! name        u8 length, that many bytes (flag 1)
//! devices     repeated until a device carries LAST (0xff alone: no devices):
//!   md        1 byte: 0x80 device has no transports;
//!             v1: 0x40 md allocates, 0x20 md registers, 5-bit md index;
//!             v2: 7-bit md index (ext)
//!   dev len   1 byte: 0x80 LAST device, 0x40 path count follows,
//!             0x20 system device follows, 5-bit device-address length (ext)
//!   paths     u8, only when flagged (written only for 2 or more paths)
//!   sys dev   u8, only when flagged (never the "unknown" id 0xff)
//!   dev addr  dev-len bytes
//!   ifaces    repeated until an iface carries LAST:
//!     tl csum   u16, checksum of the transport name
//!     attrs     v1: 16 bytes (f32 overhead, f32 bandwidth, f32 latency,
//!               u32 priority and capability bits); v2: 8 bytes (three 8-bit
//!               floats, priority, u16 segment size / 64, u16 flags)
//!     if len    1 byte: 0x80 LAST iface, 0x40 endpoint addresses follow,
//!               6-bit iface-address length (ext)
//!     if addr   if-len bytes
//!     ep addrs  (only in wire-up messages, never in a worker address)
//! ```
//!
//! # The remote key (UCX 1.13, `src/ucp/core/ucp_rkey.c`)
//!
//! ```text
//! md_map u64 | mem_type u8 | for each set bit of md_map, lowest first: size u8, size bytes
//! ```
//!
//! `ucp_rkey_pack` never writes the optional system-device section that may
//! follow, and the public `ucp_ep_rkey_unpack` never reads it (it passes a
//! zero length), so nothing may follow the last md entry.
//!
//! # What is not validated
//!
//! The walk proves that every length, count, flag and index lies where and
//! within what UCX will read, and that nothing is left over. It cannot prove
//! the *contents* that only the sending host or a transport can interpret:
//!
//! * device, iface and md-rkey bytes are opaque transport data (an IP address
//!   and port, a shared-memory segment id, a pid, an IB key). A transport's
//!   `uct_rkey_unpack` reads its own fixed-size struct whatever the size byte
//!   says; a short entry then reads the next entry or the zero padding the
//!   safe layer appends, never foreign memory. A shared-memory rkey names a
//!   segment that unpacking attaches: peers are trusted at the transport
//!   level (the control channel's handshake keeps strangers out). One
//!   binding can be checked with local knowledge, on request
//!   ([`validate_process_binding`](crate::validate_process_binding), which
//!   the runner asks for): a cma iface
//!   (a pid cma puts would write into) must name the process the address's
//!   posix fifo belongs to, with no sysv fifo beside it, and knem and xpmem
//!   ifaces (whose rkeys name memory of any process) are refused
//!   ([`AddressProblem::ForeignProcess`]), so a route's puts reach only the
//!   process its active messages reach (the runner's route proof).
//! * transport-name checksums are not matched against known transports
//!   (UCX skips an entry whose checksum matches no local transport);
//! * iface attributes are checked only as far as UCX sizes endpoints by
//!   them: version 1 floats must be finite, with a positive bandwidth and
//!   non-negative overheads; with local knowledge (below), a transport this
//!   host has must carry this host's capability bits (v1) or segment size
//!   and flags (v2). Priorities and the remaining performance figures
//!   (v2's 8-bit floats) only steer lane selection and are not checked;
//! * md indices are indices into the *sender's* md table, and iface bytes
//!   are the sender's transport data. Without local knowledge they are only
//!   bounded by the 64-bit md map UCX keeps. At connect/unpack time they are
//!   checked against what this host's own worker address and own rkey hold
//!   ([`Limits::local`]): the same address version; md indices below the
//!   local md range; for every transport this host also has (matched by
//!   name checksum), the same md index (UCX picks the component that parses
//!   the iface bytes by md index: a transport moved to another md is parsed
//!   by the wrong component), the same capability bits or segment size and
//!   flags, the same iface-address length, and for posix the same
//!   segment-mode flags (a posix fifo segment id without its procfs or
//!   shm_open flag makes 1.13 assert); rkey entries only for mds this host
//!   registers host memory with, each of this host's key size (a posix key
//!   in an rkey of registered memory makes 1.13 assert or crash). This
//!   assumes every peer runs the same UCX build with the same transports,
//!   devices and settings, as every kvcr rank does; a peer with more memory
//!   domains (say, more HCAs) or other transport settings is refused, not
//!   parsed. Device addresses are not compared (a tcp device address is
//!   longer for IPv6);
//! * the receiving side must not run in UCX's unified mode
//!   (`UCX_UNIFIED_MODE=y`), which packs and parses iface entries without
//!   lengths or attributes. kvcr never enables it; a unified-mode worker's
//!   own address does not walk as a non-unified one (tested for the
//!   transports kvcr uses, not proved for every configuration), so
//!   [`Context::create_worker`](crate::Context::create_worker) refuses to
//!   build one.

use crate::status::UcxReason;

/// Upper bound on a packed UCX worker address (1.13 addresses on these hosts
/// are 40–250 bytes; many devices make a few KiB).
pub const MAX_UCX_ADDRESS: usize = 64 * 1024;
/// Upper bound on a packed UCX rkey (9 header bytes plus a size byte and at
/// most 255 bytes per memory domain; real ones are 10–100 bytes).
pub const MAX_UCX_RKEY: usize = 4096;

/// `UCP_MAX_RESOURCES` in 1.13: an address names at most this many ifaces.
const MAX_IFACES: usize = 128;
/// `ucp_md_map_t` is 64 bits wide in 1.13: md indices are below 64.
const MAX_MDS: u32 = 64;
/// `UCP_NULL_RESOURCE`: the lone byte of an address without devices.
const NULL_RESOURCE: u8 = 0xff;
/// `UCS_SYS_DEVICE_ID_UNKNOWN`: never packed as a system device.
const SYS_DEVICE_UNKNOWN: u8 = 0xff;
/// `UCS_MEMORY_TYPE_HOST`.
const MEMORY_TYPE_HOST: u8 = 0;
/// `UCS_MEMORY_TYPE_LAST` in 1.13.
const MEMORY_TYPE_LAST: u8 = 5;

const VERSION_MASK: u8 = 0x0f;
const FLAG_DEBUG_INFO: u8 = 0x01;
const FLAG_WORKER_UUID: u8 = 0x02;
const FLAG_CLIENT_ID: u8 = 0x04;
const FLAG_AM_ONLY: u8 = 0x08;
const KNOWN_HEADER_FLAGS: u8 = FLAG_DEBUG_INFO | FLAG_WORKER_UUID | FLAG_CLIENT_ID | FLAG_AM_ONLY;

const MD_EMPTY_DEVICE: u8 = 0x80;
const MD_INDEX_V1: u8 = 0x1f;
const MD_INDEX_V2: u8 = 0x7f;

const LAST: u8 = 0x80;
const DEV_NUM_PATHS: u8 = 0x40;
const DEV_SYS_DEVICE: u8 = 0x20;
const DEV_LEN: u8 = 0x1f;
const IFACE_HAS_EP_ADDR: u8 = 0x40;
const IFACE_LEN: u8 = 0x3f;

const IFACE_ATTR_V1: usize = 16;
const IFACE_ATTR_V2: usize = 8;

/// The packed-address format version (the header's low nibble).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AddressVersion {
    /// `UCP_OBJECT_VERSION_V1` (0): 1.13's default (`UCX_ADDRESS_VERSION=v1`).
    V1,
    /// `UCP_OBJECT_VERSION_V2` (1): `UCX_ADDRESS_VERSION=v2`.
    V2,
}

/// Why a packed UCX worker address was refused (inside
/// [`UcxReason::MalformedAddress`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AddressProblem {
    /// Zero bytes.
    #[error("empty")]
    Empty,
    /// The bytes end inside a field.
    #[error("truncated inside {field}")]
    Truncated {
        /// The field being read.
        field: &'static str,
    },
    /// Bytes after the last device.
    #[error("{extra} bytes after the last device")]
    Trailing {
        /// How many.
        extra: usize,
    },
    /// The header's version nibble is neither v1 (0) nor v2 (1), or a v2
    /// header has a non-zero high nibble (UCX 1.13 asserts on the former).
    #[error("unknown address version byte {0:#04x}")]
    Version(u8),
    /// Header flags UCX 1.13 does not define.
    #[error("unknown header flags {0:#04x}")]
    HeaderFlags(u8),
    /// No worker uuid: every 1.13 worker address carries one.
    #[error("no worker uuid")]
    NoWorkerUuid,
    /// The "active-message lanes only" flag, which only wire-up messages carry.
    #[error("active-message-only address")]
    AmOnly,
    /// No devices at all (the lone `0xff` marker): nothing to connect to.
    #[error("no devices")]
    NoDevices,
    /// No device carries a transport (only memory-domain records).
    #[error("no device carries a transport")]
    EmptyDevice,
    /// A memory-domain index at or above the bound.
    #[error("md index {index} is not below {limit}")]
    MdIndex {
        /// The index.
        index: u32,
        /// The bound (64, or the local context's md range).
        limit: u32,
    },
    /// A v2 extension byte that holds a value the short field could have held
    /// (1.13 extends only values that do not fit).
    #[error("non-canonical extended {field}")]
    Extension {
        /// The field.
        field: &'static str,
    },
    /// A device path count below 2 (1.13 packs it only for 2 or more paths).
    #[error("device path count {0}")]
    PathCount(u8),
    /// The "unknown" system device id packed as a system device.
    #[error("unknown system device packed")]
    SysDevice,
    /// A v1 iface attribute that is not finite, a bandwidth that is not
    /// positive, or a negative overhead.
    #[error("iface attribute {field} out of range")]
    IfaceAttr {
        /// The attribute.
        field: &'static str,
    },
    /// Endpoint addresses, which only wire-up messages carry.
    #[error("endpoint addresses in a worker address")]
    EpAddress,
    /// More ifaces than `UCP_MAX_RESOURCES` (128).
    #[error("more than {MAX_IFACES} ifaces")]
    TooManyIfaces,
    /// A transport this host has, on an md index where this host does not
    /// have it.
    #[error("transport {csum:#06x} on md {index}, not where this host has it")]
    TransportMd {
        /// Transport-name checksum.
        csum: u16,
        /// The md index.
        index: u32,
    },
    /// The address is of another format version than this host's own
    /// (every kvcr rank runs the same UCX configuration; the version 2
    /// attributes UCX sizes endpoints by can only be compared like for like).
    #[error("address version {version:?}, this host's is {expected:?}")]
    OtherVersion {
        /// The address's version.
        version: AddressVersion,
        /// This host's.
        expected: AddressVersion,
    },
    /// A transport this host has, with other capability bits (v1) or
    /// another segment size or flags (v2) than this host's: UCX 1.13 sizes
    /// endpoint protocols by them and asserts on some combinations (a posix
    /// iface with segment size 0 failed `rkey_size <= am.max_bcopy`).
    #[error("transport {csum:#06x} attributes {caps:#010x}, this host's are {expected:#010x}")]
    IfaceCaps {
        /// Transport-name checksum.
        csum: u16,
        /// The compared attribute bits seen.
        caps: u32,
        /// This host's.
        expected: u32,
    },
    /// A transport this host has, with an iface address of another length.
    #[error("transport {csum:#06x} iface address of {len} bytes, this host's has {expected}")]
    IfaceAddressLength {
        /// Transport-name checksum.
        csum: u16,
        /// Length seen.
        len: usize,
        /// This host's length.
        expected: usize,
    },
    /// A posix fifo segment id whose mode flags (procfs, shm_open, pid
    /// namespace) differ from this host's.
    #[error("posix segment mode flags {flags:#x}, this host's are {expected:#x}")]
    PosixSegment {
        /// Mode bits seen: procfs (bit 63 of the segment id), shm_open
        /// (62) and pid namespace (60), as bits 3, 2 and 0.
        flags: u8,
        /// This host's.
        expected: u8,
    },
    /// A transport this host has that reaches a process's memory by a
    /// name of its own, not by the worker it connects to: cma (a pid) whose
    /// pid is not the one the address's posix fifo belongs to (the process
    /// a route's nonce reaches), or that has no posix fifo, or a sysv one
    /// beside it, to be bound to; knem and xpmem (the rkey alone names the
    /// memory, of any process) always. A route through it could write into
    /// a process other than the one that proved the worker.
    #[error("transport {csum:#06x} reaches process {pid:?}, not the worker's own ({owner:?})")]
    ForeignProcess {
        /// Transport-name checksum.
        csum: u16,
        /// The process it names (`None`: knem and xpmem name none).
        pid: Option<u32>,
        /// The posix fifo's process (`None`: none in procfs mode).
        owner: Option<u32>,
    },
}

/// What a well-formed packed worker address holds (its shape, not its
/// transport data).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct AddressShape {
    /// Format version.
    pub version: AddressVersion,
    /// The worker's UCX uuid.
    pub worker_uuid: u64,
    /// Devices listed.
    pub devices: usize,
    /// Ifaces (transport addresses) listed, over all devices.
    pub ifaces: usize,
    /// Bit `i` set when some device names md index `i` (sender's numbering).
    pub md_map: u64,
}

/// What a well-formed packed rkey holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RkeyShape {
    /// The sender's memory domains that packed a key (bit per md index).
    pub md_map: u64,
    /// `ucs_memory_type_t` of the registration (always host here).
    pub mem_type: u8,
}

/// `ucs_crc16_string("posix")`: the transport-name checksum of posix.
pub(crate) const TL_POSIX: u16 = 0xd3a7;
/// Segment-mode bits of a posix segment id that must match this host's
/// (procfs, shm_open, pid namespace; huge pages may differ per segment).
const POSIX_MODE_BITS: u8 = 0b1101;

/// One transport of this host's own address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LocalTransport {
    pub(crate) csum: u16,
    md_map: u64,
    /// `usize::MAX`: this host has it with several lengths (not compared).
    iface_len: usize,
    /// `None`: this host has it with several capability words (not compared).
    caps: Option<u32>,
    posix_mode: Option<u8>,
    /// This host's device address for it (the first seen).
    pub(crate) device: Vec<u8>,
}

/// This host's own rkey entries (from a probe registration).
#[derive(Debug, Clone, PartialEq, Eq)]
struct LocalRkey {
    md_map: u64,
    sizes: Vec<(u32, u8)>,
}

/// What peers' packed addresses and rkeys are checked against.
///
/// [`Limits::new`] holds the format's own bounds only (md indices below
/// 64): what [`WorkerAddress::from_bytes`](crate::WorkerAddress::from_bytes)
/// and [`RkeyBuffer::from_bytes`](crate::RkeyBuffer::from_bytes) can check
/// without a context. [`Limits::local`] adds what this host's own worker
/// address and own rkey hold (see the [module docs](self)); every worker
/// builds its own ([`Worker::limits`](crate::Worker::limits)) and checks with
/// it right before UCX parses a peer's blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    md_count: u32,
    version: Option<AddressVersion>,
    pub(crate) transports: Vec<LocalTransport>,
    rkey: Option<LocalRkey>,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            md_count: MAX_MDS,
            version: None,
            transports: Vec::new(),
            rkey: None,
        }
    }
}

impl Limits {
    /// The format's own bounds only.
    pub fn new() -> Self {
        Self::default()
    }

    /// This host's bounds, from its own packed worker address and the packed
    /// rkey of one of its own (host-memory) registrations. Fails when either
    /// is not well formed (for instance a worker in UCX's unified mode).
    pub fn local(own_address: &[u8], own_rkey: &[u8]) -> Result<Self, UcxReason> {
        let mut transports: Vec<LocalTransport> = Vec::new();
        let shape = walk_address(own_address, &Self::new(), &mut |iface| {
            let posix_mode = (iface.csum == TL_POSIX)
                .then(|| posix_mode(iface.addr))
                .flatten();
            let caps = iface.caps();
            match transports.iter_mut().find(|t| t.csum == iface.csum) {
                Some(t) => {
                    t.md_map |= 1u64 << iface.md_index;
                    // One transport in two forms: compare neither.
                    if t.iface_len != iface.addr.len() {
                        t.iface_len = usize::MAX;
                    }
                    if t.caps != Some(caps) {
                        t.caps = None;
                    }
                }
                None => transports.push(LocalTransport {
                    csum: iface.csum,
                    md_map: 1u64 << iface.md_index,
                    iface_len: iface.addr.len(),
                    caps: Some(caps),
                    posix_mode,
                    device: iface.device.to_vec(),
                }),
            }
            Ok(())
        })
        .map_err(|e| address_error(own_address.len(), e))?;
        let (rkey_shape, sizes) = walk_rkey(own_rkey, &Self::new())?;
        let md_count = MAX_MDS - (shape.md_map | rkey_shape.md_map).leading_zeros();
        Ok(Self {
            md_count,
            version: Some(shape.version),
            transports,
            rkey: Some(LocalRkey {
                md_map: rkey_shape.md_map,
                sizes,
            }),
        })
    }

    /// md indices must be below this (at most 64).
    pub fn md_count(&self) -> u32 {
        self.md_count
    }
}

/// The segment-mode bits of a posix iface address (its first 8 bytes are the
/// fifo segment id, little-endian; the mode flags are bits 60..63).
pub(crate) fn posix_mode(iface_addr: &[u8]) -> Option<u8> {
    iface_addr.get(7).map(|top| (top >> 4) & POSIX_MODE_BITS)
}

/// One iface entry of an address, as the walk meets it.
pub(crate) struct IfaceView<'a> {
    version: AddressVersion,
    /// The address of the device the iface is on (for shared memory, the
    /// host's system id).
    pub(crate) device: &'a [u8],
    md_index: u32,
    md_offset: usize,
    pub(crate) csum: u16,
    attrs_offset: usize,
    attrs: &'a [u8],
    pub(crate) addr_offset: usize,
    pub(crate) addr: &'a [u8],
}

impl IfaceView<'_> {
    /// The attribute bits UCX sizes its endpoint configuration by: v1, the
    /// capability and atomic bits (8..32) of the priority word; v2, the
    /// segment size and the flags.
    fn caps(&self) -> u32 {
        let word = |at: usize| {
            let mut a = [0u8; 4];
            if let Some(b) = self.attrs.get(at..at + 4) {
                a.copy_from_slice(b);
            }
            u32::from_le_bytes(a)
        };
        match self.version {
            AddressVersion::V1 => word(12) & !0xff,
            AddressVersion::V2 => word(4),
        }
    }
}

/// A cursor over untrusted bytes that reports where it failed.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

pub(crate) type Step<T> = Result<T, (usize, AddressProblem)>;

impl<'a> Cursor<'a> {
    fn fail<T>(&self, problem: AddressProblem) -> Step<T> {
        Err((self.pos, problem))
    }

    fn take(&mut self, n: usize, field: &'static str) -> Step<&'a [u8]> {
        let out = self
            .pos
            .checked_add(n)
            .and_then(|end| self.bytes.get(self.pos..end));
        match out {
            Some(s) => {
                self.pos += n;
                Ok(s)
            }
            None => self.fail(AddressProblem::Truncated { field }),
        }
    }

    fn u8(&mut self, field: &'static str) -> Step<u8> {
        Ok(self.take(1, field)?.first().copied().unwrap_or_default())
    }

    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    fn f32(&mut self, field: &'static str) -> Step<f32> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4, field)?);
        Ok(f32::from_le_bytes(a))
    }

    fn u16(&mut self, field: &'static str) -> Step<u16> {
        let mut a = [0u8; 2];
        a.copy_from_slice(self.take(2, field)?);
        Ok(u16::from_le_bytes(a))
    }

    fn u64(&mut self, field: &'static str) -> Step<u64> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8, field)?);
        Ok(u64::from_le_bytes(a))
    }

    /// A v2 "ext" field: `short` is the masked value of the first byte; when
    /// it is all ones (`mask`), the real value is the next byte, which must
    /// not fit the short field.
    fn extended(
        &mut self,
        version: AddressVersion,
        short: u8,
        mask: u8,
        field: &'static str,
    ) -> Step<u8> {
        if version == AddressVersion::V1 || short != mask {
            return Ok(short);
        }
        let at = self.pos;
        let value = self.u8(field)?;
        if value < mask {
            return Err((at, AddressProblem::Extension { field }));
        }
        Ok(value)
    }
}

pub(crate) fn address_error(len: usize, (offset, problem): (usize, AddressProblem)) -> UcxReason {
    UcxReason::MalformedAddress {
        offset,
        len,
        problem,
    }
}

/// Validates a packed UCX 1.13 worker address against the format and
/// `limits`; returns its shape. See the [module docs](self) for what is and
/// is not checked.
pub fn validate_worker_address(bytes: &[u8], limits: &Limits) -> Result<AddressShape, UcxReason> {
    if bytes.len() > MAX_UCX_ADDRESS {
        return Err(UcxReason::TooLarge {
            what: "packed UCX worker address",
            len: bytes.len(),
            max: MAX_UCX_ADDRESS,
        });
    }
    walk_address(bytes, limits, &mut |iface| check_iface(limits, iface))
        .map_err(|e| address_error(bytes.len(), e))
}

/// The local-knowledge checks of one iface entry (nothing without it).
fn check_iface(limits: &Limits, iface: &IfaceView<'_>) -> Step<()> {
    let Some(local) = limits.transports.iter().find(|t| t.csum == iface.csum) else {
        // A transport this host lacks: UCX never selects it.
        return Ok(());
    };
    if local.md_map & (1u64 << iface.md_index) == 0 {
        return Err((
            iface.md_offset,
            AddressProblem::TransportMd {
                csum: iface.csum,
                index: iface.md_index,
            },
        ));
    }
    if let Some(expected) = local.caps
        && expected != iface.caps()
    {
        return Err((
            iface.attrs_offset,
            AddressProblem::IfaceCaps {
                csum: iface.csum,
                caps: iface.caps(),
                expected,
            },
        ));
    }
    if local.iface_len != usize::MAX && local.iface_len != iface.addr.len() {
        return Err((
            iface.addr_offset,
            AddressProblem::IfaceAddressLength {
                csum: iface.csum,
                len: iface.addr.len(),
                expected: local.iface_len,
            },
        ));
    }
    if let Some(expected) = local.posix_mode {
        let flags = posix_mode(iface.addr).unwrap_or(u8::MAX);
        if flags != expected {
            return Err((
                iface.addr_offset,
                AddressProblem::PosixSegment { flags, expected },
            ));
        }
    }
    Ok(())
}

pub(crate) fn walk_address<'a>(
    bytes: &'a [u8],
    limits: &Limits,
    on_iface: &mut dyn FnMut(&IfaceView<'a>) -> Step<()>,
) -> Step<AddressShape> {
    let mut c = Cursor { bytes, pos: 0 };
    if bytes.is_empty() {
        return c.fail(AddressProblem::Empty);
    }
    let first = c.u8("header")?;
    let (version, flags) = match first & VERSION_MASK {
        0 => (AddressVersion::V1, first >> 4),
        1 if first >> 4 == 0 => (AddressVersion::V2, c.u8("header flags")?),
        _ => return Err((0, AddressProblem::Version(first))),
    };
    if let Some(expected) = limits.version
        && expected != version
    {
        return Err((0, AddressProblem::OtherVersion { version, expected }));
    }
    if flags & !KNOWN_HEADER_FLAGS != 0 {
        return c.fail(AddressProblem::HeaderFlags(flags));
    }
    if flags & FLAG_AM_ONLY != 0 {
        return c.fail(AddressProblem::AmOnly);
    }
    if flags & FLAG_WORKER_UUID == 0 {
        return c.fail(AddressProblem::NoWorkerUuid);
    }
    let worker_uuid = c.u64("worker uuid")?;
    if flags & FLAG_CLIENT_ID != 0 {
        c.take(8, "client id")?;
    }
    if flags & FLAG_DEBUG_INFO != 0 {
        let n = c.u8("worker name length")?;
        c.take(usize::from(n), "worker name")?;
    }
    if c.peek() == Some(NULL_RESOURCE) {
        return c.fail(AddressProblem::NoDevices);
    }
    let md_limit = limits.md_count.min(MAX_MDS);
    let (mut devices, mut ifaces, mut md_map) = (0usize, 0usize, 0u64);
    loop {
        // md index and the empty-device flag
        let md_offset = c.pos;
        let md = c.u8("md index")?;
        // A device without transports: its md is advertised for memory
        // (UCX 1.16 packs one for each such md, e.g. CUDA's on a GPU host);
        // no iface follows its device record.
        let empty = md & MD_EMPTY_DEVICE != 0;
        let md_index = match version {
            AddressVersion::V1 => md & MD_INDEX_V1,
            AddressVersion::V2 => c.extended(version, md & MD_INDEX_V2, MD_INDEX_V2, "md index")?,
        };
        let md_index = u32::from(md_index);
        if md_index >= md_limit {
            return Err((
                md_offset,
                AddressProblem::MdIndex {
                    index: md_index,
                    limit: md_limit,
                },
            ));
        }
        md_map |= 1u64 << md_index;
        devices += 1;

        // device address length and flags
        let dev = c.u8("device address length")?;
        let last_device = dev & LAST != 0;
        let dev_len = c.extended(version, dev & DEV_LEN, DEV_LEN, "device address length")?;
        if dev & DEV_NUM_PATHS != 0 {
            let paths = c.u8("device path count")?;
            if paths < 2 {
                return Err((c.pos - 1, AddressProblem::PathCount(paths)));
            }
        }
        if dev & DEV_SYS_DEVICE != 0 && c.u8("system device")? == SYS_DEVICE_UNKNOWN {
            return Err((c.pos - 1, AddressProblem::SysDevice));
        }
        let device = c.take(usize::from(dev_len), "device address")?;

        // the device's ifaces (none after a memory-domain record)
        let mut more_ifaces = !empty;
        while more_ifaces {
            ifaces += 1;
            if ifaces > MAX_IFACES {
                return c.fail(AddressProblem::TooManyIfaces);
            }
            let csum = c.u16("transport name checksum")?;
            let attrs_offset = c.pos;
            match version {
                AddressVersion::V1 => iface_attr_v1(&mut c)?,
                AddressVersion::V2 => {
                    c.take(IFACE_ATTR_V2, "iface attributes")?;
                }
            }
            let attrs = bytes.get(attrs_offset..c.pos).unwrap_or_default();
            let len_offset = c.pos;
            let iface = c.u8("iface address length")?;
            if iface & IFACE_HAS_EP_ADDR != 0 {
                return Err((len_offset, AddressProblem::EpAddress));
            }
            let len = c.extended(
                version,
                iface & IFACE_LEN,
                IFACE_LEN,
                "iface address length",
            )?;
            let addr_offset = c.pos;
            let addr = c.take(usize::from(len), "iface address")?;
            on_iface(&IfaceView {
                version,
                device,
                md_index,
                md_offset,
                csum,
                attrs_offset,
                attrs,
                addr_offset,
                addr,
            })?;
            more_ifaces = iface & LAST == 0;
        }
        if last_device {
            break;
        }
    }
    if c.pos != bytes.len() {
        return c.fail(AddressProblem::Trailing {
            extra: bytes.len() - c.pos,
        });
    }
    if ifaces == 0 {
        // Only memory domains: nothing a put could travel on.
        return Err((0, AddressProblem::EmptyDevice));
    }
    Ok(AddressShape {
        version,
        worker_uuid,
        devices,
        ifaces,
        md_map,
    })
}

/// Version 1 iface attributes: overhead, bandwidth and latency overhead as
/// f32, then the priority and capability word (any bits).
fn iface_attr_v1(c: &mut Cursor<'_>) -> Step<()> {
    let start = c.pos;
    let overhead = c.f32("iface attributes")?;
    let bandwidth = c.f32("iface attributes")?;
    let latency = c.f32("iface attributes")?;
    c.take(4, "iface attributes")?;
    let bad = |field| Err((start, AddressProblem::IfaceAttr { field }));
    if !(overhead.is_finite() && overhead >= 0.0) {
        return bad("overhead");
    }
    if !(bandwidth.is_finite() && bandwidth > 0.0) {
        return bad("bandwidth");
    }
    if !(latency.is_finite() && latency >= 0.0) {
        return bad("latency");
    }
    debug_assert_eq!(c.pos - start, IFACE_ATTR_V1);
    Ok(())
}

const RKEY_WHAT: &str = "packed UCX rkey";

/// Validates a packed UCX 1.13 rkey (`ucp_rkey_pack` output) against the
/// format and `limits`: a non-empty md map whose indices are within
/// `limits`, host memory, one size-prefixed entry per md (with local
/// knowledge: only this host's mds, each of this host's size), nothing after.
pub fn validate_rkey(bytes: &[u8], limits: &Limits) -> Result<RkeyShape, UcxReason> {
    let (shape, sizes) = walk_rkey(bytes, limits)?;
    if let Some(local) = &limits.rkey {
        for (md, size) in sizes {
            let expected = local.sizes.iter().find(|(m, _)| *m == md).map(|(_, s)| *s);
            if expected != Some(size) {
                return Err(UcxReason::ForeignRkeyEntry { md, size, expected });
            }
        }
        debug_assert_eq!(shape.md_map & !local.md_map, 0);
    }
    Ok(shape)
}

/// The format walk of an rkey; returns its shape and `(md index, size)` per
/// entry.
fn walk_rkey(bytes: &[u8], limits: &Limits) -> Result<(RkeyShape, Vec<(u32, u8)>), UcxReason> {
    if bytes.len() > MAX_UCX_RKEY {
        return Err(UcxReason::TooLarge {
            what: RKEY_WHAT,
            len: bytes.len(),
            max: MAX_UCX_RKEY,
        });
    }
    let truncated = |needed| UcxReason::Truncated {
        what: RKEY_WHAT,
        len: bytes.len(),
        needed,
    };
    let mut map = [0u8; 8];
    map.copy_from_slice(bytes.get(..8).ok_or_else(|| truncated(9))?);
    let md_map = u64::from_le_bytes(map);
    let mem_type = *bytes.get(8).ok_or_else(|| truncated(9))?;
    if md_map == 0 {
        return Err(UcxReason::MalformedRkey("empty memory-domain map"));
    }
    let md_limit = limits.md_count.min(MAX_MDS);
    let highest = MAX_MDS - 1 - md_map.leading_zeros();
    if highest >= md_limit {
        return Err(UcxReason::RkeyMdIndex {
            index: highest,
            limit: md_limit,
        });
    }
    if mem_type >= MEMORY_TYPE_LAST {
        return Err(UcxReason::MalformedRkey("unknown memory type"));
    }
    if mem_type != MEMORY_TYPE_HOST {
        return Err(UcxReason::MalformedRkey("not host memory"));
    }
    let mut pos = 9usize;
    let mut sizes = Vec::with_capacity(md_map.count_ones() as usize);
    let mut rest = md_map;
    while rest != 0 {
        let md = rest.trailing_zeros();
        rest &= rest - 1;
        let size = *bytes.get(pos).ok_or_else(|| truncated(pos + 1))?;
        pos += 1 + usize::from(size);
        if pos > bytes.len() {
            return Err(truncated(pos));
        }
        sizes.push((md, size));
    }
    if pos != bytes.len() {
        return Err(UcxReason::Trailing {
            what: RKEY_WHAT,
            extra: bytes.len() - pos,
        });
    }
    Ok((RkeyShape { md_map, mem_type }, sizes))
}
