//! Writes through UCX puts: each write's spans cut into chunks
//! ([`PutSplit`]), issued under one in-flight cap shared by every write,
//! flushed after the last, and reported once the flush completes.

use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::Arc;

use kvcr_runner_core::PutSpan;
use kvcr_ucx::{Completion, Endpoint, Registration};

use super::State;
use super::routes::{Route, RoutePath};
use crate::config::{PeerOptions, PutSplit};
use crate::error::{Error, Result, RunnerReason};
use crate::shared::Shared;

/// A write under way through UCX (puts, or one message in parts).
pub(super) struct PendingWrite {
    pub(super) write: u64,
    /// The route the write was accepted on: its puts go through this one
    /// only, even if the target's route is replaced or dropped meanwhile (a
    /// replacement may be another process at the same address).
    pub(super) route: Rc<Route>,
    pub(super) spans: VecDeque<PutSpan>,
    pub(super) in_flight: VecDeque<Completion>,
    pub(super) flush: Option<Completion>,
    pub(super) failed: bool,
    /// Sent as one message (its completion inside): ends when the message
    /// has left, with no flush.
    pub(super) as_message: bool,
}

impl State {
    /// Issues puts up to the in-flight cap, flushes each write after its last
    /// put, and reports writes whose flush completed.
    pub(super) fn issue_and_reap(&mut self, shared: &Arc<Shared>) {
        let mut finished = Vec::new();
        let pools = &self.pools;
        for w in &mut self.pending {
            while let Some(done) = w.in_flight.front().and_then(Completion::result) {
                w.failed |= done.is_err();
                w.in_flight.pop_front();
            }
        }
        // The cap is shared by every write (a fetch in batches is several
        // writes at once, and tcp collapses under many large puts); the
        // oldest write issues first, so batches land roughly in order.
        let mut in_flight: usize = self.pending.iter().map(|w| w.in_flight.len()).sum();
        for w in &mut self.pending {
            let route = &w.route;
            while in_flight < self.max_in_flight && !w.failed {
                let Some(span) = w.spans.pop_front() else {
                    break;
                };
                match put(pools, route, &span) {
                    Ok(c) => {
                        w.in_flight.push_back(c);
                        in_flight += 1;
                    }
                    Err(_) => w.failed = true,
                }
            }
            if w.spans.is_empty() && w.flush.is_none() && !w.failed && !w.as_message {
                match route.ucx_endpoint().map(Endpoint::flush) {
                    Some(Ok(c)) => w.flush = Some(c),
                    Some(Err(_)) | None => w.failed = true,
                }
            }
            let puts_done = w.in_flight.iter().all(Completion::is_done);
            let all_ok = || {
                !w.failed
                    && w.in_flight
                        .iter()
                        .all(|c| matches!(c.result(), Some(Ok(()))))
            };
            match (&w.flush, w.failed) {
                _ if w.as_message && puts_done => finished.push((w.write, all_ok(), true)),
                (Some(flush), _) if puts_done => {
                    if let Some(result) = flush.result() {
                        finished.push((w.write, result.is_ok() && all_ok(), false));
                    }
                }
                (None, true) if puts_done => finished.push((w.write, false, false)),
                _ => {}
            }
        }
        if finished.is_empty() {
            return;
        }
        self.pending
            .retain(|w| !finished.iter().any(|(id, _, _)| *id == w.write));
        shared.with_core_now(|core, now| {
            for (write, ok, as_message) in finished {
                if as_message {
                    core.handle_message_sent(now, write, ok);
                } else {
                    core.handle_put_done(now, write, ok);
                }
            }
        });
    }
}

/// How puts are cut and how many are in flight, from the options and
/// whether the transports include tcp: explicit settings as given; with
/// neither a split nor a cap set, tcp splits into [`PutSplit::TCP_DEFAULT`]
/// and other transports put each span whole, 64 in flight.
pub(super) fn put_plan(options: &PeerOptions, over_tcp: bool) -> (PutSplit, usize) {
    let split = options.put_split;
    match (split.chunk_bytes, options.max_puts_in_flight) {
        (0, 0) if over_tcp => (
            PutSplit::TCP_DEFAULT,
            PutSplit::TCP_DEFAULT.max_chunks_in_flight,
        ),
        (0, 0) => (split, 64),
        (0, n) => (split, n),
        (_, _) => (
            split,
            match split.max_chunks_in_flight {
                0 if over_tcp => PutSplit::TCP_IN_FLIGHT,
                0 => PutSplit::SHM_IN_FLIGHT,
                n => n,
            },
        ),
    }
}

/// The pool holding the span's local bytes, and their offset in it.
pub(super) fn pool_holding<'p>(
    pools: &'p [Registration<'static>],
    local: u64,
    len: u64,
) -> Option<(&'p Registration<'static>, u64)> {
    let end = local.checked_add(len)?;
    pools.iter().find_map(|p| {
        let base = p.as_ptr() as usize as u64;
        (local >= base && end <= base + p.len() as u64).then(|| (p, local - base))
    })
}

fn put(pools: &[Registration<'static>], route: &Route, span: &PutSpan) -> Result<Completion> {
    let (pool, offset) = pool_holding(pools, span.local, span.len)
        .ok_or(Error::runner(RunnerReason::LayoutMismatch))?;
    let RoutePath::Ucx { endpoint, rkeys } = &route.path else {
        return Err(Error::runner(RunnerReason::LayoutMismatch));
    };
    let (rkey, base) = rkeys
        .get(&span.region)
        .ok_or(Error::runner(RunnerReason::UnknownRegion(span.region.0)))?;
    let remote_offset = span
        .remote
        .checked_sub(*base)
        .ok_or(Error::runner(RunnerReason::LayoutMismatch))?;
    let len = usize::try_from(span.len).map_err(|_| Error::runner(RunnerReason::LayoutMismatch))?;
    let offset =
        usize::try_from(offset).map_err(|_| Error::runner(RunnerReason::LayoutMismatch))?;
    Ok(endpoint.put(pool, offset, len, rkey, remote_offset)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Over tcp, an unconfigured runner splits its puts; any explicit
    /// setting is taken as given, and other transports keep puts whole.
    #[rstest::rstest]
    #[case::tcp_unconfigured(0, 0, 0, true, PutSplit::TCP_DEFAULT, 8)]
    #[case::shm_unconfigured(0, 0, 0, false, PutSplit::default(), 64)]
    #[case::tcp_whole_puts_by_cap(0, 0, 2, true, PutSplit::default(), 2)]
    #[case::shm_whole_puts_by_cap(0, 0, 5, false, PutSplit::default(), 5)]
    #[case::tcp_split_transport_depth(
        4 << 20,
        0,
        0,
        true,
        PutSplit::chunks_of(4 << 20),
        PutSplit::TCP_IN_FLIGHT
    )]
    #[case::shm_split_transport_depth(
        4 << 20,
        0,
        0,
        false,
        PutSplit::chunks_of(4 << 20),
        PutSplit::SHM_IN_FLIGHT
    )]
    #[case::split_and_depth_given(
        1 << 20,
        3,
        7,
        true,
        PutSplit { chunk_bytes: 1 << 20, max_chunks_in_flight: 3 },
        3
    )]
    fn put_plans_follow_the_options_and_the_transport(
        #[case] chunk_bytes: u64,
        #[case] max_chunks_in_flight: usize,
        #[case] max_puts_in_flight: usize,
        #[case] over_tcp: bool,
        #[case] split: PutSplit,
        #[case] in_flight: usize,
    ) {
        let mut options = PeerOptions::loopback();
        options.put_split = PutSplit {
            chunk_bytes,
            max_chunks_in_flight,
        };
        options.max_puts_in_flight = max_puts_in_flight;
        assert_eq!(put_plan(&options, over_tcp), (split, in_flight));
    }
}
