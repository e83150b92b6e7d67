//! Running one magic on a worker thread and turning its outputs into iopub messages.
//! This is the one place where magics meet the protocol.

use crate::magics::python::PythonKernel;
use crate::magics::{
    cell::MagicLine, Bundle, CancelToken, GpuState, MagicContext, MagicError, Output, OutputSink,
    Registry,
};
use crate::server::Iopub;
use crate::wire::{Parent, Session};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex, PoisonError};

/// Registry and GPU state, shared by every execution.
pub struct Engine {
    pub registry: Registry,
    pub gpu: GpuState,
    pub python: Option<Arc<dyn PythonKernel>>,
}

/// Publishes a magic's outputs as children of one execute_request.
pub struct IopubSink {
    session: Arc<Session>,
    iopub: Iopub,
    parent: Parent,
    silent: bool,
    execution_count: u64,
    /// Pager payloads go in the execute_reply, not on iopub.
    pages: Mutex<Vec<Bundle>>,
    /// Plain text of what was shown, for history with output=True.
    text: Mutex<String>,
}

impl IopubSink {
    pub fn new(
        session: Arc<Session>,
        iopub: Iopub,
        parent: Parent,
        silent: bool,
        execution_count: u64,
    ) -> Self {
        Self {
            session,
            iopub,
            parent,
            silent,
            execution_count,
            pages: Mutex::new(Vec::new()),
            text: Mutex::new(String::new()),
        }
    }

    pub fn take_pages(&self) -> Vec<Bundle> {
        std::mem::take(&mut *self.pages.lock().unwrap_or_else(PoisonError::into_inner))
    }

    pub fn take_text(&self) -> String {
        std::mem::take(&mut *self.text.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn publish(&self, msg_type: &str, content: Value) {
        self.iopub
            .send(self.session.iopub(Some(&self.parent), msg_type, &content));
    }

    fn note_text(&self, text: &str) {
        self.text
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_str(text);
    }

    /// Publishes an error output (never suppressed: ipykernel shows errors of silent cells too
    /// only in the reply, so we follow it and skip iopub when silent).
    pub fn error(&self, err: &MagicError) {
        if self.silent {
            return;
        }
        self.publish(
            "error",
            json!({"ename": err.ename, "evalue": err.evalue, "traceback": err.traceback}),
        );
    }
}

fn plain(data: &Bundle) -> &str {
    data.get("text/plain").and_then(Value::as_str).unwrap_or("")
}

impl OutputSink for IopubSink {
    fn detach(&self) -> Arc<dyn OutputSink> {
        Arc::new(IopubSink::new(
            self.session.clone(),
            self.iopub.clone(),
            self.parent.clone(),
            self.silent,
            self.execution_count,
        ))
    }

    fn emit(&self, output: Output) {
        if let Output::Page { data } = output {
            self.pages
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(data);
            return;
        }
        if self.silent {
            return;
        }
        match output {
            Output::Stream { name, text } => {
                self.note_text(&text);
                self.publish("stream", json!({"name": name.as_str(), "text": text}));
            }
            Output::Display { data, display_id } => {
                self.note_text(plain(&data));
                let transient = match display_id {
                    Some(id) => json!({"display_id": id}),
                    None => json!({}),
                };
                self.publish(
                    "display_data",
                    json!({"data": data, "metadata": {}, "transient": transient}),
                );
            }
            Output::Update { data, display_id } => self.publish(
                "update_display_data",
                json!({"data": data, "metadata": {}, "transient": {"display_id": display_id}}),
            ),
            Output::Result { data } => {
                self.note_text(plain(&data));
                self.publish(
                    "execute_result",
                    json!({"execution_count": self.execution_count, "data": data, "metadata": {}}),
                );
            }
            Output::Page { .. } => {}
        }
    }
}

/// Runs one magic line on a blocking thread (magics may take seconds and call into C).
pub async fn run_magic(
    engine: Arc<Engine>,
    line: MagicLine,
    sink: Arc<IopubSink>,
    cancel: CancelToken,
) -> Result<(), MagicError> {
    let joined = tokio::task::spawn_blocking(move || {
        let ctx = MagicContext {
            out: sink.as_ref(),
            cancel: &cancel,
            gpu: &engine.gpu,
            registry: &engine.registry,
            python: engine.python.as_deref(),
        };
        engine.registry.execute(&line, &ctx)
    })
    .await;
    joined.unwrap_or_else(|e| {
        tracing::error!("magic panicked: {e}");
        Err(MagicError::new(
            "InternalError",
            format!(
                "the magic failed unexpectedly ({e}); this is a gpukernel bug, please report it"
            ),
        ))
    })
}
