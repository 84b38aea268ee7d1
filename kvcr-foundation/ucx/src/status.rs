//! `ucs_status_t` as a typed enum, and the reasons the safe layer refuses
//! input before it reaches UCX. No unsafe code here.

use std::fmt;

use super::sys;

/// Every `ucs_status_t` of the UCX 1.13 headers, plus [`UcsStatus::Unknown`]
/// for a code a newer libucp might return (kept raw, never dropped).
///
/// Codes inside the link-failure (-40..=-59) and endpoint-failure (-60..=-89)
/// ranges that have no name in the headers map to
/// [`UcsStatus::LinkFailure`] / [`UcsStatus::EndpointFailure`] with the raw
/// code, as `UCS_IS_LINK_ERROR` / `UCS_IS_ENDPOINT_ERROR` classify them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum UcsStatus {
    /// `UCS_OK` (0): completed successfully.
    Ok,
    /// `UCS_INPROGRESS` (1): queued, still in progress.
    InProgress,
    /// `UCS_ERR_NO_MESSAGE` (-1).
    NoMessage,
    /// `UCS_ERR_NO_RESOURCE` (-2).
    NoResource,
    /// `UCS_ERR_IO_ERROR` (-3).
    IoError,
    /// `UCS_ERR_NO_MEMORY` (-4).
    NoMemory,
    /// `UCS_ERR_INVALID_PARAM` (-5).
    InvalidParam,
    /// `UCS_ERR_UNREACHABLE` (-6): no transport reaches the peer.
    Unreachable,
    /// `UCS_ERR_INVALID_ADDR` (-7).
    InvalidAddr,
    /// `UCS_ERR_NOT_IMPLEMENTED` (-8).
    NotImplemented,
    /// `UCS_ERR_MESSAGE_TRUNCATED` (-9).
    MessageTruncated,
    /// `UCS_ERR_NO_PROGRESS` (-10).
    NoProgress,
    /// `UCS_ERR_BUFFER_TOO_SMALL` (-11).
    BufferTooSmall,
    /// `UCS_ERR_NO_ELEM` (-12).
    NoElem,
    /// `UCS_ERR_SOME_CONNECTS_FAILED` (-13).
    SomeConnectsFailed,
    /// `UCS_ERR_NO_DEVICE` (-14).
    NoDevice,
    /// `UCS_ERR_BUSY` (-15).
    Busy,
    /// `UCS_ERR_CANCELED` (-16): e.g. outstanding operations of a force-closed endpoint.
    Canceled,
    /// `UCS_ERR_SHMEM_SEGMENT` (-17).
    ShmemSegment,
    /// `UCS_ERR_ALREADY_EXISTS` (-18).
    AlreadyExists,
    /// `UCS_ERR_OUT_OF_RANGE` (-19).
    OutOfRange,
    /// `UCS_ERR_TIMED_OUT` (-20).
    TimedOut,
    /// `UCS_ERR_EXCEEDS_LIMIT` (-21).
    ExceedsLimit,
    /// `UCS_ERR_UNSUPPORTED` (-22).
    Unsupported,
    /// `UCS_ERR_REJECTED` (-23).
    Rejected,
    /// `UCS_ERR_NOT_CONNECTED` (-24).
    NotConnected,
    /// `UCS_ERR_CONNECTION_RESET` (-25).
    ConnectionReset,
    /// `UCS_ERR_FIRST_LINK_FAILURE` (-40).
    FirstLinkFailure,
    /// An unnamed code inside the link-failure range (-41..=-58).
    LinkFailure(i8),
    /// `UCS_ERR_LAST_LINK_FAILURE` (-59).
    LastLinkFailure,
    /// `UCS_ERR_FIRST_ENDPOINT_FAILURE` (-60).
    FirstEndpointFailure,
    /// `UCS_ERR_ENDPOINT_TIMEOUT` (-80).
    EndpointTimeout,
    /// An unnamed code inside the endpoint-failure range (-61..=-88, not -80).
    EndpointFailure(i8),
    /// `UCS_ERR_LAST_ENDPOINT_FAILURE` (-89).
    LastEndpointFailure,
    /// `UCS_ERR_LAST` (-100): the sentinel; never a real status.
    Last,
    /// A code the 1.13 headers do not define.
    Unknown(i8),
}

impl UcsStatus {
    /// Maps a raw `ucs_status_t`.
    pub fn from_raw(raw: i8) -> Self {
        match raw {
            sys::UCS_OK => Self::Ok,
            sys::UCS_INPROGRESS => Self::InProgress,
            sys::UCS_ERR_NO_MESSAGE => Self::NoMessage,
            sys::UCS_ERR_NO_RESOURCE => Self::NoResource,
            sys::UCS_ERR_IO_ERROR => Self::IoError,
            sys::UCS_ERR_NO_MEMORY => Self::NoMemory,
            sys::UCS_ERR_INVALID_PARAM => Self::InvalidParam,
            sys::UCS_ERR_UNREACHABLE => Self::Unreachable,
            sys::UCS_ERR_INVALID_ADDR => Self::InvalidAddr,
            sys::UCS_ERR_NOT_IMPLEMENTED => Self::NotImplemented,
            sys::UCS_ERR_MESSAGE_TRUNCATED => Self::MessageTruncated,
            sys::UCS_ERR_NO_PROGRESS => Self::NoProgress,
            sys::UCS_ERR_BUFFER_TOO_SMALL => Self::BufferTooSmall,
            sys::UCS_ERR_NO_ELEM => Self::NoElem,
            sys::UCS_ERR_SOME_CONNECTS_FAILED => Self::SomeConnectsFailed,
            sys::UCS_ERR_NO_DEVICE => Self::NoDevice,
            sys::UCS_ERR_BUSY => Self::Busy,
            sys::UCS_ERR_CANCELED => Self::Canceled,
            sys::UCS_ERR_SHMEM_SEGMENT => Self::ShmemSegment,
            sys::UCS_ERR_ALREADY_EXISTS => Self::AlreadyExists,
            sys::UCS_ERR_OUT_OF_RANGE => Self::OutOfRange,
            sys::UCS_ERR_TIMED_OUT => Self::TimedOut,
            sys::UCS_ERR_EXCEEDS_LIMIT => Self::ExceedsLimit,
            sys::UCS_ERR_UNSUPPORTED => Self::Unsupported,
            sys::UCS_ERR_REJECTED => Self::Rejected,
            sys::UCS_ERR_NOT_CONNECTED => Self::NotConnected,
            sys::UCS_ERR_CONNECTION_RESET => Self::ConnectionReset,
            sys::UCS_ERR_FIRST_LINK_FAILURE => Self::FirstLinkFailure,
            sys::UCS_ERR_LAST_LINK_FAILURE => Self::LastLinkFailure,
            sys::UCS_ERR_FIRST_ENDPOINT_FAILURE => Self::FirstEndpointFailure,
            sys::UCS_ERR_ENDPOINT_TIMEOUT => Self::EndpointTimeout,
            sys::UCS_ERR_LAST_ENDPOINT_FAILURE => Self::LastEndpointFailure,
            sys::UCS_ERR_LAST => Self::Last,
            -58..=-41 => Self::LinkFailure(raw),
            -88..=-61 => Self::EndpointFailure(raw),
            other => Self::Unknown(other),
        }
    }

    /// The raw `ucs_status_t` (round-trips [`UcsStatus::from_raw`]).
    pub fn raw(self) -> i8 {
        match self {
            Self::Ok => sys::UCS_OK,
            Self::InProgress => sys::UCS_INPROGRESS,
            Self::NoMessage => sys::UCS_ERR_NO_MESSAGE,
            Self::NoResource => sys::UCS_ERR_NO_RESOURCE,
            Self::IoError => sys::UCS_ERR_IO_ERROR,
            Self::NoMemory => sys::UCS_ERR_NO_MEMORY,
            Self::InvalidParam => sys::UCS_ERR_INVALID_PARAM,
            Self::Unreachable => sys::UCS_ERR_UNREACHABLE,
            Self::InvalidAddr => sys::UCS_ERR_INVALID_ADDR,
            Self::NotImplemented => sys::UCS_ERR_NOT_IMPLEMENTED,
            Self::MessageTruncated => sys::UCS_ERR_MESSAGE_TRUNCATED,
            Self::NoProgress => sys::UCS_ERR_NO_PROGRESS,
            Self::BufferTooSmall => sys::UCS_ERR_BUFFER_TOO_SMALL,
            Self::NoElem => sys::UCS_ERR_NO_ELEM,
            Self::SomeConnectsFailed => sys::UCS_ERR_SOME_CONNECTS_FAILED,
            Self::NoDevice => sys::UCS_ERR_NO_DEVICE,
            Self::Busy => sys::UCS_ERR_BUSY,
            Self::Canceled => sys::UCS_ERR_CANCELED,
            Self::ShmemSegment => sys::UCS_ERR_SHMEM_SEGMENT,
            Self::AlreadyExists => sys::UCS_ERR_ALREADY_EXISTS,
            Self::OutOfRange => sys::UCS_ERR_OUT_OF_RANGE,
            Self::TimedOut => sys::UCS_ERR_TIMED_OUT,
            Self::ExceedsLimit => sys::UCS_ERR_EXCEEDS_LIMIT,
            Self::Unsupported => sys::UCS_ERR_UNSUPPORTED,
            Self::Rejected => sys::UCS_ERR_REJECTED,
            Self::NotConnected => sys::UCS_ERR_NOT_CONNECTED,
            Self::ConnectionReset => sys::UCS_ERR_CONNECTION_RESET,
            Self::FirstLinkFailure => sys::UCS_ERR_FIRST_LINK_FAILURE,
            Self::LastLinkFailure => sys::UCS_ERR_LAST_LINK_FAILURE,
            Self::FirstEndpointFailure => sys::UCS_ERR_FIRST_ENDPOINT_FAILURE,
            Self::EndpointTimeout => sys::UCS_ERR_ENDPOINT_TIMEOUT,
            Self::LastEndpointFailure => sys::UCS_ERR_LAST_ENDPOINT_FAILURE,
            Self::Last => sys::UCS_ERR_LAST,
            Self::LinkFailure(raw) | Self::EndpointFailure(raw) | Self::Unknown(raw) => raw,
        }
    }

    /// `UCS_IS_LINK_ERROR`: the failure is confined to one link.
    pub fn is_link_failure(self) -> bool {
        (sys::UCS_ERR_LAST_LINK_FAILURE..=sys::UCS_ERR_FIRST_LINK_FAILURE).contains(&self.raw())
    }

    /// `UCS_IS_ENDPOINT_ERROR`: the endpoint is lost; close it (force) and
    /// connect again.
    pub fn is_endpoint_failure(self) -> bool {
        (sys::UCS_ERR_LAST_ENDPOINT_FAILURE..=sys::UCS_ERR_FIRST_ENDPOINT_FAILURE)
            .contains(&self.raw())
    }

    /// True for the codes that mean the peer or the connection to it is gone
    /// (what a protocol treats as "source lost"), as opposed to a local misuse.
    pub fn is_peer_failure(self) -> bool {
        matches!(
            self,
            Self::ConnectionReset
                | Self::NotConnected
                | Self::Unreachable
                | Self::IoError
                | Self::TimedOut
                | Self::Canceled
        ) || self.is_link_failure()
            || self.is_endpoint_failure()
    }

    /// UCX's own one-line description (the text of `ucs_status_string`,
    /// reproduced here so formatting an error never calls into C).
    pub fn description(self) -> &'static str {
        match self {
            Self::Ok => "Success",
            Self::InProgress => "Operation in progress",
            Self::NoMessage => "No pending message",
            Self::NoResource => "No resources are available to initiate the operation",
            Self::IoError => "Input/output error",
            Self::NoMemory => "Out of memory",
            Self::InvalidParam => "Invalid parameter",
            Self::Unreachable => "Destination is unreachable",
            Self::InvalidAddr => "Address not valid",
            Self::NotImplemented => "Function not implemented",
            Self::MessageTruncated => "Message truncated",
            Self::NoProgress => "No progress",
            Self::BufferTooSmall => "Provided buffer is too small",
            Self::NoElem => "No such element",
            Self::SomeConnectsFailed => "Failed to connect some of the requested endpoints",
            Self::NoDevice => "No such device",
            Self::Busy => "Device is busy",
            Self::Canceled => "Request canceled",
            Self::ShmemSegment => "Shared memory error",
            Self::AlreadyExists => "Element already exists",
            Self::OutOfRange => "Index out of range",
            Self::TimedOut => "Operation timed out",
            Self::ExceedsLimit => "User-defined limit was reached",
            Self::Unsupported => "Unsupported operation",
            Self::Rejected => "Operation rejected by remote peer",
            Self::NotConnected => "Endpoint is not connected",
            Self::ConnectionReset => "Connection reset by remote peer",
            Self::FirstLinkFailure | Self::LinkFailure(_) | Self::LastLinkFailure => "Link failure",
            Self::FirstEndpointFailure | Self::EndpointFailure(_) | Self::LastEndpointFailure => {
                "Endpoint failure"
            }
            Self::EndpointTimeout => "Endpoint timeout",
            Self::Last => "Last error code",
            Self::Unknown(_) => "Unknown error",
        }
    }
}

impl fmt::Display for UcsStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.description(), self.raw())
    }
}

/// Why the safe layer refused a UCX request before calling into UCX (or why a
/// wait ended without a UCX status).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UcxReason {
    /// A byte blob (worker address or rkey) is shorter than its header says.
    #[error("{what}: truncated ({len} bytes, need {needed})")]
    Truncated {
        /// Which blob.
        what: &'static str,
        /// Bytes given.
        len: usize,
        /// Bytes required.
        needed: usize,
    },
    /// A blob has bytes after its declared end.
    #[error("{what}: {extra} trailing bytes")]
    Trailing {
        /// Which blob.
        what: &'static str,
        /// Bytes past the end.
        extra: usize,
    },
    /// A blob does not start with the expected magic (not a kvcr blob at all).
    #[error("{what}: bad magic")]
    Magic {
        /// Which blob.
        what: &'static str,
    },
    /// A blob's envelope version is not one this build reads.
    #[error("{what}: unsupported envelope version {version}")]
    Version {
        /// Which blob.
        what: &'static str,
        /// Version seen.
        version: u8,
    },
    /// A blob's checksum does not match (corrupted or forged bytes).
    #[error("{what}: checksum mismatch")]
    Checksum {
        /// Which blob.
        what: &'static str,
    },
    /// A blob's length field (or an active message's header) is above the
    /// bound the safe layer accepts.
    #[error("{what}: {len} bytes exceeds the bound {max}")]
    TooLarge {
        /// Which blob.
        what: &'static str,
        /// Length seen.
        len: usize,
        /// Bound.
        max: usize,
    },
    /// The packed UCX rkey inside the envelope is not well formed.
    #[error("packed rkey is malformed: {0}")]
    MalformedRkey(&'static str),
    /// A packed rkey names a memory domain at or above the bound (64, or the
    /// local context's md range; see [`Limits`](crate::packed::Limits)).
    #[error("packed rkey names md index {index}, not below {limit}")]
    RkeyMdIndex {
        /// The highest md index in the rkey's md map.
        index: u32,
        /// The bound.
        limit: u32,
    },
    /// A packed rkey entry this host would not produce: an md this host does
    /// not register host memory with (`expected` is `None`), or a key size
    /// other than this host's for that md.
    #[error(
        "packed rkey entry for md {md} ({size} bytes) is not one this host produces (expected {expected:?})"
    )]
    ForeignRkeyEntry {
        /// The md index.
        md: u32,
        /// The entry's key size.
        size: u8,
        /// This host's key size for that md, if it has one.
        expected: Option<u8>,
    },
    /// The packed UCX worker address inside the envelope is not one UCX 1.13
    /// produces (see [`packed`](crate::packed) for the format and the checks).
    #[error("packed UCX worker address ({len} bytes) is malformed at byte {offset}: {problem}")]
    MalformedAddress {
        /// Offset of the offending field in the packed address.
        offset: usize,
        /// Length of the packed address.
        len: usize,
        /// What is wrong there.
        problem: crate::packed::AddressProblem,
    },
    /// The rkey was packed by another UCX context than the endpoint's peer.
    #[error(
        "rkey of context {rkey_context:#018x} used with a peer of context {peer_context:#018x}"
    )]
    ForeignRkey {
        /// Context id inside the rkey.
        rkey_context: u64,
        /// Context id of the endpoint's peer.
        peer_context: u64,
    },
    /// A remote key used with an endpoint other than the one it was unpacked on.
    #[error("remote key was unpacked on another endpoint")]
    RkeyEndpoint,
    /// A local registration of another context than the worker's.
    #[error("registration belongs to another UCX context")]
    ContextMismatch,
    /// An endpoint of another worker than the one asked to wait or flush.
    #[error("endpoint belongs to another worker")]
    WorkerMismatch,
    /// A local range outside the registration it names.
    #[error("local range {offset}+{len} is outside the {size}-byte registration")]
    LocalRange {
        /// Offset into the registration.
        offset: usize,
        /// Length.
        len: usize,
        /// Registration size.
        size: usize,
    },
    /// A remote range outside the registration the rkey was packed from.
    #[error("remote range {offset}+{len} is outside the {size}-byte remote registration")]
    RemoteRange {
        /// Offset into the remote registration.
        offset: u64,
        /// Length.
        len: u64,
        /// Remote registration size.
        size: u64,
    },
    /// A zero-length registration (UCX refuses them; nothing to register).
    #[error("cannot register an empty region")]
    EmptyRegion,
    /// The endpoint was closed (force-closed after a failure) and cannot be used.
    #[error("endpoint is closed")]
    EndpointClosed,
    /// The endpoint hit an error (peer failure); it only accepts a close now.
    #[error("endpoint failed: {0}")]
    EndpointFailed(super::UcsStatus),
    /// A wait ended at its deadline before the operation completed. The
    /// operation is still in flight; its memory stays in use.
    #[error("operation still in flight after {waited_ms} ms")]
    WaitTimeout {
        /// How long the wait lasted.
        waited_ms: u64,
    },
    /// An OS call the layer makes itself (mmap, poll) failed.
    #[error("{call} failed: errno {errno}")]
    Os {
        /// Which call.
        call: &'static str,
        /// `errno`.
        errno: i32,
    },
    /// The runtime libucp is older than the headers the bindings came from.
    #[error("libucp {found_major}.{found_minor} is older than the 1.13 headers")]
    LibraryVersion {
        /// Runtime major version.
        found_major: u32,
        /// Runtime minor version.
        found_minor: u32,
    },
}
