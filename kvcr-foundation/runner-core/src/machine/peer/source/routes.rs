//! The source role's routes: a target's metadata checked and turned into a
//! connect (within its route-change budget), the driver's connect results
//! acknowledged, and a closed session's route dropped.

use super::*;
use kvcr_contracts::MemberKey;
use std::sync::Arc;

impl Core {
    #[allow(clippy::too_many_arguments)]
    pub(in crate::machine) fn on_target_metadata(
        &mut self,
        now: u64,
        header: &Header,
        worker_address: Vec<u8>,
        regions: Vec<RegionAdvert>,
        shared_memory: Option<SharedMemoryAdvert>,
        doorbell: Option<DoorbellAdvert>,
        device_regions: Vec<DeviceRegionAdvert>,
    ) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let target = header.sender_endpoint.clone();
        // Device regions mean something only beside shared memory (a
        // same-host offer) and with one hop on here; otherwise they are
        // dropped unread (the driver is never asked to open them). More
        // than we open for one target: the route is still served, in two
        // hops (counted), never left unacknowledged.
        let offered = peer.config.one_hop && shared_memory.is_some();
        let device_regions = if !offered {
            Vec::new()
        } else if device_regions.len() > MAX_ADVERTISED_DEVICE_REGIONS {
            peer.counters.one_hop_refused += 1;
            Vec::new()
        } else {
            device_regions
        };
        let oversized = regions.len() > MAX_ADVERTISED_REGIONS
            || worker_address.len() > MAX_WORKER_ADDRESS_LEN
            || regions.iter().any(|r| r.rkey.len() > MAX_RKEY_LEN);
        if oversized {
            // Nothing of it is kept or handed to UCX, and it is not
            // acknowledged: the target's writes wait and fail by deadline.
            peer.counters.refused += 1;
            return;
        }
        let unchanged = peer.source.routes.get(&target).is_some_and(|r| {
            r.incarnation == header.sender
                && r.their_generation == header.route_generation
                && r.regions.len() == regions.len()
                && regions.iter().all(|a| r.regions.get(&a.id) == Some(a))
                && r.shared_memory == shared_memory
                && r.doorbell == doorbell
                && r.device_regions.len() == device_regions.len()
                && device_regions
                    .iter()
                    .all(|a| r.device_regions.get(a.id) == Some(a))
        });
        if !unchanged {
            let budgets = (peer.config.route_budget, peer.config.route_budget_total);
            if !peer
                .source
                .admit_route_change(now, &member_of(&target), budgets)
            {
                // Not acknowledged and nothing kept: the target re-sends its
                // metadata and is served when its budget allows. Its old
                // route, if any, stays, and names its old incarnation.
                peer.counters.routes_refused += 1;
                return;
            }
            // A new process (or new registrations) at this name: a new route
            // generation, so writes queued for the old one are never submitted.
            let generation = peer.source.next_route_generation;
            peer.source.next_route_generation += 1;
            let rkeys = regions
                .iter()
                .map(|r| (r.id, r.base, r.rkey.clone()))
                .collect();
            // The codec checked that each extent fits (no overflow).
            let extents = regions
                .iter()
                .map(|r| {
                    let last = r.count.saturating_sub(1).saturating_mul(r.stride);
                    (r.id, last.saturating_add(r.element_size))
                })
                .collect();
            peer.source.routes.insert(
                target.clone(),
                Route {
                    incarnation: header.sender,
                    their_generation: header.route_generation,
                    local_generation: generation,
                    regions: Arc::new(regions.into_iter().map(|r| (r.id, r)).collect()),
                    shared_memory: shared_memory.clone(),
                    doorbell: doorbell.clone(),
                    one_copy: None,
                    device_regions: Arc::new(DeviceGrants::new(&device_regions)),
                    device: false,
                },
            );
            // The ack waits for the driver's connect (`handle_connected`),
            // so it can say whether the writes will land with one copy.
            self.actions.push_back(Action::Connect {
                peer: target.clone(),
                generation,
                worker_address,
                rkeys,
                shared_memory,
                extents,
                doorbell,
                device_regions,
            });
            return;
        }
        let known = peer
            .source
            .routes
            .get(&target)
            .and_then(|r| Some((r.one_copy?, r.device)));
        if let Some((one_copy, device)) = known {
            self.send(
                target,
                Body::TargetMetadataAck {
                    op_handle: None,
                    one_copy,
                    device,
                },
            );
        }
    }

    /// The driver built the route of `generation` to `target`; `one_copy`:
    /// it mapped every shared segment the target advertised. Acknowledges
    /// the metadata.
    pub fn handle_connected(&mut self, target: &ControlEndpoint, generation: u64, one_copy: bool) {
        self.handle_connected_one_hop(target, generation, one_copy, false);
    }

    /// As [`Core::handle_connected`]; `device`: the driver also opened
    /// every device region the target advertised (the one-hop route), so
    /// the ack offers it and grants of their elements are written. A route
    /// with device regions the driver could not open is counted
    /// (`one_hop_refused`) and its writes go through KVCR DRAM.
    pub fn handle_connected_one_hop(
        &mut self,
        target: &ControlEndpoint,
        generation: u64,
        one_copy: bool,
        device: bool,
    ) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let Some(route) = peer
            .source
            .routes
            .get_mut(target)
            .filter(|r| r.local_generation == generation)
        else {
            return; // replaced meanwhile; the newer connect acknowledges
        };
        route.one_copy = Some(one_copy);
        let offered = !route.device_regions.is_empty();
        route.device = device && offered;
        let device = route.device;
        if offered && !device {
            peer.counters.one_hop_refused += 1;
        }
        if one_copy {
            peer.counters.one_copy_routes += 1;
        } else {
            peer.counters.ucx_routes += 1;
        }
        self.send(
            target.clone(),
            Body::TargetMetadataAck {
                op_handle: None,
                one_copy,
                device,
            },
        );
    }

    /// The session from `target` closed: its route goes (writes already
    /// accepted keep their own copy of what they need and end as usual); its
    /// fences fold into the high-water mark, which outlives the session.
    pub fn peer_target_gone(&mut self, target: &ControlEndpoint) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        if let Some(route) = peer.source.routes.remove(target)
            && let Some(fenced) = peer.source.fences.remove(&route.incarnation)
            && let Some(highest) = fenced.last()
        {
            peer.source.raise_high_water(route.incarnation, *highest);
        }
    }

    /// The driver built no route from `target`'s metadata (`why`): nothing
    /// of it is kept, and its writes are refused until new metadata
    /// connects.
    pub fn handle_connect_failed(
        &mut self,
        target: &ControlEndpoint,
        generation: u64,
        why: ConnectFailure,
    ) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        if peer
            .source
            .routes
            .get(target)
            .is_none_or(|r| r.local_generation != generation)
        {
            return; // replaced meanwhile; the newer connect answers
        }
        peer.source.routes.remove(target);
        match why {
            ConnectFailure::Unusable => peer.counters.refused += 1,
            ConnectFailure::NoMappingsLeft => peer.counters.routes_refused += 1,
            ConnectFailure::Unproven => peer.counters.routes_unproven += 1,
        }
        // Acknowledged anyway, so the target's writes are refused at once
        // (there is no route) instead of waiting out their deadline.
        self.send(
            target.clone(),
            Body::TargetMetadataAck {
                op_handle: None,
                one_copy: false,
                device: false,
            },
        );
    }
}

impl SourceRole {
    /// Whether `member` may change a route at `now` under its own budget
    /// and the total one (`budgets`), charging both if so. The remembered
    /// members stay bounded: past [`MAX_ROUTE_BUDGETS`] those whose budget
    /// has refilled (as good as new) are forgotten, and while none has a
    /// new member is refused.
    fn admit_route_change(
        &mut self,
        now: u64,
        member: &RouteMember,
        (budget, total): (RouteBudget, RouteBudget),
    ) -> bool {
        let Some(total_next) = total.admit(now, self.route_changes_total_due) else {
            return false;
        };
        let target = member;
        let due = self.route_changes_due.get(target).copied();
        if due.is_none() && self.route_changes_due.len() >= MAX_ROUTE_BUDGETS {
            self.route_changes_due.retain(|_, due| *due > now);
            if self.route_changes_due.len() >= MAX_ROUTE_BUDGETS {
                return false;
            }
        }
        match budget.admit(now, due) {
            Some(next) => {
                self.route_changes_due.insert(target.clone(), next);
                self.route_changes_total_due = Some(total_next);
                true
            }
            None => false,
        }
    }
}

/// Whom a route budget is charged to: the member key a session from
/// `target` proved (its endpoint names it once the acceptor bound the claim
/// to the handshake's key), or, for a session without one (no cluster
/// secret, keyless peers allowed), the endpoint it claimed. Keyed by the
/// key, one member pays one budget whatever names it claims; the total
/// budget bounds what rotating keyless names buy.
fn member_of(target: &ControlEndpoint) -> RouteMember {
    match target.key() {
        Some(key) => RouteMember::Key(*key),
        None => RouteMember::Endpoint(target.clone()),
    }
}

/// A route budget's owner ([`member_of`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(in crate::machine::peer) enum RouteMember {
    /// A member by the static key its session proved.
    Key(MemberKey),
    /// A keyless session by the endpoint it claimed.
    Endpoint(ControlEndpoint),
}

#[cfg(test)]
mod tests {
    use super::{RouteMember, member_of};
    use kvcr_contracts::{ControlEndpoint, MemberKey};

    /// One key pays one budget under every name it claims; keyless
    /// sessions are told apart by the names they claim.
    #[test]
    fn a_member_is_its_key_whatever_name_it_claims() {
        let key = MemberKey::from_bytes([7; 32]).unwrap();
        let named = |port: u16, key: Option<MemberKey>| {
            let endpoint = ControlEndpoint::parse(&format!("tcp://127.0.0.1:{port}")).unwrap();
            endpoint.with_key(key)
        };
        assert_eq!(member_of(&named(1000, Some(key))), RouteMember::Key(key));
        assert_eq!(
            member_of(&named(1000, Some(key))),
            member_of(&named(2000, Some(key)))
        );
        assert_ne!(member_of(&named(1000, None)), member_of(&named(2000, None)));
        let other = MemberKey::from_bytes([8; 32]).unwrap();
        assert_ne!(
            member_of(&named(1000, Some(key))),
            member_of(&named(1000, Some(other)))
        );
    }
}
