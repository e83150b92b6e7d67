//! Local state: one private JSON file per running tunnel (0600 in a 0700
//! directory; on Windows an owner-only ACL), so `down`, `status` and `ls`
//! work from any terminal. No token is stored.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::cli::App;
use crate::exit::{Exit, HasExit};
use crate::platform;

/// Overrides the state directory (tests, or several independent setups).
pub const STATE_DIR_ENV: &str = "TUNNEL_STATE_DIR";

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("no state directory: set {STATE_DIR_ENV} or HOME")]
    NoDir,
    #[error("state file {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("a tunnel to {host} is already running (pid {pid}{}); stop it with `tunnel down {host}`", url.as_deref().map(|u| format!(", {u}")).unwrap_or_default())]
    AlreadyRunning {
        host: String,
        pid: u32,
        url: Option<String>,
    },
    #[error("no tunnel to {host} is running{}", if *stale { " (removed the state of a tunnel that died)" } else { "" })]
    NoTunnel { host: String, stale: bool },
}

impl HasExit for StateError {
    fn exit(&self) -> Exit {
        match self {
            StateError::AlreadyRunning { .. } => Exit::AlreadyRunning,
            StateError::NoTunnel { .. } => Exit::NoTunnel,
            StateError::NoDir | StateError::Io { .. } => Exit::Internal,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Starting,
    Ready,
}

/// What `status` shows. Deliberately without the token.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TunnelState {
    pub host: String,
    pub pid: u32,
    pub phase: Phase,
    pub ssh_user: String,
    pub ssh_host: String,
    pub ssh_port: u16,
    pub app: App,
    /// Unix seconds.
    pub started_at: u64,
    pub local_port: Option<u16>,
    pub remote_port: Option<u16>,
    /// URL without the token.
    pub url: Option<String>,
    pub remote_runtime_dir: Option<String>,
    pub remote_pid: Option<u32>,
    /// The SLURM job Jupyter runs in (`up --slurm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slurm: Option<SlurmJob>,
    /// What `tunnel down` presents to this process's stop pipe (Windows,
    /// where there is no SIGTERM); see `platform::request_stop`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_key: Option<String>,
}

/// A `tunnel up --slurm` job as last seen by squeue. Kept up to date while
/// it is pending; once it runs it stays RUNNING for as long as the tunnel is
/// up (the tunnel ends with the job), and its end time does not move.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SlurmJob {
    pub job_id: String,
    /// PENDING, RUNNING, ...
    pub state: String,
    /// Why it is pending (Resources, Priority, ...).
    #[serde(default)]
    pub reason: Option<String>,
    /// The node Jupyter runs on.
    #[serde(default)]
    pub node: Option<String>,
    /// Unix seconds at which the time limit ends it, from squeue's time left.
    #[serde(default)]
    pub ends_at: Option<u64>,
}

/// `$TUNNEL_STATE_DIR`, else `tunnel` in the XDG state dir (Linux), the
/// local app data (`%LOCALAPPDATA%`, Windows) or Application Support (macOS).
pub fn dir() -> Result<PathBuf, StateError> {
    if let Some(d) = std::env::var_os(STATE_DIR_ENV).filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d));
    }
    dirs::state_dir()
        .or_else(dirs::data_local_dir)
        .map(|d| d.join("tunnel"))
        .ok_or(StateError::NoDir)
}

fn ensure_dir(d: &Path) -> Result<(), StateError> {
    let io = |source| StateError::Io {
        path: d.to_path_buf(),
        source,
    };
    platform::create_private_dir_all(d).map_err(io)?;
    // Other users must not list which hosts we tunnel to.
    platform::restrict_dir(d).map_err(io)?;
    Ok(())
}

/// File-name-safe form of the host argument.
pub fn key(host: &str) -> String {
    host.to_ascii_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | '@') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

pub fn path_for(dir: &Path, host: &str) -> PathBuf {
    dir.join(format!("{}.json", key(host)))
}

/// Whether `pid` is a live `tunnel` process (not a recycled pid).
pub fn is_alive(pid: u32) -> bool {
    platform::is_tunnel_alive(pid)
}

/// Holds the state file of the running `up`; removes it on drop.
pub struct StateFile {
    path: PathBuf,
    pub state: TunnelState,
}

impl StateFile {
    /// Claim the host: fails if a live tunnel already holds it; takes over
    /// the file of a dead one.
    pub fn claim(state: TunnelState) -> Result<Self, StateError> {
        let d = dir()?;
        ensure_dir(&d)?;
        let path = path_for(&d, &state.host);
        for _ in 0..2 {
            match platform::create_private_file(&path) {
                Ok(mut f) => {
                    let json = serde_json::to_vec_pretty(&state).map_err(|e| StateError::Io {
                        path: path.clone(),
                        source: e.into(),
                    })?;
                    f.write_all(&json).map_err(|source| StateError::Io {
                        path: path.clone(),
                        source,
                    })?;
                    return Ok(StateFile { path, state });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => match read(&path) {
                    Some(other) if is_alive(other.pid) => {
                        return Err(StateError::AlreadyRunning {
                            host: state.host.clone(),
                            pid: other.pid,
                            url: other.url,
                        })
                    }
                    _ => {
                        tracing::debug!("removing stale state {}", path.display());
                        let _ = fs::remove_file(&path);
                    }
                },
                Err(source) => return Err(StateError::Io { path, source }),
            }
        }
        Err(StateError::Io {
            path,
            source: std::io::Error::other("the state file keeps reappearing"),
        })
    }

    /// Rewrite atomically (0600 temp file, then rename).
    pub fn save(&self) -> Result<(), StateError> {
        write_private_json(&self.path, "json.tmp", &self.state)
    }

    pub fn dir(&self) -> &Path {
        self.path.parent().unwrap_or(Path::new("."))
    }
}

impl Drop for StateFile {
    fn drop(&mut self) {
        // Only remove it if it is still ours.
        if read(&self.path).is_some_and(|s| s.pid == self.state.pid) {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// A server left running by `tunnel up --detach`, so a later `up` can
/// reattach and `down` can stop it. Holds the token (a reattach must reuse
/// it, and the remote keeps none in a file): written 0600 in the 0700 state
/// dir, and only here.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServerRecord {
    pub host: String,
    /// The `-F` file `up` was given, so `down` resolves the host the same way.
    pub config: Option<PathBuf>,
    /// The `-J` hops `up` was given.
    #[serde(default)]
    pub jump: Option<String>,
    pub ssh_user: String,
    pub ssh_host: String,
    pub ssh_port: u16,
    pub app: App,
    pub remote_runtime_dir: String,
    pub remote_port: u16,
    pub token: String,
    /// Unix seconds.
    pub saved_at: u64,
}

/// Writes `value` as JSON to `path` atomically: a 0600 temp file (extension `tmp_ext`) that
/// is then renamed over it, so readers never see a partial file or a wider mode.
fn write_private_json(
    path: &Path,
    tmp_ext: &str,
    value: &impl Serialize,
) -> Result<(), StateError> {
    let tmp = path.with_extension(tmp_ext);
    let io = |source| StateError::Io {
        path: tmp.clone(),
        source,
    };
    let json = serde_json::to_vec_pretty(value).map_err(|e| io(e.into()))?;
    let _ = fs::remove_file(&tmp);
    let mut f = platform::create_private_file(&tmp).map_err(io)?;
    f.write_all(&json).map_err(io)?;
    fs::rename(&tmp, path).map_err(io)?;
    Ok(())
}

fn server_path(dir: &Path, host: &str) -> PathBuf {
    dir.join(format!("{}.server", key(host)))
}

impl ServerRecord {
    pub fn load(host: &str) -> Result<Option<Self>, StateError> {
        let path = server_path(&dir()?, host);
        match fs::read(&path) {
            Ok(text) => Ok(serde_json::from_slice(&text).ok()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(StateError::Io { path, source }),
        }
    }

    /// Write atomically, 0600.
    pub fn save(&self) -> Result<(), StateError> {
        let d = dir()?;
        ensure_dir(&d)?;
        let path = server_path(&d, &self.host);
        write_private_json(&path, "server.tmp", self)
    }

    pub fn remove(host: &str) {
        if let Ok(d) = dir() {
            let _ = fs::remove_file(server_path(&d, host));
        }
    }
}

pub fn read(path: &Path) -> Option<TunnelState> {
    let text = fs::read(path).ok()?;
    serde_json::from_slice(&text).ok()
}

/// All recorded tunnels (live or not), sorted by host.
pub fn list() -> Result<Vec<(PathBuf, TunnelState)>, StateError> {
    let d = dir()?;
    let entries = match fs::read_dir(&d) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(StateError::Io { path: d, source }),
    };
    let mut out: Vec<(PathBuf, TunnelState)> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .filter_map(|p| read(&p).map(|s| (p, s)))
        .collect();
    out.sort_by(|a, b| a.1.host.cmp(&b.1.host));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_file_safe() {
        assert_eq!(key("Root@GPU-1.example"), "root@gpu-1.example");
        assert_eq!(key("../x/y"), ".._x_y");
    }

    #[test]
    fn own_pid_is_alive_and_bogus_pid_is_not() {
        assert!(!is_alive(u32::MAX));
        // The test binary's name contains "tunnel".
        assert!(is_alive(std::process::id()));
    }

    #[test]
    fn state_dir_and_files_are_private() {
        let top = tempfile::tempdir().expect("tempdir");
        let d = top.path().join("a").join("tunnel");
        ensure_dir(&d).expect("ensure_dir");
        platform::assert_private(&d);
        let state = TunnelState {
            host: "h".into(),
            pid: std::process::id(),
            phase: Phase::Starting,
            ssh_user: "u".into(),
            ssh_host: "h".into(),
            ssh_port: 22,
            app: App::Lab,
            started_at: 0,
            local_port: None,
            remote_port: None,
            url: None,
            remote_runtime_dir: None,
            remote_pid: None,
            slurm: None,
            stop_key: platform::stop_key(),
        };
        let path = path_for(&d, "h");
        write_private_json(&path, "json.tmp", &state).expect("write");
        platform::assert_private(&path);
        let back = read(&path).expect("read back");
        assert_eq!(back.stop_key, state.stop_key);
        // Rewriting keeps it private (a new temp file renamed over it).
        write_private_json(&path, "json.tmp", &state).expect("rewrite");
        platform::assert_private(&path);
    }
}
