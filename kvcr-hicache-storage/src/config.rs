//! Configuration: the engine's storage configuration ([`StorageConfig`], what
//! SGLang's `HiCacheStorageConfig` carries) and this backend's own settings
//! ([`BackendConfig`], parsed from the engine's extra-config JSON).
//!
//! Parsing is strict: an unknown key is refused with the key named, every
//! value is type-checked with its key named, and every bound is checked
//! (notably the get timeout must exceed the operation timeout: a restore the
//! engine stops waiting for must already have failed inside the runner, or its
//! copy could land in host pages the engine has reused).

use std::ffi::OsString;
use std::io::Read;
use std::time::Duration;

use kvcr_foundation::hint::WorkerType;
use kvcr_foundation::runner::{DataStream, KeylessSources};
use kvcr_foundation::{AdvertisePolicy, BindAddress, Host, Medium, RankCoordinate, RankLayout};
use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// What the engine tells every storage backend about the rank it runs on
/// (SGLang's `HiCacheStorageConfig`).
///
/// Its `Debug` output shows `extra_config` with the `cluster_secret` value
/// redacted.
#[derive(Clone, PartialEq)]
pub struct StorageConfig {
    /// Attention tensor-parallel rank (attention-scoped when attention DP is on).
    pub tp_rank: u32,
    /// Attention tensor-parallel size.
    pub tp_size: u32,
    /// Pipeline rank.
    pub pp_rank: u32,
    /// Pipeline size (must be 1).
    pub pp_size: u32,
    /// Attention context-parallel rank.
    pub attn_cp_rank: u32,
    /// Attention context-parallel size.
    pub attn_cp_size: u32,
    /// Attention data-parallel rank (0 without attention DP).
    pub dp_rank: u32,
    /// Attention data-parallel size (1 without attention DP).
    pub dp_size: u32,
    /// Rank-replicated KV (MLA and compressed models); refused for now.
    pub is_mla_model: bool,
    /// Heterogeneous-TP head splitting (`tp_lcm_size`); refused.
    pub should_split_heads: bool,
    /// The served model; part of every page's namespace.
    pub model_name: String,
    /// The backend's extra config (see [`BackendConfig`]).
    pub extra_config: Option<Value>,
}

impl std::fmt::Debug for StorageConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StorageConfig")
            .field("tp_rank", &self.tp_rank)
            .field("tp_size", &self.tp_size)
            .field("pp_rank", &self.pp_rank)
            .field("pp_size", &self.pp_size)
            .field("attn_cp_rank", &self.attn_cp_rank)
            .field("attn_cp_size", &self.attn_cp_size)
            .field("dp_rank", &self.dp_rank)
            .field("dp_size", &self.dp_size)
            .field("is_mla_model", &self.is_mla_model)
            .field("should_split_heads", &self.should_split_heads)
            .field("model_name", &self.model_name)
            .field(
                "extra_config",
                &self.extra_config.as_ref().map(redact_extra),
            )
            .finish()
    }
}

/// The extra-config key that holds the cluster secret inline.
const SECRET_KEY: &str = "cluster_secret";
/// The extra-config key that names a file holding the cluster secret.
const SECRET_FILE_KEY: &str = "cluster_secret_file";
/// What a redacted secret reads as.
const REDACTED: &str = "<redacted>";

/// An extra config (an object, or its JSON text) with the value of
/// `cluster_secret` replaced by `<redacted>`, for `Debug` output and for the
/// copy a backend keeps. Text that does not parse and mentions the key is
/// redacted whole.
pub(crate) fn redact_extra(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| {
                    let v = if k == SECRET_KEY && !v.is_null() {
                        Value::String(REDACTED.to_owned())
                    } else {
                        v.clone()
                    };
                    (k.clone(), v)
                })
                .collect(),
        ),
        Value::String(text) => match serde_json::from_str::<Value>(text.trim()) {
            Ok(parsed @ Value::Object(_)) => Value::String(redact_extra(&parsed).to_string()),
            _ if text.contains(SECRET_KEY) => Value::String(REDACTED.to_owned()),
            _ => value.clone(),
        },
        other => other.clone(),
    }
}

impl StorageConfig {
    /// A single-rank configuration (TP=1, no DP, no CP, no PP).
    pub fn single_rank(model_name: &str, extra_config: Value) -> Self {
        Self {
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            pp_size: 1,
            attn_cp_rank: 0,
            attn_cp_size: 1,
            dp_rank: 0,
            dp_size: 1,
            is_mla_model: false,
            should_split_heads: false,
            model_name: model_name.to_owned(),
            extra_config: Some(extra_config),
        }
    }

    /// This rank as one of `tp_size` tensor-parallel ranks.
    pub fn with_tp(mut self, tp_rank: u32, tp_size: u32) -> Self {
        self.tp_rank = tp_rank;
        self.tp_size = tp_size;
        self
    }

    /// From the engine's storage config as JSON (SGLang's
    /// `HiCacheStorageConfig` fields: `tp_rank`, `tp_size`, `pp_rank`,
    /// `pp_size`, `attn_cp_rank`, `attn_cp_size`, `dp_rank`, `dp_size`,
    /// `is_mla_model`, `should_split_heads`, `model_name`, `extra_config`).
    /// Missing sizes default to one rank; each present field is type-checked
    /// by name; the engine's other fields (metrics, layout flags) are not
    /// this backend's and are ignored.
    pub fn from_engine_json(value: &Value) -> Result<Self> {
        let map = value
            .as_object()
            .ok_or_else(|| Error::ConfigSyntax("storage config must be a JSON object".into()))?;
        let mut c = Self::single_rank("", Value::Null);
        c.extra_config = None;
        let rank = |key: &str, default: u32| -> Result<u32> {
            match map.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v
                    .as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| Error::config(key, "must be a non-negative 32-bit integer")),
            }
        };
        let flag = |key: &str| -> Result<bool> {
            match map.get(key) {
                None | Some(Value::Null) => Ok(false),
                Some(v) => v
                    .as_bool()
                    .ok_or_else(|| Error::config(key, "must be true or false")),
            }
        };
        c.tp_rank = rank("tp_rank", 0)?;
        c.tp_size = rank("tp_size", 1)?;
        c.pp_rank = rank("pp_rank", 0)?;
        c.pp_size = rank("pp_size", 1)?;
        c.attn_cp_rank = rank("attn_cp_rank", 0)?;
        c.attn_cp_size = rank("attn_cp_size", 1)?;
        c.dp_rank = rank("dp_rank", 0)?;
        c.dp_size = rank("dp_size", 1)?;
        c.is_mla_model = flag("is_mla_model")?;
        c.should_split_heads = flag("should_split_heads")?;
        c.model_name = match map.get("model_name") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Null) | None => String::new(),
            Some(_) => return Err(Error::config("model_name", "must be a string")),
        };
        c.extra_config = map.get("extra_config").filter(|v| !v.is_null()).cloned();
        Ok(c)
    }

    /// Refuses topologies this backend cannot serve correctly, naming them,
    /// and returns this rank's coordinate.
    pub(crate) fn validate(&self) -> Result<RankCoordinate> {
        if self.pp_size > 1 {
            return Err(Error::Unsupported(format!(
                "pipeline parallelism (pp_size = {}): page keys carry no pipeline stage",
                self.pp_size
            )));
        }
        if self.should_split_heads {
            return Err(Error::Unsupported(
                "heterogeneous TP (should_split_heads): page keys carry no head slice".into(),
            ));
        }
        if self.is_mla_model {
            return Err(Error::Unsupported(
                "rank-replicated KV (is_mla_model): only MHA host pools are served".into(),
            ));
        }
        if self.model_name.is_empty() {
            return Err(Error::config("model_name", "must not be empty"));
        }
        let layout = RankLayout::new(self.dp_size, self.attn_cp_size, self.tp_size)
            .map_err(|e| Error::config("tp_size", e.to_string()))?;
        layout
            .coordinate(self.dp_rank, self.attn_cp_rank, self.tp_rank)
            .map_err(|e| Error::config("tp_rank", e.to_string()))
    }
}

/// The eviction policy of KVCR DRAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictionPolicy {
    /// Least recently used (the default).
    Lru,
    /// First in, first out.
    Fifo,
}

/// This backend's settings, from the engine's extra-config JSON.
///
/// | key | default | meaning |
/// |---|---|---|
/// | `local_dram_bytes` | required | KVCR DRAM per rank |
/// | `operation_timeout_ms` | 20000 | budget of one runner operation |
/// | `get_timeout_s` | 30 | how long `batch_get`/`batch_set` wait; must exceed the operation timeout |
/// | `policy` | `"lru"` | `"lru"` or `"fifo"` |
/// | `enable_remote_hint` | false | serve and follow router hints (peer mode) |
/// | `control_host` | `"0.0.0.0"` | control-channel bind host |
/// | `control_port` | 0 | base port; this rank binds base + its global rank offset |
/// | `control_advertise_host` | none | host peers dial; required with remote hints |
/// | `single_host` | false | allow a loopback advertise host |
/// | `ucx_tls` | none | UCX transports (`UCX_TLS`) |
/// | `data_stream` | `"auto"` | whether this rank has its peer sources write over a data stream, kvcr's own TCP connection (`"auto"`: when the UCX transports are tcp alone; `"on"`; `"off"`) |
/// | `medium` | `"CPU"` | medium KVCR pages are published under: `CPU` (what KVCR DRAM is: pageable host memory), `CPU_PINNED` or `EXTERNAL` |
/// | `publish_inventory` | false | the DP owner rank publishes the group's KVCR inventory on the KV-event wire (ZMQ PUB + replay) |
/// | `kv_events_port` | 0 | base port of the KV-event sockets: DP rank `d` binds PUB at base + 2d and replay at base + 2d + 1 on `control_host` (0: ephemeral; the publisher binds beyond loopback here because `control_host` names where) |
/// | `kv_events_worker_id` | 0 | the worker id in the KV-event topic (`kvcr.w{id}.dp{d}.{incarnation}`) |
/// | `worker_type` | `"aggregated"` | `aggregated`, `prefill` or `decode`, for the router registration (`router_hint_worker_type`) |
/// | `g3_paths` | none | directories for the G3 file tier under KVCR DRAM (each of this user or root, writable by no other user): each rank keeps one file per directory, `kvcr-g3-r{global rank offset}.bin` (put them on different devices to stripe) |
/// | `g3_capacity_bytes` | none | bytes of each G3 file; required with `g3_paths` (a multiple of the page span, itself a multiple of the files' direct-I/O alignment) |
/// | `guard_socket` | none | the Unix socket of a `kvcr-guard` (in a directory of this user or root that no other user may write): KVCR DRAM, its residency journal and the control listener live in the guard (group: the rank's global offset) and a restarted engine takes its pages back warm; needs `enable_remote_hint` |
/// | `guard_journal_bytes` | 67108864 | bytes of each rank's residency journal (with `guard_socket`; half of it must hold a snapshot of every page, or warm recovery is disabled when it overflows) |
/// | `inventory_heartbeat_ms` | 1000 | a quiet KV-event stream sends an empty batch this often, so a late subscriber notices its gap and replays (10..=60000) |
/// | `prefault` | true | touch KVCR DRAM at startup |
/// | `max_hinted_requests` | 1024 | live request hint scopes kept per rank |
/// | `cluster_secret` | none | the peer control channel's cluster secret (a string, used byte for byte, at least 16 bytes) |
/// | `keyless_sources` | `"auto"` | whether this rank follows a hint whose source endpoint names no member key (`?key=`): `"refuse"`, `"allow"`, or `"auto"`: allowed when the worker has more than one rank (its registration names only the DP owner's own key, and a TP rank dials its shard's runner by address), else refused when a cluster secret is set |
/// | `cluster_secret_file` | none | path of a file whose contents, with surrounding ASCII whitespace trimmed, are the cluster secret (at least 16 bytes, a file of at most 64 KiB) |
///
/// The cluster secret: at most one of `cluster_secret` and
/// `cluster_secret_file` may be set (both is refused, as is an unreadable
/// file or a secret under [`ClusterSecret::MIN_BYTES`] bytes); when neither
/// is, the environment variable [`CLUSTER_SECRET_ENV`] (`KVCR_CLUSTER_SECRET`,
/// used byte for byte; empty counts as unset) is the fallback. The secret goes
/// to the runner's peer control channel (`PeerOptions::secret`); a runner
/// without one talks only to peers without one. It is never echoed: errors
/// name the key, not the value, and `Debug` shows `<redacted>`.
///
/// The engine's dynamic-loader keys (`backend_name`, `module_path`,
/// `class_name`, `interface_v1`) are accepted and ignored.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendConfig {
    /// KVCR DRAM per rank, bytes.
    pub local_dram_bytes: u64,
    /// Runner operation budget.
    pub operation_timeout: Duration,
    /// How long an entry point waits for its operation.
    pub get_timeout: Duration,
    /// Eviction policy.
    pub policy: EvictionPolicy,
    /// Peer mode: serve peers and follow router hints.
    pub enable_remote_hint: bool,
    /// Control-channel bind host (`0.0.0.0`, `::` or an address).
    pub control_host: String,
    /// Base control port (0: ephemeral, local-only configs).
    pub control_port: u16,
    /// Host peers dial.
    pub control_advertise_host: Option<String>,
    /// Allow loopback advertise hosts (single-host clusters).
    pub single_host: bool,
    /// UCX transports.
    pub ucx_tls: Option<String>,
    /// Whether peer sources write to this rank over a data stream.
    pub data_stream: DataStream,
    /// Whether hints naming a source without its member key are followed
    /// (`None`: "auto", see the table).
    pub keyless_sources: Option<KeylessSources>,
    /// Medium of published KVCR pages.
    pub medium: Medium,
    /// Pre-fault KVCR DRAM at startup.
    pub prefault: bool,
    /// Request hint scopes kept per rank (oldest discarded first).
    pub max_hinted_requests: usize,
    /// The peer control channel's cluster secret (redacted in `Debug`).
    pub cluster_secret: Option<ClusterSecret>,
    /// Publish the group's KVCR inventory (on the DP owner rank).
    pub publish_inventory: bool,
    /// Base port of the KV-event PUB and replay sockets (0: ephemeral).
    pub kv_events_port: u16,
    /// The worker id in the KV-event topic.
    pub kv_events_worker_id: u64,
    /// The worker's role, for the router registration.
    pub worker_type: WorkerType,
    /// Quiet-stream heartbeat interval of the KV-event publisher.
    pub inventory_heartbeat: Duration,
    /// The G3 file tier: its directories and each file's capacity.
    pub g3: Option<G3Dirs>,
    /// A guard that keeps KVCR DRAM across engine restarts: its socket and
    /// each rank's journal bytes.
    pub guard: Option<(std::path::PathBuf, u64)>,
}

/// Where a rank's G3 files go (`g3_paths`, `g3_capacity_bytes`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct G3Dirs {
    /// One file per directory, per rank.
    pub dirs: Vec<std::path::PathBuf>,
    /// Bytes of each file.
    pub capacity_bytes_per_file: u64,
}

impl G3Dirs {
    /// The files of the rank at `global_offset`, in stripe order.
    pub fn files(&self, global_offset: u64) -> Vec<std::path::PathBuf> {
        self.dirs
            .iter()
            .map(|d| d.join(format!("kvcr-g3-r{global_offset}.bin")))
            .collect()
    }
}

/// The environment variable read for the cluster secret when the extra
/// config sets neither `cluster_secret` nor `cluster_secret_file`.
pub const CLUSTER_SECRET_ENV: &str = "KVCR_CLUSTER_SECRET";

/// Largest cluster secret accepted (and largest secret file read).
const MAX_SECRET_BYTES: usize = 64 * 1024;

/// The cluster secret of the peer control channel: bytes, at least
/// [`Self::MIN_BYTES`] long. `Debug` never shows them, no error message of
/// this crate contains them, and they are overwritten with zeros (best
/// effort) when the value is dropped.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret(Vec<u8>);

impl ClusterSecret {
    /// Shortest secret accepted, in bytes.
    pub const MIN_BYTES: usize = 16;

    /// A secret from its bytes; refused (the value is not echoed) when
    /// shorter than [`Self::MIN_BYTES`] or longer than 64 KiB.
    pub fn new(bytes: Vec<u8>) -> Result<Self> {
        Self::checked(SECRET_KEY, bytes)
    }

    /// `bytes` as the secret `source` (a key or the environment variable)
    /// gave it; the error names `source`, never the value.
    fn checked(source: &str, bytes: Vec<u8>) -> Result<Self> {
        let secret = Self(bytes);
        if secret.0.len() < Self::MIN_BYTES {
            return Err(Error::config(
                source,
                format!(
                    "the cluster secret must be at least {} bytes",
                    Self::MIN_BYTES
                ),
            ));
        }
        if secret.0.len() > MAX_SECRET_BYTES {
            return Err(Error::config(
                source,
                format!("the cluster secret must be at most {MAX_SECRET_BYTES} bytes"),
            ));
        }
        Ok(secret)
    }

    /// The secret's bytes (to hand to the runner; never log them).
    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClusterSecret({REDACTED})")
    }
}

impl Drop for ClusterSecret {
    fn drop(&mut self) {
        self.0.fill(0);
        // Keeps the zeroing from being optimised away as a dead store.
        std::hint::black_box(&self.0);
    }
}

/// Reads a secret file: at most [`MAX_SECRET_BYTES`], surrounding ASCII
/// whitespace trimmed. Errors name the path and the OS error, never contents.
fn read_secret_file(path: &str) -> Result<ClusterSecret> {
    let unreadable =
        |e: std::io::Error| Error::config(SECRET_FILE_KEY, format!("cannot read {path}: {e}"));
    let file = std::fs::File::open(path).map_err(unreadable)?;
    let mut bytes = Vec::new();
    file.take(MAX_SECRET_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(unreadable)?;
    if bytes.len() > MAX_SECRET_BYTES {
        bytes.fill(0);
        return Err(Error::config(
            SECRET_FILE_KEY,
            format!("{path} is larger than {MAX_SECRET_BYTES} bytes"),
        ));
    }
    let secret = ClusterSecret::checked(SECRET_FILE_KEY, bytes.trim_ascii().to_vec());
    bytes.fill(0);
    secret
}

/// The cluster secret from the extra config's two keys, or else from the
/// environment (`env` looks a variable up).
fn resolve_secret(
    inline: Option<String>,
    file: Option<String>,
    env: &dyn Fn(&str) -> Option<OsString>,
) -> Result<Option<ClusterSecret>> {
    match (inline, file) {
        (Some(_), Some(_)) => Err(Error::config(
            SECRET_KEY,
            format!("set {SECRET_KEY} or {SECRET_FILE_KEY}, not both"),
        )),
        (Some(text), None) => ClusterSecret::checked(SECRET_KEY, text.into_bytes()).map(Some),
        (None, Some(path)) => read_secret_file(&path).map(Some),
        (None, None) => match env(CLUSTER_SECRET_ENV) {
            Some(value) if !value.is_empty() => {
                use std::os::unix::ffi::OsStringExt;
                ClusterSecret::checked(CLUSTER_SECRET_ENV, value.into_vec()).map(Some)
            }
            _ => Ok(None),
        },
    }
}

impl Default for BackendConfig {
    fn default() -> Self {
        Self {
            local_dram_bytes: 0,
            operation_timeout: Duration::from_millis(20_000),
            get_timeout: Duration::from_secs(30),
            policy: EvictionPolicy::Lru,
            enable_remote_hint: false,
            control_host: "0.0.0.0".to_owned(),
            control_port: 0,
            control_advertise_host: None,
            single_host: false,
            ucx_tls: None,
            data_stream: DataStream::Auto,
            keyless_sources: None,
            medium: Medium::Cpu,
            prefault: true,
            max_hinted_requests: 1024,
            cluster_secret: None,
            publish_inventory: false,
            kv_events_port: 0,
            kv_events_worker_id: 0,
            worker_type: WorkerType::Aggregated,
            inventory_heartbeat: Duration::from_millis(1000),
            g3: None,
            guard: None,
        }
    }
}

/// Keys the engine's dynamic backend loader puts in the extra config.
const LOADER_KEYS: [&str; 4] = ["backend_name", "module_path", "class_name", "interface_v1"];

/// Smallest residency journal.
pub(crate) const MIN_GUARD_JOURNAL_BYTES: u64 = 4096;
/// Largest residency journal (16 GiB).
pub(crate) const MAX_GUARD_JOURNAL_BYTES: u64 = 1 << 34;

/// Largest KVCR DRAM per rank (the runner's pool limit).
pub const MAX_LOCAL_DRAM_BYTES: u64 = kvcr_foundation::runner::MAX_POOL_BYTES;
/// Longest operation budget accepted.
pub const MAX_OPERATION_TIMEOUT_MS: u64 = 3_600_000;

impl BackendConfig {
    /// Parses the extra config as the engine passes it: a JSON object, JSON
    /// text, or `@path` to a JSON file; empty text is `{}`.
    pub fn parse(text: &str) -> Result<Self> {
        let trimmed = text.trim();
        if trimmed.is_empty() {
            return Self::from_value(&Value::Object(Map::new()));
        }
        let owned;
        let body = match trimmed.strip_prefix('@') {
            Some(path) => {
                owned = std::fs::read_to_string(path)
                    .map_err(|e| Error::ConfigSyntax(format!("cannot read {path}: {e}")))?;
                owned.as_str()
            }
            None => trimmed,
        };
        let value: Value = serde_json::from_str(body)
            .map_err(|e| Error::ConfigSyntax(format!("not JSON: {e}")))?;
        Self::from_value(&value)
    }

    /// Parses and validates an extra-config object.
    pub fn from_value(value: &Value) -> Result<Self> {
        Self::from_value_with_extensions(value, &[]).map(|(c, _)| c)
    }

    /// Like [`Self::from_value`], but the keys named in `extension_keys` (a
    /// layer above's own settings, e.g. delivery knobs) are handed back
    /// instead of refused; any other unknown key is still refused by name.
    pub fn from_value_with_extensions(
        value: &Value,
        extension_keys: &[&str],
    ) -> Result<(Self, Map<String, Value>)> {
        Self::from_value_with_env(value, extension_keys, &|name| std::env::var_os(name))
    }

    /// Like [`Self::from_value_with_extensions`], with `env` standing in for
    /// the process environment (it is asked only for [`CLUSTER_SECRET_ENV`],
    /// and only when neither secret key is set).
    pub fn from_value_with_env(
        value: &Value,
        extension_keys: &[&str],
        env: &dyn Fn(&str) -> Option<OsString>,
    ) -> Result<(Self, Map<String, Value>)> {
        let map = value
            .as_object()
            .ok_or_else(|| Error::ConfigSyntax("must be a JSON object".into()))?;
        let mut extensions = Map::new();
        let mut c = Self::default();
        let mut have_dram = false;
        let mut get_timeout_s = None;
        let mut secret_inline = None;
        let mut secret_file = None;
        let mut g3_dirs = None;
        let mut g3_capacity = None;
        let mut guard_socket = None;
        let mut guard_journal = None;
        for (key, v) in map {
            let k = key.as_str();
            match k {
                "local_dram_bytes" => {
                    c.local_dram_bytes = as_u64(k, v)?;
                    have_dram = true;
                }
                "operation_timeout_ms" => {
                    let ms = as_u64(k, v)?;
                    if ms == 0 || ms > MAX_OPERATION_TIMEOUT_MS {
                        return Err(Error::config(k, "must be in 1..=3600000"));
                    }
                    c.operation_timeout = Duration::from_millis(ms);
                }
                "get_timeout_s" => {
                    let s = v
                        .as_f64()
                        .ok_or_else(|| Error::config(k, "must be a number"))?;
                    if !s.is_finite() || s <= 0.0 || s > 86_400.0 {
                        return Err(Error::config(k, "must be in (0, 86400]"));
                    }
                    get_timeout_s = Some(s);
                }
                "policy" => {
                    c.policy = match as_str(k, v)? {
                        "lru" => EvictionPolicy::Lru,
                        "fifo" => EvictionPolicy::Fifo,
                        other => {
                            return Err(Error::config(
                                k,
                                format!("unknown policy {other:?} (lru or fifo)"),
                            ));
                        }
                    }
                }
                "keyless_sources" => {
                    c.keyless_sources = match as_str(k, v)? {
                        "auto" => None,
                        "refuse" => Some(KeylessSources::Refused),
                        "allow" => Some(KeylessSources::Allowed),
                        other => {
                            return Err(Error::config(
                                k,
                                format!(
                                    "unknown keyless_sources {other:?} (auto, refuse or allow)"
                                ),
                            ));
                        }
                    }
                }
                "data_stream" => {
                    c.data_stream = match as_str(k, v)? {
                        "auto" => DataStream::Auto,
                        "on" => DataStream::On,
                        "off" => DataStream::Off,
                        other => {
                            return Err(Error::config(
                                k,
                                format!("unknown data_stream {other:?} (auto, on or off)"),
                            ));
                        }
                    }
                }
                "enable_remote_hint" => c.enable_remote_hint = as_bool(k, v)?,
                "control_host" => c.control_host = as_str(k, v)?.to_owned(),
                "control_port" => {
                    let port = as_u64(k, v)?;
                    c.control_port = u16::try_from(port)
                        .map_err(|_| Error::config(k, "must be in 0..=65535"))?;
                }
                "control_advertise_host" => {
                    c.control_advertise_host = match v {
                        Value::Null => None,
                        _ => Some(as_str(k, v)?.to_owned()),
                    }
                }
                "single_host" => c.single_host = as_bool(k, v)?,
                "ucx_tls" => {
                    c.ucx_tls = match v {
                        Value::Null => None,
                        _ => {
                            let tls = as_str(k, v)?;
                            if tls.is_empty() || tls.len() > 256 {
                                return Err(Error::config(k, "must be 1..=256 characters"));
                            }
                            Some(tls.to_owned())
                        }
                    }
                }
                "medium" => {
                    c.medium = match as_str(k, v)? {
                        "CPU" => Medium::Cpu,
                        "CPU_PINNED" => Medium::CpuPinned,
                        "EXTERNAL" => Medium::External,
                        other => {
                            return Err(Error::config(
                                k,
                                format!("{other:?} is not CPU, CPU_PINNED or EXTERNAL"),
                            ));
                        }
                    }
                }
                "publish_inventory" => c.publish_inventory = as_bool(k, v)?,
                "kv_events_port" => {
                    let port = as_u64(k, v)?;
                    c.kv_events_port = u16::try_from(port)
                        .map_err(|_| Error::config(k, "must be in 0..=65535"))?;
                }
                "kv_events_worker_id" => c.kv_events_worker_id = as_u64(k, v)?,
                "worker_type" => {
                    c.worker_type = match as_str(k, v)? {
                        "aggregated" => WorkerType::Aggregated,
                        "prefill" => WorkerType::Prefill,
                        "decode" => WorkerType::Decode,
                        other => {
                            return Err(Error::config(
                                k,
                                format!("{other:?} is not aggregated, prefill or decode"),
                            ));
                        }
                    }
                }
                "g3_paths" => {
                    let dirs = v
                        .as_array()
                        .filter(|a| (1..=4096).contains(&a.len()))
                        .ok_or_else(|| Error::config(k, "must be a list of 1..=4096 directories"))?
                        .iter()
                        .map(|d| match d.as_str() {
                            Some(d) if !d.trim().is_empty() => Ok(std::path::PathBuf::from(d)),
                            _ => Err(Error::config(k, "every entry must be a non-empty path")),
                        })
                        .collect::<Result<Vec<_>>>()?;
                    g3_dirs = Some(dirs);
                }
                "g3_capacity_bytes" => {
                    let bytes = as_u64(k, v)?;
                    if bytes == 0 {
                        return Err(Error::config(k, "must be positive"));
                    }
                    g3_capacity = Some(bytes);
                }
                "guard_socket" => {
                    let path = as_str(k, v)?;
                    if path.trim().is_empty() {
                        return Err(Error::config(k, "must be a non-empty path"));
                    }
                    guard_socket = Some(std::path::PathBuf::from(path));
                }
                "guard_journal_bytes" => {
                    let bytes = as_u64(k, v)?;
                    if !(MIN_GUARD_JOURNAL_BYTES..=MAX_GUARD_JOURNAL_BYTES).contains(&bytes) {
                        return Err(Error::config(
                            k,
                            format!(
                                "must be in {MIN_GUARD_JOURNAL_BYTES}..={MAX_GUARD_JOURNAL_BYTES}"
                            ),
                        ));
                    }
                    guard_journal = Some(bytes);
                }
                "inventory_heartbeat_ms" => {
                    let ms = as_u64(k, v)?;
                    if !(10..=60_000).contains(&ms) {
                        return Err(Error::config(k, "must be in 10..=60000"));
                    }
                    c.inventory_heartbeat = Duration::from_millis(ms);
                }
                "prefault" => c.prefault = as_bool(k, v)?,
                "max_hinted_requests" => {
                    let n = as_u64(k, v)?;
                    if !(1..=1_000_000).contains(&n) {
                        return Err(Error::config(k, "must be in 1..=1000000"));
                    }
                    c.max_hinted_requests = n as usize;
                }
                SECRET_KEY => {
                    secret_inline = match v {
                        Value::Null => None,
                        _ => Some(as_str(k, v)?.to_owned()),
                    }
                }
                SECRET_FILE_KEY => {
                    secret_file = match v {
                        Value::Null => None,
                        _ => {
                            let path = as_str(k, v)?;
                            if path.is_empty() {
                                return Err(Error::config(k, "must not be empty"));
                            }
                            Some(path.to_owned())
                        }
                    }
                }
                _ if LOADER_KEYS.contains(&k) => {}
                _ if extension_keys.contains(&k) => {
                    extensions.insert(key.clone(), v.clone());
                }
                _ => return Err(Error::UnknownKey(key.clone())),
            }
        }
        if !have_dram {
            return Err(Error::config("local_dram_bytes", "is required"));
        }
        if c.local_dram_bytes == 0 || c.local_dram_bytes > MAX_LOCAL_DRAM_BYTES {
            return Err(Error::config("local_dram_bytes", "must be in 1..=2^46"));
        }
        if let Some(s) = get_timeout_s {
            c.get_timeout = Duration::from_secs_f64(s);
        }
        // Equality is refused too: the runner's deadline must fire strictly
        // before the engine gives up, so no copy can outlive the wait.
        if c.get_timeout <= c.operation_timeout {
            return Err(Error::config(
                "get_timeout_s",
                format!(
                    "must exceed operation_timeout_ms ({} ms), got {} ms",
                    c.operation_timeout.as_millis(),
                    c.get_timeout.as_millis()
                ),
            ));
        }
        c.g3 = match (g3_dirs, g3_capacity) {
            (None, None) => None,
            (Some(dirs), Some(capacity_bytes_per_file)) => Some(G3Dirs {
                dirs,
                capacity_bytes_per_file,
            }),
            (Some(_), None) => {
                return Err(Error::config(
                    "g3_capacity_bytes",
                    "is required with g3_paths",
                ));
            }
            (None, Some(_)) => {
                return Err(Error::config(
                    "g3_paths",
                    "is required with g3_capacity_bytes",
                ));
            }
        };
        c.guard = match (guard_socket, guard_journal) {
            (Some(socket), journal) => Some((
                socket,
                journal.unwrap_or(kvcr_foundation::runner::GuardOptions::DEFAULT_JOURNAL_BYTES),
            )),
            (None, Some(_)) => {
                return Err(Error::config(
                    "guard_socket",
                    "is required with guard_journal_bytes",
                ));
            }
            (None, None) => None,
        };
        if c.guard.is_some() && !c.enable_remote_hint {
            return Err(Error::config(
                "guard_socket",
                "needs enable_remote_hint (the guard keeps the peer mode's pools and control listener)",
            ));
        }
        c.cluster_secret = resolve_secret(secret_inline, secret_file, env)?;
        c.check_peer()?;
        c.check_publishing()?;
        Ok((c, extensions))
    }

    /// The KV-event settings a publishing rank needs, checked: subscribers
    /// on other hosts dial the advertise host, so it is required (and must
    /// pass the loopback policy) exactly as for peers.
    fn check_publishing(&self) -> Result<()> {
        if !self.publish_inventory {
            return Ok(());
        }
        self.advertise_host().map_err(|e| match e {
            Error::Config { why, .. } => Error::config(
                "control_advertise_host",
                format!("{why} (publish_inventory advertises the KV-event endpoints with it)"),
            ),
            other => other,
        })?;
        self.kv_events_bind(0)?;
        Ok(())
    }

    /// The PUB and replay bind addresses of DP rank `dp_rank`.
    pub(crate) fn kv_events_bind(&self, dp_rank: u32) -> Result<(BindAddress, BindAddress)> {
        if self.kv_events_port == 0 {
            let any = self.host_bind(0)?;
            return Ok((any.clone(), any));
        }
        let base = u64::from(self.kv_events_port) + 2 * u64::from(dp_rank);
        let port = |offset: u64| {
            u16::try_from(base + offset).map_err(|_| {
                Error::config(
                    "kv_events_port",
                    "base port + 2 * dp_rank + 1 exceeds 65535",
                )
            })
        };
        Ok((self.host_bind(port(0)?)?, self.host_bind(port(1)?)?))
    }

    /// The control-channel settings a peer-mode rank needs, checked.
    fn check_peer(&self) -> Result<()> {
        let bind = self.bind_address(0)?;
        if !self.enable_remote_hint {
            return Ok(());
        }
        let _ = bind;
        if self.control_port == 0 {
            return Err(Error::config(
                "control_port",
                "must be set when enable_remote_hint is on (peers dial base + rank offset)",
            ));
        }
        let host = self.advertise_host()?;
        if self.cluster_secret.is_none() && !host.is_loopback() {
            // Without a secret the runner serves loopback only, so peers on
            // other hosts could never reach this one: say so at attach.
            return Err(Error::config(
                SECRET_KEY,
                format!(
                    "a non-loopback control_advertise_host needs a cluster secret \
                     ({SECRET_KEY}, {SECRET_FILE_KEY} or {CLUSTER_SECRET_ENV}): without one \
                     the control channel serves loopback only"
                ),
            ));
        }
        Ok(())
    }

    /// The bind address of a rank at `offset` from the base port.
    pub(crate) fn bind_address(&self, offset: u64) -> Result<BindAddress> {
        let port = if self.control_port == 0 {
            0
        } else {
            u16::try_from(u64::from(self.control_port) + offset).map_err(|_| {
                Error::config("control_port", "base port + rank offset exceeds 65535")
            })?
        };
        self.host_bind(port)
    }

    /// `control_host` with `port`, as a bind address.
    fn host_bind(&self, port: u16) -> Result<BindAddress> {
        let host = self.control_host.trim();
        let text = if host.contains(':') && !host.starts_with('[') {
            format!("tcp://[{host}]:{port}")
        } else {
            format!("tcp://{host}:{port}")
        };
        BindAddress::parse(&text).map_err(|e| Error::config("control_host", e.to_string()))
    }

    /// The advertise host, checked against the loopback policy.
    pub(crate) fn advertise_host(&self) -> Result<Host> {
        let raw = self.control_advertise_host.as_deref().unwrap_or("");
        if raw.trim().is_empty() {
            return Err(Error::config(
                "control_advertise_host",
                "is required when enable_remote_hint is on",
            ));
        }
        self.advertise_policy()
            .advertise_host(raw)
            .map_err(|e| Error::config("control_advertise_host", e.to_string()))
    }

    pub(crate) fn advertise_policy(&self) -> AdvertisePolicy {
        if self.single_host {
            AdvertisePolicy::SingleHost
        } else {
            AdvertisePolicy::CrossHost
        }
    }
}

fn as_u64(key: &str, v: &Value) -> Result<u64> {
    v.as_u64()
        .ok_or_else(|| Error::config(key, "must be a non-negative integer"))
}

fn as_bool(key: &str, v: &Value) -> Result<bool> {
    v.as_bool()
        .ok_or_else(|| Error::config(key, "must be true or false"))
}

fn as_str<'a>(key: &str, v: &'a Value) -> Result<&'a str> {
    v.as_str()
        .ok_or_else(|| Error::config(key, "must be a string"))
}
