//! Router-hint envelope parsing (contract cases 23-26).

use kvcr_contracts::error::{EndpointReason, HintReason};
use kvcr_contracts::hint::{SourceCandidate, WorkerType, choose_source};
use kvcr_contracts::{AttemptLedger, BlockKey, FetchHint, HintEnvelope, HintSnapshot, RequestId};
use rstest::rstest;
use serde_json::json;

fn envelope(actions: serde_json::Value) -> String {
    json!({"protocol_version": "0.1", "message_id": "m1", "actions": actions}).to_string()
}

fn fetch(payload: serde_json::Value) -> serde_json::Value {
    json!({"action_id": "a", "action_type": "kv.fetch", "action_version": "1.0", "payload": payload})
}

fn keys(raw: &[u64]) -> Vec<BlockKey> {
    raw.iter().copied().map(BlockKey::from_u64).collect()
}

#[track_caller]
fn hint_reason(text: &str) -> HintReason {
    match FetchHint::from_json(text) {
        Ok(h) => panic!("accepted: {h:?}"),
        Err(e) => e
            .hint_reason()
            .cloned()
            .unwrap_or_else(|| panic!("not a hint error: {e}")),
    }
}

#[test]
fn parses_a_plain_fetch() {
    let text = envelope(json!([fetch(json!({
        "source_control_endpoint": "tcp://10.0.0.5:25000",
        "block_hashes": [1, 2, 3],
        "mode": "copy"
    }))]));
    let hint = FetchHint::from_json(&text).unwrap();
    assert_eq!(hint.source.to_string(), "tcp://10.0.0.5:25000");
    assert_eq!(hint.block_hashes, keys(&[1, 2, 3]));
    assert_eq!(hint.action_id.as_deref(), Some("a"));
}

/// Case 23 and 24: hash normalisation and truncation, as a table.
#[rstest]
#[case::minus_one(json!([-1]), vec![u64::MAX])]
#[case::i64_min(json!([i64::MIN]), vec![1u64 << 63])]
#[case::u64_max(json!([u64::MAX]), vec![u64::MAX])]
#[case::signed_and_unsigned_agree(json!([-2, u64::MAX - 1]), vec![u64::MAX - 1, u64::MAX - 1])]
#[case::hex_digest(json!(["ffffffffffffffff0000"]), vec![u64::MAX])]
#[case::short_hex(json!(["1f"]), vec![0x1f])]
#[case::bad_in_middle_truncates(json!([7, "zz", 9]), vec![7])]
#[case::bool_truncates(json!([7, true, 9]), vec![7])]
#[case::float_truncates(json!([7, 1.5, 9]), vec![7])]
#[case::too_big_truncates(json!([7, 18446744073709551616u128 as f64, 9]), vec![7])]
#[case::null_truncates(json!([7, null, 9]), vec![7])]
#[case::duplicates_kept_in_place(json!([5, 5, 6]), vec![5, 5, 6])]
fn hash_lists(#[case] hashes: serde_json::Value, #[case] expected: Vec<u64>) {
    let text = envelope(json!([fetch(json!({
        "source_control_endpoint": "tcp://10.0.0.5:25000",
        "block_hashes": hashes
    }))]));
    assert_eq!(
        FetchHint::from_json(&text).unwrap().block_hashes,
        keys(&expected)
    );
}

/// The table of refused hints and the typed reason each gives.
#[rstest]
#[case::hex_junk(envelope(json!([fetch(json!({"source_control_endpoint": "tcp://h:1", "block_hashes": ["xyz", "q"]}))])), HintReason::NoHashes)]
#[case::empty_hashes(envelope(json!([fetch(json!({"source_control_endpoint": "tcp://h:1", "block_hashes": []}))])), HintReason::NoHashes)]
#[case::hashes_not_list(envelope(json!([fetch(json!({"source_control_endpoint": "tcp://h:1", "block_hashes": 5}))])), HintReason::NoHashes)]
#[case::first_hash_bool(envelope(json!([fetch(json!({"source_control_endpoint": "tcp://h:1", "block_hashes": [false]}))])), HintReason::NoHashes)]
#[case::mode_move(envelope(json!([fetch(json!({"source_control_endpoint": "tcp://h:1", "block_hashes": [1], "mode": "move"}))])), HintReason::UnsupportedMode(kvcr_contracts::error::Echo::new("move")))]
#[case::mode_not_string(envelope(json!([fetch(json!({"source_control_endpoint": "tcp://h:1", "block_hashes": [1], "mode": 1}))])), HintReason::UnsupportedMode(kvcr_contracts::error::Echo::new("1")))]
#[case::no_retain(envelope(json!([fetch(json!({"source_control_endpoint": "tcp://h:1", "block_hashes": [1], "no_retain": false}))])), HintReason::NoRetain)]
#[case::version_2(envelope(json!([{"action_type": "kv.fetch", "action_version": "2.0", "payload": {"source_control_endpoint": "tcp://h:1", "block_hashes": [1]}}])), HintReason::UnsupportedVersion(kvcr_contracts::error::Echo::new("2.0")))]
#[case::missing_source(envelope(json!([fetch(json!({"block_hashes": [1]}))])), HintReason::MissingSource)]
#[case::null_source(envelope(json!([fetch(json!({"source_control_endpoint": null, "block_hashes": [1]}))])), HintReason::MissingSource)]
#[case::only_unknown_actions(envelope(json!([{"action_type": "kv.prefetch", "action_version": "9", "payload": {}}])), HintReason::NoFetchAction)]
#[case::no_actions(envelope(json!([])), HintReason::NoFetchAction)]
#[case::envelope_version(json!({"protocol_version": "0.2", "actions": []}).to_string(), HintReason::ProtocolVersion)]
#[case::envelope_version_number(json!({"protocol_version": 0.1, "actions": []}).to_string(), HintReason::ProtocolVersion)]
#[case::envelope_version_missing(json!({"actions": []}).to_string(), HintReason::ProtocolVersion)]
#[case::envelope_not_object(json!([1, 2]).to_string(), HintReason::EnvelopeNotObject)]
#[case::actions_missing(json!({"protocol_version": "0.1"}).to_string(), HintReason::ActionsNotList)]
#[case::actions_not_list(json!({"protocol_version": "0.1", "actions": {}}).to_string(), HintReason::ActionsNotList)]
#[case::action_not_object(envelope(json!([5])), HintReason::MalformedAction { index: 0, what: "not an object" })]
#[case::payload_not_object(envelope(json!([{"action_type": "kv.fetch", "action_version": "1.0", "payload": [1]}])), HintReason::MalformedAction { index: 0, what: "payload must be an object" })]
#[case::action_type_missing(envelope(json!([{"action_version": "1.0", "payload": {}}])), HintReason::MalformedAction { index: 0, what: "action_type must be a string" })]
fn refused_hints(#[case] text: String, #[case] expected: HintReason) {
    assert_eq!(hint_reason(&text), expected);
}

#[test]
fn not_json_is_a_typed_error() {
    assert!(matches!(hint_reason("{\"protocol"), HintReason::Json(_)));
}

/// A malformed source endpoint drops the hint; it is never used verbatim.
#[rstest]
#[case::wildcard("tcp://0.0.0.0:25000", EndpointReason::WildcardHost)]
#[case::port_zero("tcp://10.0.0.5:0", EndpointReason::Port)]
#[case::no_scheme("10.0.0.5:25000", EndpointReason::Scheme)]
fn bad_source_endpoint(#[case] source: &str, #[case] expected: EndpointReason) {
    let text = envelope(json!([fetch(
        json!({"source_control_endpoint": source, "block_hashes": [1]})
    )]));
    match hint_reason(&text) {
        HintReason::Source(e) => assert_eq!(e.endpoint_reason(), Some(expected)),
        other => panic!("{other:?}"),
    }
}

/// Case 23: unknown actions are skipped; the first *valid* kv.fetch wins.
#[test]
fn first_valid_fetch_wins() {
    let text = envelope(json!([
        {"action_type": "kv.evict", "action_version": "1.0", "payload": {"x": 1}},
        {"action_type": "kv.fetch", "action_version": "2.0", "payload": {"source_control_endpoint": "tcp://h:1", "block_hashes": [1]}},
        fetch(json!({"source_control_endpoint": "tcp://h:1", "block_hashes": [1], "mode": "move"})),
        fetch(json!({"source_control_endpoint": "tcp://second:2", "block_hashes": [2]})),
        fetch(json!({"source_control_endpoint": "tcp://third:3", "block_hashes": [3]})),
    ]));
    let hint = FetchHint::from_json(&text).unwrap();
    assert_eq!(hint.source.to_string(), "tcp://second:2");
    assert_eq!(hint.block_hashes, keys(&[2]));
}

/// Case 25: a round trip keeps unknown actions byte for byte.
#[test]
fn round_trip_keeps_unknown_actions_verbatim() {
    let unknown = r#"{"action_type":"vendor.thing","action_version":"7.1","payload":{"z":[1, 2.50, "é"],"a":{}}, "extra" : true}"#;
    let fetch_action = r#"{"action_type":"kv.fetch","action_version":"1.0","payload":{"source_control_endpoint":"tcp://h:1","block_hashes":[18446744073709551615]}}"#;
    let text = format!(
        r#"{{"protocol_version":"0.1","message_id":"m9","actions":[{unknown},{fetch_action}]}}"#
    );
    let envelope = HintEnvelope::from_json(&text).unwrap();
    let out = envelope.to_json();
    assert!(out.contains(unknown), "{out}");
    assert!(out.contains(fetch_action), "{out}");
    let again = HintEnvelope::from_json(&out).unwrap();
    assert_eq!(again.to_json(), out);
    assert_eq!(
        again.raw_actions().collect::<Vec<_>>(),
        vec![unknown, fetch_action]
    );
    assert_eq!(again.message_id(), Some("m9"));
    let hint = FetchHint::from_envelope(&again).unwrap();
    assert_eq!(hint.block_hashes, keys(&[u64::MAX]));
}

#[test]
fn legacy_compact_form() {
    let hint = FetchHint::from_legacy_json(
        r#"{"source_control_endpoint":"tcp://[fd00::2]:9","block_hashes":[-1,"zz",3]}"#,
    )
    .unwrap();
    assert_eq!(hint.source.to_string(), "tcp://[fd00::2]:9");
    assert_eq!(hint.block_hashes, keys(&[u64::MAX]));
}

#[test]
fn covered_prefix_is_root_aligned() {
    let hint = FetchHint::from_legacy_json(
        r#"{"source_control_endpoint":"tcp://h:9","block_hashes":[1,2,3,4]}"#,
    )
    .unwrap();
    assert_eq!(hint.covered_prefix(&keys(&[1, 2, 3, 4, 5])), 4);
    assert_eq!(hint.covered_prefix(&keys(&[1, 2, 9, 4])), 2);
    assert_eq!(hint.covered_prefix(&keys(&[9, 2, 3])), 0);
    assert_eq!(hint.covered_prefix(&[]), 0);
}

/// Attempt scoping: a second attempt supersedes the first; a stale attempt's
/// finish cannot end the new one.
#[test]
fn attempts_supersede() {
    let mut ledger = AttemptLedger::new();
    let rid = RequestId("r1".into());
    let (first, none) = ledger.begin(rid.clone());
    assert!(none.is_none());
    let snapshot = HintSnapshot::new(first.clone(), vec![]);
    let (second, superseded) = ledger.begin(rid.clone());
    assert_eq!(superseded.as_ref(), Some(&first));
    assert!(!ledger.is_current(snapshot.attempt()));
    assert!(ledger.is_current(&second));
    assert!(
        !ledger.finish(&first),
        "a stale attempt must not end the new one"
    );
    assert!(ledger.is_current(&second));
    assert!(ledger.finish(&second));
    assert_eq!(ledger.live(), 0);
    // The id is reused: the new attempt never equals any earlier one.
    let (third, _) = ledger.begin(rid);
    assert_ne!(third, first);
    assert_ne!(third, second);
    assert!(!ledger.is_current(&first));
}

fn candidate(id: u64, kind: WorkerType, endpoint: bool, prefix: usize) -> SourceCandidate {
    SourceCandidate {
        worker_id: id,
        worker_type: kind,
        endpoint: endpoint.then(|| format!("tcp://w{id}:1").parse().unwrap()),
        prefix_blocks: prefix,
    }
}

/// Case 26: router source choice.
#[rstest]
#[case::longest_wins(vec![candidate(2, WorkerType::Decode, true, 5), candidate(3, WorkerType::Decode, true, 7)], Some(3))]
#[case::tie_smaller_id(vec![candidate(4, WorkerType::Decode, true, 7), candidate(3, WorkerType::Decode, true, 7)], Some(3))]
#[case::not_beyond_target(vec![candidate(2, WorkerType::Decode, true, 2)], None)]
#[case::other_type(vec![candidate(2, WorkerType::Prefill, true, 9)], None)]
#[case::never_self(vec![candidate(1, WorkerType::Decode, true, 9)], None)]
#[case::no_endpoint(vec![candidate(2, WorkerType::Decode, false, 9)], None)]
#[case::longer_than_request(vec![candidate(2, WorkerType::Decode, true, 11)], None)]
#[case::invalid_skipped(vec![candidate(2, WorkerType::Decode, true, 11), candidate(5, WorkerType::Decode, true, 4)], Some(5))]
#[case::empty(vec![], None)]
fn choose_source_cases(#[case] candidates: Vec<SourceCandidate>, #[case] expected: Option<u64>) {
    let chosen = choose_source(1, WorkerType::Decode, 2, 10, &candidates).map(|c| c.worker_id);
    assert_eq!(chosen, expected);
}
