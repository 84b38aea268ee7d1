//! The crate's one error type.
//!
//! Every parser and validator in this crate returns [`Error`]. Variants carry the
//! offending input (truncated to a bounded length, so a hostile peer cannot make
//! an error message large) and a typed reason that tests match on.

use std::fmt;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Longest input echoed back inside an error.
const ECHO_LIMIT: usize = 96;

/// Everything that can go wrong in `kvcr-foundation`.
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
    /// The inventory publisher could not be configured, started or stopped.
    #[error("inventory publisher: {reason}")]
    Publisher {
        /// Why.
        reason: PublisherReason,
    },
    /// The runner refused a call (bad configuration, region, layout or handle,
    /// or a lifecycle step that is not safe yet). The runner is unchanged.
    #[error("runner: {reason}")]
    Runner {
        /// Why.
        reason: RunnerReason,
    },
    /// A UCX call returned an error status (runner only).
    #[cfg(feature = "runner")]
    #[error("UCX {op}: {status}")]
    Ucx {
        /// The UCX routine (or safe-layer operation) that failed.
        op: &'static str,
        /// The status it returned.
        status: crate::ucx::UcsStatus,
    },
    /// The UCX safe layer refused a request before calling UCX, or a wait on
    /// UCX ended without a status (runner only).
    #[cfg(feature = "runner")]
    #[error("UCX {op}: {reason}")]
    UcxInput {
        /// The safe-layer operation.
        op: &'static str,
        /// Why it was refused.
        reason: crate::ucx::UcxReason,
    },
}

/// Why a pool's memory placement was refused (`RunnerConfig::pool_memory`).
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
    /// The kernel refused a memory call.
    #[error("{call} refused (errno {errno})")]
    Os {
        /// The call.
        call: &'static str,
        /// Its errno.
        errno: i32,
    },
}

/// Why the runner refused a call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RunnerReason {
    /// A configuration value is out of bounds.
    #[error("invalid configuration: {field}: {why}")]
    Config {
        /// Which field.
        field: &'static str,
        /// What is wrong.
        why: &'static str,
    },
    /// Two pools share a name.
    #[error("pool {0} configured twice")]
    DuplicatePool(Echo),
    /// A region descriptor is malformed.
    #[error("region {label}: {why}")]
    Region {
        /// The region's label.
        label: Echo,
        /// What is wrong.
        why: &'static str,
    },
    /// A region's label names no configured pool.
    #[error("region {0}: no pool of that name (labels are `pool` or `pool:part`)")]
    RegionPool(Echo),
    /// A region's element size differs from its pool's block size.
    #[error("region {label}: element size {size} differs from the pool's block size {block}")]
    RegionSize {
        /// The region's label.
        label: Echo,
        /// Its element size.
        size: u64,
        /// The pool's block size.
        block: u64,
    },
    /// A region overlaps one already registered.
    #[error("region {label} overlaps region {other}")]
    RegionOverlap {
        /// The new region.
        label: Echo,
        /// The registered one.
        other: Echo,
    },
    /// A label is registered already.
    #[error("region {0} is registered already")]
    DuplicateRegion(Echo),
    /// A reference names no registered region.
    #[error("no region with id {0}")]
    UnknownRegion(u32),
    /// A reference's element index is outside its region.
    #[error("element {index} is outside region {region} ({count} elements)")]
    ElementOutOfRange {
        /// Region id.
        region: u32,
        /// Index given.
        index: u64,
        /// Elements in the region.
        count: u64,
    },
    /// A reference names a runner-owned region where framework memory is required.
    #[error("region {0} is runner-owned; callers may only name framework regions here")]
    NotFrameworkRegion(u32),
    /// One call named both host and device framework memory.
    #[error("one call must name only host or only device memory, not both")]
    MixedMemory,
    /// A device region was registered before a device copier was set.
    #[error("device memory needs a device copier (set one before registering device regions)")]
    NoDeviceCopier,
    /// A second device copier was offered.
    #[error("a device copier is already set")]
    DeviceCopierSet,
    /// A key has no spans, or more than the layout bound.
    #[error("a key needs 1..={max} spans, got {got}")]
    LayoutLength {
        /// Spans given.
        got: usize,
        /// Bound.
        max: usize,
    },
    /// Keys of one call disagree on their layout, or a destination's layout
    /// differs from the stored one.
    #[error("span layout does not match")]
    LayoutMismatch,
    /// A namespace id was never registered.
    #[error("namespace {0:#018x} is not registered")]
    UnknownNamespace(u64),
    /// The operation handle is unknown (never issued or already completed).
    #[error("unknown operation handle {0}")]
    UnknownOperation(i64),
    /// The pool allocation failed.
    #[error("could not allocate {bytes} bytes of KVCR DRAM")]
    Allocation {
        /// Bytes asked for.
        bytes: u64,
    },
    /// The pool memory placement asked for cannot be had.
    #[error("pool memory: {0}")]
    PoolMemory(PoolMemoryReason),
    /// Startup failed at a stage; says whether memory had to be retained
    /// because a native transfer might still touch it.
    #[error("startup failed at stage {stage}: {cause}{}", if *retained { " (memory retained: a transfer may still touch it; keep caller buffers until exit)" } else { "" })]
    Startup {
        /// The stage that failed.
        stage: &'static str,
        /// Whether resources were retained rather than released.
        retained: bool,
        /// What failed.
        cause: Box<Error>,
    },
    /// Close refused: copies are still in flight.
    #[error("{0} copies still in flight; poll and retry")]
    Busy(usize),
    /// Close refused: public claims are still held.
    #[error("{0} claims still held; release them first")]
    ClaimsOutstanding(usize),
    /// The copy engine thread is gone.
    #[error("the copy engine stopped")]
    CopyEngineStopped,
    /// The device copier failed (attaching the pools or copying).
    #[error("device copy failed: {0}")]
    DeviceCopy(Echo),
    /// A slot read named a handle that is not a live claim.
    #[error("release handle {0} is not a live claim")]
    UnknownClaim(u64),
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
    /// A strided region whose extent overflows the address space.
    #[error("region {0}: base + stride * count overflows")]
    RegionExtent(Echo),
    /// Two advertised regions share an id.
    #[error("region id {0} advertised twice")]
    DuplicateRegion(u32),
    /// Bytes left over after the message.
    #[error("{0} trailing bytes after the message")]
    Trailing(usize),
}

/// Why the inventory publisher refused to start or failed to stop.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PublisherReason {
    /// A configuration bound is out of range.
    #[error("{field} must be in {min}..={max}, got {value}")]
    Config {
        /// The configuration field.
        field: &'static str,
        /// The value given.
        value: u64,
        /// Smallest allowed value.
        min: u64,
        /// Largest allowed value.
        max: u64,
    },
    /// The PUB and replay endpoints are the same address.
    #[error("the PUB and replay endpoints must differ, both are {0}")]
    SameEndpoint(Echo),
    /// A ZMQ call failed (the errno is kept raw; the text is libzmq's).
    #[error("zmq {op} failed: {message} (errno {errno})")]
    Zmq {
        /// Which call.
        op: &'static str,
        /// The raw errno.
        errno: i32,
        /// libzmq's description of it.
        message: &'static str,
    },
    /// Binding or connecting an endpoint failed.
    #[error("cannot {op} {endpoint}: {message} (errno {errno})")]
    Endpoint {
        /// `bind` or `connect`.
        op: &'static str,
        /// The endpoint.
        endpoint: Echo,
        /// The raw errno.
        errno: i32,
        /// libzmq's description of it.
        message: &'static str,
    },
    /// The driver thread could not be spawned.
    #[error("cannot spawn the publisher thread")]
    Spawn,
    /// The driver thread panicked (a bug); the publisher stopped publishing.
    #[error("the publisher thread panicked")]
    DriverPanicked,
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

    /// A runner error.
    pub fn runner(reason: RunnerReason) -> Self {
        Self::Runner { reason }
    }

    /// The runner reason, when this is a runner error.
    pub fn runner_reason(&self) -> Option<&RunnerReason> {
        match self {
            Self::Runner { reason } => Some(reason),
            _ => None,
        }
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

    /// The UCX status, when this is a UCX call failure.
    #[cfg(feature = "runner")]
    pub fn ucx_status(&self) -> Option<crate::ucx::UcsStatus> {
        match self {
            Self::Ucx { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The UCX refusal reason, when the UCX safe layer refused a request.
    #[cfg(feature = "runner")]
    pub fn ucx_reason(&self) -> Option<&crate::ucx::UcxReason> {
        match self {
            Self::UcxInput { reason, .. } => Some(reason),
            _ => None,
        }
    }

    /// The publisher reason, when this is a publisher error.
    pub fn publisher_reason(&self) -> Option<&PublisherReason> {
        match self {
            Self::Publisher { reason } => Some(reason),
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
