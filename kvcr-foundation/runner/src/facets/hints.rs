//! [`Hints`]: operations under a request's router hint. A hint names the
//! peer that holds a request's pages; keys missing here that it covers are
//! pulled from that peer (peer mode), and without a hint each call is its
//! plain counterpart on [`Runner`].

use kvcr_contracts::hint::{FetchHint, RequestId};
use kvcr_contracts::key::ScopedKey;
use kvcr_contracts::protocol::OpHandle;
use kvcr_runner_core::{DeliverEntry, PoolId, QueryStatus};

use crate::{Result, Runner};

/// The runner's hinted operations, from [`Runner::hints`].
///
/// ```ignore
/// runner.hints().submit(request.clone(), &hint);
/// let op = runner.hints().deliver(&request, entries)?;
/// runner.hints().discard(&request);
/// ```
#[derive(Clone, Copy)]
pub struct Hints<'a> {
    runner: &'a Runner,
}

impl<'a> Hints<'a> {
    pub(crate) fn new(runner: &'a Runner) -> Self {
        Self { runner }
    }

    /// Records a request's router hint (and starts the metadata handshake
    /// with its source, off the fetch path).
    pub fn submit(&self, request: RequestId, hint: &FetchHint) {
        self.runner
            .with_core(|core, now| core.submit_hint(now, request, hint));
    }

    /// Ends a request's hint scope.
    pub fn discard(&self, request: &RequestId) {
        self.runner.with_core(|core, _| core.discard_hint(request));
    }

    /// [`Runner::fetch`] under a request: keys missing here that the
    /// request's hint places on a peer are pulled from it into KVCR DRAM.
    pub fn fetch(
        &self,
        request: &RequestId,
        keys: &[ScopedKey],
        layout: &[PoolId],
    ) -> Result<OpHandle> {
        self.runner
            .core_call(|core, now| core.fetch(now, keys, layout, Some(request)))
    }

    /// [`Runner::deliver`] under a request: missing hinted keys are pulled
    /// from the peer first, then copied into the destinations.
    pub fn deliver(&self, request: &RequestId, entries: Vec<DeliverEntry>) -> Result<OpHandle> {
        crate::timeline::mark("deliver_begin", entries.len() as u64);
        let op = self.runner.core_call(|core, now| {
            // Apart from the lock's wait before and the actions' pump after.
            crate::timeline::mark("deliver_locked", 0);
            let op = core.deliver(now, entries, Some(request));
            crate::timeline::mark("deliver_core_done", 0);
            op
        });
        crate::timeline::mark("deliver_end", 0);
        op
    }

    /// [`Runner::query`] under a request: a miss the request's hint covers
    /// is `Fetchable`.
    pub fn query(&self, request: &RequestId, key: &ScopedKey) -> QueryStatus {
        self.runner
            .shared
            .lock()
            .core
            .query_request(key, Some(request))
    }
}

impl std::fmt::Debug for Hints<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hints").finish_non_exhaustive()
    }
}
