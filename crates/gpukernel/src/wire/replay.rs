//! A bounded memory of the signatures already accepted, so a captured message sent again
//! (by a peer that saw it on the wire, or a buggy client) is dropped, as jupyter_client's
//! `Session.digest_history` does. Only meaningful when messages are signed: with an empty
//! key every signature is empty.

use std::collections::{HashSet, VecDeque};

/// jupyter_client's `digest_history_size`.
pub const HISTORY: usize = 1 << 16;

/// Signatures seen, oldest forgotten first once `capacity` are held.
pub struct SeenSignatures {
    capacity: usize,
    set: HashSet<Box<[u8]>>,
    order: VecDeque<Box<[u8]>>,
}

impl SeenSignatures {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            set: HashSet::new(),
            order: VecDeque::new(),
        }
    }

    /// Records `signature`; false if it was already there (a replay).
    pub fn first_time(&mut self, signature: &[u8]) -> bool {
        if self.set.contains(signature) {
            return false;
        }
        if self.order.len() == self.capacity {
            if let Some(oldest) = self.order.pop_front() {
                self.set.remove(&oldest);
            }
        }
        let owned: Box<[u8]> = signature.into();
        self.set.insert(owned.clone());
        self.order.push_back(owned);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_is_accepted_once() {
        let mut seen = SeenSignatures::new(8);
        assert!(seen.first_time(b"a"));
        assert!(!seen.first_time(b"a"));
        assert!(seen.first_time(b"b"));
    }

    #[test]
    fn the_oldest_is_forgotten_when_full() {
        let mut seen = SeenSignatures::new(3);
        for s in [b"1", b"2", b"3", b"4"] {
            assert!(seen.first_time(s));
        }
        assert_eq!(seen.order.len(), 3);
        // "1" fell out, the others are still refused.
        assert!(!seen.first_time(b"4"));
        assert!(!seen.first_time(b"2"));
        assert!(seen.first_time(b"1"));
    }
}
