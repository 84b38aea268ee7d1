//! Feeds arbitrary text to the router-hint and endpoint parsers.
#![no_main]

use kvcr_contracts::{AdvertisePolicy, ControlEndpoint, FetchHint, HintEnvelope, WorkerEndpointMap};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(envelope) = HintEnvelope::from_json(text) {
        let again = HintEnvelope::from_json(&envelope.to_json()).expect("round trip parses");
        assert_eq!(again.to_json(), envelope.to_json());
        let _ = FetchHint::from_envelope(&envelope);
    }
    let _ = FetchHint::from_legacy_json(text);
    if let Ok(ep) = ControlEndpoint::parse(text) {
        assert_eq!(ControlEndpoint::parse(&ep.to_string()).expect("formatted endpoint parses"), ep);
    }
    let _ = WorkerEndpointMap::from_json(text, AdvertisePolicy::CrossHost);
});
