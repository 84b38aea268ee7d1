//! The contracts' one error type.
//!
//! Every parser and validator in this crate returns [`Error`]. Variants carry the
//! offending input (truncated to a bounded length, so a hostile peer cannot make
//! an error message large) and a typed reason that tests match on.

use std::fmt;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Longest input echoed back inside an error.
const ECHO_LIMIT: usize = 96;

/// Everything that can go wrong in the contracts: a parser or validator
/// refused its input. Runner, UCX and publisher failures are the errors of
/// their own crates.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A control endpoint, host or port did not parse or is not allowed here.
    #[error("invalid endpoint {input}: {reason}")]
    Endpoint {
        /// The input as given (bounded).
        input: Echo,
        /// Why it was refused.
        reason: EndpointReason,
    },
    /// A block key or namespace field did not parse.
    #[error("invalid block key {input}: {reason}")]
    Key {
        /// The input as given (bounded).
        input: Echo,
        /// Why it was refused.
        reason: KeyReason,
    },
    /// A router hint was refused.
    #[error("invalid router hint: {reason}")]
    Hint {
        /// Why it was refused.
        reason: HintReason,
    },
    /// A rank coordinate or rank layout is inconsistent.
    #[error("invalid rank layout: {reason}")]
    Rank {
        /// Why it was refused.
        reason: RankReason,
    },
    /// A peer control frame could not be encoded or decoded.
    #[error("invalid control frame: {reason}")]
    Frame {
        /// Why it was refused.
        reason: FrameReason,
    },
    /// An incarnation id did not parse.
    #[error("invalid incarnation id {input}: expected 32 lowercase hex digits, not all zero")]
    Incarnation {
        /// The input as given (bounded).
        input: Echo,
    },
}

/// A bounded copy of untrusted input, kept for error messages.
#[derive(Clone, PartialEq, Eq)]
pub struct Echo(String);

impl Echo {
    /// Keeps at most a short prefix of `input` (on a char boundary).
    pub fn new(input: &str) -> Self {
        if input.len() <= ECHO_LIMIT {
            return Self(input.to_owned());
        }
        let mut cut = ECHO_LIMIT;
        while !input.is_char_boundary(cut) {
            cut -= 1;
        }
        Self(format!("{}…", input.get(..cut).unwrap_or_default()))
    }

    /// The echoed text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Echo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for Echo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

/// Why an endpoint was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointReason {
    /// The scheme is not `tcp://`.
    #[error("scheme must be tcp://")]
    Scheme,
    /// There is no `:port` after the host.
    #[error("missing :port")]
    MissingPort,
    /// The port is not a decimal number in 1..=65535.
    #[error("port must be a decimal number in 1..=65535")]
    Port,
    /// The host is empty.
    #[error("empty host")]
    EmptyHost,
    /// The host is a wildcard (`0.0.0.0`, `::`, `*`): it can be bound, never dialed.
    #[error("wildcard host cannot be dialed or advertised")]
    WildcardHost,
    /// An IPv6 literal without brackets, or brackets around something that is not IPv6.
    #[error("IPv6 hosts must be bracketed, and brackets must hold an IPv6 address")]
    Brackets,
    /// The host is not an IP literal and not a valid DNS name.
    #[error("host is neither an IP address nor a valid DNS name")]
    HostName,
    /// A loopback host advertised for cross-host use without single-host mode.
    #[error(
        "loopback host (127.0.0.0/8, ::1, localhost, *.localhost) cannot be advertised to other hosts unless single-host mode is enabled"
    )]
    LoopbackAdvertised,
    /// Adding a rank offset pushed the port past 65535.
    #[error("rank offset pushes the port past 65535")]
    PortOverflow,
    /// Something after `?` other than one `key=` parameter.
    #[error("the only query an endpoint takes is ?key=<64 hex digits>")]
    Query,
    /// The `key=` value is not 64 hex digits, or is all zero.
    #[error("key must be 64 hex digits (a 32-byte X25519 public key), not all zero")]
    MemberKey,
}

/// Why a block key was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyReason {
    /// Not an integer in the signed or unsigned 64-bit range.
    #[error("not an integer in [-2^63, 2^64)")]
    OutOfRange,
    /// A boolean where a hash was expected (JSON `true` is not `1`).
    #[error("booleans are not hashes")]
    Boolean,
    /// A string that does not start with hex digits.
    #[error("not a hex digest")]
    NotHex,
    /// Neither an integer nor a hex string.
    #[error("not an integer or a hex string")]
    WrongType,
}

/// Why a router hint was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HintReason {
    /// The text is not a JSON document.
    #[error("not JSON: {0}")]
    Json(Echo),
    /// The envelope is not a JSON object.
    #[error("envelope is not an object")]
    EnvelopeNotObject,
    /// The envelope's `protocol_version` is missing or not `"0.1"`.
    #[error("protocol_version must be \"0.1\"")]
    ProtocolVersion,
    /// `actions` is missing or not a list.
    #[error("actions must be a list")]
    ActionsNotList,
    /// An action has no string `action_type` / `action_version`, or no object payload.
    #[error("action {index} is malformed: {what}")]
    MalformedAction {
        /// Position of the action in the envelope.
        index: usize,
        /// What is missing or mistyped.
        what: &'static str,
    },
    /// No `kv.fetch` action is present.
    #[error("no kv.fetch action")]
    NoFetchAction,
    /// A `kv.fetch` action with a version other than `1.0`.
    #[error("kv.fetch version {0} is not supported (only 1.0)")]
    UnsupportedVersion(Echo),
    /// `mode` is present and not `"copy"`.
    #[error("mode {0} is not supported (only \"copy\")")]
    UnsupportedMode(Echo),
    /// `no_retain` is present (not supported yet).
    #[error("no_retain is not supported")]
    NoRetain,
    /// The payload has no usable `source_control_endpoint`.
    #[error("source_control_endpoint: {0}")]
    Source(Box<Error>),
    /// The payload has no `source_control_endpoint` at all.
    #[error("source_control_endpoint is missing (source-less hints are not supported)")]
    MissingSource,
    /// `block_hashes` is missing, not a list, or has no valid leading hash.
    #[error("block_hashes has no valid leading hash")]
    NoHashes,
}

/// Why a rank coordinate or layout was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RankReason {
    /// A group size is zero.
    #[error("{0} must be at least 1")]
    ZeroSize(&'static str),
    /// A rank is not below its group size.
    #[error("{what} rank {rank} is not below its size {size}")]
    RankOutOfRange {
        /// Which coordinate.
        what: &'static str,
        /// The rank given.
        rank: u32,
        /// The group size.
        size: u32,
    },
    /// A DP range is empty or reversed.
    #[error("dp range {start}..{end} is empty")]
    EmptyDpRange {
        /// First DP rank.
        start: u32,
        /// One past the last DP rank.
        end: u32,
    },
    /// A port computation overflowed.
    #[error("port {base} + offset {offset} exceeds 65535")]
    PortOverflow {
        /// Base port.
        base: u16,
        /// Offset added.
        offset: u64,
    },
    /// An endpoint map entry has a key that is not a DP rank number.
    #[error("endpoint map key {0} is not a DP rank")]
    MapKey(Echo),
    /// An endpoint map entry is not a dialable endpoint.
    #[error("endpoint map entry for dp rank {dp_rank}: {source}")]
    MapEntry {
        /// The DP rank whose entry is bad.
        dp_rank: u32,
        /// What is wrong with it.
        source: Box<Error>,
    },
    /// The endpoint map is not a JSON object of strings.
    #[error("endpoint map must be a JSON object of endpoint strings")]
    MapShape,
}

/// Why a control frame was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameReason {
    /// The frame is shorter than its fields claim.
    #[error("truncated: needed {needed} more bytes")]
    Truncated {
        /// Bytes missing.
        needed: usize,
    },
    /// The declared length exceeds the codec's limit.
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Declared length.
        len: usize,
        /// Configured limit.
        max: usize,
    },
    /// The declared length is below the fixed header size.
    #[error("frame of {len} bytes is shorter than the {min}-byte header")]
    TooShort {
        /// Declared length.
        len: usize,
        /// Minimum length.
        min: usize,
    },
    /// The magic bytes are wrong (not a kvcr control stream).
    #[error("bad magic {0:#06x}")]
    Magic(u16),
    /// The codec version is not one this build speaks.
    #[error("unsupported codec version {0}")]
    Version(u8),
    /// The message kind byte is unknown.
    #[error("unknown message kind {0}")]
    Kind(u8),
    /// A boolean byte other than 0 or 1.
    #[error("{field}: boolean byte {value} is not 0 or 1")]
    Bool {
        /// Field name.
        field: &'static str,
        /// Byte seen.
        value: u8,
    },
    /// An option tag other than 0 or 1.
    #[error("{field}: option tag {value} is not 0 or 1")]
    OptionTag {
        /// Field name.
        field: &'static str,
        /// Byte seen.
        value: u8,
    },
    /// A string field that is not UTF-8.
    #[error("{0}: not UTF-8")]
    Utf8(&'static str),
    /// A count or length above the field's bound.
    #[error("{field}: {count} exceeds the bound {max}")]
    Bound {
        /// Field name.
        field: &'static str,
        /// Count seen.
        count: usize,
        /// Bound.
        max: usize,
    },
    /// A field that must be non-zero is zero.
    #[error("{0} must not be zero")]
    Zero(&'static str),
    /// A field that must be non-empty is empty.
    #[error("{0} must not be empty")]
    Empty(&'static str),
    /// An endpoint field does not parse.
    #[error("{field}: {source}")]
    Endpoint {
        /// Field name.
        field: &'static str,
        /// What is wrong with it.
        source: Box<Error>,
    },
    /// A region label is not a valid label.
    #[error("region label: {0}")]
    Label(Echo),
    /// Key and destination lists differ in length.
    #[error("{keys} keys but {destinations} destination lists")]
    LengthMismatch {
        /// Number of keys.
        keys: usize,
        /// Number of destination lists.
        destinations: usize,
    },
    /// Completed indices are not strictly ascending (so not unique).
    #[error("completed indices must be strictly ascending")]
    IndicesOrder,
    /// Page digests neither absent nor one per completed index.
    #[error("page digests must be absent or one per completed index")]
    DigestCount,
    /// A strided region whose extent overflows the address space.
    #[error("region {0}: base + stride * count overflows")]
    RegionExtent(Echo),
    /// A device region whose extent overflows or whose elements overlap.
    #[error("device region id {0}: overlapping elements or base + extent overflows")]
    DeviceRegionExtent(u32),
    /// Two advertised regions share an id.
    #[error("region id {0} advertised twice")]
    DuplicateRegion(u32),
    /// A shared segment names a region the metadata does not advertise.
    #[error("shared segment for region id {0}, which is not advertised")]
    UnknownSegmentRegion(u32),
    /// The doorbell names a region the metadata does not advertise.
    #[error("doorbell in region id {0}, which is not advertised")]
    UnknownDoorbellRegion(u32),
    /// A `start_write` run of destination regions whose last region id
    /// would pass `u32::MAX`.
    #[error("a run of {regions} regions from id {first} passes the last region id")]
    RegionRun {
        /// The run's first region id.
        first: u32,
        /// How many regions it claims.
        regions: u16,
    },
    /// Bytes left over after the message.
    #[error("{0} trailing bytes after the message")]
    Trailing(usize),
}

/// Why a pool's memory placement was refused (`RunnerConfig::pool_memory`).
///
/// Not a reason of [`Error`]: it lives here so that the crate that makes the
/// memory calls (`kvcr-sys`) and the runner core that reports them share one
/// definition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolMemoryReason {
    /// A NUMA binding names no node.
    #[error("a NUMA binding needs at least one node")]
    NoNodes,
    /// `Preferred` takes exactly one node.
    #[error("a preferred NUMA policy takes exactly one node")]
    PreferredNeedsOneNode,
    /// A NUMA binding names a node that is not online.
    #[error("NUMA node {node} does not exist (online: {online:?})")]
    NoSuchNode {
        /// The node asked for.
        node: u16,
        /// The online nodes.
        online: Vec<u16>,
    },
    /// Huge pages were required and cannot be had.
    #[error("huge pages required but unavailable: {0}")]
    HugePagesUnavailable(&'static str),
    /// The kernel refused a call (a memory call; `kvcr-sys` also reports its
    /// process calls' refusals so).
    #[error("{call} refused (errno {errno})")]
    Os {
        /// The call.
        call: &'static str,
        /// Its errno.
        errno: i32,
    },
}

impl Error {
    pub(crate) fn endpoint(input: &str, reason: EndpointReason) -> Self {
        Self::Endpoint {
            input: Echo::new(input),
            reason,
        }
    }

    pub(crate) fn key(input: &str, reason: KeyReason) -> Self {
        Self::Key {
            input: Echo::new(input),
            reason,
        }
    }

    pub(crate) fn hint(reason: HintReason) -> Self {
        Self::Hint { reason }
    }

    pub(crate) fn rank(reason: RankReason) -> Self {
        Self::Rank { reason }
    }

    pub(crate) fn frame(reason: FrameReason) -> Self {
        Self::Frame { reason }
    }

    /// The endpoint reason, when this is an endpoint error (handy in tables).
    pub fn endpoint_reason(&self) -> Option<EndpointReason> {
        match self {
            Self::Endpoint { reason, .. } => Some(*reason),
            _ => None,
        }
    }

    /// The hint reason, when this is a hint error.
    pub fn hint_reason(&self) -> Option<&HintReason> {
        match self {
            Self::Hint { reason } => Some(reason),
            _ => None,
        }
    }

    /// The frame reason, when this is a frame error.
    pub fn frame_reason(&self) -> Option<&FrameReason> {
        match self {
            Self::Frame { reason } => Some(reason),
            _ => None,
        }
    }
}
