//! The stored-response decoder: it reads bytes from Redis and Postgres, which anyone with access
//! to them can corrupt.
//!
//! Never panics, whatever the bytes; what it accepts encodes to a record that decodes to the
//! same response, and that encoding is stable.

#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use tower_idempotency::store::StoredResponse;

fuzz_target!(|record: &[u8]| {
    let Ok(response) = StoredResponse::decode(Bytes::copy_from_slice(record)) else {
        return;
    };
    let encoded = response.encode();
    let again = StoredResponse::decode(encoded.clone()).expect("an encoded response decodes");
    assert_eq!(again, response);
    assert_eq!(again.encode(), encoded);
});
