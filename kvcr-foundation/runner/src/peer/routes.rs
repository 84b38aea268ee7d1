//! Routes to our targets (as their source): how a write reaches each one,
//! built from the metadata a target sent. A target on this host whose
//! pools we can map gets a one-copy route (no UCX endpoint at all); any
//! other gets a UCX endpoint and remote keys, unless this process is short
//! of memory mappings. A route leaving the table is retired.

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::protocol::{DoorbellAdvert, RegionId, SharedMemoryAdvert};
use kvcr_runner_core::ConnectFailure;
use kvcr_ucx::{CloseMode, Endpoint, RemoteKey, RkeyBuffer, WorkerAddress};

use super::State;
use crate::error::Result;
use crate::net::doorbell::RouteMailbox;
use crate::shared::Shared;
use crate::wire::doorbell::RouteDoorbell;
use crate::wire::record::RecordKey;
use crate::wire::region;
use kvcr_sys::placement;
use kvcr_sys::segment::PeerSegment;

/// A target's remote keys and region bases, by region.
pub(super) type RemoteKeys = HashMap<RegionId, (RemoteKey, u64)>;

/// How writes reach one target, and what they ring and read there.
pub(super) struct Route {
    pub(super) generation: u64,
    /// How writes reach the target: copies into its mapped pools on the
    /// lanes, or UCX puts.
    pub(super) path: RoutePath,
    /// Where a write's completion is rung ahead of its `write_done` (a
    /// one-copy route to a target that advertised a doorbell).
    pub(super) doorbell: Option<RouteDoorbell>,
    /// The session's record key, on a UCX route to a target that sent one,
    /// and its bytes: small writes leave as messages sealed with it, and a
    /// data stream the target dials proves it (and is bound to those bytes).
    pub(super) session_key: Option<(RecordKey, [u8; 32])>,
    /// Our mailbox in the target's doorbell file (a one-copy route), and the
    /// id of the session (the target's, to us) whose metadata sent its key:
    /// requests read there are that session's messages.
    pub(super) mailbox: Option<(RouteMailbox, u64)>,
    /// The target's device regions this route opened (the one-hop route;
    /// empty: none offered, or not all could be opened).
    pub(super) device: Arc<super::one_hop::DeviceRoutes>,
}

/// The way a route's bytes travel.
pub(super) enum RoutePath {
    /// Every advertised region is mapped here: no UCX endpoint is ever made
    /// (no wire-up, no transport resources, nothing UCX parses).
    OneCopy(HashMap<RegionId, Arc<PeerSegment>>),
    /// The target's UCX endpoint and remote keys.
    Ucx {
        endpoint: Endpoint,
        rkeys: RemoteKeys,
    },
}

impl Route {
    /// Whether writes are copies into the target's mapped pools.
    pub(super) fn one_copy(&self) -> bool {
        matches!(self.path, RoutePath::OneCopy(_))
    }

    /// The target's UCX endpoint (`None` on a one-copy route).
    pub(super) fn ucx_endpoint(&self) -> Option<&Endpoint> {
        match &self.path {
            RoutePath::Ucx { endpoint, .. } => Some(endpoint),
            RoutePath::OneCopy(_) => None,
        }
    }
}

impl State {
    /// A route for `peer` over `path`, as its metadata (`generation`,
    /// `doorbell`, `rkeys`, `extents`) describes it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new_route(
        &mut self,
        peer: &ControlEndpoint,
        generation: u64,
        path: RoutePath,
        doorbell: Option<&DoorbellAdvert>,
        rkeys: &[(RegionId, u64, Vec<u8>)],
        extents: &[(RegionId, u64)],
        device: super::one_hop::DeviceRoutes,
    ) -> Rc<Route> {
        let doorbell_key = doorbell.map(|advert| advert.key);
        let session_key = match (&path, doorbell) {
            (RoutePath::Ucx { .. }, Some(advert)) => {
                Some((RecordKey::new(&advert.key), advert.key))
            }
            _ => None,
        };
        // Only a route that maps the target rings it (a record
        // put over UCX saved nothing: see `crate::wire`).
        let advertised = self.advertised_keys.remove(peer);
        let doorbell = doorbell
            .and_then(|advert| RouteDoorbell::new(advert, rkeys, extents))
            .filter(|d| match &path {
                RoutePath::OneCopy(segments) => segments.contains_key(&d.region),
                RoutePath::Ucx { .. } => false,
            });
        // Read as the session whose metadata carried this key.
        let mailbox = match (&path, &doorbell, &doorbell_key, advertised) {
            (RoutePath::OneCopy(segments), Some(ring), Some(key), Some((advertised, session)))
                if *key == advertised =>
            {
                segments
                    .get(&ring.region)
                    .and_then(|slots| ring.mailbox(Arc::clone(slots)))
                    .map(|mailbox| (mailbox, session))
            }
            _ => None,
        };
        Rc::new(Route {
            generation,
            path,
            doorbell,
            session_key,
            mailbox,
            device: Arc::new(device),
        })
    }

    /// `route` (of `generation`) is `peer`'s now: the one it replaces
    /// retires, the core hears of it, and a data stream parked for it is
    /// checked.
    pub(super) fn route_built(
        &mut self,
        shared: &Arc<Shared>,
        peer: ControlEndpoint,
        generation: u64,
        route: Rc<Route>,
    ) {
        let one_copy = route.one_copy();
        let device = !route.device.is_empty();
        retire(self.routes.insert(peer.clone(), route));
        shared.with_core_now(|core, _| {
            core.handle_connected_one_hop(&peer, generation, one_copy, device);
        });
        // A stream dialed beside this route's metadata is checked
        // now; a one-copy route needs none (dropped, not refused).
        if let Some((_, parked)) = self.parked_streams.remove(&peer)
            && !one_copy
        {
            self.bind_out_stream(shared, parked);
        }
    }

    /// No route to `peer` for this metadata (`generation`): `why`.
    pub(super) fn route_failed(
        &mut self,
        shared: &Arc<Shared>,
        peer: &ControlEndpoint,
        generation: u64,
        why: ConnectFailure,
    ) {
        // Nothing is kept for metadata UCX refused, or for a UCX
        // route this process has no mappings to spare for.
        retire(self.routes.remove(peer));
        shared.with_core_now(|core, _| {
            core.handle_connect_failed(peer, generation, why);
        });
        self.refuse_parked(peer);
    }

    /// Maps the shared segments a target advertised, when it runs on this
    /// host in this pid namespace; a segment that fails any check is left
    /// out (its region is then written through UCX, like every region of
    /// that route).
    fn map_segments(
        &self,
        advert: Option<&SharedMemoryAdvert>,
        rkeys: &[(RegionId, u64, Vec<u8>)],
        extents: &[(RegionId, u64)],
    ) -> HashMap<RegionId, Arc<PeerSegment>> {
        let mut mapped = HashMap::new();
        let Some(advert) = advert.filter(|a| self.scope.is_some_and(|s| s.matches(a))) else {
            return mapped;
        };
        for segment in &advert.segments {
            // Never our own pools: a member that learned our advert (as our
            // source) could otherwise have us overwrite our own pages.
            if self.own_tokens.contains(&segment.token) {
                continue;
            }
            let Some((_, base, _)) = rkeys.iter().find(|(r, _, _)| *r == segment.region) else {
                continue;
            };
            let Some((_, extent)) = extents.iter().find(|(r, _)| *r == segment.region) else {
                continue;
            };
            if let Ok(view) = PeerSegment::open(advert, segment, *base, *extent) {
                mapped.insert(segment.region, Arc::new(view));
            }
        }
        mapped
    }

    /// How writes will reach a target: its pools mapped here when every
    /// advertised region can be (then UCX is never touched), else a UCX
    /// endpoint and its remote keys, unless it would attach this host's
    /// shared memory while this process holds `ucx_route_mapping_limit`
    /// mappings or more (UCX keeps those until the worker goes, see
    /// [`kvcr_runner_core::RouteBudget`]).
    pub(super) fn route_path(
        &self,
        worker_address: &[u8],
        rkeys: &[(RegionId, u64, Vec<u8>)],
        shared_memory: Option<&SharedMemoryAdvert>,
        extents: &[(RegionId, u64)],
        doorbell: Option<&DoorbellAdvert>,
    ) -> std::result::Result<RoutePath, ConnectFailure> {
        let segments = self.map_segments(shared_memory, rkeys, extents);
        let all_mapped =
            !rkeys.is_empty() && rkeys.iter().all(|(r, _, _)| segments.contains_key(r));
        // The pools are the advertiser's only if its doorbell file holds
        // the owner tag for us under the key this advert carries; anything
        // else (a member replaying another runner's advert) goes through
        // UCX, where the worker must prove itself too.
        if all_mapped && !self.owned_by_advertiser(&segments, rkeys, doorbell) {
            self.control
                .stats
                .route_proofs_refused
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        } else if all_mapped {
            // First writes into a fresh part of the target's pool then find
            // it populated (it cost a first 256 KiB restore into a fresh
            // 2 MiB 1.2–1.7 ms on the H200 host).
            for segment in segments.values() {
                segment.populate_in_background();
            }
            return Ok(RoutePath::OneCopy(segments));
        }
        // Only a route that attaches this host's shared memory maps
        // anything UCX keeps (a route to another host maps nothing, and is
        // never refused for what churn left behind). Read once per such
        // route (rate-limited by the core); an unreadable map counts as
        // none; an address that does not parse fails in `connect`.
        let attaches = WorkerAddress::from_bytes(worker_address)
            .is_ok_and(|address| self.worker.attaches_shared_memory(&address));
        if attaches && placement::mapping_count().unwrap_or(0) >= self.ucx_route_mapping_limit {
            return Err(ConnectFailure::NoMappingsLeft);
        }
        // What UCX refused is dropped here: the core counts it.
        let (endpoint, rkeys) = self
            .connect(worker_address, rkeys)
            .map_err(|_| ConnectFailure::Unusable)?;
        Ok(RoutePath::Ucx { endpoint, rkeys })
    }

    /// Whether the doorbell file among `segments` holds, in the mailbox of
    /// the advertised key, the owner tag naming us under that key: written
    /// by the file's owner on the session it advertised that key on to us.
    fn owned_by_advertiser(
        &self,
        segments: &HashMap<RegionId, Arc<PeerSegment>>,
        rkeys: &[(RegionId, u64, Vec<u8>)],
        doorbell: Option<&DoorbellAdvert>,
    ) -> bool {
        let Some(advert) = doorbell else {
            return false;
        };
        let (Some(slots), Some((_, base, _))) = (
            segments.get(&advert.region),
            rkeys.iter().find(|(r, _, _)| *r == advert.region),
        ) else {
            return false;
        };
        let mut record = [0u8; 8 + 32];
        let at = region::owner_offset(region::mailbox_of(&advert.key)) as u64;
        base.checked_add(at)
            .is_some_and(|remote| slots.read_record(remote, &mut record))
            && RecordKey::new(&advert.key).verify_owner_tag(&self.endpoint, &record[8..])
    }

    fn connect(
        &self,
        worker_address: &[u8],
        rkeys: &[(RegionId, u64, Vec<u8>)],
    ) -> Result<(Endpoint, RemoteKeys)> {
        // Every blob is checked before anything is created from it.
        let address = WorkerAddress::from_bytes(worker_address)?;
        let buffers = rkeys
            .iter()
            .map(|(region, base, rkey)| Ok((*region, *base, RkeyBuffer::from_bytes(rkey)?)))
            .collect::<Result<Vec<_>>>()?;
        // Its puts must reach the process its nonce reaches (`proofs`).
        let endpoint = self.worker.connect_bound(&address)?;
        let mut keys = HashMap::new();
        for (region, base, buffer) in &buffers {
            match endpoint.unpack_rkey(buffer) {
                Ok(key) => {
                    keys.insert(*region, (key, *base));
                }
                Err(e) => {
                    // Nothing was put through it: close without waiting on a
                    // peer that may never progress.
                    endpoint.set_close_mode(CloseMode::Detach);
                    return Err(e.into());
                }
            }
        }
        Ok((endpoint, keys))
    }
}

/// A route leaving the table (replaced, its session gone, forgotten): its
/// endpoint closes without waiting on the peer once the last write using it
/// has ended (each write flushed before it reported), so a target that stops
/// progressing cannot stall this thread for a flush-mode close per route
/// (over shared memory, where UCX 1.13 has no forced close, that was the
/// whole `DROP_WAIT`, a second per route a member churned).
pub(super) fn retire(route: Option<Rc<Route>>) {
    if let Some(endpoint) = route.as_deref().and_then(Route::ucx_endpoint) {
        endpoint.set_close_mode(CloseMode::Detach);
    }
}
