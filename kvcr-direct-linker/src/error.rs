//! The crate's one error type.

/// Everything that can go wrong in the direct linker.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No CUDA driver library could be loaded on this machine.
    #[error("no CUDA driver found (libcuda.so could not be loaded)")]
    NoDriver,
    /// The driver loaded but reports no device with this ordinal.
    #[error("CUDA device {ordinal} not found ({count} present)")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: u32,
        /// Devices the driver reports.
        count: u32,
    },
    /// A CUDA driver call failed.
    #[error("CUDA call {call} failed: {status}")]
    Cuda {
        /// The driver function.
        call: &'static str,
        /// The driver's status, as it names it.
        status: String,
    },
    /// The driver is too old for what was asked.
    #[error("{what} needs a CUDA {needs} driver; this one is {driver}")]
    Unsupported {
        /// The feature.
        what: &'static str,
        /// The driver version it needs.
        needs: u32,
        /// The driver's version.
        driver: u32,
    },
    /// The device's kernel image could not be loaded.
    #[error("loading the copy kernel failed: {0}")]
    Kernel(String),
    /// A span the copier was handed lies in no attached pool, or in two.
    #[error(
        "span {src:#x} -> {dst:#x} ({len} bytes) does not join one attached pool and device memory"
    )]
    UnattachedSpan {
        /// Source address.
        src: u64,
        /// Destination address.
        dst: u64,
        /// Bytes.
        len: u64,
    },
    /// The engine's KV layout is invalid.
    #[error("invalid KV layout: {field} {why}")]
    Layout {
        /// The field at fault.
        field: &'static str,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A pipelined restore was handed slots that do not match its pages.
    #[error("restore of {pages} pages was given {slots} device slots{}", if *duplicate { " (one named twice)" } else { "" })]
    RestoreSlots {
        /// Slots given.
        slots: usize,
        /// Pages the request's tail names.
        pages: usize,
        /// Whether one slot was named twice (two pages would race for it).
        duplicate: bool,
    },
    /// A peer's device export name (the one-hop route) was refused: it
    /// comes from another process, so it is checked field by field before
    /// anything is opened (or, past its allocation, closed again at once).
    #[error("peer device export refused: {refusal}")]
    ExportName {
        /// What is wrong with it.
        refusal: NameRefusal,
    },
    /// A one-hop span's destination lies past the imported extent.
    #[error(
        "one-hop span to offset {offset:#x} ({len} bytes) is outside the {extent}-byte imported extent"
    )]
    OutsideImport {
        /// Destination offset into the extent.
        offset: u64,
        /// Bytes.
        len: u64,
        /// Bytes of the extent.
        extent: u64,
    },
    /// A one-pass copy's destination lies in no import open now.
    #[error("one-hop span to {dst:#x} ({len} bytes) lies in no open import")]
    OutsideImports {
        /// Destination address.
        dst: u64,
        /// Bytes.
        len: u64,
    },
    /// The runner refused or failed.
    #[error(transparent)]
    Runner(#[from] kvcr_foundation::runner::Error),
}

/// Why a peer's device export name was refused ([`Error::ExportName`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameRefusal {
    /// Not the record's fixed size.
    Size {
        /// Bytes received.
        got: usize,
    },
    /// Not a kvcr export record (wrong magic).
    Magic,
    /// A record format this build does not read.
    Version {
        /// The version it names.
        got: u16,
    },
    /// Reserved bytes that are not zero.
    Reserved,
    /// It names another length than the route granted.
    Length {
        /// Bytes the name covers.
        named: u64,
        /// Bytes the caller expects.
        expected: u64,
    },
    /// It names no bytes, or an extent whose end overflows.
    Extent,
    /// The device it names is none this host's driver reports.
    UnknownDevice,
    /// This very process exported it (CUDA cannot open its own handle).
    OwnProcess,
    /// Its extent runs past the allocation the handle opened.
    PastAllocation {
        /// Offset plus length, as named.
        end: u64,
        /// Bytes of the opened allocation.
        allocation: u64,
    },
}

impl std::fmt::Display for NameRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Size { got } => write!(f, "{got} bytes is not an export record's size"),
            Self::Magic => f.write_str("not a kvcr device export record"),
            Self::Version { got } => write!(f, "record version {got} is not readable here"),
            Self::Reserved => f.write_str("reserved bytes are not zero"),
            Self::Length { named, expected } => {
                write!(f, "it covers {named} bytes, not the {expected} expected")
            }
            Self::Extent => f.write_str("its extent is empty or overflows"),
            Self::UnknownDevice => f.write_str("it names a device this host does not report"),
            Self::OwnProcess => f.write_str("this process exported it (CUDA cannot reopen it)"),
            Self::PastAllocation { end, allocation } => write!(
                f,
                "its extent ends at {end} bytes, past the {allocation}-byte allocation"
            ),
        }
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<Error> for kvcr_foundation::runner::Error {
    fn from(error: Error) -> Self {
        use kvcr_foundation::runner::error::{Echo, RunnerReason};
        match error {
            Error::Runner(inner) => inner,
            other => Self::runner(RunnerReason::DeviceCopy(Echo::new(&other.to_string()))),
        }
    }
}
