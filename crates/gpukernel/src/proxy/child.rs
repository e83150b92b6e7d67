//! The child kernel (ipykernel by default): its process, connection file and sockets.

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use serde_json::json;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;
use zeromq::util::PeerIdentity;
use zeromq::{DealerSocket, Socket, SubSocket};

/// How long the child may take to bind its sockets (ipykernel takes about a second; a cold
/// conda env on NFS can take much longer).
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// A running child kernel. Dropping it kills the process and removes its connection file.
pub struct Child {
    pub process: tokio::process::Child,
    pub pid: u32,
    connection_file: PathBuf,
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.connection_file);
    }
}

/// Our side of the child's channels. Shell and stdin share one identity: ipykernel sends
/// input_request to the identity of the shell request it is running.
pub struct ChildSockets {
    pub shell: DealerSocket,
    pub control: DealerSocket,
    pub stdin: DealerSocket,
    pub iopub: SubSocket,
}

fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("no free loopback port")?;
    Ok(listener.local_addr()?.port())
}

/// Writes the child's connection file (0600: it holds the key) next to ours.
fn write_connection_file(dir: &Path, key: &str, scheme: &str) -> Result<(PathBuf, [u16; 5])> {
    let ports = [
        free_port()?,
        free_port()?,
        free_port()?,
        free_port()?,
        free_port()?,
    ];
    let info = json!({
        "ip": "127.0.0.1", "transport": "tcp",
        "shell_port": ports[0], "iopub_port": ports[1], "stdin_port": ports[2],
        "control_port": ports[3], "hb_port": ports[4],
        "key": key, "signature_scheme": scheme,
    });
    let path = dir.join(format!("gpukernel-child-{}.json", uuid::Uuid::new_v4()));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    file.write_all(info.to_string().as_bytes())?;
    Ok((path, ports))
}

/// Waits until the child listens on `port`. zeromq's own connect retries with exponential
/// backoff (50 ms, 100 ms, ...), which would add up to a few hundred ms to every kernel start.
async fn wait_listening(port: u16) {
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn connect<S: Socket>(mut socket: S, port: u16) -> Result<S> {
    wait_listening(port).await;
    socket
        .connect(&format!("tcp://127.0.0.1:{port}"))
        .await
        .with_context(|| format!("cannot connect to the child kernel on port {port}"))?;
    Ok(socket)
}

/// How many times a child that exits during start-up is started again on fresh ports. The
/// ports are picked free but released before the child binds them, so another process can
/// take one in between (ipykernel then exits with "Address already in use"); a child that is
/// really broken fails every attempt and the last error is reported.
const START_ATTEMPTS: usize = 3;

/// Why one start attempt failed.
enum StartFailure {
    /// The child exited before binding (status text): worth another attempt.
    Exited(String),
    Other(anyhow::Error),
}

impl<E: Into<anyhow::Error>> From<E> for StartFailure {
    fn from(e: E) -> Self {
        StartFailure::Other(e.into())
    }
}

/// Starts the child from `argv` with the same key, and connects to it. In `argv`,
/// `{child_connection_file}` (and our own connection file's path, which Jupyter substitutes
/// for `{connection_file}`) become the child's connection file. Fails if the child exits
/// during start-up [`START_ATTEMPTS`] times or does not bind within the start timeout.
pub async fn start(
    argv: &[String],
    key: &str,
    scheme: &str,
    own_connection_file: &Path,
) -> Result<(Child, ChildSockets)> {
    let mut attempt = 1;
    loop {
        match start_once(argv, key, scheme, own_connection_file).await {
            Ok(started) => return Ok(started),
            Err(StartFailure::Exited(status)) if attempt < START_ATTEMPTS => {
                tracing::warn!(
                    "the child kernel exited during start-up ({status}); starting it again \
                     on fresh ports ({attempt} of {START_ATTEMPTS})"
                );
                attempt += 1;
            }
            Err(StartFailure::Exited(status)) => {
                bail!("the child kernel exited during start-up ({status}); see its messages above")
            }
            Err(StartFailure::Other(e)) => return Err(e),
        }
    }
}

async fn start_once(
    argv: &[String],
    key: &str,
    scheme: &str,
    own_connection_file: &Path,
) -> Result<(Child, ChildSockets), StartFailure> {
    let dir = own_connection_file
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let own = own_connection_file.display().to_string();
    let Some(program) = argv.first() else {
        return Err(anyhow::anyhow!("no child kernel command given").into());
    };
    let (connection_file, ports) = write_connection_file(dir, key, scheme)?;
    let file_arg = connection_file.display().to_string();
    let args: Vec<String> = argv[1..]
        .iter()
        .map(|a| {
            if *a == own {
                file_arg.clone()
            } else {
                a.replace("{child_connection_file}", &file_arg)
                    .replace("{connection_file}", &file_arg)
            }
        })
        .collect();
    tracing::info!("starting child kernel: {program} {}", args.join(" "));
    // Same process group as us (the default), so a SIGINT to the group interrupts both;
    // JPY_PARENT_PID makes ipykernel exit if we die.
    let process = tokio::process::Command::new(program)
        .args(&args)
        .env("JPY_PARENT_PID", std::process::id().to_string())
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("cannot start the child kernel {program:?}"))?;
    let pid = process.id().unwrap_or(0);
    let mut child = Child {
        process,
        pid,
        connection_file,
    };

    let identity = Bytes::from(format!("gpukernel-{}", uuid::Uuid::new_v4()));
    let dealer = |identity: &Bytes| -> Result<DealerSocket> {
        let mut options = crate::server::socket_options();
        options.peer_identity(PeerIdentity::try_from(identity.clone())?);
        Ok(DealerSocket::with_options(options))
    };
    let connecting = async {
        let mut iopub = connect(
            SubSocket::with_options(crate::server::socket_options()),
            ports[1],
        )
        .await?;
        iopub.subscribe("").await?;
        Ok::<_, anyhow::Error>(ChildSockets {
            shell: connect(dealer(&identity)?, ports[0]).await?,
            stdin: connect(dealer(&identity)?, ports[2]).await?,
            control: connect(
                DealerSocket::with_options(crate::server::socket_options()),
                ports[3],
            )
            .await?,
            iopub,
        })
    };
    let sockets = tokio::select! {
        sockets = tokio::time::timeout(START_TIMEOUT, connecting) => match sockets {
            Ok(sockets) => sockets?,
            Err(_) => {
                return Err(anyhow::anyhow!(
                    "the child kernel did not start within {} s",
                    START_TIMEOUT.as_secs()
                )
                .into())
            }
        },
        status = child.process.wait() => {
            let status = status.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
            return Err(StartFailure::Exited(status));
        }
    };
    Ok((child, sockets))
}
