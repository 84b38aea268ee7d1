//! Unit tests of the UCX layer: struct layouts against the C compiler's view,
//! status mapping, envelopes, and the type-level threading contract.

use std::mem::{align_of, offset_of, size_of};

use super::packed::{Limits, MAX_UCX_RKEY};
use super::packed_tests::sample_address;
use super::*;

fn check_ucx_rkey(b: &[u8]) -> std::result::Result<packed::RkeyShape, UcxReason> {
    validate_rkey(b, &Limits::new())
}

/// Sizes and offsets of the structs the safe layer fills in, as `gcc` reports
/// them for Debian's 1.13.1 headers on x86_64 (`sizeof`/`offsetof` probe).
/// bindgen's own compile-time asserts in `bindings_1_13.rs` check every
/// struct against clang; this pins the ones we pass to UCX against a second
/// compiler, by hand.
#[test]
fn layout_of_the_structs_we_pass_matches_the_c_headers() {
    assert_eq!(size_of::<sys::ucp_params_t>(), 80);
    assert_eq!(align_of::<sys::ucp_params_t>(), 8);
    assert_eq!(offset_of!(sys::ucp_params_t, field_mask), 0);
    assert_eq!(offset_of!(sys::ucp_params_t, features), 8);
    assert_eq!(offset_of!(sys::ucp_params_t, mt_workers_shared), 48);
    assert_eq!(offset_of!(sys::ucp_params_t, name), 72);

    assert_eq!(size_of::<sys::ucp_worker_params_t>(), 200);
    assert_eq!(offset_of!(sys::ucp_worker_params_t, thread_mode), 8);

    assert_eq!(size_of::<sys::ucp_ep_params_t>(), 104);
    assert_eq!(offset_of!(sys::ucp_ep_params_t, address), 8);
    assert_eq!(offset_of!(sys::ucp_ep_params_t, err_mode), 16);
    assert_eq!(offset_of!(sys::ucp_ep_params_t, err_handler), 24);
    assert_eq!(size_of::<sys::ucp_err_handler_t>(), 16);

    assert_eq!(size_of::<sys::ucp_mem_map_params_t>(), 40);
    assert_eq!(offset_of!(sys::ucp_mem_map_params_t, address), 8);
    assert_eq!(offset_of!(sys::ucp_mem_map_params_t, length), 16);
    assert_eq!(offset_of!(sys::ucp_mem_map_params_t, flags), 24);

    assert_eq!(size_of::<sys::ucp_request_param_t>(), 72);
    assert_eq!(align_of::<sys::ucp_request_param_t>(), 8);
    assert_eq!(offset_of!(sys::ucp_request_param_t, op_attr_mask), 0);
    assert_eq!(offset_of!(sys::ucp_request_param_t, flags), 4);
    assert_eq!(offset_of!(sys::ucp_request_param_t, request), 8);
    assert_eq!(offset_of!(sys::ucp_request_param_t, cb), 16);
    assert_eq!(offset_of!(sys::ucp_request_param_t, datatype), 24);
    assert_eq!(offset_of!(sys::ucp_request_param_t, user_data), 32);
    assert_eq!(offset_of!(sys::ucp_request_param_t, reply_buffer), 40);
    assert_eq!(offset_of!(sys::ucp_request_param_t, memory_type), 48);
    assert_eq!(offset_of!(sys::ucp_request_param_t, recv_info), 56);
    assert_eq!(offset_of!(sys::ucp_request_param_t, memh), 64);

    // `ucs_status_t` is a packed enum: one signed byte.
    assert_eq!(size_of::<sys::ucs_status_t>(), 1);
    assert_eq!(sys::UCS_ERR_LAST, -100);
}

#[test]
fn runtime_library_is_at_least_the_header_version() {
    let (major, minor, _) = library_version();
    assert!((major, minor) >= (sys::UCP_API_MAJOR, sys::UCP_API_MINOR));
}

#[test]
fn every_status_code_round_trips_and_the_named_ones_are_named() {
    for raw in i8::MIN..=i8::MAX {
        let s = UcsStatus::from_raw(raw);
        assert_eq!(s.raw(), raw, "{s:?}");
        assert!(!s.to_string().is_empty());
    }
    // Every named code of the 1.13 header maps to a named variant.
    let named: &[i8] = &[
        0, 1, -1, -2, -3, -4, -5, -6, -7, -8, -9, -10, -11, -12, -13, -14, -15, -16, -17, -18, -19,
        -20, -21, -22, -23, -24, -25, -40, -59, -60, -80, -89, -100,
    ];
    for &raw in named {
        let s = UcsStatus::from_raw(raw);
        assert!(
            !matches!(
                s,
                UcsStatus::Unknown(_) | UcsStatus::LinkFailure(_) | UcsStatus::EndpointFailure(_)
            ),
            "{raw} is named in the headers but mapped to {s:?}"
        );
    }
    assert_eq!(UcsStatus::from_raw(-7), UcsStatus::InvalidAddr);
    assert_eq!(UcsStatus::from_raw(-45), UcsStatus::LinkFailure(-45));
    assert_eq!(UcsStatus::from_raw(-70), UcsStatus::EndpointFailure(-70));
    assert_eq!(UcsStatus::from_raw(-30), UcsStatus::Unknown(-30));
    assert_eq!(UcsStatus::from_raw(5), UcsStatus::Unknown(5));
    assert!(UcsStatus::EndpointTimeout.is_endpoint_failure());
    assert!(UcsStatus::LinkFailure(-45).is_link_failure());
    assert!(UcsStatus::ConnectionReset.is_peer_failure());
    assert!(!UcsStatus::InvalidParam.is_peer_failure());
}

#[test]
fn status_descriptions_match_ucs_status_string() {
    for raw in -100i8..=1 {
        let ours = UcsStatus::from_raw(raw);
        if matches!(ours, UcsStatus::Unknown(_)) {
            continue;
        }
        // SAFETY: `ucs_status_string` returns a pointer to a static
        // NUL-terminated string for any code.
        let theirs = unsafe { std::ffi::CStr::from_ptr(sys::ucs_status_string(raw)) };
        let theirs = theirs.to_string_lossy();
        if theirs.starts_with("Unknown error") {
            // Range markers and unnamed codes: UCX has no text, ours is a
            // classification ("Link failure", "Endpoint failure", …).
            continue;
        }
        assert_eq!(ours.description(), theirs, "code {raw}");
    }
}

#[test]
fn error_variant_carries_op_and_status() {
    let e = check("ucp_mem_map", sys::UCS_ERR_NO_MEMORY).unwrap_err();
    assert_eq!(e.status(), Some(UcsStatus::NoMemory));
    assert_eq!(e.to_string(), "UCX ucp_mem_map: Out of memory (-4)");
    assert!(check("x", sys::UCS_OK).is_ok());
}

fn sample_ucx_rkey() -> Vec<u8> {
    // md_map with bits 0 and 3, host memory, sizes 4 and 2.
    let mut v = 0b1001u64.to_le_bytes().to_vec();
    v.push(0);
    v.extend_from_slice(&[4, 1, 2, 3, 4]);
    v.extend_from_slice(&[2, 9, 9]);
    v
}

#[test]
fn worker_address_envelope_round_trips_and_refuses_every_truncation() {
    let ucx = sample_address();
    let a = WorkerAddress::seal(7, 9, &ucx).unwrap();
    let b = WorkerAddress::from_bytes(a.as_bytes()).unwrap();
    assert_eq!(a, b);
    assert_eq!((b.context_id(), b.worker_id()), (7, 9));
    assert_eq!(b.ucx_bytes(), ucx.as_slice());
    assert_eq!(WorkerAddress::from_packed(7, 9, &ucx).unwrap(), a);
    // A well-framed envelope around a malformed UCX address is refused too.
    assert!(matches!(
        WorkerAddress::seal(7, 9, &[1, 2, 3, 4, 5])
            .unwrap_err()
            .reason(),
        Some(UcxReason::MalformedAddress { .. })
    ));
    for cut in 0..a.as_bytes().len() {
        let e = WorkerAddress::from_bytes(&a.as_bytes()[..cut]).unwrap_err();
        assert!(e.reason().is_some(), "cut {cut}: {e}");
    }
    let mut long = a.as_bytes().to_vec();
    long.push(0);
    assert!(matches!(
        WorkerAddress::from_bytes(&long).unwrap_err().reason(),
        Some(UcxReason::Trailing { .. })
    ));
    for i in 0..a.as_bytes().len() {
        let mut flipped = a.as_bytes().to_vec();
        flipped[i] ^= 0x40;
        assert!(WorkerAddress::from_bytes(&flipped).is_err(), "flip at {i}");
    }
}

#[test]
fn rkey_envelope_round_trips_and_refuses_garbage() {
    let k = RkeyBuffer::seal(7, 0x1000, 4096, &sample_ucx_rkey()).unwrap();
    let k2 = RkeyBuffer::from_bytes(k.as_bytes()).unwrap();
    assert_eq!(k, k2);
    assert_eq!((k2.context_id(), k2.base(), k2.len()), (7, 0x1000, 4096));
    for cut in 0..k.as_bytes().len() {
        assert!(
            RkeyBuffer::from_bytes(&k.as_bytes()[..cut]).is_err(),
            "cut {cut}"
        );
    }
    for i in 0..k.as_bytes().len() {
        let mut flipped = k.as_bytes().to_vec();
        flipped[i] ^= 1;
        assert!(RkeyBuffer::from_bytes(&flipped).is_err(), "flip at {i}");
    }
    // Pseudo-random garbage of many lengths never parses and never panics.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for len in 0..600 {
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        assert!(RkeyBuffer::from_bytes(&bytes).is_err());
        assert!(WorkerAddress::from_bytes(&bytes).is_err());
    }
    // A worker address is not an rkey.
    let a = WorkerAddress::seal(7, 9, &sample_address()).unwrap();
    assert!(matches!(
        RkeyBuffer::from_bytes(a.as_bytes()).unwrap_err().reason(),
        Some(UcxReason::Magic { .. })
    ));
}

#[test]
fn packed_ucx_rkey_structure_is_checked() {
    assert!(check_ucx_rkey(&sample_ucx_rkey()).is_ok());
    let mut v = sample_ucx_rkey();
    v.pop();
    assert!(check_ucx_rkey(&v).is_err(), "short md entry");
    let mut v = sample_ucx_rkey();
    v.push(0);
    assert!(matches!(
        check_ucx_rkey(&v),
        Err(UcxReason::Trailing { .. })
    ));
    let mut v = sample_ucx_rkey();
    v[8] = 9; // memory type past UCS_MEMORY_TYPE_LAST
    assert!(check_ucx_rkey(&v).is_err());
    let mut v = sample_ucx_rkey();
    v[..8].copy_from_slice(&0u64.to_le_bytes());
    assert!(check_ucx_rkey(&v).is_err(), "empty md map");
    let mut v = sample_ucx_rkey();
    v[..8].copy_from_slice(&u64::MAX.to_le_bytes()); // claims 64 domains
    assert!(check_ucx_rkey(&v).is_err());
    assert!(check_ucx_rkey(&vec![0; MAX_UCX_RKEY + 1]).is_err());
    assert!(RkeyBuffer::seal(1, 0, 1, &[1, 2]).is_err());
    // Region extent overflow is refused on parse.
    let k = RkeyBuffer::seal(7, u64::MAX, 2, &sample_ucx_rkey()).unwrap();
    assert!(RkeyBuffer::from_bytes(k.as_bytes()).is_err());
}

/// `Worker`, `Endpoint`, `Registration`, `RemoteKey`, `Completion` and
/// `Context` must not be `Send`: UCX is told the worker has one thread.
/// (Ambiguity trick: `<T as AmbiguousIfSend<_>>::some_item` resolves only
/// when exactly one impl applies, i.e. when `T` is not `Send`.)
#[test]
fn ucx_handles_are_not_send_but_blobs_are() {
    trait AmbiguousIfSend<A> {
        fn some_item() {}
    }
    impl<T: ?Sized> AmbiguousIfSend<()> for T {}
    #[allow(dead_code)]
    struct Invalid;
    impl<T: ?Sized + Send> AmbiguousIfSend<Invalid> for T {}

    <Context as AmbiguousIfSend<_>>::some_item();
    <Worker as AmbiguousIfSend<_>>::some_item();
    <Endpoint as AmbiguousIfSend<_>>::some_item();
    <RemoteKey as AmbiguousIfSend<_>>::some_item();
    <Registration<'static> as AmbiguousIfSend<_>>::some_item();
    <Completion as AmbiguousIfSend<_>>::some_item();

    fn is_send<T: Send + Sync>() {}
    is_send::<WorkerAddress>();
    is_send::<RkeyBuffer>();
    is_send::<crate::Error>();
}

#[test]
fn config_override_with_a_bad_value_is_a_typed_error() {
    let e =
        Context::with_config(&ContextConfig::new().set("RNDV_THRESH", "not-a-size")).unwrap_err();
    assert!(e.status().is_some(), "{e}");
}

#[test]
fn empty_registrations_are_refused() {
    let ctx = Context::with_config(&ContextConfig::new().loopback_tls("self")).unwrap();
    let e = ctx.register_anon(0, AnonOptions::new()).unwrap_err();
    assert_eq!(e.reason(), Some(&UcxReason::EmptyRegion));
    assert!(ctx.register_vec(Vec::new()).is_err());
    let mut empty: [u8; 0] = [];
    ctx.scope(|s| {
        let e = s.register(&mut empty).unwrap_err();
        assert_eq!(e.reason(), Some(&UcxReason::EmptyRegion));
    });
}

#[test]
fn wait_without_progress_times_out_with_a_typed_error() {
    let ctx = Context::with_config(&ContextConfig::new().loopback_tls("self")).unwrap();
    let w = ctx.create_worker().unwrap();
    assert!(w.event_fd().is_some());
    let e = w
        .progress_until(std::time::Duration::from_millis(20), || false)
        .unwrap_err();
    assert!(
        matches!(e.reason(), Some(UcxReason::WaitTimeout { .. })),
        "{e}"
    );
}

/// With `ucx-bindgen`, the bindings are regenerated from the installed
/// headers at build time; they must equal the committed ones.
#[cfg(feature = "ucx-bindgen")]
#[test]
fn committed_bindings_match_freshly_generated_ones() {
    assert_eq!(
        include_str!(concat!(env!("OUT_DIR"), "/ucx_bindings.rs")),
        include_str!("bindings_1_13.rs"),
        "regenerate: KVCR_UCX_BINDINGS_OUT=$PWD/kvcr-foundation/ucx/src/bindings_1_13.rs \
         cargo build -p kvcr-ucx --features ucx-bindgen"
    );
}
