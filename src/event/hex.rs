//! Hex text: request hashes, digests, keys and signatures as operators
//! see and send them.
//!
//! One rule: decoding is strict (an even number of hex digits, nothing
//! else), so a key or signature never parses from damaged text.

/// Lowercase hex of `bytes` (two digits a byte).
pub fn encode(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Hex text to bytes; `None` unless it is an even number of hex digits.
pub fn decode(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|b| u8::from_str_radix(b, 16).ok()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_refuses_odd_or_non_hex_text() {
        assert_eq!(encode(&[0, 0xab, 0xff]), "00abff");
        assert_eq!(decode("00abff"), Some(vec![0, 0xab, 0xff]));
        assert_eq!(decode("ABff"), Some(vec![0xab, 0xff]));
        assert_eq!(decode("abc"), None);
        assert_eq!(decode("zz"), None);
        assert_eq!(decode(""), Some(vec![]));
    }
}
