//! Linux and macOS: file modes, signals, kill(2), the passwd entry, the
//! agent's Unix socket. Behaviour as before the Windows port.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use russh::keys::agent::client::AgentClient;
use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::config::AgentSocket;

/// What `tunnel --help` says about this platform.
pub const HELP_NOTE: &str = "";

// ---- private files and directories ------------------------------------

/// Creates `dir` and its missing parents; the ones it creates are 0700.
pub fn create_private_dir_all(dir: &Path) -> io::Result<()> {
    if dir.exists() {
        return Ok(());
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Makes an existing directory private to its owner (0700).
pub fn restrict_dir(dir: &Path) -> io::Result<()> {
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
}

/// Creates a new file (it must not exist) that only its owner may read:
/// 0600 from the start.
pub fn create_private_file(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
}

/// Opens `path` for appending, creating it 0600 if missing.
pub fn open_private_append(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .append(true)
        .create(true)
        .mode(0o600)
        .open(path)
}

/// Whether tests can read back what the private-file functions promise.
#[cfg(test)]
pub fn access_is_checkable() -> bool {
    true
}

/// Who may open `path`, for test messages: its mode.
#[cfg(test)]
pub fn describe_access(path: &Path) -> String {
    fs::metadata(path)
        .map(|m| format!("mode {:o}", m.permissions().mode() & 0o7777))
        .unwrap_or_else(|e| e.to_string())
}

#[cfg(test)]
/// Whether only the owner may read or write `path` (no group or other bits).
pub fn is_private(path: &Path) -> io::Result<bool> {
    Ok(fs::metadata(path)?.permissions().mode() & 0o077 == 0)
}

// ---- stop requests ----------------------------------------------------

/// Ctrl-C, SIGTERM (`tunnel down`, kill) and SIGHUP (terminal closed) all
/// mean "stop cleanly".
pub struct Interrupts {
    int: Signal,
    term: Signal,
    hup: Signal,
}

impl Interrupts {
    pub fn install() -> io::Result<Self> {
        Ok(Interrupts {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            hup: signal(SignalKind::hangup())?,
        })
    }

    /// Wait for the next one; returns its name.
    pub async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.int.recv() => "SIGINT",
            _ = self.term.recv() => "SIGTERM",
            _ = self.hup.recv() => "SIGHUP",
        }
    }
}

/// The secret a `tunnel down` must present: none here (SIGTERM from the
/// same user, or root, is the proof).
pub fn stop_key() -> Option<String> {
    None
}

/// Asks the `up` process `pid` to stop as on Ctrl-C: SIGTERM.
pub async fn request_stop(pid: u32, _stop_key: Option<&str>) -> io::Result<()> {
    let raw = i32::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(raw),
        nix::sys::signal::Signal::SIGTERM,
    )
    .map_err(io::Error::from)
}

/// Whether `pid` is a live `tunnel` process (not a recycled pid).
pub fn is_tunnel_alive(pid: u32) -> bool {
    let Ok(raw) = i32::try_from(pid) else {
        return false;
    };
    let alive = match nix::sys::signal::kill(nix::unistd::Pid::from_raw(raw), None) {
        Ok(()) => true,
        Err(nix::errno::Errno::EPERM) => true,
        Err(_) => false,
    };
    if !alive {
        return false;
    }
    // Where /proc exists, make sure the pid still belongs to a tunnel.
    match fs::read(format!("/proc/{pid}/cmdline")) {
        Ok(cmd) => cmd
            .split(|&b| b == 0)
            .next()
            .map(|arg0| String::from_utf8_lossy(arg0).contains("tunnel"))
            .unwrap_or(false),
        Err(_) => true,
    }
}

// ---- the local user ---------------------------------------------------

/// The user as ssh sees them: passwd home (else `$HOME`), name, uid, and
/// this machine's name.
pub fn me() -> super::Me {
    let uid = nix::unistd::getuid();
    let entry = nix::unistd::User::from_uid(uid).ok().flatten();
    let home = match &entry {
        Some(u) if !u.dir.as_os_str().is_empty() => Some(u.dir.clone()),
        _ => dirs::home_dir(),
    };
    let name = match entry {
        Some(u) => u.name,
        None => std::env::var("USER")
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| uid.to_string()),
    };
    let hostname = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_default();
    super::Me {
        home,
        name,
        uid: uid.as_raw(),
        hostname,
    }
}

/// Another user's home directory (`~user`).
pub fn home_of(user: &str) -> Option<PathBuf> {
    nix::unistd::User::from_name(user)
        .ok()
        .flatten()
        .map(|u| u.dir)
}

// ---- ssh_config rules -------------------------------------------------

/// Where the system-wide ssh config and known_hosts live.
pub fn system_ssh_dir() -> String {
    "/etc/ssh".into()
}

/// Whether an Include path is anchored already.
pub fn include_is_absolute(arg: &str) -> bool {
    arg.starts_with('/')
}

/// An Include pattern as glob(3) gets it.
pub fn include_pattern(arg: String) -> String {
    arg
}

/// A glob pattern's root (`/`) and the rest, `/`-separated.
pub fn glob_root(pattern: &str) -> (PathBuf, &str) {
    match pattern.strip_prefix('/') {
        Some(rest) => (PathBuf::from("/"), rest),
        None => (PathBuf::new(), pattern),
    }
}

/// A config file someone else could have written (windows.rs has its own,
/// with OpenSSH for Windows' reasons).
#[derive(Debug, thiserror::Error)]
#[error(
    "bad owner or permissions on {} (it must be yours or root's, and writable by no one else)",
    path.display()
)]
pub struct ConfigPermissionError {
    pub path: PathBuf,
}

/// OpenSSH refuses a config file that someone else could have written.
pub fn check_config_permissions(
    path: &Path,
    meta: &fs::Metadata,
) -> Result<(), ConfigPermissionError> {
    let uid = nix::unistd::getuid().as_raw();
    if (meta.uid() != 0 && meta.uid() != uid) || meta.mode() & 0o022 != 0 {
        return Err(ConfigPermissionError {
            path: path.to_path_buf(),
        });
    }
    Ok(())
}

/// `Match exec`: the user's shell (`$SHELL`, else /bin/sh) with `-c`.
pub fn match_exec_command(command: &str) -> Command {
    let shell = std::env::var_os("SHELL")
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/bin/sh"));
    let mut c = Command::new(shell);
    c.arg("-c").arg(command);
    c
}

// ---- ssh-agent --------------------------------------------------------

pub type Agent = AgentClient<Box<dyn russh::keys::agent::client::AgentStream + Send + Unpin>>;

/// Connects to the agent `socket` names: `Ok(None)` when none is
/// configured (`SSH_AUTH_SOCK` unset, `IdentityAgent none`).
pub async fn connect_agent(socket: &AgentSocket) -> Result<Option<Agent>, russh::keys::Error> {
    match socket {
        AgentSocket::Disabled => Ok(None),
        AgentSocket::Env => {
            if std::env::var_os("SSH_AUTH_SOCK").is_none() {
                return Ok(None);
            }
            AgentClient::connect_env().await.map(|a| Some(a.dynamic()))
        }
        AgentSocket::Path(p) => AgentClient::connect_uds(p).await.map(|a| Some(a.dynamic())),
    }
}

// ---- the browser ------------------------------------------------------

/// Asks the desktop to open `file` (`xdg-open`, or `open` on macOS); failure
/// is not fatal (the URL is printed).
pub fn open_browser(file: &Path) {
    let opener = if cfg!(target_os = "macos") {
        "open"
    } else {
        "xdg-open"
    };
    match tokio::process::Command::new(opener)
        .arg(file)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
    {
        Ok(mut child) => {
            tokio::spawn(async move {
                match child.wait().await {
                    Ok(s) if !s.success() => {
                        tracing::warn!(
                            "{opener} could not open a browser ({s}); open the URL yourself"
                        )
                    }
                    Err(e) => tracing::debug!("{opener}: {e}"),
                    _ => {}
                }
            });
        }
        Err(e) => tracing::warn!("cannot run {opener} ({e}); open the URL yourself"),
    }
}
