//! The extension's one error type, and the exception hierarchy it reaches
//! Python as: every refusal is a `kvcr_direct.KvcrError`, and a subclass
//! says which kind, so an engine can catch "no GPU here" apart from "my KV
//! pool is described wrong" apart from "the runner failed".

use pyo3::PyErr;
use pyo3::exceptions::PyException;

pyo3::create_exception!(
    kvcr_direct,
    KvcrError,
    PyException,
    "Anything kvcr's direct linker refused or failed (the subclass says which kind)."
);
pyo3::create_exception!(
    kvcr_direct,
    LayoutError,
    KvcrError,
    "The KV pool's tensors do not describe a pool the linker supports (device, dtype, \
     contiguity, strides, shapes, overlap, alignment, sizes)."
);
pyo3::create_exception!(
    kvcr_direct,
    NoGpuError,
    KvcrError,
    "No CUDA driver could be loaded, or it reports no device with the asked ordinal."
);
pyo3::create_exception!(
    kvcr_direct,
    CudaError,
    KvcrError,
    "A CUDA driver call failed, the driver is too old, or the copy kernel did not load."
);
pyo3::create_exception!(
    kvcr_direct,
    ContractError,
    KvcrError,
    "The linker contract refused a call (no live or a superseded attempt, a slot outside \
     the pool, a load without claims, a reset with transfers in flight, ...)."
);
pyo3::create_exception!(
    kvcr_direct,
    HintError,
    KvcrError,
    "A router hint is not a valid kv.fetch hint (JSON, endpoint, block hashes)."
);
pyo3::create_exception!(
    kvcr_direct,
    ArgumentError,
    KvcrError,
    "An argument of the wrong type or out of range (a key, a slot, a timeout, ...)."
);
pyo3::create_exception!(
    kvcr_direct,
    RunnerError,
    KvcrError,
    "The linker's runner (KVCR DRAM, its copy thread, the peer protocol) refused or failed."
);

/// Everything the extension can refuse.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    /// The direct linker refused or failed.
    #[error(transparent)]
    Linker(#[from] kvcr_direct_linker::Error),
    /// The linker contract refused.
    #[error("{}", contract_text(.0))]
    Contract(#[from] kvcr_linker_contracts::Error),
    /// The KV pool's tensors, as this extension read them, are unusable.
    #[error("KV pool: {0}")]
    Layout(String),
    /// An argument of the wrong type or out of range.
    #[error("{0}")]
    Argument(String),
    /// A router hint that does not parse.
    #[error("router hint {index}: {error}")]
    Hint {
        /// The hint's index in the call.
        index: usize,
        /// Why it was refused.
        error: kvcr_foundation::Error,
    },
    /// The linker was closed; it serves nothing any more.
    #[error("the linker is closed")]
    Closed,
}

/// A contract error's text, with its backend's cause (the contract's
/// `Backend` variant only says that the backend failed).
fn contract_text(error: &kvcr_linker_contracts::Error) -> String {
    match error {
        kvcr_linker_contracts::Error::Backend(inner) => format!("linker backend failed: {inner}"),
        other => other.to_string(),
    }
}

/// The exception a direct linker error raises.
fn linker_exception(error: &kvcr_direct_linker::Error, text: String) -> PyErr {
    use kvcr_direct_linker::Error as E;
    match error {
        E::NoDriver | E::NoDevice { .. } => NoGpuError::new_err(text),
        E::Layout { .. } => LayoutError::new_err(text),
        E::RestoreSlots { .. } => ContractError::new_err(text),
        E::Runner(_) => RunnerError::new_err(text),
        E::Cuda { .. }
        | E::Unsupported { .. }
        | E::Kernel(_)
        | E::UnattachedSpan { .. }
        | E::ExportName { .. }
        | E::OutsideImport { .. }
        | E::OutsideImports { .. } => CudaError::new_err(text),
    }
}

impl From<Error> for PyErr {
    fn from(e: Error) -> Self {
        let text = e.to_string();
        match &e {
            Error::Linker(inner) => linker_exception(inner, text),
            Error::Contract(kvcr_linker_contracts::Error::Backend(inner)) => {
                match inner.downcast_ref::<kvcr_direct_linker::Error>() {
                    Some(linker) => linker_exception(linker, text),
                    None => RunnerError::new_err(text),
                }
            }
            Error::Contract(_) => ContractError::new_err(text),
            Error::Layout(_) => LayoutError::new_err(text),
            Error::Argument(_) => ArgumentError::new_err(text),
            Error::Hint { .. } => HintError::new_err(text),
            Error::Closed => KvcrError::new_err(text),
        }
    }
}

/// Result alias of the extension.
pub(crate) type Result<T, E = Error> = std::result::Result<T, E>;
