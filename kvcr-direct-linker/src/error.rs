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
    /// The runner refused or failed.
    #[error(transparent)]
    Runner(#[from] kvcr_foundation::runner::Error),
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
