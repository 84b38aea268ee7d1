//! The peer thread's start: the UCX context and worker (transports from
//! the options), the pools (a guard's files, shared memfds a same-host
//! source may map, private or placed anonymous memory), the control
//! channel's listener, our doorbell, and the thread's [`State`].

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use tokio::sync::mpsc;

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::protocol::{RegionId, SegmentAdvert, SharedMemoryAdvert};
use kvcr_ucx::{Context, ContextConfig, ErrorMode, MessageLimits, Registration};

use super::messages::MAX_HELD_MESSAGES;
use super::puts::put_plan;
use super::{Adopted, PeerSetup, State};
use crate::config::{PeerOptions, control_bind_address};
use crate::copy::lanes::Lanes;
use crate::error::{Error, Result, RunnerReason};
use crate::net::doorbell::TargetDoorbell;
use crate::net::{ControlChannel, Inbound, PeerIdentity, StaticKey};
use crate::wire::record::SLOT_BYTES;
use crate::wire::region::REGION_BYTES;
use kvcr_sys::mapping::AnonMapping;
use kvcr_sys::memfd::{HostScope, SharedPool};
use kvcr_sys::owned::{SharedMemory, SharedOwner};
use kvcr_sys::placement::{self, PlacementOutcome, PoolMemory};
use kvcr_sys::{MemoryRegistry, RegisteredMemory};

impl State {
    /// Starts everything the thread owns; hands back what the runner needs
    /// to know of it.
    pub(super) async fn setup(
        options: &PeerOptions,
        incarnation: Incarnation,
        pool_bytes: &[u64],
        prefault: bool,
        pool_memory: &PoolMemory,
        adopted: Option<Adopted>,
        memory: Arc<MemoryRegistry>,
    ) -> Result<(Self, PeerSetup)> {
        let (mut adopted_pools, adopted_listener) = match adopted {
            Some(a) if a.pools.as_ref().is_none_or(|p| p.len() == pool_bytes.len()) => (
                a.pools.map(Vec::into_iter),
                Some((a.listener, a.member_key)),
            ),
            Some(_) => {
                return Err(Error::runner(RunnerReason::Config {
                    field: "guard grant",
                    why: "the grant's pool count differs from the configuration's",
                }));
            }
            None => (None, None),
        };
        let (config, over_tcp) = ucx_config(options);
        let context = Context::with_config(&config)?;
        let worker = context.create_worker()?;
        let scope = HostScope::current();
        let (pools, placements, segments, held_pools) = make_pools(
            PoolHomes {
                context: &context,
                memory: &memory,
            },
            options,
            pool_bytes,
            prefault,
            pool_memory,
            adopted_pools.as_mut(),
            scope,
        )?;
        let rkeys = pools
            .iter()
            .map(|p| p.pack_rkey().map(|r| r.as_bytes().to_vec()))
            .collect::<kvcr_ucx::Result<Vec<_>>>()?;
        let (endpoint, control, inbound) =
            start_control(options, adopted_listener, incarnation).await?;
        let endpoint_for_streams = endpoint.clone();
        let shared_memory = shared_memory_advert(scope, segments, pools.len());
        let mut own_tokens: Vec<[u8; 16]> = shared_memory
            .as_ref()
            .map(|a| a.segments.iter().map(|s| s.token).collect())
            .unwrap_or_default();
        let doorbell = make_doorbell(&context, shared_memory.as_ref(), &mut own_tokens)?;
        // Write messages, verified with the doorbell's session keys.
        worker.accept_messages(
            crate::wire::record::WRITE_MESSAGE,
            MessageLimits {
                max_header: SLOT_BYTES,
                max_data: usize::try_from(PeerOptions::WRITE_MESSAGE_LIMIT).unwrap_or(usize::MAX),
                max_held: MAX_HELD_MESSAGES,
            },
        )?;
        // Route proofs' nonces: a header, no data.
        worker.accept_messages(
            crate::wire::route_proof::ROUTE_PROOF,
            MessageLimits {
                max_header: crate::wire::route_proof::MAX_HEADER,
                max_data: 0,
                max_held: MAX_HELD_NONCES,
            },
        )?;
        let setup = PeerSetup {
            endpoint,
            bases: pools.iter().map(|p| p.as_ptr() as usize as u64).collect(),
            rkeys,
            worker_address: worker.address()?.as_bytes().to_vec(),
            placements,
            shared_memory,
        };
        let (put_split, max_in_flight) = put_plan(options, over_tcp);
        let efd = worker.watch_events();
        let lanes = Lanes::start(
            match options.lanes {
                0 => crate::copy::plan::default_lanes(),
                n => n,
            },
            Arc::clone(&memory),
        )
        .map_err(|_| Error::runner(RunnerReason::CopyEngineStopped))?
        .counting_in(Arc::clone(&control.stats.source_checks));
        let one_hop = super::one_hop::OneHopWriter::new(Arc::clone(&control.stats.one_hop_passes));
        let (lane_done_tx, lane_done) = mpsc::unbounded_channel();
        let (leads_landed_tx, leads_landed) = mpsc::unbounded_channel();
        let (device_checked_tx, device_checked) = mpsc::unbounded_channel();
        let (streams_dialed_tx, streams_dialed) = mpsc::unbounded_channel();
        Ok((
            Self {
                efd,
                pending: Vec::new(),
                out_streams: HashMap::new(),
                parked_streams: HashMap::new(),
                in_streams: HashMap::new(),
                dialing: HashSet::new(),
                advertised_keys: HashMap::new(),
                streams_dialed_tx,
                streams_dialed,
                request_mailbox: options.request_mailbox,
                data_stream: options.data_stream.enabled(
                    options
                        .ucx_tls
                        .clone()
                        .or_else(|| std::env::var("UCX_TLS").ok())
                        .as_deref(),
                ),
                seal_streams: options.stream_sealing.sealed(options.secret.is_some()),
                landing_check: options.landing_check,
                checked_in_copy: HashSet::new(),
                device_landings: Vec::new(),
                device_check: super::device_check::DeviceChecker::new(device_checked_tx),
                device_checked,
                endpoint: endpoint_for_streams,
                stream_limits: (
                    options.limits.handshake_timeout,
                    options.limits.frame_deadline,
                ),
                routes: HashMap::new(),
                unproven: HashMap::new(),
                held_nonces: Vec::new(),
                advert_sessions: HashMap::new(),
                incarnation,
                control,
                inbound,
                lanes,
                one_hop,
                lane_done_tx,
                lane_done,
                leads_landed_tx,
                leads_landed,
                scope,
                own_tokens,
                doorbell,
                rings: HashMap::new(),
                pools,
                _held_pools: held_pools,
                memory,
                worker,
                _context: context,
                max_in_flight,
                put_split,
                write_message_max_bytes: options.write_message_max_bytes,
                write_message_part_bytes: match options.write_message_part_bytes {
                    0 => PeerOptions::DEFAULT_WRITE_MESSAGE_PART_BYTES,
                    bytes => bytes.min(PeerOptions::WRITE_MESSAGE_LIMIT),
                },
                messages_dropped: 0,
                unarmable_since: None,
                ucx_route_mapping_limit: match options.ucx_route_mapping_limit {
                    // 65,530 is the kernel's default.
                    0 => placement::max_map_count().unwrap_or(65_530) / 2,
                    limit => limit,
                },
            },
            setup,
        ))
    }
}

/// Most route-proof nonces the worker holds between a progress and their
/// handling (each is answered or dropped at once).
const MAX_HELD_NONCES: usize = 64;

/// The UCX context's configuration from the options (transports, error
/// mode, tcp tuning), and whether the transports include tcp.
fn ucx_config(options: &PeerOptions) -> (ContextConfig, bool) {
    let mut config = ContextConfig::new();
    if options.ucx_tls.is_none() && std::env::var_os("UCX_TLS").is_none() {
        config = config.set(
            "TLS",
            &default_tls(|dev| std::path::Path::new(dev).exists()),
        );
    }
    if let Some(tls) = &options.ucx_tls {
        // A runner that advertises loopback keeps tcp on loopback; one
        // that peers dial over a network must not (it did: every
        // cross-host tcp route failed "Destination is unreachable",
        // found by the between-hosts scenarios). `UCX_NET_DEVICES` in
        // the environment wins either way.
        let on_loopback =
            pins_tcp_to_loopback(options, std::env::var_os("UCX_NET_DEVICES").is_some());
        config = if on_loopback {
            config.loopback_tls(tls)
        } else {
            config.set("TLS", tls)
        };
        // UCX reports dead peers only on network transports; its 1.13
        // shared-memory transports refuse endpoints in that mode.
        if tls.split(',').any(|t| t.trim() == "tcp") {
            config = config.error_mode(ErrorMode::Peer);
        }
    }
    let over_tcp = options
        .ucx_tls
        .as_deref()
        .is_none_or(|t| t.split(',').any(|t| t.trim() == "tcp"));
    if over_tcp {
        config = config.tuned_tcp_segments();
    }
    (config, over_tcp)
}

/// The transports UCX may choose when nothing names them: every one but
/// those that write into another process by a name of their own (cma, and
/// knem and xpmem where their devices exist; naming an absent one makes UCX
/// warn). Same-host writes go through the pools a target's memfds map
/// (kernel-checked, see `routes`); a route through UCX then writes only
/// into the process its nonce reached. `exists` says whether a device file
/// is there.
fn default_tls(exists: impl Fn(&str) -> bool) -> String {
    let mut excluded = vec!["cma"];
    for (transport, device) in [("knem", "/dev/knem"), ("xpmem", "/dev/xpmem")] {
        if exists(device) {
            excluded.push(transport);
        }
    }
    format!("^{}", excluded.join(","))
}

/// Registered pools, what placing each did, and the segments a same-host
/// source may map.
type MadePools = (
    Vec<Registration<'static>>,
    Vec<Option<PlacementOutcome>>,
    Vec<SegmentAdvert>,
    Vec<RegisteredMemory>,
);

/// Where a pool is registered: with UCX (its context) and for copies.
#[derive(Clone, Copy)]
struct PoolHomes<'a> {
    context: &'a Context,
    memory: &'a Arc<MemoryRegistry>,
}

/// The pools, registered with `context`, one per entry of `pool_bytes`: a
/// guard's files first (`adopted_pools`), else as `pool_memory` says
/// (sealed memfds a same-host source may map, when `scope` allows it);
/// with what placing each did, and the segments a same-host source may map.
/// Each pool is held by `memory` too (copies go through it), so it is freed
/// once both the registration and the returned handle let go.
fn make_pools(
    homes: PoolHomes<'_>,
    options: &PeerOptions,
    pool_bytes: &[u64],
    prefault: bool,
    pool_memory: &PoolMemory,
    mut adopted_pools: Option<&mut std::vec::IntoIter<(std::fs::File, [u8; 16])>>,
    scope: Option<HostScope>,
) -> Result<MadePools> {
    let mut pools = Vec::with_capacity(pool_bytes.len());
    let mut placements = Vec::with_capacity(pool_bytes.len());
    let mut segments = Vec::new();
    let mut held = Vec::with_capacity(pool_bytes.len());
    let mut register = |pool: SharedOwner| -> Result<Registration<'static>> {
        held.push(homes.memory.hold(Arc::clone(&pool))?);
        Ok(homes
            .context
            .register_owned(Box::new(SharedMemory::new(pool)))?)
    };
    for bytes in pool_bytes {
        if let Some((file, token)) = adopted_pools.as_mut().and_then(Iterator::next) {
            // A guard's file: mapped with its bytes kept; advertised for
            // one-copy writes as our own pools are.
            let pool = SharedPool::adopt(file, token, *bytes, prefault)?;
            if options.same_host_mapping && scope.is_some() {
                segments.push(pool.advert(RegionId(pools.len() as u32)));
            }
            pools.push(register(Arc::new(pool))?);
            placements.push(None);
            continue;
        }
        match pool_memory {
            PoolMemory::Default if options.same_host_mapping && scope.is_some() => {
                let pool = SharedPool::create(*bytes, prefault)?;
                segments.push(pool.advert(RegionId(pools.len() as u32)));
                pools.push(register(Arc::new(pool))?);
                placements.push(None);
            }
            PoolMemory::Default => {
                // A plain private mapping, touched page by page with
                // `prefault` (what UCX's own anonymous registration made).
                let (mapping, _) = AnonMapping::new(*bytes, &Default::default(), prefault)?;
                pools.push(register(Arc::new(mapping))?);
                placements.push(None);
            }
            PoolMemory::Anonymous(anon) => {
                let (mapping, outcome) = AnonMapping::new(*bytes, anon, prefault)?;
                pools.push(register(Arc::new(mapping))?);
                placements.push(Some(outcome));
            }
        }
    }
    Ok((pools, placements, segments, held))
}

/// The control channel on the guard's listener (`adopted`, with the
/// group's member key) or a new one, our endpoint on it, and the channel's
/// inbound queue.
async fn start_control(
    options: &PeerOptions,
    adopted: Option<(std::net::TcpListener, StaticKey)>,
    incarnation: Incarnation,
) -> Result<(
    ControlEndpoint,
    ControlChannel,
    mpsc::UnboundedReceiver<Inbound>,
)> {
    // Our member key: the advertised endpoint names it, so whoever is told
    // where we are is told who must answer there. A guarded runner proves
    // its group's key, which the guard keeps across its restarts.
    let (bound, static_key) = match (adopted, &options.static_key) {
        (Some(_), Some(_)) => {
            return Err(Error::runner(RunnerReason::Config {
                field: "peer.static_key",
                why: "a guarded runner proves its group's member key, kept by the guard",
            }));
        }
        // The guard's listener: peers keep dialling the same address.
        (Some((listener, key)), None) => (ControlChannel::adopt(listener), key),
        (None, given) => (
            ControlChannel::bind(control_bind_address(options)?).await,
            match given {
                Some(key) => key.clone(),
                None => StaticKey::generate()?,
            },
        ),
    };
    let (listener, local) = bound.map_err(|_| {
        Error::runner(RunnerReason::Config {
            field: "peer.bind",
            why: "could not bind the control listener",
        })
    })?;
    let endpoint = ControlEndpoint::new(options.advertise_host.clone(), local.port())?
        .with_key(Some(static_key.public()));
    endpoint.check_advertisable(options.advertise_policy)?;
    let (control, inbound) = ControlChannel::start(
        listener,
        PeerIdentity {
            endpoint: endpoint.clone(),
            incarnation,
        },
        options.secret.as_deref(),
        options.limits,
        (static_key, options.keyless_sources),
    );
    Ok((endpoint, control, inbound))
}

/// The pools a same-host source may map, when every pool is a segment.
fn shared_memory_advert(
    scope: Option<HostScope>,
    segments: Vec<SegmentAdvert>,
    pools: usize,
) -> Option<SharedMemoryAdvert> {
    // Pool i is region i; advertised only when every pool is a segment
    // (a source then writes with one copy or not at all through them).
    match scope {
        Some(scope) if !segments.is_empty() && segments.len() == pools => {
            Some(SharedMemoryAdvert {
                boot_id: scope.boot_id,
                pid_namespace: scope.pid_namespace,
                pid: std::process::id(),
                segments,
            })
        }
        _ => None,
    }
}

/// Our doorbell, registered with `context`; its file's token joins
/// `own_tokens` when it is shared.
fn make_doorbell(
    context: &Context,
    shared_memory: Option<&SharedMemoryAdvert>,
    own_tokens: &mut Vec<[u8; 16]>,
) -> Result<TargetDoorbell> {
    // The doorbell: a shared file beside shared pools (a same-host
    // source maps it with them); plain registered memory when the pools
    // are not shared (then it is there for its per-session key, which
    // seals write messages).
    let doorbell = match shared_memory {
        Some(_) => {
            let file = SharedPool::create(REGION_BYTES as u64, true)?;
            let segment = file.advert(crate::wire::region::REGION);
            own_tokens.push(segment.token);
            let slots = context.register_owned(Box::new(file))?;
            let rkey = slots.pack_rkey()?.as_bytes().to_vec();
            TargetDoorbell::new(slots, rkey, Some(segment))
        }
        None => {
            let slots = context.register_vec(vec![0; REGION_BYTES])?;
            let rkey = slots.pack_rkey()?.as_bytes().to_vec();
            TargetDoorbell::new(slots, rkey, None)
        }
    };
    Ok(doorbell)
}

/// Whether UCX's tcp transport is kept on the loopback device: only for a
/// runner whose peers dial it on loopback, and only when the environment
/// names no devices itself.
fn pins_tcp_to_loopback(options: &PeerOptions, env_names_devices: bool) -> bool {
    options.advertise_host.is_loopback() && !env_names_devices
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvcr_contracts::endpoint::Host;

    /// A runner that peers dial over a network must not have its tcp
    /// transport pinned to loopback (every cross-host tcp route failed so).
    #[rstest::rstest]
    #[case::loopback(
        Host::Ip(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)),
        false,
        true
    )]
    #[case::loopback_with_env_devices(
        Host::Ip(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)),
        true,
        false
    )]
    #[case::network_host(
        Host::Ip(std::net::IpAddr::V4(std::net::Ipv4Addr::new(10, 77, 0, 1))),
        false,
        false
    )]
    #[case::dns_name(Host::Name("node-7.cluster".into()), false, false)]
    fn tcp_stays_on_loopback_only_for_loopback_runners(
        #[case] host: Host,
        #[case] env_names_devices: bool,
        #[case] pinned: bool,
    ) {
        let mut options = PeerOptions::loopback();
        options.advertise_host = host;
        assert_eq!(pins_tcp_to_loopback(&options, env_names_devices), pinned);
    }

    /// Unconfigured, UCX may not choose a transport that writes into a
    /// process by its own naming; knem and xpmem are named only where their
    /// devices exist (UCX warns about an absent one).
    #[test]
    fn the_default_transports_exclude_cross_process_writes() {
        assert_eq!(default_tls(|_| false), "^cma");
        assert_eq!(default_tls(|_| true), "^cma,knem,xpmem");
        assert_eq!(default_tls(|d| d == "/dev/xpmem"), "^cma,xpmem");
    }
}
