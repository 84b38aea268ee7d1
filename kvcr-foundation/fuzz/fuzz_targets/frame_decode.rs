//! Feeds arbitrary bytes to the control-frame decoder: as a whole frame, as a
//! frame body behind a correct length prefix (so the fuzzer spends its time in
//! field decoding, not in guessing lengths), and as a stream.
//! Whatever decodes must re-encode to a frame that decodes to the same message.
#![no_main]

use bytes::BytesMut;
use kvcr_contracts::protocol::codec::FrameCodec;
use libfuzzer_sys::fuzz_target;

fn check(codec: &FrameCodec, frame: &[u8]) {
    if let Ok(message) = codec.decode_frame(frame) {
        let again = codec.encode_to_vec(&message).expect("a decoded message re-encodes");
        assert_eq!(codec.decode_frame(&again).expect("re-encoded frame decodes"), message);
    }
}

fuzz_target!(|data: &[u8]| {
    let codec = FrameCodec::default();
    check(&codec, data);
    let mut prefixed = (data.len() as u32).to_be_bytes().to_vec();
    prefixed.extend_from_slice(data);
    check(&codec, &prefixed);
    let mut buf = BytesMut::from(data);
    while let Ok(Some(_)) = codec.decode(&mut buf) {}
});
