//! Request-lifetime hooks: what the engine tells a linker about each request
//! attempt, with no-op defaults for linkers that need none of it.

use kvcr_contracts::{
    AttemptId, AttemptLedger, BlockKey, FetchHint, HintSnapshot, Incarnation, NamespaceId,
    RequestId,
};

use crate::error::Result;

/// What the engine asks a linker to prepare: the tail of a request after the
/// engine's own device prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixQuery {
    /// The namespace of the request's pages (model digest, LoRA, salt).
    pub namespace: NamespaceId,
    /// Pages the engine already holds on its device.
    pub device_prefix_pages: u32,
    /// The keys of the pages after the device prefix, in order.
    pub tail: Vec<BlockKey>,
}

/// One attempt of one request, frozen when the attempt is enqueued: its id,
/// the router hints it carried, and the tail to prepare. Later changes to the
/// request's hints never reach an attempt already started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestContext {
    snapshot: HintSnapshot,
    query: PrefixQuery,
}

impl RequestContext {
    /// A context for the attempt `snapshot` belongs to.
    pub fn new(snapshot: HintSnapshot, query: PrefixQuery) -> Self {
        Self { snapshot, query }
    }

    /// Starts a new attempt of `request` in `ledger` and freezes its hints.
    /// Also returns the attempt it superseded, if any.
    pub fn begin(
        ledger: &mut AttemptLedger,
        request: RequestId,
        hints: Vec<FetchHint>,
        query: PrefixQuery,
    ) -> (Self, Option<AttemptId>) {
        let (attempt, superseded) = ledger.begin(request);
        (
            Self::new(HintSnapshot::new(attempt, hints), query),
            superseded,
        )
    }

    /// The attempt.
    pub fn attempt(&self) -> &AttemptId {
        self.snapshot.attempt()
    }

    /// The router hints the attempt started with (advisory).
    pub fn hints(&self) -> &[FetchHint] {
        self.snapshot.hints()
    }

    /// The frozen hint snapshot.
    pub fn snapshot(&self) -> &HintSnapshot {
        &self.snapshot
    }

    /// The tail to prepare.
    pub fn query(&self) -> &PrefixQuery {
        &self.query
    }
}

/// Request-lifetime hooks. Every method defaults to doing nothing, so a linker
/// without request-scoped state implements none of them.
///
/// Ending a request ([`Self::request_finished`], [`Self::request_aborted`])
/// never revokes a transfer the linker already accepted: the transfer lands,
/// and what it staged or consumed is released then.
pub trait RequestHooks {
    /// Whether the engine should call [`Self::request_started`] at enqueue and
    /// gate admission on the linker's preparation. Default: no.
    fn prepares_requests(&self) -> bool {
        false
    }

    /// An attempt was enqueued. A newer attempt of a request id supersedes the
    /// live one; it never waits for it. Default: nothing.
    fn request_started(&mut self, context: &RequestContext) -> Result<()> {
        let _ = context;
        Ok(())
    }

    /// The attempt completed normally; drop whatever it still holds.
    /// Default: nothing.
    fn request_finished(&mut self, attempt: &AttemptId) -> Result<()> {
        let _ = attempt;
        Ok(())
    }

    /// The attempt was aborted (cancelled, preempted, retried); drop whatever
    /// it still holds. Default: nothing.
    fn request_aborted(&mut self, attempt: &AttemptId) -> Result<()> {
        let _ = attempt;
        Ok(())
    }

    /// The engine reset its cache; the linker quiesces and opens incarnation
    /// `next`. Refused while accepted transfers are in flight. Default:
    /// nothing.
    fn reset(&mut self, next: Incarnation) -> Result<()> {
        let _ = next;
        Ok(())
    }
}

/// Hooks that do nothing: every default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoHooks;

impl RequestHooks for NoHooks {}
