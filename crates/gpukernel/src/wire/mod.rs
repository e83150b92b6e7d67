//! The Jupyter wire protocol: frames, signatures and the messages we originate.
//!
//! Nothing here knows about GPUs or magics. Incoming messages stay as raw frames
//! ([`RawMessage`]) so the proxy can forward them byte for byte; only what routing needs is
//! parsed.

mod frames;
mod replay;
mod session;
mod sign;

pub use frames::RawMessage;
pub use session::{Parent, Session, PROTOCOL_VERSION};
pub use sign::Signer;

use thiserror::Error;

/// Why an incoming message was refused. Each is logged and the message dropped; none of them
/// ends a socket loop.
#[derive(Debug, Error)]
pub enum WireError {
    #[error("no <IDS|MSG> delimiter in {0} frames")]
    NoDelimiter(usize),
    #[error("expected at least 5 frames after the delimiter, got {0}")]
    TooFewFrames(usize),
    #[error("bad signature")]
    BadSignature,
    #[error("a replay: this signature was already accepted")]
    Replayed,
    #[error("unsupported signature scheme {0:?}: only hmac-sha256 is supported")]
    UnsupportedScheme(String),
    #[error("{part} is not valid JSON: {source}")]
    Json {
        part: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("header has no msg_type")]
    NoMsgType,
}
