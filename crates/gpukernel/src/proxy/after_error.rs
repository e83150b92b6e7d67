//! After a forwarded cell fails: the OOM diagnosis (`%oom --after-error`), shown under the
//! traceback before the cell's idle.
//!
//! A frontend stops collecting a cell's outputs at its idle status, so the child's idle for a
//! cell that published an `error` is held back here until the diagnosis is out (or skipped).
//! The diagnosis starts when the cell's execute_reply says `error`: the child then serves our
//! side-channel request next (it serves shell requests in order). Cells that fail silently
//! (no `error` on iopub) and cells whose code caught its own exception (reply `ok`) get none.

use super::link::INTERNAL_PREFIX;
use crate::magics::cell::MagicLine;
use crate::magics::CancelToken;
use crate::server::Iopub;
use crate::shell::exec::{run_magic, Engine, IopubSink};
use crate::wire::{Parent, RawMessage, Session};
use serde_json::Value;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::Notify;

/// How many failing cells we track at once (older ones are let go).
const TRACKED: usize = 64;
/// How long we wait for the cell's `error` output once its reply said error.
const ERROR_SEEN: Duration = Duration::from_secs(1);
/// The most a held idle waits for the diagnosis.
const HOLD: Duration = Duration::from_secs(4);

#[derive(Default)]
struct Cell {
    id: String,
    saw_error: bool,
    /// The reply came: `Some(true)` with status error (the diagnosis started).
    replied: Option<bool>,
    idle: Option<RawMessage>,
}

/// The hidden magic line that diagnoses a failed cell whose exception is named `ename`.
pub fn oom_line(ename: &str) -> MagicLine {
    MagicLine {
        name: "oom".into(),
        args: format!(
            "--after-error {}",
            shlex::try_quote(ename).unwrap_or_else(|_| "''".into())
        ),
        help: false,
        source: String::new(),
    }
}

pub struct ErrorWatch {
    session: Arc<Session>,
    iopub: Iopub,
    engine: Arc<Engine>,
    cells: Mutex<VecDeque<Cell>>,
    error_seen: Notify,
}

fn parent_of(message: &RawMessage) -> Option<Value> {
    serde_json::from_slice(&message.parent_header).ok()
}

fn msg_id(parent: &Value) -> Option<&str> {
    parent.get("msg_id").and_then(Value::as_str)
}

impl ErrorWatch {
    pub fn new(session: Arc<Session>, iopub: Iopub, engine: Arc<Engine>) -> Arc<Self> {
        Arc::new(Self {
            session,
            iopub,
            engine,
            cells: Mutex::new(VecDeque::new()),
            error_seen: Notify::new(),
        })
    }

    fn with_cell<T>(&self, id: &str, f: impl FnOnce(&mut Cell) -> T) -> T {
        let mut cells = self.cells.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(cell) = cells.iter_mut().find(|c| c.id == id) {
            return f(cell);
        }
        if cells.len() >= TRACKED {
            if let Some(old) = cells.pop_front() {
                if let Some(idle) = old.idle {
                    self.iopub.send(idle.into_zmq());
                }
            }
        }
        cells.push_back(Cell {
            id: id.to_string(),
            ..Default::default()
        });
        let last = cells.len() - 1;
        f(&mut cells[last])
    }

    /// Lets the cell go: its held idle (if any) goes out now.
    fn release(&self, id: &str) {
        let cell = {
            let mut cells = self.cells.lock().unwrap_or_else(PoisonError::into_inner);
            let position = cells.iter().position(|c| c.id == id);
            position.and_then(|p| cells.remove(p))
        };
        if let Some(idle) = cell.and_then(|c| c.idle) {
            self.iopub.send(idle.into_zmq());
        }
    }

    /// A child iopub message on its way to the frontend; `None` when it is held back here.
    pub fn on_iopub(&self, message: RawMessage) -> Option<RawMessage> {
        // Most iopub traffic is output (streams, displays): skip it without parsing.
        let interesting = |needle: &[u8]| message.header.windows(needle.len()).any(|w| w == needle);
        if !interesting(b"\"error\"") && !interesting(b"\"status\"") {
            return Some(message);
        }
        let Ok(header) = message.header_json() else {
            return Some(message);
        };
        let msg_type = header.get("msg_type").and_then(Value::as_str).unwrap_or("");
        if msg_type != "error" && msg_type != "status" {
            return Some(message);
        }
        let parent = parent_of(&message)?;
        let is_cell = parent.get("msg_type").and_then(Value::as_str) == Some("execute_request");
        let Some(id) = msg_id(&parent).filter(|id| is_cell && !id.starts_with(INTERNAL_PREFIX))
        else {
            return Some(message);
        };
        if msg_type == "error" {
            self.with_cell(id, |c| c.saw_error = true);
            self.error_seen.notify_waiters();
            return Some(message);
        }
        let idle = message
            .content_json()
            .ok()
            .is_some_and(|c| c.get("execution_state").and_then(Value::as_str) == Some("idle"));
        if !idle {
            return Some(message);
        }
        let mut cells = self.cells.lock().unwrap_or_else(PoisonError::into_inner);
        match cells.iter_mut().find(|c| c.id == id) {
            Some(cell) if cell.saw_error && cell.replied != Some(false) => {
                cell.idle = Some(message);
                None
            }
            _ => Some(message),
        }
    }

    /// A child reply on its way to the frontend (it goes on unchanged; this only looks).
    pub fn on_reply(self: &Arc<Self>, reply: &RawMessage) {
        if !matches!(reply.msg_type().as_deref(), Ok("execute_reply")) {
            return;
        }
        let Some(parent) = parent_of(reply) else {
            return;
        };
        let Some(id) = msg_id(&parent).map(str::to_owned) else {
            return;
        };
        let content = reply.content_json().unwrap_or(Value::Null);
        let error = content.get("status").and_then(Value::as_str) == Some("error");
        // Kept (until it ages out) even for a reply "ok": the cell's error output, if it
        // showed one without failing, may still be on its way, and its idle must not be held.
        let (first, held) = self.with_cell(&id, |c| {
            let first = c.replied.is_none();
            c.replied = Some(error);
            (first, if error { None } else { c.idle.take() })
        });
        if let Some(idle) = held {
            self.iopub.send(idle.into_zmq());
        }
        if !error || !first {
            return;
        }
        let ename = content
            .get("ename")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let watch = self.clone();
        let header = reply.parent_header.clone();
        tokio::spawn(async move {
            if watch.wait_for_error(&id).await {
                let diagnosis = watch.diagnose(header, ename);
                if tokio::time::timeout(HOLD, diagnosis).await.is_err() {
                    tracing::warn!("OOM diagnosis took over {HOLD:?}; the cell's idle goes out");
                }
            }
            watch.release(&id);
        });
    }

    /// Whether the cell published its error (it was not silent); waits a little for it.
    async fn wait_for_error(&self, id: &str) -> bool {
        let deadline = tokio::time::Instant::now() + ERROR_SEEN;
        loop {
            let notified = self.error_seen.notified();
            if self.with_cell(id, |c| c.saw_error) {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return false;
            }
        }
    }

    async fn diagnose(&self, header: bytes::Bytes, ename: String) {
        let parent = Parent {
            identities: Vec::new(),
            header,
        };
        let sink = Arc::new(IopubSink::new(
            self.session.clone(),
            self.iopub.clone(),
            parent,
            false,
            0,
        ));
        if let Err(e) = run_magic(
            self.engine.clone(),
            oom_line(&ename),
            sink,
            CancelToken::new(),
        )
        .await
        {
            tracing::warn!("OOM diagnosis failed: {}", e.evalue);
        }
    }
}
