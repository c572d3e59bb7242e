//! `Idempotency-Key` header values, as any client (or proxy) may send them.
//!
//! Never panics; an accepted key is 1 to 255 visible ASCII characters; and the RFC 9651 string
//! that serializes an accepted key parses back to the same key (quoted and bare forms agree).

#![no_main]

use libfuzzer_sys::fuzz_target;
use tower_idempotency::IdempotencyKey;

fuzz_target!(|value: &[u8]| {
    let Ok(key) = IdempotencyKey::parse(value) else {
        return;
    };
    let text = key.as_str();
    assert!(
        (1..=IdempotencyKey::MAX_LEN).contains(&text.len()),
        "{key:?}"
    );
    assert!(text.bytes().all(|b| b.is_ascii_graphic()), "{key:?}");

    let mut quoted = String::from("\"");
    for c in text.chars() {
        if c == '"' || c == '\\' {
            quoted.push('\\');
        }
        quoted.push(c);
    }
    quoted.push('"');
    assert_eq!(
        IdempotencyKey::parse(quoted.as_bytes()).as_ref(),
        Ok(&key),
        "{quoted}"
    );
});
