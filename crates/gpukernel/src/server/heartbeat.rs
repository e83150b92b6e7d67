use zeromq::{RepSocket, SocketRecv, SocketSend};

/// Echoes every heartbeat ping back unchanged, on its own task so a busy kernel still answers.
pub fn spawn_heartbeat(mut socket: RepSocket) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            match socket.recv().await {
                Ok(ping) => {
                    if let Err(e) = socket.send(ping).await {
                        tracing::debug!("heartbeat reply failed: {e}");
                    }
                }
                Err(e) => tracing::debug!("heartbeat receive failed: {e}"),
            }
        }
    })
}
