//! Read-only views of the peer protocol for the driver and the framework:
//! in-flight work, landing spans of a write, notices, state sizes and
//! counters.

use std::collections::BTreeSet;

use super::*;

impl Core {
    /// Target operations whose bytes may arrive through UCX, so this
    /// process's worker must progress for them (UCX 1.13 completes a put into
    /// private memory over shared memory only when the destination
    /// progresses): those from sources that did not map our shared segments.
    pub fn peer_transport_waits(&self) -> usize {
        self.transport_waiting_ops().count()
    }

    /// Whether any target operation's bytes may arrive through UCX
    /// ([`Self::peer_transport_waits`] > 0, found sooner): the peer thread
    /// asks on every turn, under the core's lock.
    pub fn peer_awaits_transport(&self) -> bool {
        self.transport_waiting_ops().next().is_some()
    }

    /// The target operations whose source did not map our shared segments.
    /// A restore's hundreds of operations share a source or a few: each
    /// source is looked up once per run of operations naming it, not once
    /// per operation (a hash of its endpoint each, every turn of a busy
    /// peer thread, was most of that thread's time under the lock, locally
    /// profiled).
    fn transport_waiting_ops(&self) -> impl Iterator<Item = &TargetOp> + '_ {
        let peer = self.peer.as_ref();
        let mut last: Option<(&ControlEndpoint, bool)> = None;
        peer.into_iter()
            .flat_map(|p| p.target.ops.values())
            .filter(move |o| {
                let one_copy = match last {
                    Some((source, one_copy)) if *source == o.source => one_copy,
                    _ => {
                        let one_copy = peer
                            .and_then(|p| p.target.sources.get(&o.source))
                            .is_some_and(|s| s.one_copy);
                        last = Some((&o.source, one_copy));
                        one_copy
                    }
                };
                !one_copy
            })
    }

    /// Whether the peer side still has work that may touch memory.
    pub fn peer_busy(&self) -> (usize, usize) {
        self.peer
            .as_ref()
            .map_or((0, 0), |p| (p.target.ops.len(), p.source.writes.len()))
    }

    /// Whether target operation `op` still waits for its source's reply.
    pub fn peer_awaits_reply(&self, op: OpHandle) -> bool {
        self.peer.as_ref().is_some_and(|p| {
            p.target
                .ops
                .get(&op)
                .is_some_and(|o| o.state == TargetState::WaitingWriteDone)
        })
    }

    /// Where a write of the first `keys` keys of target operation `op`
    /// lands in our memory, while the operation waits for its source's
    /// reply: the address and length of every element granted to those
    /// keys, key by key in request order and each key's elements in layout
    /// order (the order a source's puts take). `None` unless `keys` is 1 to
    /// the operation's key count (a source holding only the first keys
    /// asked writes those) and each of them still holds its granted slots.
    ///
    /// A driver that receives a write's bytes as one message (rather than
    /// as puts into the granted elements) copies them here, in this order,
    /// and only while the core lock it asked under is held: the slots stay
    /// the operation's until its reply is handled.
    pub fn peer_landing_spans(&self, op: OpHandle, keys: u32) -> Option<Vec<(u64, u64)>> {
        let target_op = self
            .peer
            .as_ref()?
            .target
            .ops
            .get(&op)
            .filter(|o| o.state == TargetState::WaitingWriteDone)?;
        let keys = usize::try_from(keys).ok().filter(|k| *k > 0)?;
        let mut spans = Vec::new();
        for fill in target_op.fills.get(..keys)? {
            let fill = self.fills.get(*fill as usize)?.as_ref()?;
            if fill.source != (FillSource::Remote { target_op: op.0 }) {
                return None;
            }
            let elements = self.slot_refs(fill.record);
            if elements.is_empty() {
                return None;
            }
            for element in elements {
                spans.push(self.resolve(element).ok()?);
            }
        }
        Some(spans)
    }

    /// Drains the framework notices.
    pub fn take_notices(&mut self) -> Vec<PeerNotice> {
        self.peer
            .as_mut()
            .map(|p| std::mem::take(&mut p.notices))
            .unwrap_or_default()
    }

    /// How much per-peer state the core holds: what the bounds in the trust
    /// rules are checked against.
    pub fn peer_state_sizes(&self) -> PeerStateSizes {
        self.peer
            .as_ref()
            .map_or_else(PeerStateSizes::default, |p| PeerStateSizes {
                routes: p.source.routes.len(),
                fences: p.source.fences.values().map(BTreeSet::len).sum(),
                high_water: p.source.high_water.len(),
                hinted_requests: p.target.hints.len(),
                sources: p.target.sources.len(),
                target_ops: p.target.ops.len(),
            })
    }

    /// Peer counters.
    pub fn peer_counters(&self) -> PeerCounters {
        self.peer.as_ref().map(|p| p.counters).unwrap_or_default()
    }
}
