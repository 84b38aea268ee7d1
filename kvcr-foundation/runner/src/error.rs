//! The runner's one error type.
//!
//! It flattens the core's refusals ([`RunnerReason`]) and the contracts' parse
//! errors, and adds what only the driver can fail at: UCX calls and startup.

use kvcr_runner_core::error as core_error;
pub use kvcr_runner_core::{Echo, PoolMemoryReason, RunnerReason};

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the runner.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A contract value (endpoint, key, hint, frame, ...) was refused.
    #[error(transparent)]
    Contract(#[from] kvcr_contracts::Error),
    /// The runner refused a call (bad configuration, region, layout or handle,
    /// or a lifecycle step that is not safe yet). The runner is unchanged.
    #[error("runner: {reason}")]
    Runner {
        /// Why.
        reason: RunnerReason,
    },
    /// Startup failed at a stage; says whether memory had to be retained
    /// because a native transfer might still touch it.
    #[error("runner startup failed at stage {stage}: {cause}{}", if *retained { " (memory retained: a transfer may still touch it; keep caller buffers until exit)" } else { "" })]
    Startup {
        /// The stage that failed.
        stage: &'static str,
        /// Whether resources were retained rather than released.
        retained: bool,
        /// What failed.
        cause: Box<Error>,
    },
    /// A UCX call failed or the UCX layer refused a request.
    #[error(transparent)]
    Ucx(#[from] kvcr_ucx::Error),
    /// The G3 file tier refused its files or configuration.
    #[error(transparent)]
    G3(#[from] crate::g3::G3Error),
    /// The guard refused a claim, handed over a grant that does not match
    /// it, or could not be reached or started.
    #[error(transparent)]
    Guard(#[from] crate::guard::GuardError),
}

impl From<core_error::Error> for Error {
    fn from(e: core_error::Error) -> Self {
        match e {
            core_error::Error::Contract(e) => Self::Contract(e),
            core_error::Error::Runner { reason } => Self::Runner { reason },
        }
    }
}

impl Error {
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

    /// The UCX status, when this is a UCX call failure.
    pub fn ucx_status(&self) -> Option<kvcr_ucx::UcsStatus> {
        match self {
            Self::Ucx(e) => e.status(),
            _ => None,
        }
    }

    /// The UCX refusal reason, when the UCX safe layer refused a request.
    pub fn ucx_reason(&self) -> Option<&kvcr_ucx::UcxReason> {
        match self {
            Self::Ucx(e) => e.reason(),
            _ => None,
        }
    }
}

/// The runner's reading of a `kvcr_sys` refusal (pool memory, registry).
impl From<kvcr_sys::SysError> for Error {
    fn from(error: kvcr_sys::SysError) -> Self {
        match error {
            kvcr_sys::SysError::Allocation { bytes } => {
                Error::runner(RunnerReason::Allocation { bytes })
            }
            kvcr_sys::SysError::PoolMemory(reason) => {
                Error::runner(RunnerReason::PoolMemory(reason))
            }
            kvcr_sys::SysError::Grant { why } => Error::runner(RunnerReason::Config {
                field: "guard grant",
                why,
            }),
            kvcr_sys::SysError::Unregistered { .. } => Error::runner(RunnerReason::ClaimedCopy(
                "a span lies outside registered memory",
            )),
            kvcr_sys::SysError::Overlap => Error::runner(RunnerReason::ClaimedCopy(
                "a span's source and destination overlap",
            )),
            // `AlreadyRegistered`, and whatever a later kvcr-sys adds.
            _ => Error::runner(RunnerReason::Config {
                field: "memory registry",
                why: "a range overlaps a registered one",
            }),
        }
    }
}
