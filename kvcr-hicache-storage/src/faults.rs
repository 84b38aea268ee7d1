//! Fault injection for the entry points (tests and chaos runs): arm a fault
//! on one rank's backend and its next calls fail internally, exactly like a
//! real internal error, so the miss-shaping and rank agreement are exercised.

use std::sync::{Mutex, PoisonError};

use crate::error::{Error, Result};

/// An entry point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Method {
    /// `batch_exists`.
    BatchExists,
    /// `batch_get`.
    BatchGet,
    /// `batch_set`.
    BatchSet,
}

impl Method {
    /// The method's name (as in `faults_<name>`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::BatchExists => "batch_exists",
            Self::BatchGet => "batch_get",
            Self::BatchSet => "batch_set",
        }
    }
}

/// What an armed fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The local step returns an internal error.
    Error,
    /// The local step panics (caught by the entry point).
    Panic,
}

/// Armed faults of one backend.
#[derive(Debug, Default)]
pub struct FaultInjector {
    armed: Mutex<Vec<(Method, FaultKind, u32)>>,
}

impl FaultInjector {
    /// The next `times` calls of `method` fail with `kind`.
    pub fn arm(&self, method: Method, kind: FaultKind, times: u32) {
        self.armed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((method, kind, times));
    }

    /// Disarms everything.
    pub fn clear(&self) {
        self.armed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    /// Fires an armed fault of `method`, if any.
    pub(crate) fn fire(&self, method: Method) -> Result<()> {
        let kind = {
            let mut armed = self.armed.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(pos) = armed.iter().position(|(m, _, n)| *m == method && *n > 0) else {
                return Ok(());
            };
            let Some(entry) = armed.get_mut(pos) else {
                return Ok(());
            };
            entry.2 -= 1;
            let kind = entry.1;
            if entry.2 == 0 {
                armed.remove(pos);
            }
            kind
        };
        match kind {
            FaultKind::Error => Err(Error::Injected),
            #[allow(clippy::panic)] // the injected fault is a panic, by request
            FaultKind::Panic => panic!("injected panic in {}", method.as_str()),
        }
    }
}
