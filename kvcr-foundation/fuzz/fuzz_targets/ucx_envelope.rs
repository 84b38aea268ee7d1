//! Arbitrary bytes to kvcr-ucx's checks of the blobs UCX 1.13 parses without
//! a length (a packed worker address, a packed rkey), and whatever they accept
//! to the real UCX parse: `Worker::connect` (`ucp_ep_create`) and
//! `Endpoint::unpack_rkey` (`ucp_ep_rkey_unpack`), in this process. UCX
//! asserts (SIGABRT) or crashes on the shapes the checks exist to refuse, so
//! a crash here is a shape that got through.
//!
//! The first byte picks what the rest is: 0 a packed address, 1 a packed
//! rkey, 2 / 3 an edit script applied to this process's own live address /
//! rkey (so the fuzzer starts from blobs that reach deep into UCX). The whole
//! input is also tried as the travelling envelopes.
#![no_main]

use kvcr_ucx::{
    AnonOptions, CloseMode, Context, ContextConfig, Endpoint, Limits, Registration, RkeyBuffer,
    UcxReason, Worker, WorkerAddress, validate_rkey, validate_worker_address,
};
use libfuzzer_sys::fuzz_target;

/// A UCX context: a target worker with a registration, and a source worker
/// connected to it. Rebuilt after [`CONNECTS_PER_FIXTURE`] successful
/// connects: UCX 1.13 keeps about 8 MiB of fresh posix shared memory (four
/// mappings) per endpoint that connected to a live worker and unpacked an
/// rkey, until the workers are destroyed, and the process would run out of
/// mappings (`vm.max_map_count`) after some 16 000.
struct Fixture {
    ctx: Context,
    target: Worker,
    source: Worker,
    reg: Registration<'static>,
    address: WorkerAddress,
    rkey: RkeyBuffer,
    good: Endpoint,
    connects: std::cell::Cell<u32>,
}

const CONNECTS_PER_FIXTURE: u32 = 1000;

fn fixture() -> Fixture {
    let ctx = Context::with_config(&ContextConfig::new().loopback_tls("posix,cma,self"))
        .expect("UCX context (posix,cma,self)");
    let target = ctx.create_worker().expect("target worker");
    let source = ctx.create_worker().expect("source worker");
    let reg = ctx
        .register_anon(4096, AnonOptions::new())
        .expect("registration");
    let address = target.address().expect("own address");
    let rkey = reg.pack_rkey().expect("own rkey");
    let good = source.connect(&address).expect("connect to own address");
    Fixture {
        ctx,
        target,
        source,
        reg,
        address,
        rkey,
        good,
        connects: std::cell::Cell::new(0),
    }
}

thread_local! {
    static FIXTURE: std::cell::RefCell<Option<Fixture>> = const { std::cell::RefCell::new(None) };
}

/// Applies an edit script to `base`: each 3-byte step `(op, position, value)`
/// sets, xors, inserts or removes one byte, or truncates.
fn edit(base: &[u8], script: &[u8]) -> Vec<u8> {
    let mut v = base.to_vec();
    for step in script.chunks_exact(3) {
        let (op, at, value) = (step[0], usize::from(step[1]), step[2]);
        match op % 5 {
            0 if !v.is_empty() => {
                let i = at % v.len();
                v[i] = value;
            }
            1 if !v.is_empty() => {
                let i = at % v.len();
                v[i] ^= value;
            }
            2 => v.insert(at % (v.len() + 1), value),
            3 if !v.is_empty() => {
                v.remove(at % v.len());
            }
            4 => v.truncate(at % (v.len() + 1)),
            _ => {}
        }
    }
    v
}

impl Fixture {
    /// Lets both workers settle, so the endpoints close without waiting for
    /// a peer nobody progresses, then tears everything down.
    fn retire(self) {
        for _ in 0..256 {
            self.source.progress();
            self.target.progress();
        }
    }

    fn address(&self, packed: &[u8]) {
        let loose = validate_worker_address(packed, &Limits::new());
        let strict = validate_worker_address(packed, self.source.limits());
        // Local knowledge only narrows what the format allows.
        assert!(strict.is_err() || loose.is_ok());
        match WorkerAddress::from_packed(self.ctx.id(), self.target.id(), packed) {
            Ok(a) => {
                assert!(loose.is_ok());
                self.connect(&a, strict.is_ok());
            }
            Err(_) => assert!(loose.is_err()),
        }
    }

    fn connect(&self, a: &WorkerAddress, accepted: bool) {
        match self.source.connect(a) {
            Ok(ep) => {
                assert!(accepted, "connect went to UCX with a refused address");
                self.connects.set(self.connects.get() + 1);
                ep.set_close_mode(CloseMode::Force);
                drop(ep.unpack_rkey(&self.rkey));
                for _ in 0..4 {
                    self.source.progress();
                    self.target.progress();
                }
            }
            Err(e) => {
                let refused = matches!(e.reason(), Some(UcxReason::MalformedAddress { .. }));
                assert_eq!(refused, !accepted, "{e}");
            }
        }
    }

    fn rkey(&self, packed: &[u8]) {
        let loose = validate_rkey(packed, &Limits::new());
        let strict = validate_rkey(packed, self.source.limits());
        assert!(strict.is_err() || loose.is_ok());
        let base = self.reg.as_ptr() as u64;
        match RkeyBuffer::from_packed(self.ctx.id(), base, 4096, packed) {
            Ok(k) => {
                assert!(loose.is_ok());
                let unpacked = self.good.unpack_rkey(&k);
                if strict.is_err() {
                    assert!(unpacked.is_err(), "unpack went to UCX with a refused rkey");
                }
            }
            Err(_) => assert!(loose.is_err()),
        }
    }
}

// UCX's memory hooks off before libucs loads (they do not survive
// AddressSanitizer), its log level down, and its own leaks suppressed: the
// process-level setup every fuzz target that loads UCX needs.
kvcr_ucx::fuzz_process_setup!();

fuzz_target!(|data: &[u8]| {
    FIXTURE.with_borrow_mut(|slot| {
        if slot
            .as_ref()
            .is_none_or(|f| f.connects.get() >= CONNECTS_PER_FIXTURE)
        {
            // The old fixture (if any) is torn down first.
            if let Some(old) = slot.take() {
                old.retire();
            }
            *slot = Some(fixture());
        }
        let Some(f) = slot.as_ref() else {
            return;
        };
        // The travelling forms (envelope, checksum, then the packed blob).
        if let Ok(a) = WorkerAddress::from_bytes(data) {
            let accepted = validate_worker_address(a.packed(), f.source.limits()).is_ok();
            f.connect(&a, accepted);
        }
        if let Ok(k) = RkeyBuffer::from_bytes(data) {
            drop(f.good.unpack_rkey(&k));
        }
        let Some((&mode, rest)) = data.split_first() else {
            return;
        };
        match mode % 4 {
            0 => f.address(rest),
            1 => f.rkey(rest),
            2 => f.address(&edit(f.address.packed(), rest)),
            _ => f.rkey(&edit(f.rkey.packed(), rest)),
        }
    });
});
