//! Proxy mode (the `gpu-python` kernel): a child kernel (ipykernel) does the Python; we sit in
//! front, forward every message untouched, and answer only our own magics.
//!
//! Routing: frontend shell -> (execute_request containing our magics? -> [`mixed`]; completion
//! on our magics -> merged reply; inspect of our magic -> our help; else -> child, raw).
//! Replies and iopub from the child come back raw; see [`link`] for what is held back.

mod after_error;
mod child;
mod link;
mod mixed;
mod python;

use crate::magics::{cell, CancelToken, GpuState, Registry};
use crate::server::{accept, send, spawn_heartbeat, spawn_iopub, spawn_on_sigint, Channels, Iopub};
use crate::shell::exec::Engine;
use crate::shell::request::{CodeAt, ExecuteRequest};
use crate::shell::{busy, reply};
use crate::wire::{Parent, RawMessage, Session, Signer};
use anyhow::Result;
use jupyter_protocol::ConnectionInfo;
use link::ChildLink;
use serde_json::{json, Value};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use zeromq::{DealerRecvHalf, RouterRecvHalf, RouterSendHalf, SocketRecv, SocketSend};

pub struct Proxy {
    session: Arc<Session>,
    iopub: Iopub,
    engine: Arc<Engine>,
    link: Arc<ChildLink>,
    running: Mutex<Option<CancelToken>>,
    shutting_down: AtomicBool,
}

impl Proxy {
    /// The magics run here; Python goes to the child through `link`.
    fn new(session: Arc<Session>, iopub: Iopub, link: Arc<ChildLink>, child_pid: u32) -> Self {
        Proxy {
            session,
            iopub,
            engine: Arc::new(Engine {
                registry: Registry::new(),
                gpu: GpuState::new(),
                python: Some(Arc::new(python::ChildPython {
                    link: link.clone(),
                    pid: child_pid,
                    runtime: tokio::runtime::Handle::current(),
                })),
            }),
            link,
            running: Mutex::new(None),
            shutting_down: AtomicBool::new(false),
        }
    }

    fn start_running(&self) -> CancelToken {
        let token = CancelToken::new();
        *self.running.lock().unwrap_or_else(PoisonError::into_inner) = Some(token.clone());
        token
    }

    fn stop_running(&self) {
        *self.running.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }

    fn interrupt_magic(&self) {
        if let Some(token) = &*self.running.lock().unwrap_or_else(PoisonError::into_inner) {
            token.cancel();
        }
    }
}

/// Child replies: ours (no envelope) to the waiting caller, the frontend's straight back.
fn spawn_reply_router(
    mut from_child: DealerRecvHalf,
    mut to_frontend: RouterSendHalf,
    link: Arc<ChildLink>,
    watch: Option<Arc<after_error::ErrorWatch>>,
) {
    tokio::spawn(async move {
        while let Ok(frames) = from_child.recv().await {
            match RawMessage::from_zmq(frames) {
                Ok(msg) if msg.identities.is_empty() => link.deliver(msg),
                Ok(msg) => {
                    if let Some(msg) = link.take_if_awaited(msg) {
                        if let Some(watch) = &watch {
                            watch.on_reply(&msg);
                        }
                        send(&mut to_frontend, msg.into_zmq()).await;
                    }
                }
                Err(e) => tracing::warn!("malformed reply from the child: {e}"),
            }
        }
    });
}

/// Raw frames one way, for stdin (input_request / input_reply).
fn spawn_pipe_to_frontend(mut from: DealerRecvHalf, mut to: RouterSendHalf) {
    tokio::spawn(async move {
        while let Ok(frames) = from.recv().await {
            send(&mut to, frames).await;
        }
    });
}

fn spawn_pipe_to_child(
    mut from: RouterRecvHalf,
    to: zeromq::DealerSendHalf,
    session: Arc<Session>,
) {
    tokio::spawn(async move {
        let mut to = to;
        while let Ok(frames) = from.recv().await {
            // Checked here too: nothing forged reaches the child through us.
            let Some((msg, _)) = accept(&session, "stdin", frames) else {
                continue;
            };
            if let Err(e) = to.send(msg.into_zmq()).await {
                tracing::warn!("stdin to child: {e}");
            }
        }
    });
}

/// Runs the proxy until the frontend shuts it down or the child dies.
pub async fn run(
    info: ConnectionInfo,
    child_argv: Vec<String>,
    connection_file: &Path,
) -> Result<()> {
    let signer = Signer::new(&info.signature_scheme, &info.key)?;
    let session = Arc::new(Session::new(signer));
    let channels = Channels::bind(&info).await?;
    let iopub = spawn_iopub(channels.iopub, session.clone());
    spawn_heartbeat(channels.heartbeat);

    let (child, sockets) = child::start(
        &child_argv,
        &info.key,
        &info.signature_scheme,
        connection_file,
    )
    .await?;
    let child_pid = child.pid;
    let (child_shell_send, child_shell_recv) = sockets.shell.split();
    let (child_control_send, child_control_recv) = sockets.control.split();
    let (child_stdin_send, child_stdin_recv) = sockets.stdin.split();
    let link = Arc::new(ChildLink::new(
        session.clone(),
        child_shell_send,
        child_control_send,
    ));

    let proxy = Arc::new(Proxy::new(
        session.clone(),
        iopub.clone(),
        link.clone(),
        child_pid,
    ));

    let (front_shell_send, mut front_shell_recv) = channels.shell.split();
    let (front_control_send, front_control_recv) = channels.control.split();
    let (front_stdin_send, front_stdin_recv) = channels.stdin.split();
    // The OOM diagnosis under a failed cell (before its idle).
    let watch = after_error::ErrorWatch::new(session.clone(), iopub.clone(), proxy.engine.clone());
    spawn_reply_router(
        child_shell_recv,
        front_shell_send.clone(),
        link.clone(),
        Some(watch.clone()),
    );
    spawn_reply_router(child_control_recv, front_control_send, link.clone(), None);
    spawn_pipe_to_frontend(child_stdin_recv, front_stdin_send);
    spawn_pipe_to_child(front_stdin_recv, child_stdin_send, session.clone());

    spawn_child_iopub(sockets.iopub, link.clone(), watch, iopub.clone());
    spawn_control(front_control_recv, proxy.clone());
    // SIGINT (interrupt_mode "signal"): the whole process group gets it, so the child has it
    // already; we only stop our own magic.
    let signal_proxy = proxy.clone();
    spawn_on_sigint(move || signal_proxy.interrupt_magic());

    let shell_proxy = proxy.clone();
    let mut shell_send = front_shell_send;
    let shell_loop = async move {
        while let Ok(frames) = front_shell_recv.recv().await {
            let Some((msg, msg_type)) = accept(&shell_proxy.session, "shell", frames) else {
                continue;
            };
            handle_shell(&shell_proxy, &mut shell_send, msg, &msg_type).await;
        }
    };

    serve_until_end(child, shell_loop, &proxy, &iopub).await
}

/// Serves until the child exits, the frontend's shell socket closes, or SIGTERM comes. A
/// child that exits unasked (no shutdown_request) is told to the frontend and ends gpukernel
/// with an error, so the server restarts the pair; otherwise the child is stopped with us.
async fn serve_until_end(
    mut child: child::Child,
    shell_loop: impl std::future::Future<Output = ()>,
    proxy: &Proxy,
    iopub: &Iopub,
) -> Result<()> {
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let status = tokio::select! {
        status = child.process.wait() => Some(status),
        _ = shell_loop => None,
        _ = sigterm.recv() => None,
    };
    let expected = proxy.shutting_down.load(Ordering::SeqCst);
    match status {
        Some(status) if !expected => {
            let why = status
                .map(|s| s.to_string())
                .unwrap_or_else(|e| e.to_string());
            tell_child_died(&proxy.session, iopub, child.pid, &why).await;
            anyhow::bail!("the Python kernel exited unexpectedly ({why})");
        }
        Some(_) => {
            // Let the child's shutdown_reply and last iopub messages drain.
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        None => {
            let _ = child.process.start_kill();
            let _ = child.process.wait().await;
        }
    }
    Ok(())
}

/// Child iopub -> ours, filtered (see link::ChildLink::should_forward), the OOM watch seeing
/// each message on the way.
fn spawn_child_iopub(
    mut child_iopub: zeromq::SubSocket,
    link: Arc<ChildLink>,
    watch: Arc<after_error::ErrorWatch>,
    iopub: Iopub,
) {
    tokio::spawn(async move {
        while let Ok(frames) = child_iopub.recv().await {
            match RawMessage::from_zmq(frames) {
                Ok(msg) if link.should_forward(&msg) => {
                    if let Some(msg) = watch.on_iopub(msg) {
                        iopub.send(msg.into_zmq());
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::warn!("malformed iopub message from the child: {e}"),
            }
        }
    });
}

/// Control: interrupts also stop our magic; everything goes on to the child.
fn spawn_control(mut from_frontend: RouterRecvHalf, proxy: Arc<Proxy>) {
    tokio::spawn(async move {
        while let Ok(frames) = from_frontend.recv().await {
            let Some((msg, msg_type)) = accept(&proxy.session, "control", frames) else {
                continue;
            };
            match msg_type.as_str() {
                "interrupt_request" => proxy.interrupt_magic(),
                "shutdown_request" => proxy.shutting_down.store(true, Ordering::SeqCst),
                _ => {}
            }
            proxy.link.forward_control(msg.into_zmq()).await;
        }
    });
}

/// Says on iopub that the Python kernel died, and gives the message time to leave before
/// gpukernel exits too.
async fn tell_child_died(session: &Session, iopub: &Iopub, child_pid: u32, why: &str) {
    tracing::error!("the Python kernel exited unexpectedly ({why})");
    iopub.send(session.iopub(
        None,
        "stream",
        &json!({"name": "stderr", "text": format!(
            "gpukernel: the Python kernel (pid {child_pid}) exited unexpectedly ({why}). \
             gpukernel stops too, so Jupyter restarts both.\n")}),
    ));
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
}

async fn handle_shell(
    proxy: &Arc<Proxy>,
    socket: &mut RouterSendHalf,
    msg: RawMessage,
    msg_type: &str,
) {
    let content = match msg_type {
        "execute_request" | "complete_request" | "inspect_request" => msg.content_json().ok(),
        _ => None,
    };
    let Some(content) = content else {
        proxy.link.forward_shell(msg.into_zmq()).await;
        return;
    };
    let parent = Parent::of(&msg);
    let answer = match msg_type {
        "execute_request" => execute(proxy, &msg, &content, &parent).await,
        _ => match CodeAt::parse(&content) {
            Ok(at) if msg_type == "complete_request" => complete(proxy, &at, &parent).await,
            Ok(at) => inspect(proxy, &at, &parent).await,
            Err(_) => None, // the child says what is wrong with it
        },
    };
    match answer {
        Some((reply_type, reply)) => {
            send(socket, proxy.session.reply(&parent, reply_type, &reply)).await;
        }
        None => proxy.link.forward_shell(msg.into_zmq()).await,
    }
}

/// What we answer ourselves: the reply's type and content; `None`: the child answers.
type Answer = Option<(&'static str, Value)>;

/// A cell with our magics in it runs here (see [`mixed`]); any other goes to the child.
async fn execute(proxy: &Arc<Proxy>, msg: &RawMessage, content: &Value, parent: &Parent) -> Answer {
    let request = ExecuteRequest::parse(content).ok()?;
    let segments = cell::split(&request.code, |name| proxy.engine.registry.is_ours(name));
    if !segments
        .iter()
        .any(|s| matches!(s, cell::Segment::Magic(_)))
    {
        return None;
    }
    let work = mixed::execute(proxy, msg, content, &request, segments, parent);
    let reply = busy(&proxy.session, &proxy.iopub, parent, work).await;
    Some(("execute_reply", reply))
}

/// Completion on our magics, merged with IPython's own %magics at the same spot.
async fn complete(proxy: &Arc<Proxy>, at: &CodeAt, parent: &Parent) -> Answer {
    let ours = proxy.engine.registry.complete(&at.code, at.cursor())?;
    let work = async {
        let theirs = proxy
            .link
            .request(
                "complete_request",
                &json!({"code": at.code, "cursor_pos": at.cursor()}),
            )
            .await
            .ok();
        let mut matches = ours.matches.clone();
        if let Some(theirs) = theirs.as_ref().filter(|t| {
            t["cursor_start"].as_u64() == Some(ours.cursor_start as u64)
                && t["cursor_end"].as_u64() == Some(ours.cursor_end as u64)
        }) {
            for m in theirs["matches"].as_array().into_iter().flatten() {
                if let Some(m) = m.as_str().filter(|m| !matches.iter().any(|x| x == m)) {
                    matches.push(m.to_string());
                }
            }
        }
        json!({"status": "ok", "matches": matches, "cursor_start": ours.cursor_start,
               "cursor_end": ours.cursor_end, "metadata": {}})
    };
    let reply = busy(&proxy.session, &proxy.iopub, parent, work).await;
    Some(("complete_reply", reply))
}

/// Help on our magics; anything else is inspected by the child.
async fn inspect(proxy: &Arc<Proxy>, at: &CodeAt, parent: &Parent) -> Answer {
    let registry = &proxy.engine.registry;
    registry.inspect(&at.code, at.cursor())?;
    let work = async { reply::inspect(registry, &at.code, at.cursor()) };
    let reply = busy(&proxy.session, &proxy.iopub, parent, work).await;
    Some(("inspect_reply", reply))
}
