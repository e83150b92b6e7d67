//! Requests we make to the child ourselves, and which child messages reach the frontend.
//!
//! Frontend requests travel with their routing envelope (the frontend's identity frames), so
//! the child's replies come back with it and go straight out. Our own requests travel without
//! one; their replies are delivered to the waiting caller by parent msg_id.

use crate::magics::CancelToken;
use crate::wire::{RawMessage, Session};
use anyhow::{anyhow, Result};
use bytes::Bytes;
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, PoisonError};
use tokio::sync::{oneshot, Notify};
use zeromq::{DealerSendHalf, SocketSend, ZmqMessage};

/// msg_ids of our own requests start with this; the child's iopub traffic about them
/// (busy/idle of a side-channel query) is not shown to the frontend.
pub const INTERNAL_PREFIX: &str = "gpukernel-internal-";

/// How many finished mixed cells we keep suppressing stray status messages for.
const RECENT: usize = 32;

/// How long a part of a mixed cell may take to answer once interrupted (ipykernel answers a
/// KeyboardInterrupt at once; one stuck in C code may not).
const AFTER_INTERRUPT: std::time::Duration = std::time::Duration::from_secs(5);
const POLL: std::time::Duration = std::time::Duration::from_millis(50);

#[derive(Default)]
struct Suppression {
    /// msg_id of the mixed cell running now: its status and execute_input messages from the
    /// child are ours to send, once, for the whole cell.
    active: Option<String>,
    idles: u64,
    recent: VecDeque<String>,
}

pub struct ChildLink {
    session: std::sync::Arc<Session>,
    shell: tokio::sync::Mutex<DealerSendHalf>,
    control: tokio::sync::Mutex<DealerSendHalf>,
    pending: Mutex<HashMap<String, oneshot::Sender<RawMessage>>>,
    suppression: Mutex<Suppression>,
    idle: Notify,
}

fn msg_id_of(header: &Value) -> Option<&str> {
    header.get("msg_id").and_then(Value::as_str)
}

impl ChildLink {
    pub fn new(
        session: std::sync::Arc<Session>,
        shell: DealerSendHalf,
        control: DealerSendHalf,
    ) -> Self {
        Self {
            session,
            shell: tokio::sync::Mutex::new(shell),
            control: tokio::sync::Mutex::new(control),
            pending: Mutex::new(HashMap::new()),
            suppression: Mutex::new(Suppression::default()),
            idle: Notify::new(),
        }
    }

    fn suppression(&self) -> std::sync::MutexGuard<'_, Suppression> {
        self.suppression
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    pub async fn forward_shell(&self, message: ZmqMessage) {
        if let Err(e) = self.shell.lock().await.send(message).await {
            tracing::warn!("could not forward to the child's shell: {e}");
        }
    }

    pub async fn forward_control(&self, message: ZmqMessage) {
        if let Err(e) = self.control.lock().await.send(message).await {
            tracing::warn!("could not forward to the child's control: {e}");
        }
    }

    /// A reply that someone here waits for (by parent msg_id) goes to them; any other comes
    /// back to be forwarded to the frontend. A part of a mixed cell travels with the
    /// frontend's envelope (so the child's input_request reaches the frontend's stdin) but
    /// its reply is ours.
    pub fn take_if_awaited(&self, reply: RawMessage) -> Option<RawMessage> {
        let parent: Value = serde_json::from_slice(&reply.parent_header).unwrap_or(Value::Null);
        let waiter = msg_id_of(&parent).and_then(|id| {
            self.pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(id)
        });
        match waiter {
            Some(tx) => {
                let _ = tx.send(reply);
                None
            }
            None => Some(reply),
        }
    }

    /// Hands a reply that came back without an envelope to whoever waits for it.
    pub fn deliver(&self, reply: RawMessage) {
        let parent: Value = serde_json::from_slice(&reply.parent_header).unwrap_or(Value::Null);
        let Some(id) = msg_id_of(&parent) else {
            tracing::warn!("child reply without parent msg_id dropped");
            return;
        };
        let waiter = self
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(id);
        match waiter {
            Some(tx) => {
                let _ = tx.send(reply);
            }
            None => tracing::debug!("no one waits for the reply to {id}"),
        }
    }

    async fn round_trip(
        &self,
        id: String,
        message: ZmqMessage,
        control: bool,
    ) -> Result<RawMessage> {
        let (tx, rx) = oneshot::channel();
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id.clone(), tx);
        if control {
            self.forward_control(message).await;
        } else {
            self.forward_shell(message).await;
        }
        rx.await
            .map_err(|_| anyhow!("the child kernel went away before answering {id}"))
    }

    /// Sends our own request on the child's shell and waits for its reply content.
    pub async fn request(&self, msg_type: &str, content: &Value) -> Result<Value> {
        let id = format!("{INTERNAL_PREFIX}{}", uuid::Uuid::new_v4());
        let message = self.own_request(&id, msg_type, content);
        let reply = self.round_trip(id, message, false).await?;
        Ok(reply.content_json()?)
    }

    /// Asks the child to interrupt what it runs (ipykernel signals itself), as a frontend's
    /// interrupt_request does; waits for its reply at most `wait`.
    pub async fn interrupt(&self, wait: std::time::Duration) -> Result<()> {
        let id = format!("{INTERNAL_PREFIX}{}", uuid::Uuid::new_v4());
        let message = self.own_request(&id, "interrupt_request", &json!({}));
        match tokio::time::timeout(wait, self.round_trip(id.clone(), message, true)).await {
            Ok(reply) => reply.map(drop),
            Err(_) => {
                self.forget(&id);
                Err(anyhow!(
                    "the child did not answer the interrupt within {wait:?}"
                ))
            }
        }
    }

    /// Drops the waiter of a request whose reply we stopped waiting for.
    pub fn forget(&self, id: &str) {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(id);
    }

    fn own_request(&self, id: &str, msg_type: &str, content: &Value) -> ZmqMessage {
        let header = json!({
            "msg_id": id, "session": self.session.id(), "username": "gpukernel",
            "date": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            "msg_type": msg_type, "version": crate::wire::PROTOCOL_VERSION,
        });
        self.session.signed(
            Vec::new(),
            Bytes::from(header.to_string()),
            Bytes::from_static(b"{}"),
            Bytes::from_static(b"{}"),
            Bytes::from(content.to_string()),
        )
    }

    /// A silent execute: runs `code` with no output and no history, evaluates
    /// `user_expressions`, and (because the child serves shell requests in order) returns
    /// only after every earlier cell finished.
    pub async fn silent_execute(&self, code: &str, user_expressions: &Value) -> Result<Value> {
        self.request(
            "execute_request",
            &json!({"code": code, "silent": true, "store_history": false,
                    "user_expressions": user_expressions, "allow_stdin": false,
                    "stop_on_error": false}),
        )
        .await
    }

    /// Runs one part of a mixed cell in the child under the frontend's own header and
    /// envelope, so the child's outputs are parented to the frontend's request and its
    /// input_request reaches the frontend's stdin, without any rewriting.
    ///
    /// Every part's metadata carries a part id of its own: identical parts would otherwise
    /// be identical signed messages, and the child drops a repeated signature as a replay.
    /// The wait ends when `cancel` fires (an interrupt, which the child got as well) and the
    /// child has not answered within [`AFTER_INTERRUPT`].
    pub async fn execute_part(
        &self,
        request: &RawMessage,
        content: &Value,
        cancel: &CancelToken,
    ) -> Result<Value> {
        let header = request.header_json()?;
        let id = msg_id_of(&header).unwrap_or_default().to_string();
        let mut metadata: Value =
            serde_json::from_slice(&request.metadata).unwrap_or_else(|_| json!({}));
        if !metadata.is_object() {
            metadata = json!({});
        }
        metadata["gpukernel_part"] = Value::String(uuid::Uuid::new_v4().to_string());
        let message = self.session.signed(
            request.identities.clone(),
            request.header.clone(),
            request.parent_header.clone(),
            Bytes::from(metadata.to_string()),
            Bytes::from(content.to_string()),
        );
        let reply = self.round_trip(id.clone(), message, false);
        tokio::pin!(reply);
        let mut interrupted_at: Option<tokio::time::Instant> = None;
        loop {
            tokio::select! {
                reply = &mut reply => return Ok(reply?.content_json()?),
                _ = tokio::time::sleep(POLL) => {}
            }
            if !cancel.is_cancelled() {
                continue;
            }
            let since = *interrupted_at.get_or_insert_with(tokio::time::Instant::now);
            if since.elapsed() >= AFTER_INTERRUPT {
                self.forget(&id);
                return Err(anyhow!(
                    "KeyboardInterrupt: the Python kernel did not answer within {} s of the                      interrupt",
                    AFTER_INTERRUPT.as_secs()
                ));
            }
        }
    }

    /// From now on, the child's status/execute_input for `msg_id` are not forwarded.
    pub fn begin_cell(&self, msg_id: &str) {
        let mut s = self.suppression();
        s.active = Some(msg_id.to_string());
        s.idles = 0;
    }

    pub fn end_cell(&self) {
        let mut s = self.suppression();
        if let Some(id) = s.active.take() {
            s.recent.push_back(id);
            if s.recent.len() > RECENT {
                s.recent.pop_front();
            }
        }
    }

    /// Waits until the child has published `n` idle statuses for the running cell: its
    /// outputs for the first `n` parts are then all out, so ours come after them.
    pub async fn wait_idles(&self, n: u64) {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let notified = self.idle.notified();
            if self.suppression().idles >= n {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                tracing::warn!("child idle status not seen in 5 s; output order may differ");
                return;
            }
        }
    }

    /// Decides whether a child iopub message goes to the frontend.
    pub fn should_forward(&self, message: &RawMessage) -> bool {
        let Ok(header) = message.header_json() else {
            return false;
        };
        let msg_type = header.get("msg_type").and_then(Value::as_str).unwrap_or("");
        if msg_type == "iopub_welcome" {
            return false; // we send our own
        }
        let parent: Value = serde_json::from_slice(&message.parent_header).unwrap_or(Value::Null);
        let Some(parent_id) = msg_id_of(&parent) else {
            return true;
        };
        if parent_id.starts_with(INTERNAL_PREFIX) {
            return false;
        }
        if msg_type != "status" && msg_type != "execute_input" {
            return true;
        }
        let mut s = self.suppression();
        if s.active.as_deref() == Some(parent_id) {
            let idle = message
                .content_json()
                .ok()
                .and_then(|c| {
                    c.get("execution_state")
                        .and_then(Value::as_str)
                        .map(|v| v == "idle")
                })
                .unwrap_or(false);
            if idle {
                s.idles += 1;
                drop(s);
                self.idle.notify_waiters();
            }
            return false;
        }
        !s.recent.iter().any(|id| id == parent_id)
    }
}
