//! Block keys, namespaces and the page hash chain (contract cases 4 and 58).

use kvcr_contracts::error::KeyReason;
use kvcr_contracts::{BlockKey, CompatDigest, Error, Namespace, PageHashChain};
use proptest::prelude::*;
use rstest::rstest;
use serde_json::json;

/// Case 4: `hash_str_to_int64("ffff...f") == -1`, and signed/unsigned agree.
#[test]
fn all_f_digest_is_minus_one() {
    let key = BlockKey::from_hex_digest(&"f".repeat(64)).unwrap();
    assert_eq!(key.as_i64(), -1);
    assert_eq!(key, BlockKey::from_i64(-1));
    assert_eq!(key, BlockKey::from_u64(u64::MAX));
    assert_eq!(key, BlockKey::from_json(&json!(-1)).unwrap());
    assert_eq!(key, BlockKey::from_json(&json!(u64::MAX)).unwrap());
}

proptest! {
    #[test]
    fn signed_and_unsigned_forms_normalise(raw: u64) {
        let signed = raw as i64;
        prop_assert_eq!(BlockKey::from_i64(signed), BlockKey::from_u64(raw));
        prop_assert_eq!(BlockKey::from_wire_int(i128::from(signed)).unwrap(), BlockKey::from_u64(raw));
        prop_assert_eq!(BlockKey::from_wire_int(i128::from(raw)).unwrap(), BlockKey::from_u64(raw));
        prop_assert_eq!(BlockKey::from_json(&json!(signed)).unwrap(), BlockKey::from_json(&json!(raw)).unwrap());
        prop_assert_eq!(BlockKey::from_hex_digest(&format!("{raw:016x}")).unwrap().as_u64(), raw);
    }
}

#[rstest]
#[case::below_i64(i128::from(i64::MIN) - 1)]
#[case::above_u64(i128::from(u64::MAX) + 1)]
fn wire_int_out_of_range(#[case] raw: i128) {
    assert!(matches!(
        BlockKey::from_wire_int(raw),
        Err(Error::Key {
            reason: KeyReason::OutOfRange,
            ..
        })
    ));
}

/// The table of refused key spellings.
#[rstest]
#[case::bool(json!(true), KeyReason::Boolean)]
#[case::float(json!(1.5), KeyReason::OutOfRange)]
#[case::huge(json!(1e30), KeyReason::OutOfRange)]
#[case::junk(json!("xyz"), KeyReason::NotHex)]
#[case::empty(json!(""), KeyReason::NotHex)]
#[case::hex_then_junk(json!("12345678zz"), KeyReason::NotHex)]
#[case::signed_hex(json!("-1"), KeyReason::NotHex)]
#[case::null(json!(null), KeyReason::WrongType)]
#[case::list(json!([1]), KeyReason::WrongType)]
fn key_json_rejects(#[case] value: serde_json::Value, #[case] expected: KeyReason) {
    match BlockKey::from_json(&value) {
        Err(Error::Key { reason, .. }) => assert_eq!(reason, expected),
        other => panic!("{value}: {other:?}"),
    }
}

#[test]
fn only_first_16_hex_digits_matter() {
    let a = BlockKey::from_hex_digest("0123456789abcdef0000").unwrap();
    let b = BlockKey::from_hex_digest("0123456789ABCDEFffff").unwrap();
    assert_eq!(a, b);
    assert_eq!(a.as_u64(), 0x0123_4567_89ab_cdef);
}

fn tokens(n: u32) -> Vec<u32> {
    (0..n).map(|t| t.wrapping_mul(2_654_435_761)).collect()
}

/// Case 4: hashing page i with page i-1's digest as prior equals a fresh chain.
#[test]
fn resumed_chain_equals_fresh_chain() {
    let ns = Namespace::base(CompatDigest(7));
    let toks = tokens(64 * 5);
    let fresh = PageHashChain::new(&ns).pages(&toks, 64);
    assert_eq!(fresh.len(), 5);
    for i in 1..fresh.len() {
        let mut resumed = PageHashChain::resume(fresh[i - 1]);
        let page = resumed.next_page(&toks[i * 64..(i + 1) * 64]);
        assert_eq!(page, fresh[i], "page {i}");
    }
    // The router key is the digest's first 16 hex digits.
    for d in &fresh {
        assert_eq!(
            BlockKey::from_hex_digest(&d.to_hex()).unwrap(),
            d.block_key()
        );
    }
}

/// The base namespace leaves the engine's plain chain unchanged: page 0 is
/// sha256 of its u32-LE tokens, with no prior.
#[test]
fn base_namespace_chain_is_unseeded() {
    let page = PageHashChain::new(&Namespace::base(CompatDigest(0))).next_page(&[1, 2]);
    use sha2::Digest as _;
    let expected: [u8; 32] = sha2::Sha256::digest([1u8, 0, 0, 0, 2, 0, 0, 0]).into();
    assert_eq!(page.0, expected);
}

/// A partial tail page is not keyed.
#[test]
fn partial_tail_page_is_dropped() {
    let ns = Namespace::base(CompatDigest(1));
    assert_eq!(PageHashChain::new(&ns).pages(&tokens(130), 64).len(), 2);
    assert!(PageHashChain::new(&ns).pages(&tokens(10), 0).is_empty());
}

/// Case 58: the same tokens under another LoRA adapter or salt give other keys
/// and another namespace id, so they can never share a restore.
#[rstest]
#[case::lora(Some("adapter-a"), None)]
#[case::salt(None, Some("tenant-1"))]
#[case::both(Some("adapter-a"), Some("tenant-1"))]
fn lora_and_salt_change_every_key(#[case] lora: Option<&str>, #[case] salt: Option<&str>) {
    let base = Namespace::base(CompatDigest(9));
    let other = Namespace {
        lora_name: lora.map(str::to_owned),
        cache_salt: salt.map(str::to_owned),
        ..base.clone()
    };
    let toks = tokens(64 * 3);
    let a = PageHashChain::new(&base).pages(&toks, 64);
    let b = PageHashChain::new(&other).pages(&toks, 64);
    for (x, y) in a.iter().zip(&b) {
        assert_ne!(x.block_key(), y.block_key());
    }
    assert_ne!(base.id(), other.id());
}

#[test]
fn namespace_fields_do_not_collide_by_concatenation() {
    let a = Namespace {
        compat: CompatDigest(1),
        lora_name: Some("ab".into()),
        cache_salt: None,
    };
    let b = Namespace {
        compat: CompatDigest(1),
        lora_name: Some("a".into()),
        cache_salt: Some("b".into()),
    };
    let c = Namespace {
        compat: CompatDigest(1),
        lora_name: None,
        cache_salt: Some("ab".into()),
    };
    assert_ne!(a.id(), b.id());
    assert_ne!(a.id(), c.id());
    assert_ne!(a.chain_seed(), c.chain_seed());
    assert_ne!(
        Namespace::base(CompatDigest(1)).id(),
        Namespace::base(CompatDigest(2)).id()
    );
}

/// The namespace id is stable across builds and hosts: pin one value.
#[test]
fn namespace_id_is_stable() {
    insta::assert_snapshot!(
        "namespace_id_base_0x1234",
        format!("{:?}", Namespace::base(CompatDigest(0x1234)).id())
    );
}
