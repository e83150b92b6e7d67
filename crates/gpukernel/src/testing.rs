//! An in-process test frontend (as ark's amalthea has its dummy frontend): it starts a kernel
//! of this crate on ipc sockets in a temporary directory and talks to it with the same zeromq
//! sockets a Jupyter client uses, so the protocol rules are tested without Python.

use crate::wire::{RawMessage, Session, Signer};
use bytes::Bytes;
use jupyter_protocol::ConnectionInfo;
use serde_json::{json, Value};
use std::time::Duration;
use tokio::time::timeout;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

pub const KEY: &str = "test-key";
const WAIT: Duration = Duration::from_secs(10);

/// A connection on ipc sockets under `dir`, with the tests' key.
pub fn connection(dir: &std::path::Path) -> ConnectionInfo {
    crate::server::ipc_connection(dir, KEY, "hmac-sha256")
}

/// One message as the frontend sees it.
#[derive(Debug, Clone)]
pub struct Received {
    pub msg_type: String,
    pub parent_id: String,
    pub content: Value,
}

impl Received {
    fn of(frames: ZmqMessage) -> Self {
        let raw = RawMessage::from_zmq(frames).expect("a well-formed message from the kernel");
        let parent = serde_json::from_slice::<Value>(&raw.parent_header).unwrap_or(Value::Null);
        Self {
            msg_type: raw.msg_type().expect("a msg_type"),
            parent_id: parent["msg_id"].as_str().unwrap_or_default().to_string(),
            content: raw.content_json().unwrap_or(Value::Null),
        }
    }
}

pub struct TestFrontend {
    session: Session,
    pub shell: DealerSocket,
    pub control: DealerSocket,
    pub iopub: SubSocket,
    next_id: u64,
}

impl TestFrontend {
    /// Connects to a kernel serving `info`, and waits until iopub delivers.
    pub async fn connect(info: &ConnectionInfo) -> Self {
        let mut shell = DealerSocket::new();
        let mut control = DealerSocket::new();
        let mut iopub = SubSocket::new();
        connect(&mut shell, &info.shell_url()).await;
        connect(&mut control, &info.control_url()).await;
        connect(&mut iopub, &info.iopub_url()).await;
        iopub.subscribe("").await.expect("subscribe");
        let mut frontend = Self {
            session: Session::new(Signer::new("hmac-sha256", KEY).expect("a signer")),
            shell,
            control,
            iopub,
            next_id: 0,
        };
        // A subscription takes effect some time after connect: nudge until iopub speaks.
        loop {
            let id = frontend.send_shell("kernel_info_request", json!({})).await;
            frontend.reply(&id).await;
            if let Ok(Ok(_)) = timeout(Duration::from_millis(200), frontend.iopub.recv()).await {
                break;
            }
        }
        while timeout(Duration::from_millis(100), frontend.iopub.recv())
            .await
            .is_ok()
        {}
        frontend
    }

    /// A signed request's frames, and its msg_id.
    pub fn request(&mut self, msg_type: &str, content: Value) -> (ZmqMessage, String) {
        self.next_id += 1;
        let id = format!("test-{}-{}", self.next_id, uuid::Uuid::new_v4());
        let header = json!({"msg_id": id, "session": "test-frontend", "username": "test",
                            "date": "2026-01-01T00:00:00.000000Z", "msg_type": msg_type,
                            "version": "5.3"});
        let frames = self.session.signed(
            Vec::new(),
            Bytes::from(header.to_string()),
            Bytes::from_static(b"{}"),
            Bytes::from_static(b"{}"),
            Bytes::from(content.to_string()),
        );
        (frames, id)
    }

    pub async fn send_shell(&mut self, msg_type: &str, content: Value) -> String {
        let (frames, id) = self.request(msg_type, content);
        self.shell.send(frames).await.expect("shell send");
        id
    }

    pub async fn send_control(&mut self, msg_type: &str, content: Value) -> String {
        let (frames, id) = self.request(msg_type, content);
        self.control.send(frames).await.expect("control send");
        id
    }

    pub async fn execute(&mut self, code: &str, extra: Value) -> String {
        let mut content = json!({"code": code, "silent": false, "store_history": true,
                                 "user_expressions": {}, "allow_stdin": false,
                                 "stop_on_error": true});
        if let (Some(c), Some(extra)) = (content.as_object_mut(), extra.as_object()) {
            c.extend(extra.clone());
        }
        self.send_shell("execute_request", content).await
    }

    /// The shell reply to `id` (other replies are skipped).
    pub async fn reply(&mut self, id: &str) -> Received {
        loop {
            let frames = timeout(WAIT, self.shell.recv())
                .await
                .expect("a shell reply in time")
                .expect("shell recv");
            let msg = Received::of(frames);
            if msg.parent_id == id {
                return msg;
            }
        }
    }

    /// Whether any shell reply comes within `wait`.
    pub async fn no_reply_within(&mut self, wait: Duration) -> bool {
        timeout(wait, self.shell.recv()).await.is_err()
    }

    /// Every iopub message whose parent is `id`, up to and including its idle.
    pub async fn iopub_until_idle(&mut self, id: &str) -> Vec<Received> {
        let mut seen = Vec::new();
        loop {
            let frames = timeout(WAIT, self.iopub.recv())
                .await
                .expect("iopub in time")
                .expect("iopub recv");
            let msg = Received::of(frames);
            if msg.parent_id != id {
                continue;
            }
            let idle = msg.msg_type == "status" && msg.content["execution_state"] == "idle";
            seen.push(msg);
            if idle {
                return seen;
            }
        }
    }
}

async fn connect<S: Socket>(socket: &mut S, endpoint: &str) {
    timeout(WAIT, crate::server::wait_bound(endpoint))
        .await
        .unwrap_or_else(|_| panic!("the kernel did not bind {endpoint}"));
    socket.connect(endpoint).await.expect("connect");
}
