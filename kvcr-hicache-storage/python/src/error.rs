//! The extension's one error type, and how it reaches Python.

use pyo3::PyErr;
use pyo3::exceptions::PyException;

pyo3::create_exception!(
    kvcr_hicache,
    KvcrError,
    PyException,
    "A kvcr backend could not be built or its host pool registered (the message names why)."
);

/// Everything the extension itself can refuse.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum Error {
    /// The backend refused (configuration, topology, host pool, runner).
    #[error(transparent)]
    Storage(#[from] kvcr_hicache_storage::Error),
    /// The storage config the Python class passed is not JSON, or its rank
    /// groups are incomplete.
    #[error("storage config: {0}")]
    StorageConfig(String),
    /// A host-pool description or a flat page from Python is inconsistent.
    #[error("{0}")]
    Argument(String),
    /// Memory for the legacy staging pool could not be allocated.
    #[error("cannot allocate {0} bytes of staging memory")]
    Allocation(u64),
}

impl From<Error> for PyErr {
    fn from(e: Error) -> Self {
        KvcrError::new_err(e.to_string())
    }
}

/// Result alias of the extension.
pub(crate) type Result<T, E = Error> = std::result::Result<T, E>;
