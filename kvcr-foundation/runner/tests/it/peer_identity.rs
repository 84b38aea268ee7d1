//! Member identity between real runners: every session proves its static
//! key, a destination talks only to the key its hint names, and a source
//! binds each session to the key its dialer proved, so one member cannot
//! speak for another (issue 40, item 1).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use kvcr_contracts::{ControlEndpoint, Incarnation};
use kvcr_runner::StaticKey;
use kvcr_runner::client::ControlClient;
use kvcr_runner::{
    DataStream, EntryStatus, FailReason, KeylessSources, OpResult, PeerOptions, QueryStatus,
};
use rstest::rstest;

use crate::nodes::{Node, assert_restored, fetch_on_hint, hint, hint_to, node_with, stock};

const SECRET: &[u8] = b"identity-tests-cluster-secret-0123456789";

fn options(keyless: KeylessSources) -> PeerOptions {
    let mut options = PeerOptions::loopback();
    options.secret = Some(SECRET.to_vec());
    options.keyless_sources = keyless;
    options
}

fn member(blocks: u32, timeout: Duration) -> Node {
    node_with(&options(KeylessSources::default()), blocks, timeout)
}

/// A member whose writes go through UCX over tcp and whose completions
/// come on the control session alone (no mapping of a same-host peer's
/// pools, no doorbells, no data streams), as between hosts.
fn cross_host_member(blocks: u32, timeout: Duration) -> Node {
    let mut options = options(KeylessSources::default());
    options.ucx_tls = Some("tcp,self".to_owned());
    options.same_host_mapping = false;
    options.request_mailbox = false;
    options.data_stream = DataStream::Off;
    node_with(&options, blocks, timeout)
}

fn assert_nothing_restored(target: &Node, result: &OpResult) {
    for (key, entry) in &result.entries {
        assert!(
            matches!(
                entry.status,
                EntryStatus::Failed(FailReason::Timeout | FailReason::NoSource)
            ),
            "{key:?}: {entry:?}"
        );
        assert_ne!(target.runner.query(key), QueryStatus::Hit);
    }
}

/// A member keeps opening sessions at the destination's source claiming
/// the destination's endpoint (its key too: refused; its address alone:
/// taken as the member itself) while the destination restores 160 pages in
/// ten rounds. Before member keys each such session replaced the
/// destination's at the source (one live session per claimed endpoint):
/// 128 of 160 pages served, a second per restore. Now every page is served
/// byte-exact, the destination's session at the source is never replaced,
/// no reply is lost for want of it, and the claims naming the
/// destination's key are refused.
#[test]
fn a_member_claiming_the_destinations_endpoint_changes_nothing() {
    let _serial = crate::serial();
    let mut source = cross_host_member(160, Duration::from_secs(5));
    let all: Vec<u64> = (0..160).collect();
    stock(&mut source, &all);
    let source_endpoint = source.runner.peers().endpoint().unwrap().clone();
    let mut target = cross_host_member(160, Duration::from_secs(5));
    let honest = target.runner.peers().endpoint().unwrap().clone();
    assert!(
        honest.key().is_some(),
        "the advertised endpoint names its key"
    );
    // One round first, so the destination's session is in place.
    let result = fetch_on_hint(&mut target, "first", &hint(&source, &all[..16]), &all[..16]);
    assert_restored(&target, &source, &result, &all[..16]);

    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicU64::new(0));
    let impostor = {
        let (stop, opened) = (Arc::clone(&stop), Arc::clone(&opened));
        let (to, honest) = (source_endpoint.clone(), honest.clone());
        std::thread::spawn(move || {
            let mut held = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                for claim in [honest.clone(), honest.with_key(None)] {
                    // A fresh key each time: none of its sessions is the
                    // same identity as another, so none replaces another.
                    let session =
                        ControlClient::connect(&to, Some(SECRET), claim, Incarnation::generate());
                    if let Ok(session) = session {
                        opened.fetch_add(1, Ordering::Relaxed);
                        held.push(session);
                    }
                }
                // Keep a few open, as the member in the probe did.
                if held.len() > 8 {
                    held.remove(0);
                }
            }
        })
    };
    crate::wait_until("the impostor to get going", Duration::from_secs(10), || {
        opened.load(Ordering::Relaxed) > 10
    });
    for keys in all[16..].chunks(16) {
        let request = format!("honest-{}", keys[0]);
        let result = fetch_on_hint(&mut target, &request, &hint(&source, keys), keys);
        assert_restored(&target, &source, &result, keys);
    }
    stop.store(true, Ordering::Relaxed);
    impostor.join().unwrap();
    assert_eq!(target.runner.peers().stats().counters.keys_received, 160);
    let at_source = source.runner.peers().control_stats();
    assert_eq!(
        at_source.dropped, 0,
        "no reply lost its session: {at_source:?}"
    );
    let at_target = target.runner.peers().control_stats();
    assert_eq!(at_target.sources_wrong_key, 0);
    assert_eq!(at_target.bad_frames, 0);
    source.runner.check_invariants().unwrap();
    target.runner.check_invariants().unwrap();
}

/// A hint naming the source's address with another member's key: the
/// destination refuses whoever answers there (counted) and restores
/// nothing; the source sends nothing.
#[test]
fn a_hint_naming_a_wrong_key_restores_nothing() {
    let _serial = crate::serial();
    let mut source = member(16, Duration::from_secs(5));
    let keys: Vec<u64> = (0..16).collect();
    stock(&mut source, &keys);
    let mut target = member(16, Duration::from_millis(500));
    let other = StaticKey::generate().unwrap();
    let wrong = source
        .runner
        .peers()
        .endpoint()
        .unwrap()
        .with_key(Some(other.public()));
    let result = fetch_on_hint(&mut target, "wrong-key", &hint_to(&wrong, &keys), &keys);
    assert_nothing_restored(&target, &result);
    assert!(target.runner.peers().control_stats().sources_wrong_key >= 1);
    assert_eq!(source.runner.peers().stats().counters.keys_sent, 0);
    assert_eq!(target.runner.peers().stats().counters.keys_received, 0);
    target.runner.check_invariants().unwrap();
}

/// A hint naming the source's address without a key: with a cluster
/// secret it is refused by default (counted, the source never dialed) and
/// followed byte-exact where the operator allows keyless sources.
#[rstest]
#[case::refused_by_default(KeylessSources::default(), false)]
#[case::allowed(KeylessSources::Allowed, true)]
fn a_keyless_hint_follows_the_policy(#[case] policy: KeylessSources, #[case] restored: bool) {
    let _serial = crate::serial();
    let mut source = member(16, Duration::from_secs(5));
    let keys: Vec<u64> = (0..16).collect();
    stock(&mut source, &keys);
    let mut target = node_with(&options(policy), 16, Duration::from_millis(500));
    let keyless = source.runner.peers().endpoint().unwrap().with_key(None);
    let result = fetch_on_hint(&mut target, "keyless", &hint_to(&keyless, &keys), &keys);
    let stats = target.runner.peers().control_stats();
    if restored {
        assert_restored(&target, &source, &result, &keys);
        assert_eq!(stats.sources_keyless_refused, 0);
    } else {
        assert_nothing_restored(&target, &result);
        assert!(stats.sources_keyless_refused >= 1, "{stats:?}");
        assert_eq!(
            source.runner.peers().control_stats().refused_handshakes,
            0,
            "never dialed"
        );
        assert_eq!(source.runner.peers().stats().counters.keys_sent, 0);
    }
    target.runner.check_invariants().unwrap();
}

/// `allowed_peers` naming a key admits only that member: the destination
/// listed with its own key restores; listed at its address with another
/// key, its requests are refused.
#[rstest]
#[case::its_own_key(true)]
#[case::another_key(false)]
fn allowed_peers_match_on_the_key(#[case] own_key: bool) {
    let _serial = crate::serial();
    let mut target = member(16, Duration::from_millis(500));
    let honest = target.runner.peers().endpoint().unwrap().clone();
    let listed = if own_key {
        honest
    } else {
        honest.with_key(Some(StaticKey::generate().unwrap().public()))
    };
    let mut source_options = options(KeylessSources::default());
    source_options.allowed_peers = vec![listed];
    let mut source = node_with(&source_options, 16, Duration::from_secs(5));
    let keys: Vec<u64> = (0..16).collect();
    stock(&mut source, &keys);
    let result = fetch_on_hint(&mut target, "allowed", &hint(&source, &keys), &keys);
    if own_key {
        assert_restored(&target, &source, &result, &keys);
    } else {
        assert_nothing_restored(&target, &result);
        assert!(source.runner.peers().stats().counters.refused_peers >= 1);
    }
}

/// A member a destination dials with the right key answers as itself; the
/// runner's client refuses a runner that proves another key than `to`
/// names.
#[test]
fn the_client_checks_the_key_it_dials() {
    let _serial = crate::serial();
    let source = member(4, Duration::from_secs(1));
    let to = source.runner.peers().endpoint().unwrap().clone();
    let me = ControlEndpoint::parse("tcp://127.0.0.9:1").unwrap();
    let client = ControlClient::connect(&to, Some(SECRET), me.clone(), Incarnation::generate());
    assert_eq!(client.unwrap().peer().0, &to);
    let wrong = to.with_key(Some(StaticKey::generate().unwrap().public()));
    assert!(ControlClient::connect(&wrong, Some(SECRET), me, Incarnation::generate()).is_err());
}
