//! Member keys inside control endpoints: the `?key=` grammar, its typed
//! refusals, what equality and list matching mean for keyed endpoints, and
//! the printed form (a frame's `sender_endpoint` carries it).

use kvcr_contracts::error::EndpointReason;
use kvcr_contracts::{AdvertisePolicy, ControlEndpoint, Host, MemberKey, WorkerEndpointMap};
use proptest::prelude::*;
use rstest::rstest;

const KEY_A: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
const KEY_B: &str = "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210";

fn endpoint(text: &str) -> ControlEndpoint {
    ControlEndpoint::parse(text).unwrap()
}

#[track_caller]
fn reason(input: &str) -> EndpointReason {
    match ControlEndpoint::parse(input) {
        Ok(ep) => panic!("{input:?} parsed as {ep}"),
        Err(e) => e.endpoint_reason().unwrap(),
    }
}

#[rstest]
#[case::lowercase(format!("tcp://10.0.0.5:25000?key={KEY_A}"))]
#[case::uppercase_read(format!("tcp://10.0.0.5:25000?key={}", KEY_A.to_uppercase()))]
#[case::ipv6(format!("tcp://[fd00::1]:25000?key={KEY_A}"))]
fn keyed_endpoint_parses(#[case] input: String) {
    let ep = endpoint(&input);
    assert_eq!(ep.key().unwrap().to_string(), KEY_A);
    assert_eq!(ep.port(), 25000);
    assert_eq!(endpoint(&ep.to_string()), ep);
}

#[rstest]
#[case::empty_query("tcp://10.0.0.5:1?", EndpointReason::Query)]
#[case::other_parameter("tcp://10.0.0.5:1?id=1", EndpointReason::Query)]
#[case::empty_key("tcp://10.0.0.5:1?key=", EndpointReason::MemberKey)]
#[case::short_key("tcp://10.0.0.5:1?key=0123", EndpointReason::MemberKey)]
#[case::long_key(
    "tcp://10.0.0.5:1?key=0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef00",
    EndpointReason::MemberKey
)]
#[case::not_hex(
    "tcp://10.0.0.5:1?key=g123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    EndpointReason::MemberKey
)]
#[case::all_zero(
    "tcp://10.0.0.5:1?key=0000000000000000000000000000000000000000000000000000000000000000",
    EndpointReason::MemberKey
)]
#[case::second_parameter(
    "tcp://10.0.0.5:1?key=0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef&x=1",
    EndpointReason::MemberKey
)]
#[case::multibyte(
    "tcp://10.0.0.5:1?key=ééééééééééééééééééééééééééééééé",
    EndpointReason::MemberKey
)]
#[case::key_before_port(
    "tcp://10.0.0.5?key=0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    EndpointReason::MissingPort
)]
fn keyed_endpoint_rejects(#[case] input: &str, #[case] expected: EndpointReason) {
    assert_eq!(reason(input), expected);
}

#[test]
fn a_key_is_part_of_the_identity() {
    let bare = endpoint("tcp://10.0.0.5:1");
    let a = endpoint(&format!("tcp://10.0.0.5:1?key={KEY_A}"));
    let b = endpoint(&format!("tcp://10.0.0.5:1?key={KEY_B}"));
    // Three identities: equality covers the key.
    assert_ne!(a, b);
    assert_ne!(a, bare);
    assert!(a.same_address(&b) && a.same_address(&bare));
    assert_eq!(a.with_key(None), bare);
    assert_eq!(bare.with_key(a.key().copied()), a);
    // A list entry without a key names every key at its address; one with a
    // key names only that key.
    assert!(bare.names(&a) && bare.names(&b) && bare.names(&bare));
    assert!(a.names(&a));
    assert!(!a.names(&b) && !a.names(&bare));
    assert!(!bare.names(&endpoint("tcp://10.0.0.5:2")));
}

#[test]
fn a_port_offset_drops_the_key_of_another_runner() {
    let a = endpoint(&format!("tcp://10.0.0.5:100?key={KEY_A}"));
    assert_eq!(a.with_port_offset(0).unwrap(), a);
    assert_eq!(
        a.with_port_offset(3).unwrap(),
        endpoint("tcp://10.0.0.5:103")
    );
}

#[test]
fn an_endpoint_map_names_a_known_key() {
    let host = Host::Ip("10.0.0.5".parse().unwrap());
    let key = MemberKey::parse(KEY_A).unwrap();
    let map = WorkerEndpointMap::for_dp_range(&host, 100, 0, 2, 4)
        .unwrap()
        .with_member_key(1, key)
        .with_member_key(7, key);
    assert_eq!(map.get(0).unwrap().key(), None);
    assert_eq!(map.get(1).unwrap().key(), Some(&key));
    assert_eq!(map.len(), 2);
    let json = map.to_json();
    assert_eq!(
        WorkerEndpointMap::from_json(&json, AdvertisePolicy::CrossHost).unwrap(),
        map
    );
}

#[test]
fn printed_form() {
    let key = MemberKey::parse(KEY_A).unwrap();
    let ep = endpoint("tcp://[fd00::1]:25000").with_key(Some(key));
    insta::assert_snapshot!(ep.to_string(), @"tcp://[fd00::1]:25000?key=0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef");
    assert_eq!(format!("{key:?}"), format!("MemberKey({KEY_A})"));
}

proptest! {
    #[test]
    fn keyed_endpoints_round_trip(port in 1u16.., bytes in any::<[u8; 32]>(), v4 in any::<u32>()) {
        let host = Host::Ip(std::net::Ipv4Addr::from(v4.max(1)).into());
        let ep = ControlEndpoint::new(host, port).unwrap().with_key(MemberKey::from_bytes(bytes));
        prop_assert_eq!(ControlEndpoint::parse(&ep.to_string()).unwrap(), ep);
    }

    #[test]
    fn arbitrary_queries_never_panic(query in ".{0,80}") {
        let _ = ControlEndpoint::parse(&format!("tcp://10.0.0.5:1?{query}"));
        let _ = MemberKey::parse(&query);
    }
}
