//! The Jupyter access token: 256 random bits, hex encoded.

use std::fmt;

/// A secret that never prints itself by accident (`{:?}` shows `***`).
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    pub fn generate() -> Result<Self, getrandom::Error> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes)?;
        Ok(Token(bytes.iter().map(|b| format!("{b:02x}")).collect()))
    }

    /// The token of a server left running by `up --detach` (from the 0600
    /// state file): a reattach must present the same one.
    pub fn from_saved(token: String) -> Self {
        Token(token)
    }

    /// The secret itself, for the places that must carry it (the remote's
    /// stdin, the Authorization header, the URL printed on stdout).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(***)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_long_random_hex_and_hidden_from_debug() {
        let a = Token::generate().expect("rng");
        let b = Token::generate().expect("rng");
        assert_eq!(a.expose().len(), 64);
        assert!(a.expose().bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
        assert!(!format!("{a:?}").contains(a.expose()));
    }
}
