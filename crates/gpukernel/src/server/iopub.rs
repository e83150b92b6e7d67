use crate::wire::Session;
use serde_json::json;
use std::sync::Arc;
use tokio::sync::mpsc;
use zeromq::{SocketRecv, SocketSend, XPubSocket, ZmqMessage};

/// Handle for publishing on iopub from any task or thread.
#[derive(Clone)]
pub struct Iopub {
    tx: mpsc::UnboundedSender<ZmqMessage>,
}

impl Iopub {
    /// Queues a message; it goes out in the order queued.
    pub fn send(&self, message: ZmqMessage) {
        if self.tx.send(message).is_err() {
            tracing::debug!("iopub task has ended; message dropped");
        }
    }
}

/// Owns the XPUB socket: publishes queued messages and greets each new subscriber with an
/// `iopub_welcome` (JEP 65), which tells clients that iopub is live.
pub fn spawn_iopub(mut socket: XPubSocket, session: Arc<Session>) -> Iopub {
    let (tx, mut rx) = mpsc::unbounded_channel::<ZmqMessage>();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                queued = rx.recv() => {
                    let Some(message) = queued else { break };
                    if let Err(e) = socket.send(message).await {
                        tracing::warn!("iopub send failed: {e}");
                    }
                }
                incoming = socket.recv() => match incoming {
                    Ok(frames) => {
                        let Some(first) = frames.get(0) else { continue };
                        // XPUB delivers subscriptions as 0x01 + topic (0x00 = unsubscribe).
                        if first.first() == Some(&1) {
                            let topic = String::from_utf8_lossy(&first[1..]).into_owned();
                            let welcome = session.iopub(
                                None,
                                "iopub_welcome",
                                &json!({"subscription": topic}),
                            );
                            if let Err(e) = socket.send(welcome).await {
                                tracing::warn!("iopub_welcome send failed: {e}");
                            }
                        }
                    }
                    Err(e) => tracing::debug!("iopub receive: {e}"),
                },
            }
        }
    });
    Iopub { tx }
}
