//! Receiving from and replying to frontends, the same in both kernel modes.

use crate::wire::{RawMessage, Session};
use zeromq::{RouterSendHalf, SocketSend, ZmqMessage};

/// Parses and verifies what a frontend sent; a bad message is logged and dropped (the loop
/// goes on). Returns the message and its type.
pub fn accept(
    session: &Session,
    channel: &str,
    frames: ZmqMessage,
) -> Option<(RawMessage, String)> {
    let msg = match RawMessage::from_zmq(frames) {
        Ok(msg) => msg,
        Err(e) => {
            tracing::warn!("{channel}: dropped a malformed message: {e}");
            return None;
        }
    };
    if let Err(e) = session.verify(&msg) {
        tracing::warn!("{channel}: dropped a message: {e}");
        return None;
    }
    match msg.msg_type() {
        Ok(t) => Some((msg, t)),
        Err(e) => {
            tracing::warn!("{channel}: dropped a message: {e}");
            None
        }
    }
}

/// Sends a reply; a client that vanished between request and reply must not end the loop.
pub async fn send(socket: &mut RouterSendHalf, message: ZmqMessage) {
    if let Err(e) = socket.send(message).await {
        tracing::warn!("reply not delivered: {e}");
    }
}
