//! What the linker reports, as plain Python values: each `LinkerEvent` a
//! dict with a `kind` (the package turns them into dataclasses), attempts as
//! [`Attempt`] objects.

use kvcr_foundation::AttemptId;
use kvcr_linker_contracts::{Accounting, LinkerEvent, OffloadOutcome, PreparationState};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// One attempt of one request: the request id the engine named and the
/// generation the linker's attempt ledger gave it (a retried request id gets
/// a higher one, and the old attempt is superseded).
#[pyclass(frozen, eq, hash, name = "Attempt", module = "kvcr_direct._native")]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Attempt {
    /// The request id.
    #[pyo3(get)]
    pub(crate) request_id: String,
    /// The generation.
    #[pyo3(get)]
    pub(crate) generation: u64,
}

#[pymethods]
impl Attempt {
    fn __repr__(&self) -> String {
        format!(
            "Attempt(request_id={:?}, generation={})",
            self.request_id, self.generation
        )
    }
}

impl From<&AttemptId> for Attempt {
    fn from(id: &AttemptId) -> Self {
        Self {
            request_id: id.request.0.clone(),
            generation: id.generation,
        }
    }
}

impl From<&Attempt> for AttemptId {
    fn from(attempt: &Attempt) -> Self {
        Self {
            request: kvcr_foundation::RequestId(attempt.request_id.clone()),
            generation: attempt.generation,
        }
    }
}

/// One event as a dict.
pub(crate) fn event<'py>(py: Python<'py>, event: &LinkerEvent) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    match event {
        LinkerEvent::OffloadDone { ticket, success } => {
            d.set_item("kind", "offload_done")?;
            d.set_item("ticket", ticket.0)?;
            d.set_item("success", *success)?;
        }
        LinkerEvent::LoadDone {
            attempt,
            ticket,
            success,
        } => {
            d.set_item("kind", "load_done")?;
            d.set_item("attempt", Attempt::from(attempt))?;
            d.set_item("ticket", ticket.0)?;
            d.set_item("success", *success)?;
        }
        LinkerEvent::RestoreDone {
            attempt,
            ticket,
            restored,
            pages,
        } => {
            d.set_item("kind", "restore_done")?;
            d.set_item("attempt", Attempt::from(attempt))?;
            d.set_item("ticket", ticket.0)?;
            d.set_item("restored", *restored)?;
            d.set_item("pages", *pages)?;
        }
        LinkerEvent::FirstLayerLanded {
            attempt,
            ticket,
            pages,
        } => {
            d.set_item("kind", "first_layer_landed")?;
            d.set_item("attempt", Attempt::from(attempt))?;
            d.set_item("ticket", ticket.0)?;
            d.set_item("pages", *pages)?;
        }
        LinkerEvent::Evicted {
            incarnation,
            tier,
            keys,
        } => {
            d.set_item("kind", "evicted")?;
            d.set_item("incarnation", incarnation.raw())?;
            d.set_item("tier", format!("{tier:?}"))?;
            let keys: Vec<(u64, u64)> = keys
                .iter()
                .map(|k| (k.namespace.0, k.key.as_u64()))
                .collect();
            d.set_item("keys", keys)?;
        }
    }
    Ok(d)
}

/// Events as a list of dicts.
pub(crate) fn events<'py>(
    py: Python<'py>,
    events: &[LinkerEvent],
) -> PyResult<Vec<Bound<'py, PyDict>>> {
    events.iter().map(|e| event(py, e)).collect()
}

/// An offload's answer: `{"queued": ticket}` or `{"declined": reason}`.
pub(crate) fn offload<'py>(
    py: Python<'py>,
    outcome: OffloadOutcome,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    match outcome {
        OffloadOutcome::Queued(ticket) => d.set_item("queued", ticket.0)?,
        OffloadOutcome::Declined(reason) => d.set_item(
            "declined",
            match reason {
                kvcr_linker_contracts::DeclineReason::OverCapacity => "over_capacity",
                kvcr_linker_contracts::DeclineReason::Unhealthy => "unhealthy",
            },
        )?,
    }
    Ok(d)
}

/// A preparation state's name (`fetching`, `ready`, `loaded`, or
/// `retired:<reason>`).
pub(crate) fn preparation(state: PreparationState) -> String {
    match state {
        PreparationState::Fetching => "fetching".to_owned(),
        PreparationState::Ready => "ready".to_owned(),
        PreparationState::Loaded => "loaded".to_owned(),
        PreparationState::Retired(reason) => format!("retired:{reason:?}"),
    }
}

/// Claim and transfer counts as a dict.
pub(crate) fn accounting(py: Python<'_>, a: Accounting) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("claims_held", a.claims_held)?;
    d.set_item("transfers_in_flight", a.transfers_in_flight)?;
    d.set_item("live_attempts", a.live_attempts)?;
    Ok(d)
}
