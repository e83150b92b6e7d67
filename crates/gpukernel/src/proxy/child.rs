//! The child kernel (ipykernel by default): its process, connection file and sockets.

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use jupyter_protocol::ConnectionInfo;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;
use zeromq::util::PeerIdentity;
use zeromq::{DealerSocket, Socket, SocketOptions, SubSocket};

/// How long the child may take to bind its sockets (ipykernel takes about a second; a cold
/// conda env on NFS can take much longer).
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// A running child kernel. Dropping it kills the process and removes its private directory
/// (connection file and sockets).
pub struct Child {
    pub process: tokio::process::Child,
    pub pid: u32,
    _dir: tempfile::TempDir,
}

/// Our side of the child's channels. Shell and stdin share one identity: ipykernel sends
/// input_request to the identity of the shell request it is running.
pub struct ChildSockets {
    pub shell: DealerSocket,
    pub control: DealerSocket,
    pub stdin: DealerSocket,
    pub iopub: SubSocket,
}

/// The private directory the child lives in: mode 0700, so no other user of the machine can
/// reach its sockets (ipc, not tcp: nothing listens on loopback) or read its key. Under the
/// temp dir because a Unix socket path must stay short (108 bytes).
fn private_dir() -> Result<tempfile::TempDir> {
    let dir = tempfile::Builder::new()
        .prefix("gpukernel-")
        .tempdir()
        .context("cannot create a private directory for the child kernel")?;
    // tempfile makes it 0700 already; said here so it does not depend on that.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700))?;
    Ok(dir)
}

/// Writes the child's connection file (0600: it holds the key) in its private directory.
fn write_connection_file(dir: &Path, info: &ConnectionInfo) -> Result<PathBuf> {
    let path = dir.join("connection.json");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    file.write_all(serde_json::to_string(info)?.as_bytes())?;
    Ok(path)
}

async fn connect<S: Socket>(mut socket: S, endpoint: String) -> Result<S> {
    crate::server::wait_bound(&endpoint).await;
    socket
        .connect(&endpoint)
        .await
        .with_context(|| format!("cannot connect to the child kernel at {endpoint}"))?;
    Ok(socket)
}

/// Why the child could not be started.
enum StartFailure {
    /// The child exited before binding (status text).
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
/// during start-up or does not bind within the start timeout.
pub async fn start(
    argv: &[String],
    key: &str,
    scheme: &str,
    own_connection_file: &Path,
) -> Result<(Child, ChildSockets)> {
    match start_once(argv, key, scheme, own_connection_file).await {
        Ok(started) => Ok(started),
        Err(StartFailure::Exited(status)) => {
            bail!("the child kernel exited during start-up ({status}); see its messages above")
        }
        Err(StartFailure::Other(e)) => Err(e),
    }
}

async fn start_once(
    argv: &[String],
    key: &str,
    scheme: &str,
    own_connection_file: &Path,
) -> Result<(Child, ChildSockets), StartFailure> {
    let own = own_connection_file.display().to_string();
    let Some(program) = argv.first() else {
        return Err(anyhow::anyhow!("no child kernel command given").into());
    };
    let dir = private_dir()?;
    let info = crate::server::ipc_connection(dir.path(), key, scheme);
    let connection_file = write_connection_file(dir.path(), &info)?;
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
        _dir: dir,
    };

    let identity = Bytes::from(format!("gpukernel-{}", uuid::Uuid::new_v4()));
    // No message size limit towards the child: only it can reach these sockets, and what it
    // sends (a large plot, a widget's buffers) is the user's own output.
    let dealer = |identity: &Bytes| -> Result<DealerSocket> {
        let mut options = SocketOptions::default();
        options.peer_identity(PeerIdentity::try_from(identity.clone())?);
        Ok(DealerSocket::with_options(options))
    };
    let connecting = async {
        let mut iopub = connect(SubSocket::new(), info.iopub_url()).await?;
        iopub.subscribe("").await?;
        Ok::<_, anyhow::Error>(ChildSockets {
            shell: connect(dealer(&identity)?, info.shell_url()).await?,
            stdin: connect(dealer(&identity)?, info.stdin_url()).await?,
            control: connect(DealerSocket::new(), info.control_url()).await?,
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
