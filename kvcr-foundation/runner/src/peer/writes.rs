//! A write the core asked for (`Action::Put`), started on the route it was
//! accepted on: a one-copy write runs on the lanes (ringing the target's
//! doorbell when its copies end); a write through UCX goes on a data
//! stream, as a message or as puts, whichever the route allows first.

use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::sync::Arc;

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::protocol::RegionId;
use kvcr_runner_core::{CopySpan, PutSpan};

use super::State;
use super::puts::{PendingWrite, pool_holding};
use super::routes::{Route, RoutePath};
use crate::copy::lanes::CheckedPage;
use crate::shared::Shared;
use kvcr_sys::segment::PeerSegment;

impl State {
    /// The route to `target` a write was accepted on (`generation`), unless
    /// it is gone or was replaced since (never write through those).
    pub(super) fn accepted_route(
        &self,
        target: &ControlEndpoint,
        generation: u64,
    ) -> Option<Rc<Route>> {
        self.routes
            .get(target)
            .filter(|r| r.generation == generation)
            .cloned()
    }

    /// Starts write `write` into `target` through the route it was accepted
    /// on (`generation`); a route gone or replaced since fails it at once.
    pub(super) fn write(
        &mut self,
        shared: &Arc<Shared>,
        write: u64,
        target: &ControlEndpoint,
        generation: u64,
        spans: Vec<PutSpan>,
    ) {
        let Some(route) = self.accepted_route(target, generation) else {
            // The route is gone or was replaced: never write through it.
            shared.with_core_now(|core, now| core.handle_put_done(now, write, false));
            return;
        };
        match &route.path {
            RoutePath::OneCopy(segments) => {
                self.write_one_copy(shared, write, &route, segments, &spans);
            }
            RoutePath::Ucx { .. } => self.write_through_ucx(shared, write, target, route, spans),
        }
    }

    /// A one-copy write: our pool's spans copied into the target's mapped
    /// `segments` on the lanes; fails at once if any range is outside them.
    fn write_one_copy(
        &mut self,
        shared: &Arc<Shared>,
        write: u64,
        route: &Route,
        segments: &HashMap<RegionId, Arc<PeerSegment>>,
        spans: &[PutSpan],
    ) {
        let copies = self.one_copy_plan(segments, spans);
        match copies {
            Some(copies) => {
                // Pages with their deposit digests are checked as they are
                // copied (all of them, or none: a page deposited without a
                // digest has nothing to be checked against).
                let (completion, pages) = {
                    let guard = shared.lock();
                    let completion = route
                        .doorbell
                        .as_ref()
                        .and_then(|_| super::landing::write_record(&guard.core, write));
                    (completion, guard.core.peer_write_pages(write))
                };
                let (plain, checked) = match pages {
                    Some(pages) => match CheckedPage::group(copies, &pages) {
                        Some(checked) => (Vec::new(), Some(checked)),
                        None => return self.copied(shared, (write, false)),
                    },
                    None => (copies, None),
                };
                if checked.is_some() {
                    self.checked_in_copy.insert(write);
                }
                if let (Some(doorbell), Some((op, keys, digest))) = (&route.doorbell, completion)
                    && let Some(slots) = segments.get(&doorbell.region)
                {
                    let (record, remote) = doorbell.ring(op, keys, digest, checked.is_some());
                    self.rings
                        .insert(write, (Arc::clone(slots), record, remote));
                }
                let segments = segments.values().cloned().collect();
                // Every source range lies inside one of our pools
                // (checked by `one_copy_plan`, and by the registry),
                // claimed by this write until it is reported; every
                // destination lies inside a mapping of `segments`
                // (checked), granted to this write by its target.
                let done = &self.lane_done_tx;
                let inline = match checked {
                    Some(pages) => self.lanes.submit_checked(write, pages, segments, done),
                    None => self.lanes.submit(write, plain, segments, done),
                };
                if let Some(ok) = inline {
                    self.copied(shared, (write, ok));
                }
            }
            None => shared.with_core_now(|core, now| core.handle_put_done(now, write, false)),
        }
    }

    /// A write through UCX: on the target's data stream if it has one, as
    /// a message if small enough, as puts otherwise.
    fn write_through_ucx(
        &mut self,
        shared: &Arc<Shared>,
        write: u64,
        target: &ControlEndpoint,
        route: Rc<Route>,
        spans: Vec<PutSpan>,
    ) {
        if self.send_on_stream(shared, write, target, &route, &spans) {
            self.pump_streams(shared);
            return;
        }
        let (spans, in_flight, failed, as_message) =
            match self.send_as_message(shared, write, &route, &spans) {
                Some((sent, whole)) => {
                    self.control
                        .stats
                        .write_messages_sent
                        .fetch_add(sent.len() as u64, std::sync::atomic::Ordering::Relaxed);
                    (VecDeque::new(), sent, !whole, true)
                }
                None => (self.put_split.split(spans), VecDeque::new(), false, false),
            };
        self.pending.push(PendingWrite {
            write,
            route,
            spans,
            in_flight,
            flush: None,
            failed,
            as_message,
        });
        self.issue_and_reap(shared);
    }

    /// The copies of a one-copy write: each span from our pool to the
    /// mapped target segment; `None` if any range is outside either.
    fn one_copy_plan(
        &self,
        segments: &HashMap<RegionId, Arc<PeerSegment>>,
        spans: &[PutSpan],
    ) -> Option<Vec<CopySpan>> {
        spans
            .iter()
            .map(|span| {
                pool_holding(&self.pools, span.local, span.len)?;
                let dst = segments
                    .get(&span.region)?
                    .destination(span.remote, span.len)?;
                Some(CopySpan {
                    src: span.local,
                    dst,
                    len: span.len,
                })
            })
            .collect()
    }

    /// A write's copies ended (`ok`: all of them): rings the target's
    /// doorbell first when the write has a record waiting (the moment the
    /// bytes are in place, before the core hears of it and the
    /// `write_done` goes out), then reports to the core.
    pub(super) fn copied(&mut self, shared: &Arc<Shared>, (write, ok): (u64, bool)) {
        if let Some((slots, record, remote)) = self.rings.remove(&write)
            && ok
            && slots.write_record(remote, &record)
        {
            self.control
                .stats
                .doorbells_rung
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let checked_in_copy = self.checked_in_copy.remove(&write);
        shared.with_core_now(|core, now| match (ok, checked_in_copy) {
            (true, true) => core.handle_put_done_checked_in_copy(now, write),
            _ => core.handle_put_done(now, write, ok),
        });
    }
}
