//! Tests of the packed-blob validator ([`crate::packed`]): this host's real
//! addresses and rkeys validate; malformed ones are refused, each by the
//! field at fault; and mutations of real blobs that get through go to the
//! real UCX parse (`ucp_ep_create`, `ucp_ep_rkey_unpack`) in this process,
//! which must not abort.

use std::time::Duration;

use rstest::rstest;

use crate::packed::{AddressProblem as P, AddressVersion, Limits, MAX_UCX_RKEY};
use crate::*;

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// A v1 address of a posix,cma,self worker as Debian's UCX 1.13.1 packed it.
/// Offsets: header 0, uuid 1..9; device 1 (self): md 9, length 10, tl csum
/// 11..13, attributes 13..29 (overhead 13, bandwidth 17, latency 21, flags
/// 25), iface length 29, iface address 30..38; device 2 (posix): md 38,
/// length 39, device address 40..48, csum 48..50, attributes 50..66, iface
/// length 66, iface address 67..75 (a fifo segment id); device 3 (cma): md
/// 75, length 76, device address 77..85, csum 85..87, attributes 87..103,
/// iface length 103, iface address 104..108 (a pid).
const V1_SHM: &str = "208a7124f2617267042000637577cc2b3200f8d74f00000000004f030088578d4770ea06a36d41080a2b31eb59abdf0ba7d377cc2b32004c3e5077ccab33004f2300886f1300c0020000c022880a2b31eb59abdf0b478bbd37063600242e5077ccab3300922100846f130000";
/// The same worker with `UCX_ADDRESS_VERSION=v2`: a two-byte header (uuid at
/// 2..10, device 1's md at 10) and 8-byte iface attributes.
const V2_SHM: &str = "01028bed038b3b5722b70000637544a4000080001b0088e591f6c7d5985ea601080a2b31eb59abdf0ba7d34475430081009b00886f1300c0020000c002880a2b31eb59abdf0b478bfb55430000009900846f130000";
/// A v1 address of a tcp,self worker on loopback.
const V1_TCP: &str = "207f82e1abf9f02b582000637577cc2b3200f8d74f00000000004f03008823c6528a3c6c0e6c219201020a2b31eb59abdf8bf9ffffef00000000cf1917b75138539e3e4bd7e03737011323008299b5";
/// The rkey of a posix,cma,self registration: md 0 (self) and md 2 (cma),
/// host memory, two empty keys.
const RKEY_SHM: &str = "0500000000000000000000";

const CSUM_CMA: u16 = 0x8b47;

/// A valid packed address (for other tests' envelopes).
pub(crate) fn sample_address() -> Vec<u8> {
    unhex(V1_SHM)
}

fn problem(bytes: &[u8], limits: &Limits) -> P {
    match validate_worker_address(bytes, limits) {
        Err(UcxReason::MalformedAddress { problem, .. }) => problem,
        other => panic!("expected a malformed-address refusal, got {other:?}"),
    }
}

/// xorshift64: deterministic pseudo-random bytes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

#[rstest]
#[case::v1_shm(V1_SHM, AddressVersion::V1, 3, 0b111)]
#[case::v2_shm(V2_SHM, AddressVersion::V2, 3, 0b111)]
#[case::v1_tcp(V1_TCP, AddressVersion::V1, 2, 0b11)]
fn recorded_addresses_validate(
    #[case] hex: &str,
    #[case] version: AddressVersion,
    #[case] ifaces: usize,
    #[case] md_map: u64,
) {
    let shape = validate_worker_address(&unhex(hex), &Limits::new()).unwrap();
    assert_eq!(shape.version, version);
    assert_eq!(shape.ifaces, ifaces);
    assert_eq!(shape.devices, ifaces);
    assert_eq!(shape.md_map, md_map);
}

/// UCX 1.16 packs a device record without transports for each memory domain
/// that has none (CUDA's on a GPU host, seen on the H200 machine): accepted,
/// with no iface of its own.
#[test]
fn memory_domain_records_without_transports_are_accepted() {
    let mut v = unhex(V1_SHM);
    v.splice(9..9, [0x80 | 3, 0x00]);
    let shape = validate_worker_address(&v, &Limits::new()).unwrap();
    assert_eq!((shape.devices, shape.ifaces, shape.md_map), (4, 3, 0b1111));
}

fn put_f32(v: &mut [u8], at: usize, x: f32) {
    v[at..at + 4].copy_from_slice(&x.to_le_bytes());
}

/// An address with one device and `n` ifaces (csum 0, v1 attributes, empty
/// iface addresses).
fn many_ifaces(n: usize) -> Vec<u8> {
    let mut v = vec![0x20];
    v.extend_from_slice(&7u64.to_le_bytes());
    v.extend_from_slice(&[0x00, 0x80]);
    for i in 0..n {
        v.extend_from_slice(&[0, 0]);
        let mut attrs = [0u8; 16];
        put_f32(&mut attrs, 4, 1e9);
        v.extend_from_slice(&attrs);
        v.push(if i + 1 == n { 0x80 } else { 0x00 });
    }
    v
}

#[rstest]
#[case::empty(V1_SHM, |v: &mut Vec<u8>| v.clear(), P::Empty)]
#[case::sixteen_bytes_starting_0x0f(V1_SHM, |v: &mut Vec<u8>| { *v = vec![0x0f]; v.resize(16, 0) }, P::Version(0x0f))]
#[case::sixteen_bytes_0x0f(V1_SHM, |v: &mut Vec<u8>| *v = vec![0x0f; 16], P::Version(0x0f))]
#[case::version_2(V1_SHM, |v: &mut Vec<u8>| v[0] = 0x22, P::Version(0x22))]
#[case::version_15(V2_SHM, |v: &mut Vec<u8>| v[0] = 0x0f, P::Version(0x0f))]
#[case::v2_high_nibble(V2_SHM, |v: &mut Vec<u8>| v[0] = 0x11, P::Version(0x11))]
#[case::v2_unknown_flag(V2_SHM, |v: &mut Vec<u8>| v[1] = 0x22, P::HeaderFlags(0x22))]
#[case::no_worker_uuid(V1_SHM, |v: &mut Vec<u8>| v[0] = 0x00, P::NoWorkerUuid)]
#[case::am_only(V1_SHM, |v: &mut Vec<u8>| v[0] = 0xa0, P::AmOnly)]
#[case::no_devices(V1_SHM, |v: &mut Vec<u8>| { v.truncate(9); v.push(0xff) }, P::NoDevices)]
#[case::memory_domains_only(V1_SHM, |v: &mut Vec<u8>| { v.truncate(9); v.extend_from_slice(&[0x80, 0x80]) }, P::EmptyDevice)]
#[case::v2_md_index_128(V2_SHM, |v: &mut Vec<u8>| { v[10] = 0x7f; v.insert(11, 0x80) }, P::MdIndex { index: 128, limit: 64 })]
#[case::v2_short_extension(V2_SHM, |v: &mut Vec<u8>| { v[10] = 0x7f; v.insert(11, 0x05) }, P::Extension { field: "md index" })]
#[case::one_path(V1_SHM, |v: &mut Vec<u8>| { v[10] |= 0x40; v.insert(11, 1) }, P::PathCount(1))]
#[case::unknown_sys_device(V1_SHM, |v: &mut Vec<u8>| { v[10] |= 0x20; v.insert(11, 0xff) }, P::SysDevice)]
#[case::nan_bandwidth(V1_SHM, |v: &mut Vec<u8>| put_f32(v, 17, f32::NAN), P::IfaceAttr { field: "bandwidth" })]
#[case::zero_bandwidth(V1_SHM, |v: &mut Vec<u8>| put_f32(v, 17, 0.0), P::IfaceAttr { field: "bandwidth" })]
#[case::negative_overhead(V1_SHM, |v: &mut Vec<u8>| put_f32(v, 13, -1.0), P::IfaceAttr { field: "overhead" })]
#[case::infinite_latency(V1_SHM, |v: &mut Vec<u8>| put_f32(v, 21, f32::INFINITY), P::IfaceAttr { field: "latency" })]
#[case::ep_address(V1_SHM, |v: &mut Vec<u8>| v[29] |= 0x40, P::EpAddress)]
#[case::last_byte_cut(V1_SHM, |v: &mut Vec<u8>| { v.pop(); }, P::Truncated { field: "iface address" })]
#[case::one_byte_more(V1_SHM, |v: &mut Vec<u8>| v.push(0), P::Trailing { extra: 1 })]
#[case::last_device_unmarked(V1_SHM, |v: &mut Vec<u8>| v[76] &= 0x7f, P::Truncated { field: "md index" })]
#[case::last_iface_unmarked(V1_SHM, |v: &mut Vec<u8>| v[103] &= 0x7f, P::Truncated { field: "transport name checksum" })]
#[case::iface_length_past_end(V1_SHM, |v: &mut Vec<u8>| v[103] = 0x85, P::Truncated { field: "iface address" })]
#[case::device_length_past_end(V1_TCP, |v: &mut Vec<u8>| v[39] = 0x9f, P::Truncated { field: "iface attributes" })]
#[case::too_many_ifaces(V1_SHM, |v: &mut Vec<u8>| *v = many_ifaces(129), P::TooManyIfaces)]
fn malformed_addresses_are_refused_by_field(
    #[case] hex: &str,
    #[case] mutate: fn(&mut Vec<u8>),
    #[case] expected: P,
) {
    let mut v = unhex(hex);
    mutate(&mut v);
    assert_eq!(problem(&v, &Limits::new()), expected);
    // The same refusal through the envelope constructors, typed.
    let e = WorkerAddress::from_packed(1, 2, &v).unwrap_err();
    assert!(
        matches!(e.reason(), Some(UcxReason::MalformedAddress { problem, .. }) if *problem == expected),
        "{e}"
    );
}

#[test]
fn the_most_ifaces_ucx_packs_validate() {
    assert_eq!(
        validate_worker_address(&many_ifaces(128), &Limits::new())
            .unwrap()
            .ifaces,
        128
    );
}

#[rstest]
fn every_truncation_and_extension_of_an_address_is_refused(
    #[values(V1_SHM, V2_SHM, V1_TCP)] hex: &str,
) {
    let v = unhex(hex);
    for cut in 0..v.len() {
        assert!(
            validate_worker_address(&v[..cut], &Limits::new()).is_err(),
            "cut at {cut}"
        );
    }
    for extra in [0u8, 0x80, 0xff] {
        let mut long = v.clone();
        long.push(extra);
        assert_eq!(
            problem(&long, &Limits::new()),
            P::Trailing { extra: 1 },
            "{extra:#x}"
        );
    }
}

#[test]
fn random_bytes_are_refused_and_never_panic() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for len in 0..2048 {
        let bytes = rng.bytes(len % 700);
        assert!(validate_worker_address(&bytes, &Limits::new()).is_err());
        assert!(validate_rkey(&bytes, &Limits::new()).is_err());
    }
    let big = vec![0x20; packed::MAX_UCX_ADDRESS + 1];
    assert!(matches!(
        validate_worker_address(&big, &Limits::new()),
        Err(UcxReason::TooLarge { .. })
    ));
}

const RKEY: &str = "packed UCX rkey";

#[rstest]
#[case::empty(|v: &mut Vec<u8>| v.clear(), UcxReason::Truncated { what: RKEY, len: 0, needed: 9 })]
#[case::short_md_map(|v: &mut Vec<u8>| v.truncate(5), UcxReason::Truncated { what: RKEY, len: 5, needed: 9 })]
#[case::empty_md_map(|v: &mut Vec<u8>| v[0] = 0, UcxReason::MalformedRkey("empty memory-domain map"))]
#[case::unknown_memory_type(|v: &mut Vec<u8>| v[8] = 9, UcxReason::MalformedRkey("unknown memory type"))]
#[case::cuda_memory(|v: &mut Vec<u8>| v[8] = 1, UcxReason::MalformedRkey("not host memory"))]
#[case::missing_entry(|v: &mut Vec<u8>| { v.pop(); }, UcxReason::Truncated { what: RKEY, len: 10, needed: 11 })]
#[case::entry_past_end(|v: &mut Vec<u8>| v[10] = 3, UcxReason::Truncated { what: RKEY, len: 11, needed: 14 })]
#[case::extra_md(|v: &mut Vec<u8>| v[0] = 0b111, UcxReason::Truncated { what: RKEY, len: 11, needed: 12 })]
#[case::trailing(|v: &mut Vec<u8>| v.push(0), UcxReason::Trailing { what: RKEY, extra: 1 })]
#[case::too_large(|v: &mut Vec<u8>| v.resize(MAX_UCX_RKEY + 1, 0), UcxReason::TooLarge { what: RKEY, len: MAX_UCX_RKEY + 1, max: MAX_UCX_RKEY })]
fn malformed_rkeys_are_refused(#[case] mutate: fn(&mut Vec<u8>), #[case] expected: UcxReason) {
    let mut v = unhex(RKEY_SHM);
    assert!(validate_rkey(&v, &Limits::new()).is_ok());
    mutate(&mut v);
    assert_eq!(validate_rkey(&v, &Limits::new()), Err(expected));
}

#[rstest]
#[case::posix_cma_self("posix,cma,self")]
#[case::tcp_self("tcp,self")]
fn every_truncation_and_flip_of_a_real_rkey_is_refused(#[case] tls: &str) {
    let ctx = Context::with_config(&ContextConfig::new().loopback_tls(tls)).unwrap();
    let w = ctx.create_worker().unwrap();
    let reg = ctx.register_anon(4096, AnonOptions::new()).unwrap();
    let k = reg.pack_rkey().unwrap();
    let v = k.ucx_bytes().to_vec();
    for cut in 0..v.len() {
        assert!(validate_rkey(&v[..cut], w.limits()).is_err(), "cut {cut}");
    }
    let mut long = v.clone();
    long.push(0);
    assert!(validate_rkey(&long, w.limits()).is_err());
    for i in 0..v.len() * 8 {
        let mut m = v.clone();
        m[i / 8] ^= 1 << (i % 8);
        // A flip inside a key's bytes would keep the shape; these keys are
        // empty, so every flip breaks the map, the type or a size.
        assert!(validate_rkey(&m, w.limits()).is_err(), "flip {i}");
    }
}

/// Real blobs of this host's UCX, in every shape its configuration can give
/// them: each validates (format bounds and local knowledge), and a second
/// worker connects, unpacks and puts through them.
#[rstest]
fn own_addresses_and_rkeys_validate_and_work(
    #[values("posix,cma,self", "tcp,self", "self", "sysv,posix,cma,self")] tls: &str,
    #[values("v1", "v2")] version: &str,
    #[values("n", "y")] debug_info: &str,
) {
    let mut config = ContextConfig::new()
        .loopback_tls(tls)
        .set("ADDRESS_VERSION", version)
        .set("ADDRESS_DEBUG_INFO", debug_info);
    if tls.contains("tcp") {
        config = config.error_mode(ErrorMode::Peer);
    }
    let ctx = Context::with_config(&config).unwrap();
    let target = ctx.create_worker().unwrap();
    // `self` reaches only its own worker.
    let source = if tls == "self" {
        target.clone()
    } else {
        ctx.create_worker().unwrap()
    };
    let a = target.address().unwrap();
    let expected = if version == "v1" {
        AddressVersion::V1
    } else {
        AddressVersion::V2
    };
    for limits in [&Limits::new(), target.limits(), source.limits()] {
        let shape = validate_worker_address(a.ucx_bytes(), limits).unwrap();
        assert_eq!(shape.version, expected);
    }
    assert_eq!(WorkerAddress::from_bytes(a.as_bytes()).unwrap(), a);
    let reg = ctx.register_anon(4096, AnonOptions::new()).unwrap();
    reg.fill(0, 4096, 0).unwrap();
    let k = reg.pack_rkey().unwrap();
    for limits in [&Limits::new(), target.limits(), source.limits()] {
        validate_rkey(k.ucx_bytes(), limits).unwrap();
    }
    assert_eq!(RkeyBuffer::from_bytes(k.as_bytes()).unwrap(), k);

    let ep = source.connect(&a).unwrap();
    let rkey = ep.unpack_rkey(&k).unwrap();
    let local = ctx.register_anon(4096, AnonOptions::new()).unwrap();
    local.write(0, b"kvcr-ucx").unwrap();
    let put = ep.put(&local, 0, 8, &rkey, 64).unwrap();
    let both = |c: &Completion| {
        source
            .progress_until(Duration::from_secs(10), || {
                target.progress();
                c.is_done()
            })
            .unwrap();
        c.result().unwrap().unwrap();
    };
    both(&put);
    both(&ep.flush().unwrap());
    let mut got = [0u8; 8];
    reg.read(64, &mut got).unwrap();
    assert_eq!(&got, b"kvcr-ucx");
}

/// With both fifo transports, a route's nonce may go through sysv, whose
/// segment names no process, while its puts go through cma to the pid the
/// address names: such an address cannot bind cma to the worker, and a
/// bound connect refuses it even as this host's own.
#[test]
fn cma_beside_a_sysv_fifo_is_refused() {
    let ctx =
        Context::with_config(&ContextConfig::new().loopback_tls("sysv,posix,cma,self")).unwrap();
    let target = ctx.create_worker().unwrap();
    let source = ctx.create_worker().unwrap();
    let a = target.address().unwrap();
    validate_worker_address(a.ucx_bytes(), &Limits::new()).expect("format-only check passes");
    validate_worker_address(a.ucx_bytes(), source.limits()).expect("well formed");
    assert!(matches!(
        validate_process_binding(a.ucx_bytes(), source.limits()),
        Err(UcxReason::MalformedAddress {
            problem: P::ForeignProcess { csum: CSUM_CMA, pid: Some(pid), owner: Some(owner) },
            ..
        }) if pid == std::process::id() && owner == pid
    ));
    assert!(source.connect_bound(&a).is_err());
    assert!(source.connect(&a).is_ok(), "plain connects do not ask");
}

/// Shapes only a peer that disagrees with this host (or lies) sends: each
/// passes the format-only check and is refused with this host's limits, by
/// `connect` and `unpack_rkey` too, before UCX sees it. (Each was an abort
/// or a crash inside UCX 1.13 before the local checks existed.)
#[test]
fn local_limits_refuse_what_this_host_would_not_produce() {
    let ctx = Context::with_config(&ContextConfig::new().loopback_tls("posix,cma,self")).unwrap();
    let target = ctx.create_worker().unwrap();
    let source = ctx.create_worker().unwrap();
    let own = target.address().unwrap().ucx_bytes().to_vec();
    assert_eq!(own.len(), unhex(V1_SHM).len(), "layout of V1_SHM");
    let limits = source.limits();
    assert_eq!(limits.md_count(), 3);
    let refused = |v: &[u8], expected: P| {
        validate_worker_address(v, &Limits::new()).expect("format-only check passes");
        assert_eq!(problem(v, limits), expected);
        let a = WorkerAddress::from_packed(ctx.id(), target.id(), v).unwrap();
        let e = source.connect(&a).unwrap_err();
        assert!(
            matches!(e.reason(), Some(UcxReason::MalformedAddress { problem, .. }) if *problem == expected),
            "{e}"
        );
    };
    // The cma device moved to md 0 (self's): UCX would parse cma's iface
    // bytes with the wrong component (it asserted in mm_posix.c).
    let mut v = own.clone();
    v[75] = 0x00;
    refused(
        &v,
        P::TransportMd {
            csum: CSUM_CMA,
            index: 0,
        },
    );
    // An md index past this host's md range.
    let mut v = own.clone();
    v[75] = 0x03;
    refused(&v, P::MdIndex { index: 3, limit: 3 });
    // A posix fifo segment id without its procfs/shm_open mode bits: 1.13
    // asserts `dir != NULL` attaching it.
    let mut v = own.clone();
    v[74] = 0x00;
    refused(
        &v,
        P::PosixSegment {
            flags: 0,
            expected: 0b1100,
        },
    );
    // A cma iface address one byte longer than this host's.
    let mut v = own.clone();
    v[103] = 0x85;
    v.push(0);
    refused(
        &v,
        P::IfaceAddressLength {
            csum: CSUM_CMA,
            len: 5,
            expected: 4,
        },
    );

    // A cma iface naming another process than the one the posix fifo
    // belongs to (a member pairing its own fifo, which a route's nonce
    // reaches, with another runner's pid, which cma puts would reach).
    let unbound = |v: &[u8], expected: P| {
        validate_worker_address(v, limits).expect("well formed");
        assert!(matches!(
            validate_process_binding(v, limits),
            Err(UcxReason::MalformedAddress { problem, .. }) if problem == expected
        ));
        let a = WorkerAddress::from_packed(ctx.id(), target.id(), v).unwrap();
        let e = source.connect_bound(&a).unwrap_err();
        assert!(
            matches!(e.reason(), Some(UcxReason::MalformedAddress { problem, .. }) if *problem == expected),
            "{e}"
        );
    };
    validate_process_binding(&own, limits).expect("this host's own address is bound");
    let pid = |v: &[u8]| u32::from_le_bytes(v[104..108].try_into().unwrap());
    assert_eq!(pid(&own), std::process::id(), "layout of the cma iface");
    let mut v = own.clone();
    v[104] ^= 0x01;
    unbound(
        &v,
        P::ForeignProcess {
            csum: CSUM_CMA,
            pid: Some(pid(&v)),
            owner: Some(pid(&own)),
        },
    );
    // The fifo's own pid changed instead: the same mismatch, seen from the
    // other side.
    let mut v = own.clone();
    v[67] ^= 0x01;
    unbound(
        &v,
        P::ForeignProcess {
            csum: CSUM_CMA,
            pid: Some(pid(&own)),
            owner: Some(pid(&own) ^ 0x01),
        },
    );

    // A cma iface claiming another capability bit.
    let mut v = own.clone();
    v[100] ^= 0x01;
    let caps = |v: &[u8]| u32::from_le_bytes(v[99..103].try_into().unwrap()) & !0xff;
    refused(
        &v,
        P::IfaceCaps {
            csum: CSUM_CMA,
            caps: caps(&v),
            expected: caps(&own),
        },
    );
    // Another address version than this host's.
    refused(
        &unhex(V2_SHM),
        P::OtherVersion {
            version: AddressVersion::V2,
            expected: AddressVersion::V1,
        },
    );

    // Rkeys: an entry for posix (md 1), which this host never registers
    // host memory with (1.13 asserted or segfaulted unpacking one), a wrong
    // key size, an md past the range.
    let a = target.address().unwrap();
    let ep = source.connect(&a).unwrap();
    let reg = ctx.register_anon(4096, AnonOptions::new()).unwrap();
    let base = reg.as_ptr() as u64;
    let rkey_refused = |v: &[u8], expected: UcxReason| {
        validate_rkey(v, &Limits::new()).expect("format-only check passes");
        assert_eq!(validate_rkey(v, limits), Err(expected.clone()));
        let k = RkeyBuffer::from_packed(ctx.id(), base, 4096, v).unwrap();
        let e = ep.unpack_rkey(&k).unwrap_err();
        assert_eq!(e.reason(), Some(&expected));
    };
    let mut posix = 0b111u64.to_le_bytes().to_vec();
    posix.extend_from_slice(&[0, 0, 24]);
    posix.extend_from_slice(&[0xc5; 24]);
    posix.push(0);
    rkey_refused(
        &posix,
        UcxReason::ForeignRkeyEntry {
            md: 1,
            size: 24,
            expected: None,
        },
    );
    let mut sized = 0b101u64.to_le_bytes().to_vec();
    sized.extend_from_slice(&[0, 0, 8]);
    sized.extend_from_slice(&[0; 8]);
    rkey_refused(
        &sized,
        UcxReason::ForeignRkeyEntry {
            md: 2,
            size: 8,
            expected: Some(0),
        },
    );
    let mut past = 0b1001u64.to_le_bytes().to_vec();
    past.extend_from_slice(&[0, 0, 0]);
    rkey_refused(&past, UcxReason::RkeyMdIndex { index: 3, limit: 3 });
}

/// The fuzzer's first find (`ucx_envelope`, about 950 000 executions in): a
/// v2 address whose posix iface says segment size 0 (and priority 2) made
/// UCX 1.13 assert `rkey_size <= am.max_bcopy` in `ucp_ep_config_init`,
/// under `ucp_ep_create`. It is refused against this host's v1 limits (other
/// version) and against v2 limits (other attributes), never parsed by UCX.
#[test]
fn fuzz_find_v2_posix_segment_size_zero_is_refused() {
    let mut found = unhex(V2_SHM);
    found[12..14].copy_from_slice(&[0x75, 0x63]);
    found[46] = 0x02;
    found[47..49].copy_from_slice(&[0, 0]);
    found[82] = 0x1b;
    validate_worker_address(&found, &Limits::new()).expect("well formed");
    for version in ["v1", "v2"] {
        let ctx = Context::with_config(
            &ContextConfig::new()
                .loopback_tls("posix,cma,self")
                .set("ADDRESS_VERSION", version),
        )
        .unwrap();
        let target = ctx.create_worker().unwrap();
        let source = ctx.create_worker().unwrap();
        let expected = if version == "v1" {
            P::OtherVersion {
                version: AddressVersion::V2,
                expected: AddressVersion::V1,
            }
        } else {
            let own = target.address().unwrap().packed().to_vec();
            assert_eq!(own.len(), found.len(), "layout of V2_SHM");
            P::IfaceCaps {
                csum: 0xd3a7,
                caps: u32::from_le_bytes([0, 0, found[49], found[50]]),
                expected: u32::from_le_bytes(own[47..51].try_into().unwrap()),
            }
        };
        assert_eq!(problem(&found, source.limits()), expected, "{version}");
        let a = WorkerAddress::from_packed(ctx.id(), target.id(), &found).unwrap();
        let e = source.connect(&a).unwrap_err();
        assert!(
            matches!(e.reason(), Some(UcxReason::MalformedAddress { problem, .. }) if *problem == expected),
            "{e}"
        );
    }
}

/// Every mutation family of a real blob: single-bit flips, bytes set to
/// 0x00/0xff, truncations, byte insertions, byte deletions.
fn mutations(base: &[u8], rng: &mut Rng) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for bit in 0..base.len() * 8 {
        let mut m = base.to_vec();
        m[bit / 8] ^= 1 << (bit % 8);
        out.push(m);
    }
    for i in 0..base.len() {
        for value in [0x00, 0xff] {
            let mut m = base.to_vec();
            m[i] = value;
            out.push(m);
        }
        out.push(base[..i].to_vec());
        let mut m = base.to_vec();
        m.insert(i, rng.next() as u8);
        out.push(m);
        let mut m = base.to_vec();
        m.remove(i);
        out.push(m);
    }
    out
}

/// Progresses both workers until neither has made progress for a while.
/// Over tcp, the target answers each connection attempt with a wire-up reply
/// of its own; UCX 1.13 asserts in `ucp_worker_destroy` if such a reply is
/// still queued when the worker goes (whatever the address was).
pub(super) fn settle(source: &Worker, target: &Worker) {
    let mut quiet = 0;
    let _ = source.progress_until(Duration::from_secs(5), || {
        if source.progress() + target.progress() == 0 {
            quiet += 1;
        } else {
            quiet = 0;
        }
        quiet > 2000
    });
}

/// A few hundred to a few thousand mutations of a real address and a real
/// rkey go through the validator; whatever it accepts goes through the real
/// `Worker::connect` / `Endpoint::unpack_rkey` in this process. UCX 1.13
/// aborts the process on the shapes the validator exists to refuse, so this
/// test passing means none got through.
#[rstest]
#[case::posix_cma_self("posix,cma,self")]
#[case::tcp_self("tcp,self")]
fn mutated_blobs_never_abort_ucx(#[case] tls: &str) {
    let mut config = ContextConfig::new().loopback_tls(tls);
    if tls.contains("tcp") {
        // Force-close the endpoints of mutated addresses at once.
        config = config.error_mode(ErrorMode::Peer);
    }
    let ctx = Context::with_config(&config).unwrap();
    let target = ctx.create_worker().unwrap();
    let source = ctx.create_worker().unwrap();
    let reg = ctx.register_anon(4096, AnonOptions::new()).unwrap();
    let address = target.address().unwrap();
    let rkey = reg.pack_rkey().unwrap();
    let good = source.connect(&address).unwrap();
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);

    let (mut tried, mut accepted, mut connected) = (0usize, 0usize, 0usize);
    for m in mutations(address.ucx_bytes(), &mut rng) {
        tried += 1;
        if validate_worker_address(&m, source.limits()).is_err() {
            continue;
        }
        accepted += 1;
        let a = WorkerAddress::from_packed(ctx.id(), target.id(), &m).unwrap();
        if let Ok(ep) = source.connect(&a) {
            connected += 1;
            ep.set_close_mode(CloseMode::Force);
            drop(ep.unpack_rkey(&rkey));
            for _ in 0..4 {
                source.progress();
                target.progress();
            }
        }
    }
    settle(&source, &target);
    assert!(tried > 1000, "{tried}");
    assert!(accepted > 100 && connected > 10, "{accepted} {connected}");

    // Rkeys: the mutation families, plus every md map over this host's md
    // range with empty and posix-sized keys (the shapes that crashed 1.13).
    let mut keys = mutations(rkey.ucx_bytes(), &mut rng);
    for map in 1u64..16 {
        for size in [0u8, 8, 24] {
            let mut m = map.to_le_bytes().to_vec();
            m.push(0);
            for _ in 0..map.count_ones() {
                m.push(size);
                m.extend(std::iter::repeat_n(0xc5, usize::from(size)));
            }
            keys.push(m);
        }
    }
    let (mut rkeys_accepted, mut unpacked) = (0usize, 0usize);
    for m in keys {
        if validate_rkey(&m, source.limits()).is_err() {
            continue;
        }
        rkeys_accepted += 1;
        let k = RkeyBuffer::from_packed(ctx.id(), reg.as_ptr() as u64, 4096, &m).unwrap();
        if good.unpack_rkey(&k).is_ok() {
            unpacked += 1;
        }
    }
    assert!(
        rkeys_accepted >= 1 && unpacked >= 1,
        "{rkeys_accepted} {unpacked}"
    );
    drop(good);
    settle(&source, &target);
    // Nothing recorded on the way is an abort; drop errors are allowed
    // (endpoints to mutated addresses may not close cleanly).
    let _ = ctx.take_drop_errors();
}

/// UCX's unified mode packs iface entries without lengths or attributes (the
/// receiver takes them from its own resources), which this parse does not
/// read; a unified-mode worker's own address does not walk, so no such worker
/// is built (and no peer is parsed with the wrong rules).
#[rstest]
fn unified_mode_workers_are_refused(
    #[values("posix,cma,self", "tcp,self", "self", "sysv,posix,cma,self")] tls: &str,
) {
    let ctx = Context::with_config(
        &ContextConfig::new()
            .loopback_tls(tls)
            .set("UNIFIED_MODE", "y"),
    )
    .unwrap();
    let e = ctx.create_worker().unwrap_err();
    assert!(
        matches!(e.reason(), Some(UcxReason::MalformedAddress { .. })),
        "{e}"
    );
}

/// A worker on this host's shared memory attaches it; one on tcp, or whose
/// shared-memory ifaces are on another host's device (another system id),
/// does not; without local limits nothing does.
#[test]
fn only_this_hosts_shared_memory_attaches() {
    let shm = Context::with_config(&ContextConfig::new().loopback_tls("posix,cma,self")).unwrap();
    let tcp = Context::with_config(&ContextConfig::new().loopback_tls("tcp,posix,self")).unwrap();
    let (target, source) = (shm.create_worker().unwrap(), tcp.create_worker().unwrap());
    let tcp_only = Context::with_config(&ContextConfig::new().loopback_tls("tcp,self"))
        .unwrap()
        .create_worker()
        .unwrap();
    let own = target.address().unwrap().ucx_bytes().to_vec();
    assert_eq!(own.len(), unhex(V1_SHM).len(), "layout of V1_SHM");
    assert!(attaches_shared_memory(&own, source.limits()));
    assert!(attaches_shared_memory(&own, target.limits()));
    assert!(!attaches_shared_memory(&own, &Limits::new()));
    let elsewhere = {
        let mut v = own.clone();
        v[40] ^= 0x01; // the posix device's system id
        v[77] ^= 0x01; // the cma device's
        v
    };
    assert!(!attaches_shared_memory(&elsewhere, target.limits()));
    let tcp_address = tcp_only.address().unwrap().ucx_bytes().to_vec();
    assert!(!attaches_shared_memory(&tcp_address, source.limits()));
    assert!(source.attaches_shared_memory(&target.address().unwrap()));
    assert!(!source.attaches_shared_memory(&tcp_only.address().unwrap()));
}
