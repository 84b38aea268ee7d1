//! The engine's collective, lent from Python: SGLang ranks agree through
//! torch.distributed groups, so a tensor-parallel engine passes an object with
//! `rank`, `size`, `all_reduce_min(list[int]) -> list[int]` and
//! `all_gather(list[int]) -> list[list[int]]` (for example over a gloo group).
//!
//! The backend calls it from inside an entry point, with the GIL released;
//! each call attaches to the interpreter for the duration of the collective.

use kvcr_hicache_storage::{GroupError, RankGroup};
use pyo3::prelude::*;

/// A [`RankGroup`] that calls a Python object.
pub(crate) struct PyRankGroup {
    object: Py<PyAny>,
    rank: u32,
    size: u32,
}

impl PyRankGroup {
    /// Reads `rank` and `size` once (they never change for a group).
    pub(crate) fn new(object: &Bound<'_, PyAny>) -> PyResult<Self> {
        let rank: u32 = object.getattr("rank")?.extract()?;
        let size: u32 = object.getattr("size")?.extract()?;
        Ok(Self {
            object: object.clone().unbind(),
            rank,
            size,
        })
    }
}

fn engine_error(e: PyErr) -> GroupError {
    GroupError::Engine(e.to_string())
}

impl RankGroup for PyRankGroup {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.size
    }

    fn all_reduce_min(&self, values: &mut [u64]) -> Result<(), GroupError> {
        Python::attach(|py| {
            let reduced: Vec<u64> = self
                .object
                .bind(py)
                .call_method1("all_reduce_min", (values.to_vec(),))
                .and_then(|r| r.extract())
                .map_err(engine_error)?;
            if reduced.len() != values.len() {
                return Err(GroupError::ShapeMismatch);
            }
            values.copy_from_slice(&reduced);
            Ok(())
        })
    }

    fn all_gather(&self, local: &[u64]) -> Result<Vec<Vec<u64>>, GroupError> {
        Python::attach(|py| {
            let gathered: Vec<Vec<u64>> = self
                .object
                .bind(py)
                .call_method1("all_gather", (local.to_vec(),))
                .and_then(|r| r.extract())
                .map_err(engine_error)?;
            if gathered.len() != self.size as usize {
                return Err(GroupError::ShapeMismatch);
            }
            Ok(gathered)
        })
    }
}
