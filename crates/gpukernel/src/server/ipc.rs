//! Kernels on `ipc` sockets: gpukernel's child kernel, and the in-process tests' kernels.

use jupyter_protocol::{ConnectionInfo, Transport};
use std::path::Path;
use std::time::Duration;

/// A connection on ipc sockets `<dir>/k-1` .. `k-5` (with the ipc transport a port is only
/// the suffix of a socket path, ipykernel's `<ip>-<port>`).
pub fn ipc_connection(dir: &Path, key: &str, scheme: &str) -> ConnectionInfo {
    ConnectionInfo {
        ip: dir.join("k").display().to_string(),
        transport: Transport::IPC,
        shell_port: 1,
        iopub_port: 2,
        stdin_port: 3,
        control_port: 4,
        hb_port: 5,
        key: key.to_string(),
        signature_scheme: scheme.to_string(),
        kernel_name: None,
    }
}

/// Waits until something listens on `endpoint` (`ipc://PATH`); callers bound the wait.
/// zeromq's own connect retries with exponential backoff (50 ms, 100 ms, ...), which would add
/// up to a few hundred ms to every kernel start.
pub async fn wait_bound(endpoint: &str) {
    let path = endpoint.trim_start_matches("ipc://");
    while tokio::net::UnixStream::connect(path).await.is_err() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
