//! The magics-only kernel (`gpu-magics`): answers every request itself.
//!
//! Shell requests are handled one at a time on the main task; control runs on its own task so
//! interrupt and shutdown arrive while a magic runs. Magics run on blocking threads
//! ([`exec::run_magic`]).

pub mod history;
pub mod replies;

#[cfg(test)]
mod tests;

use crate::magics::{cell, CancelToken, GpuState, Registry};
use crate::server::{accept, send, spawn_heartbeat, spawn_iopub, spawn_on_sigint, Channels, Iopub};
use crate::shell::exec::{self, Engine, IopubSink};
use crate::shell::request::{CodeAt, ExecuteRequest};
use crate::shell::{busy, reply};
use crate::wire::{Parent, RawMessage, Session, Signer};
use history::History;
use jupyter_protocol::{CommClose, CommId, ConnectionInfo, InterruptReply, ShutdownReply};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex, PoisonError};
use tokio::sync::mpsc;
use zeromq::{RouterSendHalf, RouterSocket, SocketRecv};

/// State shared by the shell and control tasks.
#[derive(Default)]
struct State {
    execution_count: u64,
    history: History,
    /// The running execution's token, for interrupts.
    running: Option<CancelToken>,
}

pub struct Kernel {
    session: Arc<Session>,
    iopub: Iopub,
    engine: Arc<Engine>,
    state: Mutex<State>,
}

impl Kernel {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Interrupts the running magic, if any.
    pub fn interrupt(&self) {
        if let Some(token) = &self.state().running {
            tracing::info!("interrupting the running magic");
            token.cancel();
        }
    }
}

/// Runs the magics-only kernel until a shutdown_request.
pub async fn run(info: ConnectionInfo) -> anyhow::Result<()> {
    let signer = Signer::new(&info.signature_scheme, &info.key)?;
    let session = Arc::new(Session::new(signer));
    let channels = Channels::bind(&info).await?;
    let iopub = spawn_iopub(channels.iopub, session.clone());
    spawn_heartbeat(channels.heartbeat);
    spawn_stdin_drain(channels.stdin);

    let kernel = Arc::new(Kernel {
        session,
        iopub,
        engine: Arc::new(Engine {
            registry: Registry::new(),
            gpu: GpuState::new(),
            python: None,
        }),
        state: Mutex::new(State::default()),
    });
    tracing::info!("gpukernel (magics-only) listening on {}", info.shell_url());

    let (shutdown_tx, mut shutdown_rx) = mpsc::channel::<()>(1);
    spawn_control(channels.control, kernel.clone(), shutdown_tx);
    let interrupt_kernel = kernel.clone();
    spawn_on_sigint(move || interrupt_kernel.interrupt());

    let (mut shell_send, mut shell_recv) = channels.shell.split();
    loop {
        tokio::select! {
            _ = shutdown_rx.recv() => break,
            received = shell_recv.recv() => {
                let frames = match received {
                    Ok(f) => f,
                    Err(e) => { tracing::debug!("shell receive: {e}"); continue; }
                };
                let Some((msg, msg_type)) = accept(&kernel.session, "shell", frames) else { continue };
                let parent = Parent::of(&msg);
                let work = handle_shell(&kernel, &mut shell_send, &msg, &msg_type, &parent);
                let stop = busy(&kernel.session, &kernel.iopub, &parent, work).await;
                if stop { break; }
            }
        }
    }
    kernel.interrupt();
    // Let iopub drain the final idle before the process ends.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    tracing::info!("shutting down");
    Ok(())
}

/// stdin stays bound so clients can connect; no magic asks for input. It is still read (and
/// what arrives dropped), so a peer that breaks the wire rules there is disconnected.
fn spawn_stdin_drain(mut stdin: RouterSocket) {
    tokio::spawn(async move {
        while let Ok(frames) = stdin.recv().await {
            tracing::debug!(
                "stdin: dropped a message ({} frames): no input was asked",
                frames.len()
            );
        }
    });
}

/// Control requests, each answered under its own busy/idle; a shutdown_request ends the
/// shell loop through `shutdown`.
fn spawn_control(control: RouterSocket, kernel: Arc<Kernel>, shutdown: mpsc::Sender<()>) {
    let (mut reply, mut control_recv) = control.split();
    tokio::spawn(async move {
        loop {
            let frames = match control_recv.recv().await {
                Ok(f) => f,
                Err(e) => {
                    tracing::debug!("control receive: {e}");
                    continue;
                }
            };
            let Some((msg, msg_type)) = accept(&kernel.session, "control", frames) else {
                continue;
            };
            let parent = Parent::of(&msg);
            let work = handle_control(&kernel, &mut reply, &msg, &msg_type, &parent);
            let stop = busy(&kernel.session, &kernel.iopub, &parent, work).await;
            if stop {
                let _ = shutdown.send(()).await;
            }
        }
    });
}

/// Returns true when the kernel should exit.
async fn handle_control(
    kernel: &Arc<Kernel>,
    socket: &mut RouterSendHalf,
    msg: &RawMessage,
    msg_type: &str,
    parent: &Parent,
) -> bool {
    let session = &kernel.session;
    match msg_type {
        "kernel_info_request" => {
            send(
                socket,
                session.reply(parent, "kernel_info_reply", &replies::kernel_info()),
            )
            .await;
        }
        "interrupt_request" => {
            kernel.interrupt();
            send(
                socket,
                session.reply(parent, "interrupt_reply", &InterruptReply::default()),
            )
            .await;
        }
        "shutdown_request" => {
            reply_shutdown(session, socket, parent, content_bool(msg, "restart")).await;
            return true;
        }
        "usage_request" => {
            send(
                socket,
                session.reply(parent, "usage_reply", &replies::usage()),
            )
            .await;
        }
        other => tracing::info!("control: ignoring {other}"),
    }
    false
}

fn content_bool(msg: &RawMessage, key: &str) -> bool {
    msg.content_json()
        .ok()
        .and_then(|c| c.get(key).and_then(Value::as_bool))
        .unwrap_or(false)
}

async fn handle_shell(
    kernel: &Arc<Kernel>,
    socket: &mut RouterSendHalf,
    msg: &RawMessage,
    msg_type: &str,
    parent: &Parent,
) -> bool {
    let session = &kernel.session;
    let content = match msg.content_json() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("shell: {msg_type} with bad content: {e}");
            return false;
        }
    };
    let registry = &kernel.engine.registry;
    let code_at = || {
        CodeAt::parse(&content)
            .map_err(|e| tracing::warn!("shell: {msg_type} with bad content: {e}"))
            .ok()
    };
    let reply = match msg_type {
        "kernel_info_request" => replies::kernel_info(),
        "execute_request" => match ExecuteRequest::parse(&content) {
            Ok(request) => execute(kernel, &request, parent).await,
            Err(e) => {
                tracing::warn!("shell: execute_request with bad content: {e}");
                return false;
            }
        },
        "complete_request" | "inspect_request" | "is_complete_request" => {
            let Some(at) = code_at() else { return false };
            match msg_type {
                "complete_request" => reply::complete(registry, &at.code, at.cursor()),
                "inspect_request" => reply::inspect(registry, &at.code, at.cursor()),
                _ => replies::is_complete(registry, &at.code),
            }
        }
        "history_request" => {
            json!({"status": "ok", "history": kernel.state().history.query(&content)})
        }
        "comm_info_request" => json!({"status": "ok", "comms": {}}),
        "comm_open" => {
            // No comm targets here: close it so the frontend does not wait (as ipykernel does).
            let id = content.get("comm_id").and_then(Value::as_str).unwrap_or("");
            let close = CommClose {
                comm_id: CommId(id.to_string()),
                data: Default::default(),
            };
            kernel
                .iopub
                .send(session.iopub(Some(parent), "comm_close", &close));
            return false;
        }
        "comm_msg" | "comm_close" => return false,
        "shutdown_request" => {
            let restart = content
                .get("restart")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            reply_shutdown(session, socket, parent, restart).await;
            return true;
        }
        other => {
            tracing::info!("shell: ignoring unsupported {other}");
            return false;
        }
    };
    let reply_type = msg_type.replace("_request", "_reply");
    send(socket, session.reply(parent, &reply_type, &reply)).await;
    false
}

/// The shutdown_reply, on whichever socket the request came (control, or shell as older
/// clients send it).
async fn reply_shutdown(
    session: &Session,
    socket: &mut RouterSendHalf,
    parent: &Parent,
    restart: bool,
) {
    let content = ShutdownReply {
        restart,
        ..ShutdownReply::default()
    };
    send(socket, session.reply(parent, "shutdown_reply", &content)).await;
}

/// execute_request in magics-only mode: every non-blank, non-comment line must be a magic.
async fn execute(kernel: &Arc<Kernel>, request: &ExecuteRequest, parent: &Parent) -> Value {
    let code = request.code.as_str();
    let store_history = request.stores_history();
    let cancel = CancelToken::new();
    let count = {
        let mut state = kernel.state();
        if store_history {
            state.execution_count += 1;
        }
        state.running = Some(cancel.clone());
        state.execution_count
    };
    if !request.silent {
        kernel.iopub.send(kernel.session.iopub(
            Some(parent),
            "execute_input",
            &crate::shell::execute_input(code, count),
        ));
    }
    let sink = Arc::new(IopubSink::new(
        kernel.session.clone(),
        kernel.iopub.clone(),
        parent.clone(),
        request.silent,
        count,
    ));
    let registry = &kernel.engine.registry;
    let mut outcome = Ok(());
    for segment in cell::split(code, |name| registry.is_ours(name)) {
        let result = match segment {
            cell::Segment::Magic(line) => {
                exec::run_magic(kernel.engine.clone(), line, sink.clone(), cancel.clone()).await
            }
            cell::Segment::Other(text) => replies::not_a_magic(registry, &text),
        };
        if let Err(e) = result {
            sink.error(&e);
            outcome = Err(e);
            break;
        }
    }
    let pages: Vec<Value> = reply::pages(sink.take_pages()).collect();
    {
        let mut state = kernel.state();
        state.running = None;
        if store_history {
            state.history.record(count, code, sink.take_text());
        }
    }
    let user_expressions = replies::user_expressions(&request.user_expressions);
    reply::execute_reply(count, outcome.map(|()| pages), user_expressions)
}
