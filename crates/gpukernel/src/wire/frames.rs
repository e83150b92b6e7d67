use super::{Signer, WireError};
use bytes::Bytes;
use serde_json::Value;
use zeromq::ZmqMessage;

pub const DELIMITER: &[u8] = b"<IDS|MSG>";

/// A message as it came off a socket: routing identities, signature, the four JSON frames
/// untouched, and binary buffers.
#[derive(Debug, Clone)]
pub struct RawMessage {
    pub identities: Vec<Bytes>,
    pub signature: Bytes,
    pub header: Bytes,
    pub parent_header: Bytes,
    pub metadata: Bytes,
    pub content: Bytes,
    pub buffers: Vec<Bytes>,
}

impl RawMessage {
    /// Splits frames at the delimiter. Does not verify the signature; see [`Self::verify`].
    pub fn from_frames(frames: Vec<Bytes>) -> Result<Self, WireError> {
        let total = frames.len();
        let split = frames
            .iter()
            .position(|f| f.as_ref() == DELIMITER)
            .ok_or(WireError::NoDelimiter(total))?;
        let mut rest = frames.into_iter();
        let identities: Vec<Bytes> = rest.by_ref().take(split).collect();
        rest.next(); // the delimiter
        let after: Vec<Bytes> = rest.collect();
        if after.len() < 5 {
            return Err(WireError::TooFewFrames(after.len()));
        }
        let mut after = after.into_iter();
        let mut next = || after.next().unwrap_or_default();
        let (signature, header, parent_header, metadata, content) =
            (next(), next(), next(), next(), next());
        Ok(Self {
            identities,
            signature,
            header,
            parent_header,
            metadata,
            content,
            buffers: after.collect(),
        })
    }

    pub fn from_zmq(message: ZmqMessage) -> Result<Self, WireError> {
        Self::from_frames(message.into_vec())
    }

    pub fn verify(&self, signer: &Signer) -> Result<(), WireError> {
        signer.verify(
            &self.signature,
            [
                &self.header,
                &self.parent_header,
                &self.metadata,
                &self.content,
            ],
        )
    }

    /// The frames in wire order, ready to send.
    pub fn into_zmq(self) -> ZmqMessage {
        let mut frames = self.identities;
        frames.reserve(6 + self.buffers.len());
        frames.push(Bytes::from_static(DELIMITER));
        frames.extend([
            self.signature,
            self.header,
            self.parent_header,
            self.metadata,
            self.content,
        ]);
        frames.extend(self.buffers);
        // Never empty: the delimiter and five frames are always there.
        ZmqMessage::try_from(frames).unwrap_or_else(|_| ZmqMessage::from(""))
    }

    pub fn header_json(&self) -> Result<Value, WireError> {
        parse_json("header", &self.header)
    }

    pub fn content_json(&self) -> Result<Value, WireError> {
        parse_json("content", &self.content)
    }

    /// The header's msg_type, found without trusting anything else in it.
    pub fn msg_type(&self) -> Result<String, WireError> {
        self.header_json()?
            .get("msg_type")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or(WireError::NoMsgType)
    }
}

fn parse_json(part: &'static str, bytes: &[u8]) -> Result<Value, WireError> {
    serde_json::from_slice(bytes).map_err(|source| WireError::Json { part, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(parts: &[&'static [u8]]) -> Vec<Bytes> {
        parts.iter().map(|p| Bytes::from_static(p)).collect()
    }

    #[test]
    fn splits_identities_and_buffers() {
        let msg = RawMessage::from_frames(frames(&[
            b"id1",
            b"id2",
            DELIMITER,
            b"sig",
            b"{\"msg_type\":\"kernel_info_request\"}",
            b"{}",
            b"{}",
            b"{}",
            b"buf",
        ]))
        .unwrap();
        assert_eq!(msg.identities.len(), 2);
        assert_eq!(msg.buffers, vec![Bytes::from_static(b"buf")]);
        assert_eq!(msg.msg_type().unwrap(), "kernel_info_request");
        let back = msg.into_zmq().into_vec();
        assert_eq!(back.len(), 9);
        assert_eq!(back[2].as_ref(), DELIMITER);
    }

    #[test]
    fn refuses_malformed_frames() {
        assert!(matches!(
            RawMessage::from_frames(frames(&[b"id", b"{}"])),
            Err(WireError::NoDelimiter(2))
        ));
        assert!(matches!(
            RawMessage::from_frames(frames(&[DELIMITER, b"sig", b"{}"])),
            Err(WireError::TooFewFrames(2))
        ));
        let not_json =
            RawMessage::from_frames(frames(&[DELIMITER, b"", b"nope", b"{}", b"{}", b"{}"]))
                .unwrap();
        assert!(not_json.msg_type().is_err());
    }
}
