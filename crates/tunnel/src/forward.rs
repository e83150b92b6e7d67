//! The local end: a listener on 127.0.0.1 whose connections each get their
//! own direct-tcpip channel over the one SSH session.
//!
//! The session can change under the listener: after a reconnect, `up`
//! publishes the new one on a watch channel. While there is none (the link
//! is down), new connections wait for it instead of failing, so a browser
//! that retries during an outage succeeds once the tunnel is back.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::connect::Handle;
use crate::exit::{Exit, HasExit};
use crate::relay::{Relay, RelayError};

/// How far past the preferred port to look for a free one.
const PORT_SEARCH: u16 = 100;
/// Copy buffers: big enough that bulk downloads are not syscall-bound.
const COPY_BUF: usize = 256 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("local port {port} is busy ({source}); choose another with --port")]
    PortBusy { port: u16, source: std::io::Error },
    #[error("no free local port between {from} and {to}; choose one with --port")]
    NoFreePort { from: u16, to: u16 },
    #[error("cannot listen on 127.0.0.1:{port}: {source}")]
    Listen { port: u16, source: std::io::Error },
}

impl HasExit for ForwardError {
    fn exit(&self) -> Exit {
        match self {
            ForwardError::PortBusy { .. } | ForwardError::NoFreePort { .. } => Exit::PortBusy,
            ForwardError::Listen { .. } => Exit::Internal,
        }
    }
}

async fn bind(port: u16) -> std::io::Result<TcpListener> {
    // Loopback only: the token is the only lock, so nobody else on the
    // network should even reach the door.
    TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, port))).await
}

/// Why one local connection could not be carried (logged, at debug level).
#[derive(Debug, thiserror::Error)]
enum ConnectionError {
    #[error(transparent)]
    Local(#[from] std::io::Error),
    /// The forwarding channel could not be opened.
    #[error(transparent)]
    Channel(#[from] russh::Error),
    #[error(transparent)]
    Relay(#[from] RelayError),
}

/// Listen on exactly `port` (the user asked for it).
pub async fn bind_exact(port: u16) -> Result<TcpListener, ForwardError> {
    bind(port).await.map_err(|source| match source.kind() {
        std::io::ErrorKind::AddrInUse | std::io::ErrorKind::PermissionDenied => {
            ForwardError::PortBusy { port, source }
        }
        _ => ForwardError::Listen { port, source },
    })
}

/// Listen on `preferred` if free, else the next free port above it.
pub async fn bind_near(preferred: u16) -> Result<TcpListener, ForwardError> {
    let from = preferred.max(1024);
    let to = from.saturating_add(PORT_SEARCH);
    for port in from..=to {
        match bind(port).await {
            Ok(l) => return Ok(l),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => continue,
            Err(source) => return Err(ForwardError::Listen { port, source }),
        }
    }
    Err(ForwardError::NoFreePort { from, to })
}

/// The current SSH session, or `None` while reconnecting.
pub type Session = watch::Receiver<Option<Arc<Handle>>>;

/// How each local connection reaches Jupyter over the session.
#[derive(Debug, Clone)]
pub enum Way {
    /// A direct-tcpip channel to 127.0.0.1:port on the session's host.
    Direct(u16),
    /// Through the tunnel's relay (`tunnel up --slurm` where ssh to the
    /// job's node is closed): one job step on the node that carries every
    /// connection, multiplexed over one exec channel of the login session.
    Relay(Arc<Relay>),
}

/// Accept connections forever, forwarding each to Jupyter `way` (usually
/// 127.0.0.1:port on the remote) over the current session. Ends when the
/// task is aborted.
pub fn serve(listener: TcpListener, session: Session, way: Way) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = match listener.accept().await {
                Ok(x) => x,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!("accepting a local connection failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            let mut session = session.clone();
            let way = way.clone();
            tokio::spawn(async move {
                let handle = match session.wait_for(Option::is_some).await {
                    Ok(h) => h.clone(),
                    Err(_) => return, // the tunnel is shutting down
                };
                let Some(handle) = handle else { return };
                if let Err(e) = forward_one(tcp, peer, &handle, &way).await {
                    tracing::debug!("connection from {peer}: {e}");
                }
            });
        }
    })
}

async fn forward_one(
    mut tcp: TcpStream,
    peer: SocketAddr,
    handle: &Handle,
    way: &Way,
) -> Result<(), ConnectionError> {
    tcp.set_nodelay(true)?;
    let remote_port = match way {
        Way::Direct(port) => *port,
        Way::Relay(relay) => return Ok(relay.forward(tcp, handle).await?),
    };
    let channel = handle
        .channel_open_direct_tcpip(
            "127.0.0.1",
            u32::from(remote_port),
            peer.ip().to_string(),
            u32::from(peer.port()),
        )
        .await
        .map_err(|e| {
            tracing::warn!(
                "cannot open a forwarding channel to the remote port {remote_port}: {e}"
            );
            e
        })?;
    let mut stream = channel.into_stream();
    let (up, down) =
        tokio::io::copy_bidirectional_with_sizes(&mut tcp, &mut stream, COPY_BUF, COPY_BUF).await?;
    tracing::trace!("connection from {peer} closed ({up} B up, {down} B down)");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn busy_port_is_reported_and_skipped() {
        let taken = bind_near(20000).await.expect("some port");
        let port = taken.local_addr().expect("addr").port();
        let err = bind_exact(port).await.expect_err("busy");
        assert_eq!(err.exit(), Exit::PortBusy);
        let other = bind_near(port).await.expect("next port");
        let other_port = other.local_addr().expect("addr").port();
        assert!(other_port > port);
        assert!(other.local_addr().expect("addr").ip().is_loopback());
    }
}
