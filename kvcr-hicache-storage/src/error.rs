//! The crate's one error type.
//!
//! Construction and registration return [`Error`]; the storage entry points
//! (`batch_exists`, `batch_get`, `batch_set`) never do: they turn every
//! internal error into a miss of the right shape and count it (see
//! [`crate::StorageStats`]).

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in `kvcr-hicache-storage`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The extra-config JSON is not an object (or not JSON, or an unreadable
    /// `@path`).
    #[error("extra config: {0}")]
    ConfigSyntax(String),
    /// The extra config has a key this backend does not know.
    #[error("extra config: unknown key `{0}`")]
    UnknownKey(String),
    /// A configuration value is out of bounds or of the wrong type.
    #[error("config `{key}`: {why}")]
    Config {
        /// The offending key.
        key: String,
        /// What is wrong with it.
        why: String,
    },
    /// The engine's topology is one this backend refuses to serve (named).
    #[error("unsupported engine configuration: {0}")]
    Unsupported(String),
    /// A host pool description is inconsistent.
    #[error("host pool: {0}")]
    HostPool(String),
    /// A host pool was registered after another one (replacing it is refused).
    #[error("host pool already registered with a different description")]
    HostPoolReplaced,
    /// An entry point was called before a host pool was registered.
    #[error("no host pool registered yet")]
    NotRegistered,
    /// Keys and host pages differ in length, or a host page is out of range.
    #[error("bad batch: {0}")]
    Batch(String),
    /// One call names the same host page for two entries (two copies into,
    /// or out of, one page): the call is refused before anything is copied.
    #[error("bad batch: host page {0} is named more than once in one call")]
    DuplicateHostPage(u64),
    /// A rank collective failed.
    #[error("rank group: {0}")]
    Group(#[from] GroupError),
    /// The runner refused a call or failed to start.
    #[error("runner: {0}")]
    Runner(#[from] kvcr_foundation::runner::Error),
    /// The KV-event publisher (`publish_inventory`) failed to start, or the
    /// registration it advertises cannot be built.
    #[error("inventory publisher: {0}")]
    Publisher(String),
    /// An operation did not complete within its budget.
    #[error("operation did not complete within {0} ms")]
    Timeout(u64),
    /// A fault injected through [`crate::FaultInjector`].
    #[error("injected fault")]
    Injected,
    /// A panic inside an entry point, caught (the message, bounded).
    #[error("internal panic: {0}")]
    Panic(String),
}

/// Why a rank collective failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GroupError {
    /// Not every rank arrived in time.
    #[error("collective timed out after {0} ms")]
    Timeout(u64),
    /// Ranks called different collectives, or with different lengths.
    #[error("ranks disagree on the collective's shape")]
    ShapeMismatch,
    /// The engine's collective failed (its message).
    #[error("engine collective failed: {0}")]
    Engine(String),
}

impl Error {
    pub(crate) fn config(key: &str, why: impl Into<String>) -> Self {
        Self::Config {
            key: key.to_owned(),
            why: why.into(),
        }
    }
}

/// A refused contract value (an endpoint, a hint) is refused the way the
/// runner refuses it.
impl From<kvcr_foundation::Error> for Error {
    fn from(e: kvcr_foundation::Error) -> Self {
        Self::Runner(e.into())
    }
}
