//! Router hints: the versioned `kv.fetch@1.0` envelope, its parsing rules, and
//! attempt-scoped hint snapshots.
//!
//! ```json
//! { "protocol_version": "0.1", "message_id": "m1",
//!   "actions": [ { "action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0",
//!                  "payload": { "source_control_endpoint": "tcp://10.0.0.5:25000",
//!                               "block_hashes": [17, -1, "ffffffffffffffff"],
//!                               "mode": "copy" } } ] }
//! ```
//!
//! Two layers:
//!
//! * [`HintEnvelope`] is the strict ingress form a router or engine front door
//!   checks: the envelope must be an object with `protocol_version: "0.1"` and
//!   `actions` a list of objects with string `action_type`/`action_version` and an
//!   object `payload`. Every action is kept as its **original bytes**, so unknown
//!   actions survive a round trip byte for byte.
//! * [`FetchHint::from_envelope`] is what a worker runs: unknown action types are
//!   skipped, the **first valid** `kv.fetch@1.0` wins, `mode` other than `"copy"`
//!   and any `no_retain` are refused, and the hash list is read root-aligned:
//!   hashes are integers in `[-2^63, 2^64)` (normalised to `u64`) or hex digests,
//!   and the first bad hash **truncates** the list (a bad hash never shifts later
//!   hashes to earlier block positions).
//!
//! Hints are scoped to one attempt of one request ([`AttemptId`]); a second
//! attempt of the same request id supersedes the first ([`AttemptLedger`]).

use std::collections::HashMap;
use std::sync::Arc;

use serde::Serialize;
use serde_json::value::RawValue;

use crate::endpoint::ControlEndpoint;
use crate::error::{Echo, Error, HintReason, Result};
use crate::key::BlockKey;

/// The only envelope version this build speaks.
pub const PROTOCOL_VERSION: &str = "0.1";
/// The fetch action's type.
pub const FETCH_ACTION_TYPE: &str = "kv.fetch";
/// The fetch action's only supported version.
pub const FETCH_ACTION_VERSION: &str = "1.0";

/// A router hint envelope, checked at ingress, with every action kept as raw JSON.
#[derive(Debug, Clone)]
pub struct HintEnvelope {
    message_id: Option<String>,
    actions: Vec<Box<RawValue>>,
}

#[derive(Serialize)]
struct EnvelopeOut<'a> {
    protocol_version: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    message_id: Option<&'a str>,
    actions: &'a [Box<RawValue>],
}

#[derive(serde::Deserialize)]
struct EnvelopeIn {
    protocol_version: Option<serde_json::Value>,
    message_id: Option<serde_json::Value>,
    actions: Option<Vec<Box<RawValue>>>,
}

impl HintEnvelope {
    /// Parses and checks an envelope (see the module docs for the rules).
    pub fn from_json(text: &str) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::hint(HintReason::Json(Echo::new(&e.to_string()))))?;
        if !value.is_object() {
            return Err(Error::hint(HintReason::EnvelopeNotObject));
        }
        // The envelope is an object; parse it again keeping actions raw (the raw
        // slices are what a round trip must reproduce).
        let parsed: EnvelopeIn =
            serde_json::from_str(text).map_err(|_| Error::hint(HintReason::ActionsNotList))?;
        match parsed.protocol_version {
            Some(serde_json::Value::String(v)) if v == PROTOCOL_VERSION => {}
            _ => return Err(Error::hint(HintReason::ProtocolVersion)),
        }
        let message_id = match parsed.message_id {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) => Some(s),
            Some(other) => Some(other.to_string()),
        };
        let actions = parsed
            .actions
            .ok_or(Error::hint(HintReason::ActionsNotList))?;
        for (index, raw) in actions.iter().enumerate() {
            check_action_shape(index, raw)?;
        }
        Ok(Self {
            message_id,
            actions,
        })
    }

    /// Serialises the envelope; every action is written back byte for byte.
    pub fn to_json(&self) -> String {
        let out = EnvelopeOut {
            protocol_version: PROTOCOL_VERSION,
            message_id: self.message_id.as_deref(),
            actions: &self.actions,
        };
        // Serialising borrowed strings and already-valid raw JSON cannot fail.
        serde_json::to_string(&out).unwrap_or_default()
    }

    /// The router's message id, if any.
    pub fn message_id(&self) -> Option<&str> {
        self.message_id.as_deref()
    }

    /// The actions as their original JSON text.
    pub fn raw_actions(&self) -> impl Iterator<Item = &str> {
        self.actions.iter().map(|a| a.get())
    }
}

fn check_action_shape(index: usize, raw: &RawValue) -> Result<()> {
    let malformed = |what| Error::hint(HintReason::MalformedAction { index, what });
    let value: serde_json::Value =
        serde_json::from_str(raw.get()).map_err(|_| malformed("not JSON"))?;
    let object = value.as_object().ok_or(malformed("not an object"))?;
    if !object.get("action_type").is_some_and(|v| v.is_string()) {
        return Err(malformed("action_type must be a string"));
    }
    if !object.get("action_version").is_some_and(|v| v.is_string()) {
        return Err(malformed("action_version must be a string"));
    }
    if !object.get("payload").is_some_and(|v| v.is_object()) {
        return Err(malformed("payload must be an object"));
    }
    Ok(())
}

/// How the destination may treat the source's copy. Only `Copy` exists today.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FetchMode {
    /// The source keeps its copy.
    Copy,
}

/// A parsed, validated `kv.fetch@1.0` action: which peer holds which prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchHint {
    /// The source rank's (DP group's) control endpoint, as the router resolved it.
    pub source: ControlEndpoint,
    /// Root-aligned: `block_hashes[i]` is request block `i`.
    pub block_hashes: Vec<BlockKey>,
    /// Always [`FetchMode::Copy`] today.
    pub mode: FetchMode,
    /// The router's action id, if any.
    pub action_id: Option<String>,
}

impl FetchHint {
    /// The worker-side rule: the first valid `kv.fetch@1.0` in the envelope.
    /// When none is valid, the error of the first `kv.fetch` action seen (or
    /// [`HintReason::NoFetchAction`]).
    pub fn from_envelope(envelope: &HintEnvelope) -> Result<Self> {
        let mut first_error = None;
        for raw in &envelope.actions {
            let Ok(serde_json::Value::Object(action)) =
                serde_json::from_str::<serde_json::Value>(raw.get())
            else {
                continue;
            };
            if action.get("action_type").and_then(|v| v.as_str()) != Some(FETCH_ACTION_TYPE) {
                continue;
            }
            match Self::from_action(&action) {
                Ok(hint) => return Ok(hint),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        Err(first_error.unwrap_or(Error::hint(HintReason::NoFetchAction)))
    }

    /// Parses an envelope text and applies [`Self::from_envelope`].
    pub fn from_json(text: &str) -> Result<Self> {
        Self::from_envelope(&HintEnvelope::from_json(text)?)
    }

    /// The legacy compact form `{"source_control_endpoint": .., "block_hashes": [..]}`
    /// (`kv_transfer_params.router_hint`), with the same payload rules.
    pub fn from_legacy_json(text: &str) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::hint(HintReason::Json(Echo::new(&e.to_string()))))?;
        let payload = value
            .as_object()
            .ok_or(Error::hint(HintReason::EnvelopeNotObject))?;
        Self::from_payload(payload, None)
    }

    fn from_action(action: &serde_json::Map<String, serde_json::Value>) -> Result<Self> {
        match action.get("action_version") {
            Some(serde_json::Value::String(v)) if v == FETCH_ACTION_VERSION => {}
            Some(other) => {
                let shown = other
                    .as_str()
                    .map_or_else(|| other.to_string(), str::to_owned);
                return Err(Error::hint(HintReason::UnsupportedVersion(Echo::new(
                    &shown,
                ))));
            }
            None => {
                return Err(Error::hint(HintReason::MalformedAction {
                    index: 0,
                    what: "action_version must be a string",
                }));
            }
        }
        let payload = action
            .get("payload")
            .and_then(|p| p.as_object())
            .ok_or(Error::hint(HintReason::MalformedAction {
                index: 0,
                what: "payload must be an object",
            }))?;
        let action_id = action
            .get("action_id")
            .and_then(|v| v.as_str())
            .map(str::to_owned);
        Self::from_payload(payload, action_id)
    }

    fn from_payload(
        payload: &serde_json::Map<String, serde_json::Value>,
        action_id: Option<String>,
    ) -> Result<Self> {
        if payload.contains_key("no_retain") {
            return Err(Error::hint(HintReason::NoRetain));
        }
        let mode = match payload.get("mode") {
            None => FetchMode::Copy,
            Some(serde_json::Value::String(m)) if m == "copy" => FetchMode::Copy,
            Some(other) => {
                let shown = other
                    .as_str()
                    .map_or_else(|| other.to_string(), str::to_owned);
                return Err(Error::hint(HintReason::UnsupportedMode(Echo::new(&shown))));
            }
        };
        let source = match payload.get("source_control_endpoint") {
            None | Some(serde_json::Value::Null) => {
                return Err(Error::hint(HintReason::MissingSource));
            }
            Some(serde_json::Value::String(s)) => ControlEndpoint::parse(s)
                .map_err(|e| Error::hint(HintReason::Source(Box::new(e))))?,
            Some(other) => {
                return Err(Error::hint(HintReason::Source(Box::new(Error::endpoint(
                    &other.to_string(),
                    crate::error::EndpointReason::Scheme,
                )))));
            }
        };
        let hashes = payload
            .get("block_hashes")
            .and_then(|v| v.as_array())
            .ok_or(Error::hint(HintReason::NoHashes))?;
        // Root-aligned: stop at the first bad hash, never skip it.
        let block_hashes: Vec<BlockKey> = hashes
            .iter()
            .map_while(|h| BlockKey::from_json(h).ok())
            .collect();
        if block_hashes.is_empty() {
            return Err(Error::hint(HintReason::NoHashes));
        }
        Ok(Self {
            source,
            block_hashes,
            mode,
            action_id,
        })
    }

    /// How many leading blocks of a request whose block hashes are `request`
    /// this hint covers: the length of the common root-aligned prefix.
    pub fn covered_prefix(&self, request: &[BlockKey]) -> usize {
        self.block_hashes
            .iter()
            .zip(request)
            .take_while(|(a, b)| a == b)
            .count()
    }
}

/// A request id as the engine names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub String);

/// One attempt of one request: a retried request id gets a higher generation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AttemptId {
    /// The request.
    pub request: RequestId,
    /// Strictly increasing per request id, from 1.
    pub generation: u64,
}

/// The hints one attempt started with, frozen: cheap to clone, never mutated,
/// and tagged with the attempt so a stale attempt's snapshot can be recognised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HintSnapshot {
    attempt: AttemptId,
    hints: Arc<[FetchHint]>,
}

impl HintSnapshot {
    /// Freezes `hints` for `attempt`.
    pub fn new(attempt: AttemptId, hints: Vec<FetchHint>) -> Self {
        Self {
            attempt,
            hints: hints.into(),
        }
    }

    /// The attempt these hints belong to.
    pub fn attempt(&self) -> &AttemptId {
        &self.attempt
    }

    /// The hints.
    pub fn hints(&self) -> &[FetchHint] {
        &self.hints
    }
}

/// Issues attempt generations and answers "is this attempt still current?".
///
/// A second attempt of a request id supersedes the first at once (admission is
/// never blocked by an old attempt); anything holding the old [`AttemptId`] sees
/// [`AttemptLedger::is_current`] turn false and must not touch the new attempt.
#[derive(Debug, Default)]
pub struct AttemptLedger {
    current: HashMap<RequestId, u64>,
    next_generation: u64,
}

impl AttemptLedger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts a new attempt of `request`, superseding any earlier one. Returns
    /// the new attempt and the superseded one, if there was one.
    pub fn begin(&mut self, request: RequestId) -> (AttemptId, Option<AttemptId>) {
        // Generations are unique across all requests, so an id reused after
        // `finish` still never compares equal to a stale attempt.
        self.next_generation += 1;
        let generation = self.next_generation;
        let previous = self
            .current
            .insert(request.clone(), generation)
            .map(|g| AttemptId {
                request: request.clone(),
                generation: g,
            });
        (
            AttemptId {
                request,
                generation,
            },
            previous,
        )
    }

    /// Whether `attempt` is the live attempt of its request.
    pub fn is_current(&self, attempt: &AttemptId) -> bool {
        self.current.get(&attempt.request) == Some(&attempt.generation)
    }

    /// Ends `attempt` if it is current; a stale attempt ending changes nothing.
    /// Returns whether it was current.
    pub fn finish(&mut self, attempt: &AttemptId) -> bool {
        if self.is_current(attempt) {
            self.current.remove(&attempt.request);
            true
        } else {
            false
        }
    }

    /// Number of live attempts.
    pub fn live(&self) -> usize {
        self.current.len()
    }
}

/// Whether a worker is an aggregated server or one side of disaggregation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WorkerType {
    /// Prefill and decode on one worker.
    Aggregated,
    /// Prefill-only.
    Prefill,
    /// Decode-only.
    Decode,
}

/// A worker the router could name as a hint source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceCandidate {
    /// The router's worker id.
    pub worker_id: u64,
    /// Its role.
    pub worker_type: WorkerType,
    /// Its control endpoint for the relevant DP rank; `None` makes it ineligible.
    pub endpoint: Option<ControlEndpoint>,
    /// How many leading blocks of the request it holds.
    pub prefix_blocks: usize,
}

/// The router's source choice after target selection: the candidate with the
/// longest prefix strictly beyond what the target already has, of the target's
/// worker type, with an endpoint, never the target itself; ties go to the
/// smaller worker id. A candidate claiming more blocks than the request's hash
/// list has is ignored (fail closed).
pub fn choose_source(
    target_id: u64,
    target_type: WorkerType,
    target_cached_blocks: usize,
    request_blocks: usize,
    candidates: &[SourceCandidate],
) -> Option<&SourceCandidate> {
    candidates
        .iter()
        .filter(|c| {
            c.worker_id != target_id
                && c.worker_type == target_type
                && c.endpoint.is_some()
                && c.prefix_blocks <= request_blocks
                && c.prefix_blocks > target_cached_blocks
        })
        .min_by(|a, b| {
            b.prefix_blocks
                .cmp(&a.prefix_blocks)
                .then(a.worker_id.cmp(&b.worker_id))
        })
}
