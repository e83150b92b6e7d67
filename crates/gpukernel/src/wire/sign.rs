use super::WireError;
use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Signs and verifies messages with the connection file's key.
///
/// An empty key means "no signing" (the spec's rule): signatures are empty and not checked.
#[derive(Clone)]
pub struct Signer {
    mac: Option<HmacSha256>,
}

impl Signer {
    pub fn new(scheme: &str, key: &str) -> Result<Self, WireError> {
        if key.is_empty() {
            return Ok(Self { mac: None });
        }
        if scheme != "hmac-sha256" {
            return Err(WireError::UnsupportedScheme(scheme.to_string()));
        }
        let mac = HmacSha256::new_from_slice(key.as_bytes())
            .map_err(|_| WireError::UnsupportedScheme(scheme.to_string()))?;
        Ok(Self { mac: Some(mac) })
    }

    /// Whether messages are signed (a non-empty key).
    pub fn is_signing(&self) -> bool {
        self.mac.is_some()
    }

    /// Hex HMAC over header, parent_header, metadata and content (never the buffers).
    pub fn sign(&self, parts: [&[u8]; 4]) -> String {
        match &self.mac {
            None => String::new(),
            Some(mac) => {
                let mut mac = mac.clone();
                for part in parts {
                    mac.update(part);
                }
                hex::encode(mac.finalize().into_bytes())
            }
        }
    }

    /// Constant-time check of a hex signature.
    pub fn verify(&self, signature: &[u8], parts: [&[u8]; 4]) -> Result<(), WireError> {
        let Some(mac) = &self.mac else {
            return Ok(());
        };
        let expected = hex::decode(signature).map_err(|_| WireError::BadSignature)?;
        let mut mac = mac.clone();
        for part in parts {
            mac.update(part);
        }
        mac.verify_slice(&expected)
            .map_err(|_| WireError::BadSignature)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARTS: [&[u8]; 4] = [b"{\"msg_type\":\"x\"}", b"{}", b"{}", b"{}"];

    #[test]
    fn signature_round_trips_and_detects_tampering() {
        let signer = Signer::new("hmac-sha256", "secret").unwrap();
        let sig = signer.sign(PARTS);
        assert_eq!(sig.len(), 64);
        signer.verify(sig.as_bytes(), PARTS).unwrap();
        let tampered: [&[u8]; 4] = [b"{\"msg_type\":\"y\"}", b"{}", b"{}", b"{}"];
        assert!(signer.verify(sig.as_bytes(), tampered).is_err());
        let other = Signer::new("hmac-sha256", "other").unwrap();
        assert!(other.verify(sig.as_bytes(), PARTS).is_err());
        assert!(signer.verify(b"not hex", PARTS).is_err());
        assert!(signer.verify(b"", PARTS).is_err());
    }

    #[test]
    fn known_vector_matches_python_hmac() {
        // python3 -c "import hmac,hashlib;print(hmac.new(b'key',b'abcd',hashlib.sha256).hexdigest())"
        let signer = Signer::new("hmac-sha256", "key").unwrap();
        let expected = "2a31ec0ee8d878c9eece9fb0df79b3b90b2256240163aa5ee50d176d3d1121f8";
        assert_eq!(signer.sign([b"a", b"b", b"c", b"d"]), expected);
    }

    #[test]
    fn empty_key_disables_signing_and_unknown_scheme_is_refused() {
        let none = Signer::new("hmac-sha256", "").unwrap();
        assert_eq!(none.sign(PARTS), "");
        none.verify(b"anything", PARTS).unwrap();
        assert!(matches!(
            Signer::new("hmac-md5", "k"),
            Err(WireError::UnsupportedScheme(_))
        ));
    }
}
