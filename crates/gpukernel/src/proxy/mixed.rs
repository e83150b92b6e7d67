//! A cell that mixes our magics with Python: run top to bottom, outputs in order, one
//! execution count (the Python kernel's), stop at the first failure, history as IPython keeps it.
//!
//! Python parts run in the child under the frontend's own header with store_history off; our
//! magics run here in between. At the end one silent execute stores the whole cell in IPython's
//! history and advances its counter, so `In`, `%history` and the next count are what a plain
//! IPython cell would give.

use super::python::record_history_code;
use super::Proxy;
use crate::magics::cell::{MagicLine, Segment};
use crate::magics::{CancelToken, MagicError};
use crate::shell::exec::{run_magic, IopubSink};
use crate::shell::reply;
use crate::shell::request::ExecuteRequest;
use crate::wire::{Parent, RawMessage};
use serde_json::{json, Value};
use std::sync::Arc;

fn error_of(reply: &Value) -> MagicError {
    MagicError {
        ename: reply["ename"].as_str().unwrap_or("Error").to_string(),
        evalue: reply["evalue"].as_str().unwrap_or("").to_string(),
        traceback: reply["traceback"]
            .as_array()
            .map(|t| {
                t.iter()
                    .filter_map(|l| l.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default(),
    }
}

/// Runs the cell and returns the execute_reply content. `content` is the request's own
/// content (each Python part is sent with it, only the code and bookkeeping fields changed);
/// `cell` its typed view.
pub async fn execute(
    proxy: &Arc<Proxy>,
    request: &RawMessage,
    content: &Value,
    cell: &ExecuteRequest,
    segments: Vec<Segment>,
    parent: &Parent,
) -> Value {
    let code = cell.code.as_str();
    let silent = cell.silent;
    let link = &proxy.link;

    // Waits for earlier cells, and tells us the count this cell gets.
    let count = match link.silent_execute("", &json!({})).await {
        Ok(reply) => reply["execution_count"].as_u64().unwrap_or(0) + 1,
        Err(e) => {
            let error = MagicError::new("KernelError", e.to_string());
            return reply::execute_reply(0, Err(error), Default::default());
        }
    };
    if !silent {
        proxy.iopub.send(proxy.session.iopub(
            Some(parent),
            "execute_input",
            &crate::shell::execute_input(code, count),
        ));
    }
    let msg_id = request
        .header_json()
        .ok()
        .and_then(|h| h["msg_id"].as_str().map(str::to_owned))
        .unwrap_or_default();
    link.begin_cell(&msg_id);

    let mut run = CellRun {
        proxy,
        request,
        content,
        cell,
        cancel: proxy.start_running(),
        sink: Arc::new(IopubSink::new(
            proxy.session.clone(),
            proxy.iopub.clone(),
            parent.clone(),
            silent,
            count,
        )),
        payload: Vec::new(),
        python_parts: 0,
    };
    let mut failure: Option<MagicError> = None;
    for segment in segments {
        let outcome = match segment {
            Segment::Other(text) if text.trim().is_empty() => Ok(()),
            Segment::Other(text) => run.python(text).await,
            Segment::Magic(line) => run.magic(line).await,
        };
        if let Err(e) = outcome {
            failure = Some(e);
            break;
        }
    }
    let mut payload = run.payload;
    payload.extend(reply::pages(run.sink.take_pages()));
    proxy.stop_running();
    let user_expressions = record_cell(proxy, cell, count).await;
    link.end_cell();

    reply::execute_reply(count, failure.map_or(Ok(payload), Err), user_expressions)
}

/// One cell's run through its segments: what each part needs, and what the parts gave.
struct CellRun<'a> {
    proxy: &'a Arc<Proxy>,
    request: &'a RawMessage,
    content: &'a Value,
    cell: &'a ExecuteRequest,
    cancel: CancelToken,
    sink: Arc<IopubSink>,
    payload: Vec<Value>,
    python_parts: u64,
}

impl CellRun<'_> {
    /// A Python part, in the child under the frontend's header; a failure there comes with
    /// the OOM diagnosis under its traceback (nothing when it is no OOM).
    async fn python(&mut self, text: String) -> Result<(), MagicError> {
        let mut part = self.content.clone();
        part["code"] = Value::String(text);
        part["store_history"] = Value::Bool(false);
        part["allow_stdin"] = Value::Bool(self.cell.allow_stdin);
        part["user_expressions"] = json!({});
        // We stop the cell ourselves; the child must not abort our follow-up requests.
        part["stop_on_error"] = Value::Bool(false);
        let link = &self.proxy.link;
        let reply = match link.execute_part(self.request, &part, &self.cancel).await {
            Ok(reply) => reply,
            Err(_) if self.cancel.is_cancelled() => return Err(MagicError::interrupted()),
            Err(e) => return Err(MagicError::new("KernelError", e.to_string())),
        };
        self.python_parts += 1;
        link.wait_idles(self.python_parts).await;
        if let Some(p) = reply["payload"].as_array() {
            self.payload.extend(p.iter().cloned());
        }
        if reply["status"] == "ok" {
            return Ok(());
        }
        let line = super::after_error::oom_line(reply["ename"].as_str().unwrap_or(""));
        let diagnosis = run_magic(
            self.proxy.engine.clone(),
            line,
            self.sink.clone(),
            self.cancel.clone(),
        );
        if let Err(e) = diagnosis.await {
            tracing::warn!("OOM diagnosis failed: {}", e.evalue);
        }
        Err(error_of(&reply))
    }

    /// One of our magics, here; its error is shown as the cell's.
    async fn magic(&mut self, line: MagicLine) -> Result<(), MagicError> {
        let sink = self.sink.clone();
        let outcome = run_magic(self.proxy.engine.clone(), line, sink, self.cancel.clone()).await;
        if let Err(e) = &outcome {
            self.sink.error(e);
        }
        outcome
    }
}

/// History and counter, plus the request's user_expressions, in one silent execute: the
/// cell ends as a plain IPython cell would.
async fn record_cell(
    proxy: &Proxy,
    cell: &ExecuteRequest,
    count: u64,
) -> serde_json::Map<String, Value> {
    let bookkeeping = if cell.stores_history() {
        record_history_code(count, &cell.code)
    } else {
        String::new()
    };
    let asked = Value::Object(cell.user_expressions.clone());
    match proxy.link.silent_execute(&bookkeeping, &asked).await {
        Ok(reply) => match reply.get("user_expressions") {
            Some(Value::Object(values)) => values.clone(),
            _ => Default::default(),
        },
        Err(e) => {
            tracing::warn!("could not record the cell in IPython's history: {e}");
            Default::default()
        }
    }
}
