//! Sockets of a kernel: binding them from a connection file, the iopub publisher and the
//! heartbeat. Protocol plumbing only; what requests mean is decided elsewhere.

mod heartbeat;
mod iopub;
mod ipc;
mod signal;
mod socket;

pub use heartbeat::spawn_heartbeat;
pub use iopub::{spawn_iopub, Iopub};
pub use ipc::{ipc_connection, wait_bound};
pub use signal::spawn_on_sigint;
pub use socket::{accept, send};

use jupyter_protocol::ConnectionInfo;
use thiserror::Error;
use zeromq::{RepSocket, RouterSocket, Socket, SocketOptions, XPubSocket};

/// The largest message a peer may send on any socket unless `GPUKERNEL_MAX_MESSAGE_BYTES`
/// says otherwise: generous for notebooks (widgets and uploads send tens of MB), and what
/// keeps a peer without the key from making the kernel reserve what a frame announces.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 256 << 20;

/// The message size limit in force: `GPUKERNEL_MAX_MESSAGE_BYTES` (bytes) or the default.
pub fn max_message_bytes() -> usize {
    match std::env::var("GPUKERNEL_MAX_MESSAGE_BYTES") {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            tracing::warn!(
                "GPUKERNEL_MAX_MESSAGE_BYTES={v:?} is not a number of bytes; using {}",
                DEFAULT_MAX_MESSAGE_BYTES
            );
            DEFAULT_MAX_MESSAGE_BYTES
        }),
        Err(_) => DEFAULT_MAX_MESSAGE_BYTES,
    }
}

/// Options for every socket gpukernel opens, ours and those to the child: a peer whose
/// message passes the limit is disconnected (the socket serves its other peers on).
pub fn socket_options() -> SocketOptions {
    let mut options = SocketOptions::default();
    options.max_message_size(Some(max_message_bytes()));
    options
}

#[derive(Debug, Error)]
pub enum ServerError {
    #[error("cannot read connection file {path}: {source}")]
    ConnectionFile {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("connection file {path} is not valid: {source}")]
    ConnectionJson {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("cannot bind the {channel} socket to {endpoint}: {source}")]
    Bind {
        channel: &'static str,
        endpoint: String,
        #[source]
        source: zeromq::ZmqError,
    },
}

/// Reads a kernel connection file (as written by jupyter_client).
pub fn read_connection_file(path: &std::path::Path) -> Result<ConnectionInfo, ServerError> {
    let text = std::fs::read_to_string(path).map_err(|source| ServerError::ConnectionFile {
        path: path.display().to_string(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| ServerError::ConnectionJson {
        path: path.display().to_string(),
        source,
    })
}

/// The five kernel sockets, bound where the connection file says.
pub struct Channels {
    pub shell: RouterSocket,
    pub control: RouterSocket,
    pub stdin: RouterSocket,
    pub iopub: XPubSocket,
    pub heartbeat: RepSocket,
}

async fn bind<S: Socket>(channel: &'static str, endpoint: String) -> Result<S, ServerError> {
    let mut socket = S::with_options(socket_options());
    socket
        .bind(&endpoint)
        .await
        .map_err(|source| ServerError::Bind {
            channel,
            endpoint,
            source,
        })?;
    Ok(socket)
}

impl Channels {
    pub async fn bind(info: &ConnectionInfo) -> Result<Self, ServerError> {
        Ok(Self {
            shell: bind("shell", info.shell_url()).await?,
            control: bind("control", info.control_url()).await?,
            stdin: bind("stdin", info.stdin_url()).await?,
            iopub: bind("iopub", info.iopub_url()).await?,
            heartbeat: bind("heartbeat", info.hb_url()).await?,
        })
    }
}
