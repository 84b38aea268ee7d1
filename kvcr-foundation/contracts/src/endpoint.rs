//! Rank-local control endpoints.
//!
//! Every rank-local runner listens on one `tcp://host:port` control endpoint.
//! This module owns the grammar and the policy around it:
//!
//! * [`ControlEndpoint`] is a *dialable* endpoint: `tcp://` scheme, host split
//!   from the port at the **last** colon, IPv6 bracketed, port in `1..=65535`,
//!   never a wildcard host, and optionally the member key that must answer
//!   there: `tcp://host:port?key=<64 hex digits>` (a [`MemberKey`]). A
//!   malformed endpoint is an error, never passed on verbatim.
//!
//!   **An endpoint with a key is an identity.** Equality, ordering and
//!   hashing cover the key: `tcp://h:1?key=A`, `tcp://h:1?key=B` and
//!   `tcp://h:1` are three different endpoints (a session keyed by one never
//!   stands for another). [`ControlEndpoint::names`] is the looser match a
//!   configured list uses: a listed endpoint without a key names every key at
//!   that address, one with a key names only that key.
//! * [`BindAddress`] is where a runner listens; wildcards are allowed there.
//! * [`AdvertisePolicy`] decides whether a host may be advertised to other hosts:
//!   loopback addresses, `localhost` and every `*.localhost` name are refused
//!   unless single-host mode is explicitly on. Engine-side validation and
//!   router-side publishing call the same function, so they cannot disagree.
//! * [`RankLayout`] and [`RankCoordinate`] give the per-DP port stride: a rank
//!   binds at `base + dp * stride + within_dp_offset` and dials only
//!   `source_port + within_dp_offset`, never adding its own DP rank (that would
//!   fetch another DP group's shard).
//! * [`WorkerEndpointMap`] is the all-or-nothing map from global DP rank to the
//!   endpoint of that rank's DP group; a missing rank means "no source".

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{EndpointReason, Error, RankReason, Result};
use crate::member::MemberKey;

const SCHEME: &str = "tcp://";
/// The one query parameter an endpoint takes.
const KEY_QUERY: &str = "key=";
/// Longest DNS name (RFC 1035).
const MAX_HOST_NAME: usize = 253;
/// Longest DNS label.
const MAX_LABEL: usize = 63;

/// A host that can be dialed: an IP literal or a DNS name, never a wildcard.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Host {
    /// An IP address (v4 or v6), not unspecified.
    Ip(IpAddr),
    /// A DNS name, lowercased, without a trailing dot.
    Name(String),
}

impl Host {
    /// Parses a dialable host as written *inside* an endpoint (IPv6 must be
    /// bracketed there) or in a configuration value (`::1` and `[::1]` both
    /// accepted), depending on `brackets`.
    fn parse(raw: &str, brackets: BracketRule) -> std::result::Result<Self, EndpointReason> {
        if raw.is_empty() {
            return Err(EndpointReason::EmptyHost);
        }
        if raw == "*" {
            return Err(EndpointReason::WildcardHost);
        }
        let ip = if let Some(inner) = raw.strip_prefix('[') {
            let inner = inner.strip_suffix(']').ok_or(EndpointReason::Brackets)?;
            Some(IpAddr::V6(
                Ipv6Addr::from_str(inner).map_err(|_| EndpointReason::Brackets)?,
            ))
        } else if raw.contains(':') {
            match brackets {
                BracketRule::Required => return Err(EndpointReason::Brackets),
                BracketRule::Optional => Some(IpAddr::V6(
                    Ipv6Addr::from_str(raw).map_err(|_| EndpointReason::Brackets)?,
                )),
            }
        } else if raw.contains(']') {
            return Err(EndpointReason::Brackets);
        } else if let Ok(v4) = Ipv4Addr::from_str(raw) {
            Some(IpAddr::V4(v4))
        } else {
            None
        };
        match ip {
            Some(ip) if ip.is_unspecified() => Err(EndpointReason::WildcardHost),
            Some(ip) => Ok(Self::Ip(ip)),
            None => Self::parse_name(raw),
        }
    }

    fn parse_name(raw: &str) -> std::result::Result<Self, EndpointReason> {
        let name = raw.strip_suffix('.').unwrap_or(raw);
        let labels_ok = !name.is_empty()
            && name.len() <= MAX_HOST_NAME
            && name.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= MAX_LABEL
                    && !label.starts_with('-')
                    && !label.ends_with('-')
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-')
            });
        // An all-numeric dotted name that is not a valid IPv4 literal
        // ("1.2.3.999") is a typo, not a host name.
        let numeric = name.bytes().all(|b| b.is_ascii_digit() || b == b'.');
        if !labels_ok || numeric {
            return Err(EndpointReason::HostName);
        }
        Ok(Self::Name(name.to_ascii_lowercase()))
    }

    /// Loopback in the sense of the advertise policy: `127.0.0.0/8`, `::1`,
    /// IPv4-mapped loopback, `localhost` and every `*.localhost` name.
    pub fn is_loopback(&self) -> bool {
        match self {
            Self::Ip(IpAddr::V4(v4)) => v4.is_loopback(),
            Self::Ip(IpAddr::V6(v6)) => {
                v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
            }
            Self::Name(name) => name == "localhost" || name.ends_with(".localhost"),
        }
    }
}

impl fmt::Display for Host {
    /// IPv6 is bracketed and compressed; names and IPv4 as they are.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ip(IpAddr::V6(v6)) => write!(f, "[{v6}]"),
            Self::Ip(IpAddr::V4(v4)) => write!(f, "{v4}"),
            Self::Name(name) => f.write_str(name),
        }
    }
}

#[derive(Clone, Copy)]
enum BracketRule {
    Required,
    Optional,
}

/// Parses the decimal port after the last colon: digits only, `1..=65535`.
fn parse_port(raw: &str) -> std::result::Result<u16, EndpointReason> {
    if raw.is_empty() || raw.len() > 5 || !raw.bytes().all(|b| b.is_ascii_digit()) {
        return Err(EndpointReason::Port);
    }
    match raw.parse::<u32>() {
        Ok(port @ 1..=65535) => u16::try_from(port).map_err(|_| EndpointReason::Port),
        _ => Err(EndpointReason::Port),
    }
}

/// A dialable `tcp://host:port` control endpoint, with the key of the member
/// that must answer there when it names one (`?key=`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ControlEndpoint {
    host: Host,
    port: u16,
    key: Option<MemberKey>,
}

impl ControlEndpoint {
    /// Builds an endpoint from a host and a non-zero port.
    pub fn new(host: Host, port: u16) -> Result<Self> {
        if port == 0 {
            return Err(Error::endpoint(
                &format!("{SCHEME}{host}:0"),
                EndpointReason::Port,
            ));
        }
        Ok(Self {
            host,
            port,
            key: None,
        })
    }

    /// Parses `tcp://host:port` or `tcp://host:port?key=<64 hex digits>`
    /// (see the module docs for the grammar).
    pub fn parse(input: &str) -> Result<Self> {
        let err = |reason| Error::endpoint(input, reason);
        let rest = input
            .strip_prefix(SCHEME)
            .ok_or(err(EndpointReason::Scheme))?;
        let (address, key) = match rest.split_once('?') {
            None => (rest, None),
            Some((address, query)) => {
                let key = query
                    .strip_prefix(KEY_QUERY)
                    .ok_or(err(EndpointReason::Query))?;
                (address, Some(MemberKey::parse_reason(key).map_err(err)?))
            }
        };
        let (host, port) = address
            .rsplit_once(':')
            .ok_or(err(EndpointReason::MissingPort))?;
        let port = parse_port(port).map_err(err)?;
        let host = Host::parse(host, BracketRule::Required).map_err(err)?;
        Ok(Self { host, port, key })
    }

    /// The key of the member that must answer here, when the endpoint names
    /// one.
    pub fn key(&self) -> Option<&MemberKey> {
        self.key.as_ref()
    }

    /// The same address naming `key` (or none).
    pub fn with_key(&self, key: Option<MemberKey>) -> Self {
        Self {
            host: self.host.clone(),
            port: self.port,
            key,
        }
    }

    /// Whether `other` is at the same host and port, whatever keys they name.
    pub fn same_address(&self, other: &Self) -> bool {
        self.host == other.host && self.port == other.port
    }

    /// Whether this endpoint, as a configured list entry, names `peer`: the
    /// same address, and the same key unless this entry names none.
    pub fn names(&self, peer: &Self) -> bool {
        self.same_address(peer) && self.key.is_none_or(|key| peer.key == Some(key))
    }

    /// The host.
    pub fn host(&self) -> &Host {
        &self.host
    }

    /// The port (never 0).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The same host with `offset` added to the port; refused past 65535.
    /// A non-zero offset names another runner, so its key is dropped (this
    /// endpoint's key is not that runner's); offset 0 keeps it.
    pub fn with_port_offset(&self, offset: u64) -> Result<Self> {
        let port = u64::from(self.port)
            .checked_add(offset)
            .and_then(|p| u16::try_from(p).ok())
            .ok_or_else(|| Error::endpoint(&self.to_string(), EndpointReason::PortOverflow))?;
        Ok(Self {
            host: self.host.clone(),
            port,
            key: if offset == 0 { self.key } else { None },
        })
    }

    /// Checks that this endpoint may be advertised to other hosts.
    pub fn check_advertisable(&self, policy: AdvertisePolicy) -> Result<()> {
        policy
            .check(&self.host)
            .map_err(|reason| Error::endpoint(&self.to_string(), reason))
    }
}

impl fmt::Display for ControlEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{SCHEME}{}:{}", self.host, self.port)?;
        match &self.key {
            Some(key) => write!(f, "?{KEY_QUERY}{key}"),
            None => Ok(()),
        }
    }
}

impl FromStr for ControlEndpoint {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}

impl Serialize for ControlEndpoint {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ControlEndpoint {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// Whether loopback hosts may be advertised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum AdvertisePolicy {
    /// Peers live on other hosts: loopback hosts are refused (the default).
    #[default]
    CrossHost,
    /// Every runner is on this one host; loopback is what peers should dial.
    SingleHost,
}

impl AdvertisePolicy {
    fn check(self, host: &Host) -> std::result::Result<(), EndpointReason> {
        match self {
            Self::CrossHost if host.is_loopback() => Err(EndpointReason::LoopbackAdvertised),
            _ => Ok(()),
        }
    }

    /// Validates an advertise host as written in configuration (`10.0.0.5`,
    /// `::1`, `[fd00::1]`, `node7.cluster`) and returns it normalised.
    /// Wildcards and empty hosts are refused; loopback follows the policy.
    pub fn advertise_host(self, raw: &str) -> Result<Host> {
        let host = Host::parse(raw.trim(), BracketRule::Optional)
            .map_err(|reason| Error::endpoint(raw, reason))?;
        self.check(&host)
            .map_err(|reason| Error::endpoint(raw, reason))?;
        Ok(host)
    }
}

/// Where a runner listens: a host that may be a wildcard, and a port that may be
/// 0 (ephemeral) only when nothing needs to dial it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BindAddress {
    /// `None` is the wildcard (all interfaces).
    pub host: Option<IpAddr>,
    /// The port; 0 asks the OS for one.
    pub port: u16,
}

impl BindAddress {
    /// Parses `tcp://host:port` where host may be `*`, `0.0.0.0`, `[::]` or an
    /// IP literal, and port may be 0.
    pub fn parse(input: &str) -> Result<Self> {
        let err = |reason| Error::endpoint(input, reason);
        let rest = input
            .strip_prefix(SCHEME)
            .ok_or(err(EndpointReason::Scheme))?;
        let (host, port) = rest
            .rsplit_once(':')
            .ok_or(err(EndpointReason::MissingPort))?;
        let port = if port == "0" {
            0
        } else {
            parse_port(port).map_err(err)?
        };
        let host = match host {
            "*" | "0.0.0.0" | "[::]" => None,
            other => match Host::parse(other, BracketRule::Required) {
                Ok(Host::Ip(ip)) => Some(ip),
                Ok(Host::Name(_)) => return Err(err(EndpointReason::HostName)),
                Err(reason) => return Err(err(reason)),
            },
        };
        Ok(Self { host, port })
    }

    /// Whether this binds every interface.
    pub fn is_wildcard(&self) -> bool {
        self.host.is_none()
    }
}

impl fmt::Display for BindAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.host {
            None => write!(f, "{SCHEME}*:{}", self.port),
            Some(IpAddr::V6(v6)) => write!(f, "{SCHEME}[{v6}]:{}", self.port),
            Some(IpAddr::V4(v4)) => write!(f, "{SCHEME}{v4}:{}", self.port),
        }
    }
}

/// The shape of a worker's ranks: data parallel groups, each made of
/// `attn_cp_size * attn_tp_size` ranks (the per-DP port stride).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RankLayout {
    /// Number of data-parallel groups.
    pub dp_size: u32,
    /// Context-parallel ranks per DP group.
    pub attn_cp_size: u32,
    /// Attention tensor-parallel ranks per CP rank.
    pub attn_tp_size: u32,
}

impl RankLayout {
    /// Validates that every size is at least 1.
    pub fn new(dp_size: u32, attn_cp_size: u32, attn_tp_size: u32) -> Result<Self> {
        for (what, size) in [
            ("dp_size", dp_size),
            ("attn_cp_size", attn_cp_size),
            ("attn_tp_size", attn_tp_size),
        ] {
            if size == 0 {
                return Err(Error::rank(RankReason::ZeroSize(what)));
            }
        }
        Ok(Self {
            dp_size,
            attn_cp_size,
            attn_tp_size,
        })
    }

    /// Ports per DP group: `attn_cp_size * attn_tp_size`.
    pub fn stride(&self) -> u64 {
        u64::from(self.attn_cp_size) * u64::from(self.attn_tp_size)
    }

    /// Validates a coordinate against this layout.
    pub fn coordinate(&self, dp: u32, cp: u32, tp: u32) -> Result<RankCoordinate> {
        for (what, rank, size) in [
            ("dp", dp, self.dp_size),
            ("attn_cp", cp, self.attn_cp_size),
            ("attn_tp", tp, self.attn_tp_size),
        ] {
            if rank >= size {
                return Err(Error::rank(RankReason::RankOutOfRange { what, rank, size }));
            }
        }
        Ok(RankCoordinate {
            layout: *self,
            dp,
            cp,
            tp,
        })
    }
}

/// A validated rank position inside a [`RankLayout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RankCoordinate {
    layout: RankLayout,
    dp: u32,
    cp: u32,
    tp: u32,
}

impl RankCoordinate {
    /// The data-parallel rank.
    pub fn dp(&self) -> u32 {
        self.dp
    }

    /// The offset inside the DP group: `cp * attn_tp_size + tp`.
    pub fn within_dp_offset(&self) -> u64 {
        u64::from(self.cp) * u64::from(self.layout.attn_tp_size) + u64::from(self.tp)
    }

    /// The full offset: `dp * stride + within_dp_offset`.
    pub fn global_offset(&self) -> u64 {
        u64::from(self.dp) * self.layout.stride() + self.within_dp_offset()
    }

    /// The port this rank binds: `base + global_offset`.
    pub fn bind_port(&self, base: u16) -> Result<u16> {
        offset_port(base, self.global_offset())
    }

    /// The endpoint this rank dials on a source whose DP group the router
    /// resolved to `source`: only the within-DP offset is added.
    pub fn dial(&self, source: &ControlEndpoint) -> Result<ControlEndpoint> {
        source.with_port_offset(self.within_dp_offset())
    }
}

fn offset_port(base: u16, offset: u64) -> Result<u16> {
    u64::from(base)
        .checked_add(offset)
        .and_then(|p| u16::try_from(p).ok())
        .ok_or(Error::rank(RankReason::PortOverflow { base, offset }))
}

/// A worker's control endpoints, one per global DP rank it serves.
///
/// Built all-or-nothing: if any rank's endpoint is undialable the whole map is
/// refused, so a router never routes to half a worker. Lookups of a rank that is
/// not present return `None` ("no source"), never panic.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WorkerEndpointMap {
    by_dp_rank: BTreeMap<u32, ControlEndpoint>,
}

impl WorkerEndpointMap {
    /// Endpoints for global DP ranks `dp_start..dp_end`: rank `r` is at
    /// `base + (r - dp_start) * stride` on `host`.
    pub fn for_dp_range(
        host: &Host,
        base_port: u16,
        dp_start: u32,
        dp_end: u32,
        stride: u64,
    ) -> Result<Self> {
        if dp_end <= dp_start {
            return Err(Error::rank(RankReason::EmptyDpRange {
                start: dp_start,
                end: dp_end,
            }));
        }
        if stride == 0 {
            return Err(Error::rank(RankReason::ZeroSize("stride")));
        }
        let mut by_dp_rank = BTreeMap::new();
        for dp in dp_start..dp_end {
            let offset = u64::from(dp - dp_start) * stride;
            let port = offset_port(base_port, offset)?;
            let endpoint = ControlEndpoint::new(host.clone(), port).map_err(|e| {
                Error::rank(RankReason::MapEntry {
                    dp_rank: dp,
                    source: Box::new(e),
                })
            })?;
            by_dp_rank.insert(dp, endpoint);
        }
        Ok(Self { by_dp_rank })
    }

    /// Parses the published JSON form `{"<dp rank>": "tcp://host:port", ...}`.
    /// Any bad key or endpoint refuses the whole map; endpoints must also pass
    /// the advertise policy.
    pub fn from_json(text: &str, policy: AdvertisePolicy) -> Result<Self> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|_| Error::rank(RankReason::MapShape))?;
        let object = value.as_object().ok_or(Error::rank(RankReason::MapShape))?;
        let mut by_dp_rank = BTreeMap::new();
        for (key, entry) in object {
            let dp_rank = parse_dp_key(key)?;
            let text = entry.as_str().ok_or(Error::rank(RankReason::MapShape))?;
            let endpoint = ControlEndpoint::parse(text)
                .and_then(|ep| ep.check_advertisable(policy).map(|()| ep))
                .map_err(|e| {
                    Error::rank(RankReason::MapEntry {
                        dp_rank,
                        source: Box::new(e),
                    })
                })?;
            by_dp_rank.insert(dp_rank, endpoint);
        }
        Ok(Self { by_dp_rank })
    }

    /// The JSON form, keys in ascending rank order.
    pub fn to_json(&self) -> String {
        let object: serde_json::Map<String, serde_json::Value> = self
            .by_dp_rank
            .iter()
            .map(|(dp, ep)| (dp.to_string(), serde_json::Value::String(ep.to_string())))
            .collect();
        serde_json::Value::Object(object).to_string()
    }

    /// Names `key` on the endpoint of global DP rank `dp` (a rank whose
    /// runner's key is known, e.g. the registering rank's own); a rank not
    /// in the map is left out.
    pub fn with_member_key(mut self, dp: u32, key: MemberKey) -> Self {
        if let Some(endpoint) = self.by_dp_rank.get_mut(&dp) {
            endpoint.key = Some(key);
        }
        self
    }

    /// The endpoint serving global DP rank `dp`, or `None` (source ineligible).
    pub fn get(&self, dp: u32) -> Option<&ControlEndpoint> {
        self.by_dp_rank.get(&dp)
    }

    /// Checks every endpoint against the advertise policy.
    pub fn check_advertisable(&self, policy: AdvertisePolicy) -> Result<()> {
        self.by_dp_rank
            .values()
            .try_for_each(|ep| ep.check_advertisable(policy))
    }

    /// Number of ranks.
    pub fn len(&self) -> usize {
        self.by_dp_rank.len()
    }

    /// Whether there are no ranks.
    pub fn is_empty(&self) -> bool {
        self.by_dp_rank.is_empty()
    }

    /// Ranks and endpoints in ascending rank order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &ControlEndpoint)> {
        self.by_dp_rank.iter().map(|(dp, ep)| (*dp, ep))
    }
}

fn parse_dp_key(key: &str) -> Result<u32> {
    let canonical = !key.is_empty()
        && key.bytes().all(|b| b.is_ascii_digit())
        && (key == "0" || !key.starts_with('0'));
    canonical
        .then(|| key.parse::<u32>().ok())
        .flatten()
        .ok_or_else(|| Error::rank(RankReason::MapKey(crate::error::Echo::new(key))))
}
