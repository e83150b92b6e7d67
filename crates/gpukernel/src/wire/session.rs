use super::replay::{SeenSignatures, HISTORY};
use super::{RawMessage, Signer, WireError};
use bytes::Bytes;
use chrono::{SecondsFormat, Utc};
use serde::Serialize;
use serde_json::json;
use std::sync::{Mutex, PoisonError};
use zeromq::ZmqMessage;

/// What a reply needs from its request: where it came from and its header, kept as the raw
/// bytes the client sent so the parent_header echoes it exactly.
#[derive(Debug, Clone)]
pub struct Parent {
    pub identities: Vec<Bytes>,
    pub header: Bytes,
}

impl Parent {
    pub fn of(msg: &RawMessage) -> Self {
        Self {
            identities: msg.identities.clone(),
            header: msg.header.clone(),
        }
    }
}

/// Builds and signs the messages this kernel originates.
pub struct Session {
    signer: Signer,
    id: String,
    seen: Mutex<SeenSignatures>,
}

pub const PROTOCOL_VERSION: &str = "5.3";

impl Session {
    pub fn new(signer: Signer) -> Self {
        Self {
            signer,
            id: uuid::Uuid::new_v4().to_string(),
            seen: Mutex::new(SeenSignatures::new(HISTORY)),
        }
    }

    /// This session's id (the `session` field of every header we write).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Signs frames we assembled ourselves (for requests made on a client's behalf).
    pub fn signed(
        &self,
        identities: Vec<Bytes>,
        header: Bytes,
        parent_header: Bytes,
        metadata: Bytes,
        content: Bytes,
    ) -> ZmqMessage {
        let signature = self
            .signer
            .sign([&header, &parent_header, &metadata, &content]);
        RawMessage {
            identities,
            signature: Bytes::from(signature),
            header,
            parent_header,
            metadata,
            content,
            buffers: Vec::new(),
        }
        .into_zmq()
    }

    /// Checks the signature, and that it was not accepted before (a replay).
    pub fn verify(&self, msg: &RawMessage) -> Result<(), WireError> {
        msg.verify(&self.signer)?;
        if self.signer.is_signing()
            && !self
                .seen
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .first_time(&msg.signature)
        {
            return Err(WireError::Replayed);
        }
        Ok(())
    }

    /// A reply on a ROUTER socket, addressed to the request's sender. `content` is a
    /// jupyter-protocol message type where one fits, else a JSON value.
    pub fn reply(&self, parent: &Parent, msg_type: &str, content: &impl Serialize) -> ZmqMessage {
        self.build(parent.identities.clone(), Some(parent), msg_type, content)
    }

    /// An iopub message; the topic frame names the message type, as ipykernel does.
    pub fn iopub(
        &self,
        parent: Option<&Parent>,
        msg_type: &str,
        content: &impl Serialize,
    ) -> ZmqMessage {
        let topic = Bytes::from(format!("kernel.{}.{msg_type}", self.id));
        self.build(vec![topic], parent, msg_type, content)
    }

    fn build(
        &self,
        identities: Vec<Bytes>,
        parent: Option<&Parent>,
        msg_type: &str,
        content: &impl Serialize,
    ) -> ZmqMessage {
        // Our contents are JSON values and protocol structs: they always serialise.
        let content = serde_json::to_vec(content).unwrap_or_else(|e| {
            tracing::error!("{msg_type}: content not serialisable: {e}");
            b"{}".to_vec()
        });
        let header = json!({
            "msg_id": uuid::Uuid::new_v4().to_string(),
            "session": self.id,
            "username": "gpukernel",
            "date": Utc::now().to_rfc3339_opts(SecondsFormat::Micros, true),
            "msg_type": msg_type,
            "version": PROTOCOL_VERSION,
        });
        let header = Bytes::from(header.to_string());
        let parent_header = parent
            .map(|p| p.header.clone())
            .unwrap_or_else(|| Bytes::from_static(b"{}"));
        self.signed(
            identities,
            header,
            parent_header,
            Bytes::from_static(b"{}"),
            Bytes::from(content),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_signed_and_carry_the_parent() {
        let session = Session::new(Signer::new("hmac-sha256", "k").unwrap());
        let parent = Parent {
            identities: vec![Bytes::from_static(b"client")],
            header: Bytes::from_static(b"{\"msg_id\":\"p\",\"msg_type\":\"kernel_info_request\"}"),
        };
        let reply = session.reply(&parent, "kernel_info_reply", &json!({"status": "ok"}));
        let raw = RawMessage::from_zmq(reply).unwrap();
        assert_eq!(raw.identities, parent.identities);
        assert_eq!(raw.parent_header, parent.header);
        assert_eq!(raw.msg_type().unwrap(), "kernel_info_reply");
        session.verify(&raw).unwrap();
    }

    #[test]
    fn a_message_sent_twice_is_refused_the_second_time() {
        let session = Session::new(Signer::new("hmac-sha256", "k").unwrap());
        let message = session.iopub(None, "status", &json!({"execution_state": "idle"}));
        let raw = RawMessage::from_zmq(message).unwrap();
        session.verify(&raw).unwrap();
        assert!(matches!(session.verify(&raw), Err(WireError::Replayed)));
        // Without a key nothing is signed, so nothing can be told apart: all accepted.
        let unsigned = Session::new(Signer::new("hmac-sha256", "").unwrap());
        let raw = RawMessage::from_zmq(unsigned.iopub(None, "status", &json!({}))).unwrap();
        unsigned.verify(&raw).unwrap();
        unsigned.verify(&raw).unwrap();
    }
}
