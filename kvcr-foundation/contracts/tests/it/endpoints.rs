//! Endpoint grammar, advertise policy, DP strides and endpoint maps
//! (contract cases 8, 13-17, 19-21 of the engine/router reference).

use kvcr_contracts::error::{EndpointReason, RankReason};
use kvcr_contracts::{
    AdvertisePolicy, BindAddress, ControlEndpoint, Error, Host, Incarnation, RankLayout,
    WorkerEndpointMap,
};
use rstest::rstest;

#[track_caller]
fn reason(input: &str) -> EndpointReason {
    match ControlEndpoint::parse(input) {
        Ok(ep) => panic!("{input:?} parsed as {ep}"),
        Err(e) => e
            .endpoint_reason()
            .unwrap_or_else(|| panic!("{input:?}: not an endpoint error: {e}")),
    }
}

#[rstest]
#[case::ipv4("tcp://10.0.0.5:25000", "10.0.0.5", 25000)]
#[case::bracketed_ipv6("tcp://[fd00::1]:25000", "[fd00::1]", 25000)]
#[case::ipv6_compressed_on_output("tcp://[fd00:0:0::0001]:1", "[fd00::1]", 1)]
#[case::name("tcp://node7.cluster:65535", "node7.cluster", 65535)]
#[case::name_lowercased_and_trailing_dot("tcp://Node7.Cluster.:80", "node7.cluster", 80)]
#[case::leading_zero_port("tcp://10.0.0.5:00080", "10.0.0.5", 80)]
#[case::loopback_parses("tcp://127.0.0.1:5", "127.0.0.1", 5)]
fn endpoint_parses(#[case] input: &str, #[case] host: &str, #[case] port: u16) {
    let ep = ControlEndpoint::parse(input).unwrap();
    assert_eq!(ep.host().to_string(), host);
    assert_eq!(ep.port(), port);
    // Formatting then parsing is the identity.
    assert_eq!(ControlEndpoint::parse(&ep.to_string()).unwrap(), ep);
}

/// The table of malformed endpoints and the typed error each gives.
#[rstest]
#[case::port_zero("tcp://10.0.0.5:0", EndpointReason::Port)]
#[case::port_65536("tcp://10.0.0.5:65536", EndpointReason::Port)]
#[case::port_huge("tcp://10.0.0.5:99999999999", EndpointReason::Port)]
#[case::port_signed("tcp://10.0.0.5:+80", EndpointReason::Port)]
#[case::port_negative("tcp://10.0.0.5:-1", EndpointReason::Port)]
#[case::port_empty("tcp://10.0.0.5:", EndpointReason::Port)]
#[case::port_hex("tcp://10.0.0.5:0x50", EndpointReason::Port)]
#[case::no_port("tcp://10.0.0.5", EndpointReason::MissingPort)]
#[case::scheme_udp("udp://10.0.0.5:80", EndpointReason::Scheme)]
#[case::scheme_missing("10.0.0.5:80", EndpointReason::Scheme)]
#[case::scheme_upper("TCP://10.0.0.5:80", EndpointReason::Scheme)]
#[case::empty_host("tcp://:80", EndpointReason::EmptyHost)]
#[case::wildcard_v4("tcp://0.0.0.0:80", EndpointReason::WildcardHost)]
#[case::wildcard_v6("tcp://[::]:80", EndpointReason::WildcardHost)]
#[case::wildcard_star("tcp://*:80", EndpointReason::WildcardHost)]
#[case::unbracketed_v6("tcp://fd00::1:80", EndpointReason::Brackets)]
#[case::bare_v6_wildcard("tcp://:::80", EndpointReason::Brackets)]
#[case::unclosed_bracket("tcp://[fd00::1:80", EndpointReason::Brackets)]
#[case::bracketed_v4("tcp://[10.0.0.5]:80", EndpointReason::Brackets)]
#[case::stray_bracket("tcp://host]:80", EndpointReason::Brackets)]
#[case::bad_name("tcp://no_underscores:80", EndpointReason::HostName)]
#[case::bad_v4("tcp://1.2.3.999:80", EndpointReason::HostName)]
#[case::label_dash("tcp://-node:80", EndpointReason::HostName)]
#[case::empty_label("tcp://a..b:80", EndpointReason::HostName)]
#[case::space("tcp://a b:80", EndpointReason::HostName)]
#[case::path("tcp://a/b:80", EndpointReason::HostName)]
fn endpoint_rejects(#[case] input: &str, #[case] expected: EndpointReason) {
    assert_eq!(reason(input), expected);
}

#[test]
fn endpoint_error_echo_is_bounded() {
    let long = format!("tcp://{}:80", "a".repeat(10_000));
    let err = ControlEndpoint::parse(&long).unwrap_err();
    assert!(err.to_string().len() < 400, "{}", err.to_string().len());
}

#[rstest]
#[case::v4("127.0.0.1")]
#[case::v4_other("127.3.2.1")]
#[case::v6("::1")]
#[case::v6_bracketed("[::1]")]
#[case::v4_mapped("::ffff:127.0.0.1")]
#[case::localhost("localhost")]
#[case::localhost_upper("LocalHost")]
#[case::localhost_dot("localhost.")]
#[case::sub_localhost("foo.localhost")]
#[case::deep_localhost("a.b.localhost")]
fn loopback_refused_cross_host_but_allowed_single_host(#[case] host: &str) {
    let err = AdvertisePolicy::CrossHost.advertise_host(host).unwrap_err();
    assert_eq!(
        err.endpoint_reason(),
        Some(EndpointReason::LoopbackAdvertised)
    );
    let ok = AdvertisePolicy::SingleHost.advertise_host(host).unwrap();
    assert!(ok.is_loopback());
    // The same rule holds for a full endpoint, as a router would check it.
    let ep = ControlEndpoint::new(ok, 25000).unwrap();
    assert!(ep.check_advertisable(AdvertisePolicy::CrossHost).is_err());
    assert!(ep.check_advertisable(AdvertisePolicy::SingleHost).is_ok());
}

#[rstest]
#[case::v4("10.0.0.5", "10.0.0.5")]
#[case::v6_bare("fd00::1", "[fd00::1]")]
#[case::v6_bracketed("[fd00:0::1]", "[fd00::1]")]
#[case::name("node7.cluster", "node7.cluster")]
#[case::not_localhost("localhostx", "localhostx")]
#[case::localhost_inside("localhost.example.com", "localhost.example.com")]
fn advertise_host_accepted(#[case] raw: &str, #[case] shown: &str) {
    let host = AdvertisePolicy::CrossHost.advertise_host(raw).unwrap();
    assert_eq!(host.to_string(), shown);
}

#[rstest]
#[case::empty("", EndpointReason::EmptyHost)]
#[case::blank("  ", EndpointReason::EmptyHost)]
#[case::v4_wildcard("0.0.0.0", EndpointReason::WildcardHost)]
#[case::v6_wildcard("::", EndpointReason::WildcardHost)]
#[case::v6_wildcard_bracketed("[::]", EndpointReason::WildcardHost)]
#[case::star("*", EndpointReason::WildcardHost)]
fn advertise_host_refused_in_both_modes(#[case] raw: &str, #[case] expected: EndpointReason) {
    for policy in [AdvertisePolicy::CrossHost, AdvertisePolicy::SingleHost] {
        let err = policy.advertise_host(raw).unwrap_err();
        assert_eq!(err.endpoint_reason(), Some(expected), "{policy:?} {raw:?}");
    }
}

#[rstest]
#[case::star("tcp://*:25000", true, 25000)]
#[case::v4_any("tcp://0.0.0.0:25000", true, 25000)]
#[case::v6_any("tcp://[::]:25000", true, 25000)]
#[case::ephemeral("tcp://127.0.0.1:0", false, 0)]
#[case::v6("tcp://[fd00::1]:7", false, 7)]
fn bind_address_allows_wildcards(#[case] input: &str, #[case] wildcard: bool, #[case] port: u16) {
    let bind = BindAddress::parse(input).unwrap();
    assert_eq!(bind.is_wildcard(), wildcard);
    assert_eq!(bind.port, port);
    assert_eq!(BindAddress::parse(&bind.to_string()).unwrap(), bind);
}

#[rstest]
#[case::name("tcp://node7:80", EndpointReason::HostName)]
#[case::no_port("tcp://*", EndpointReason::MissingPort)]
#[case::port("tcp://*:65536", EndpointReason::Port)]
fn bind_address_rejects(#[case] input: &str, #[case] expected: EndpointReason) {
    assert_eq!(
        BindAddress::parse(input).unwrap_err().endpoint_reason(),
        Some(expected)
    );
}

/// Case 15: DP=2, attn_tp=2 binds B, B+1, B+2, B+3.
#[rstest]
#[case(0, 0, 25000)]
#[case(0, 1, 25001)]
#[case(1, 0, 25002)]
#[case(1, 1, 25003)]
fn bind_port_uses_full_coordinate(#[case] dp: u32, #[case] tp: u32, #[case] port: u16) {
    let layout = RankLayout::new(2, 1, 2).unwrap();
    assert_eq!(
        layout
            .coordinate(dp, 0, tp)
            .unwrap()
            .bind_port(25000)
            .unwrap(),
        port
    );
}

/// With context parallelism the stride is cp * tp.
#[test]
fn bind_port_with_context_parallel() {
    let layout = RankLayout::new(2, 2, 2).unwrap();
    assert_eq!(layout.stride(), 4);
    let c = layout.coordinate(1, 1, 0).unwrap();
    assert_eq!(c.within_dp_offset(), 2);
    assert_eq!(c.bind_port(100).unwrap(), 106);
}

/// Case 16: rank (dp=1, tp=1) dials E:B+1, never E:B+3.
#[test]
fn dial_adds_only_within_dp_offset() {
    let layout = RankLayout::new(2, 1, 2).unwrap();
    let source = ControlEndpoint::parse("tcp://10.0.0.9:25002").unwrap();
    let dialed = layout.coordinate(1, 0, 1).unwrap().dial(&source).unwrap();
    assert_eq!(dialed.to_string(), "tcp://10.0.0.9:25003");
}

/// Case 14: an offset past 65535 is an error, never the unmodified endpoint.
#[test]
fn dial_offset_overflow_is_error() {
    let layout = RankLayout::new(1, 1, 4).unwrap();
    let source = ControlEndpoint::parse("tcp://10.0.0.9:65534").unwrap();
    let err = layout
        .coordinate(0, 0, 3)
        .unwrap()
        .dial(&source)
        .unwrap_err();
    assert_eq!(err.endpoint_reason(), Some(EndpointReason::PortOverflow));
    let err = layout
        .coordinate(0, 0, 3)
        .unwrap()
        .bind_port(65534)
        .unwrap_err();
    assert!(matches!(
        err,
        Error::Rank {
            reason: RankReason::PortOverflow { .. }
        }
    ));
}

#[rstest]
#[case::zero_dp(0, 1, 1)]
#[case::zero_cp(1, 0, 1)]
#[case::zero_tp(1, 1, 0)]
fn layout_rejects_zero_sizes(#[case] dp: u32, #[case] cp: u32, #[case] tp: u32) {
    assert!(matches!(
        RankLayout::new(dp, cp, tp),
        Err(Error::Rank {
            reason: RankReason::ZeroSize(_)
        })
    ));
}

#[rstest]
#[case::dp(2, 0, 0)]
#[case::cp(0, 1, 0)]
#[case::tp(0, 0, 2)]
fn coordinate_out_of_range(#[case] dp: u32, #[case] cp: u32, #[case] tp: u32) {
    let layout = RankLayout::new(2, 1, 2).unwrap();
    assert!(matches!(
        layout.coordinate(dp, cp, tp),
        Err(Error::Rank {
            reason: RankReason::RankOutOfRange { .. }
        })
    ));
}

/// Case 17: dp bounds (2,4), stride 4 -> {"2": B, "3": B+4}.
#[test]
fn endpoint_map_for_dp_range() {
    let host = AdvertisePolicy::CrossHost
        .advertise_host("10.1.2.3")
        .unwrap();
    let map = WorkerEndpointMap::for_dp_range(&host, 30000, 2, 4, 4).unwrap();
    assert_eq!(
        map.to_json(),
        r#"{"2":"tcp://10.1.2.3:30000","3":"tcp://10.1.2.3:30004"}"#
    );
    let back = WorkerEndpointMap::from_json(&map.to_json(), AdvertisePolicy::CrossHost).unwrap();
    assert_eq!(back, map);
}

/// Case 17 (all-or-nothing) and 20 (missing rank is ineligible, not a crash).
#[rstest]
#[case::undialable_rank(r#"{"0":"tcp://10.0.0.1:1","1":"tcp://0.0.0.0:2"}"#)]
#[case::bad_port(r#"{"0":"tcp://10.0.0.1:1","1":"tcp://10.0.0.1:0"}"#)]
#[case::loopback_cross_host(r#"{"0":"tcp://10.0.0.1:1","1":"tcp://127.0.0.1:2"}"#)]
#[case::localhost_name(r#"{"0":"tcp://foo.localhost:2"}"#)]
#[case::key_not_number(r#"{"zero":"tcp://10.0.0.1:1"}"#)]
#[case::key_negative(r#"{"-1":"tcp://10.0.0.1:1"}"#)]
#[case::key_leading_zero(r#"{"01":"tcp://10.0.0.1:1"}"#)]
#[case::value_not_string(r#"{"0":25000}"#)]
#[case::not_object(r#"["tcp://10.0.0.1:1"]"#)]
#[case::not_json(r#"{"0":"#)]
fn endpoint_map_all_or_nothing(#[case] json: &str) {
    let err = WorkerEndpointMap::from_json(json, AdvertisePolicy::CrossHost).unwrap_err();
    assert!(matches!(err, Error::Rank { .. }), "{err}");
}

#[test]
fn endpoint_map_missing_rank_is_none() {
    let map = WorkerEndpointMap::from_json(
        r#"{"0":"tcp://10.0.0.1:1","2":"tcp://10.0.0.1:3"}"#,
        AdvertisePolicy::CrossHost,
    )
    .unwrap();
    assert!(map.get(1).is_none());
    assert!(map.get(u32::MAX).is_none());
    assert_eq!(map.get(2).unwrap().port(), 3);
}

#[test]
fn endpoint_map_single_host_accepts_loopback() {
    let map =
        WorkerEndpointMap::from_json(r#"{"0":"tcp://127.0.0.1:1"}"#, AdvertisePolicy::SingleHost)
            .unwrap();
    assert_eq!(map.len(), 1);
    assert!(map.check_advertisable(AdvertisePolicy::CrossHost).is_err());
}

#[rstest]
#[case::port_overflow(65000, 0, 2, 1000)]
#[case::empty_range(25000, 3, 3, 1)]
#[case::reversed_range(25000, 3, 1, 1)]
#[case::zero_stride(25000, 0, 2, 0)]
fn endpoint_map_for_dp_range_rejects(
    #[case] base: u16,
    #[case] start: u32,
    #[case] end: u32,
    #[case] stride: u64,
) {
    let host = Host::Ip("10.0.0.1".parse().unwrap());
    assert!(WorkerEndpointMap::for_dp_range(&host, base, start, end, stride).is_err());
}

/// Case 21: names differ across ranks, DP groups and restarts.
#[test]
fn agent_names_are_unique_per_rank_and_incarnation() {
    let a = Incarnation::generate();
    let b = Incarnation::generate();
    assert_ne!(a, b);
    let names = [
        a.agent_name(0, 0),
        a.agent_name(0, 1),
        a.agent_name(1, 0),
        b.agent_name(0, 0),
    ];
    let unique: std::collections::HashSet<_> = names.iter().collect();
    assert_eq!(unique.len(), names.len(), "{names:?}");
}

#[rstest]
#[case::short("abc")]
#[case::zero("00000000000000000000000000000000")]
#[case::upper("0123456789ABCDEF0123456789ABCDEF")]
#[case::non_hex("0123456789abcdef0123456789abcdeg")]
#[case::long("0123456789abcdef0123456789abcdef0")]
fn incarnation_parse_rejects(#[case] input: &str) {
    assert!(matches!(
        Incarnation::parse(input),
        Err(Error::Incarnation { .. })
    ));
}

#[test]
fn incarnation_round_trips() {
    let inc = Incarnation::generate();
    assert_eq!(Incarnation::parse(&inc.to_string()).unwrap(), inc);
    assert!(Incarnation::from_raw(0).is_none());
}
