//! The remote side: the launch script, its stdin protocol and its events.
//!
//! The exec command is a constant one-liner that reads the real script from
//! the first stdin line, so nothing but that line ever shows in `ps`, and it
//! works whatever the user's login shell is (csh and fish included). The
//! token is the second stdin line: it never appears on a command line or in
//! an environment (the bootstrap writes it to a 0600 file in the private
//! runtime dir, which Jupyter reads through `JUPYTER_TOKEN_FILE`). Later
//! lines are commands ("stop"); EOF means the client is gone, and the remote
//! stops Jupyter after the linger time.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use russh::client::Msg;
use russh::{ChannelMsg, ChannelWriteHalf};
use tokio::sync::mpsc;

use crate::cli::App;
use crate::connect::Handle;
use crate::exit::{Exit, HasExit};
use crate::token::Token;

const BOOTSTRAP: &str = include_str!("remote/bootstrap.sh");
const SETUP_GUARD: &str = include_str!("remote/setup_guard.sh");
const COMMON: &str = include_str!("remote/common.sh");
const SETUP: &str = include_str!("remote/setup.sh");
const LAUNCH: &str = include_str!("remote/launch.sh");
const DOCTOR: &str = include_str!("remote/doctor.sh");
const ATTACH: &str = include_str!("remote/attach.sh");
const SESSION: &str = include_str!("remote/session.sh");

/// What sshd runs. `printf %b` turns the `\n`/`\\` escapes of the first stdin
/// line back into the multi-line stage-1 script.
pub const EXEC_COMMAND: &str = r#"exec /bin/sh -c 'IFS= read -r s && eval "$(printf %b "$s")"'"#;

/// The part of [`EXEC_COMMAND`] that `/bin/sh -c` runs: read a script from
/// the first stdin line and run it. Also what a SLURM job step runs.
pub const STDIN_SCRIPT: &str = r#"IFS= read -r s && eval "$(printf %b "$s")""#;

const PREFIX: &str = "tunnel-remote: ";

/// What to start on the remote.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    pub app: App,
    pub env: Option<String>,
    pub init: Option<String>,
    pub dir: Option<String>,
    /// First port Jupyter tries (it moves on if taken).
    pub port_hint: u16,
    pub linger_secs: u64,
    pub timeout_secs: u64,
    /// Inside a SLURM job step (`tunnel up --slurm`), this submission's
    /// step key ([`crate::slurm::step_key`]): the launcher records its pid
    /// for the job's batch script under it, and stops Jupyter as soon as the
    /// client's stdin ends (a job step cannot be reattached).
    pub slurm: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error("{message}{}", log_block(log))]
    Setup { message: String, log: Vec<String> },
    #[error("{message}")]
    JupyterMissing { message: String },
    #[error("{message}{}", log_block(log))]
    JupyterFailed { message: String, log: Vec<String> },
    #[error("{message}{}", log_block(log))]
    Timeout { message: String, log: Vec<String> },
    #[error("the remote session ended before Jupyter was ready{}{}", status_text(*status), log_block(log))]
    Ended {
        status: Option<u32>,
        log: Vec<String>,
    },
    #[error("cannot start the remote command: {0}")]
    Channel(#[source] russh::Error),
    /// A reattach found no server to attach to.
    #[error("{message}")]
    Gone { message: String },
}

fn status_text(status: Option<u32>) -> String {
    status
        .map(|s| format!(" (exit status {s})"))
        .unwrap_or_default()
}

fn log_block(log: &[String]) -> String {
    if log.is_empty() {
        String::new()
    } else {
        format!("\n  last lines of the log:\n    {}", log.join("\n    "))
    }
}

impl HasExit for RemoteError {
    fn exit(&self) -> Exit {
        match self {
            RemoteError::Setup { .. } => Exit::RemoteSetup,
            RemoteError::JupyterMissing { .. } => Exit::JupyterMissing,
            RemoteError::JupyterFailed { .. } => Exit::JupyterFailed,
            RemoteError::Timeout { .. } => Exit::Timeout,
            RemoteError::Ended { .. } | RemoteError::Channel(_) => Exit::ConnectionLost,
            RemoteError::Gone { .. } => Exit::JupyterFailed,
        }
    }
}

/// A line the launcher printed, or a change of the channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Runtime(String),
    Root,
    Env(String),
    Pid(u32),
    Ready {
        port: u16,
        base_url: String,
    },
    Exited(String),
    Error {
        kind: String,
        message: String,
    },
    Log(String),
    Stopped,
    /// The server will wait for a detached client indefinitely.
    Kept,
    /// A `tunnel doctor` finding (`shell ...`, `jupyter ...`, `gpu ...`).
    Check(String),
    /// The channel delivered an exit status.
    Status(u32),
    /// The launcher was killed by this signal.
    Signal(String),
    /// The channel (or the whole connection) closed.
    Closed,
}

/// Single-quote for sh.
pub fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The first stdin line: stage 1 with its parameters, escaped onto one line.
pub fn stage1_line(spec: &LaunchSpec) -> String {
    stage1_with(spec, &[COMMON, SETUP, LAUNCH, SESSION].concat())
}

/// The first stdin line of `tunnel doctor`: the same bootstrap and setup
/// (login shell, --init, --env) as a launch, then checks instead of Jupyter.
pub fn doctor_line(spec: &LaunchSpec) -> String {
    stage1_with(spec, &[COMMON, SETUP, DOCTOR].concat())
}

fn stage1_with(spec: &LaunchSpec, main: &str) -> String {
    let opt = |o: &Option<String>| sh_quote(o.as_deref().unwrap_or(""));
    let script = format!(
        "TUNNEL_MAIN={main}\nTUNNEL_INIT={init}\nTUNNEL_GUARD={guard}\nTUNNEL_ENV={env}\n\
         TUNNEL_DIR={dir}\n\
         TUNNEL_APP={app}\nTUNNEL_PORT={port}\nTUNNEL_LINGER={linger}\nTUNNEL_TIMEOUT={timeout}\n\
         TUNNEL_SLURM={slurm}\n{boot}",
        main = sh_quote(main),
        init = opt(&spec.init),
        guard = sh_quote(SETUP_GUARD),
        env = opt(&spec.env),
        dir = opt(&spec.dir),
        app = spec.app.subcommand(),
        port = spec.port_hint,
        linger = spec.linger_secs,
        timeout = spec.timeout_secs,
        slurm = opt(&spec.slurm),
        boot = BOOTSTRAP,
    );
    escape_line(&script)
}

/// The first (and only script) stdin line of a reattach to the server whose
/// runtime directory is `runtime_dir`. Runs in plain /bin/sh: the login
/// environment only matters for starting Jupyter.
pub fn attach_line(runtime_dir: &str) -> String {
    let script = format!(
        "TUNNEL_RT={rt}\n{common}{attach}{session}",
        rt = sh_quote(runtime_dir),
        common = COMMON,
        attach = ATTACH,
        session = SESSION,
    );
    escape_line(&script)
}

/// Escape a script onto one line, as `printf %b` decodes it.
pub fn escape_line(script: &str) -> String {
    let mut line = script.replace('\\', r"\\").replace('\n', r"\n");
    line.push('\n');
    line
}

/// Parse one stdout line of the launcher; `None` for lines that are not ours
/// (a chatty login profile, for instance).
pub fn parse_line(line: &str) -> Option<Event> {
    let rest = line.strip_prefix(PREFIX)?;
    let (word, args) = rest.split_once(' ').unwrap_or((rest, ""));
    Some(match word {
        "runtime" => Event::Runtime(args.to_string()),
        "root" => Event::Root,
        "env" => Event::Env(args.to_string()),
        "pid" => Event::Pid(args.trim().parse().ok()?),
        "ready" => {
            let (port, base) = args.split_once(' ').unwrap_or((args, "/"));
            Event::Ready {
                port: port.trim().parse().ok()?,
                base_url: base.trim().to_string(),
            }
        }
        "exited" => Event::Exited(args.to_string()),
        "error" => {
            let (kind, message) = args.split_once(' ').unwrap_or((args, ""));
            Event::Error {
                kind: kind.to_string(),
                message: message.to_string(),
            }
        }
        "log" => Event::Log(args.to_string()),
        "stopped" => Event::Stopped,
        "kept" => Event::Kept,
        "check" => Event::Check(args.to_string()),
        _ => return None,
    })
}

/// Turn an `error` event (plus the log lines that followed) into an error.
pub fn error_from(kind: &str, message: String, log: Vec<String>) -> RemoteError {
    match kind {
        "jupyter-missing" => RemoteError::JupyterMissing { message },
        "jupyter-exited" => RemoteError::JupyterFailed { message, log },
        "timeout" | "login-timeout" | "init-timeout" | "setup-timeout" | "env-timeout"
        | "checks-timeout" => RemoteError::Timeout { message, log },
        "gone" => RemoteError::Gone { message },
        _ => RemoteError::Setup { message, log },
    }
}

/// How many stderr lines of the remote command are kept for error messages.
const STDERR_TAIL: usize = 20;

/// The running launcher: send commands, receive events.
pub struct Launcher {
    writer: ChannelWriteHalf<Msg>,
    pub events: mpsc::Receiver<Event>,
    /// The last lines the remote command wrote on stderr: what `srun` (or a
    /// shell) said when it failed before the launcher could say anything.
    stderr: Arc<Mutex<VecDeque<String>>>,
}

impl Launcher {
    /// Open an exec channel, start the launcher and hand it the token.
    pub async fn start(
        handle: &Handle,
        spec: &LaunchSpec,
        token: &Token,
    ) -> Result<Self, RemoteError> {
        Self::start_via(handle, None, spec, token).await
    }

    /// [`Launcher::start`] through `wrapper`: a script (run by `/bin/sh` on
    /// the host) that ends by handing its stdin to a command that runs the
    /// launcher elsewhere, as `srun ... /bin/sh -c '<EXEC_COMMAND's reader>'`
    /// does for a SLURM job step. The launcher and token lines follow it on
    /// stdin, so they travel to the step without touching a command line.
    pub async fn start_via(
        handle: &Handle,
        wrapper: Option<&str>,
        spec: &LaunchSpec,
        token: &Token,
    ) -> Result<Self, RemoteError> {
        let mut stdin = wrapper.map(escape_line).unwrap_or_default().into_bytes();
        stdin.extend_from_slice(stage1_line(spec).as_bytes());
        stdin.extend_from_slice(token.expose().as_bytes());
        stdin.push(b'\n');
        Self::open(handle, &stdin).await
    }

    /// Run the doctor's checks (bootstrap, --init, --env, jupyter, GPU).
    /// The token line is empty: nothing is started that would need one.
    pub async fn doctor(handle: &Handle, spec: &LaunchSpec) -> Result<Self, RemoteError> {
        let mut stdin = doctor_line(spec).into_bytes();
        stdin.push(b'\n');
        Self::open(handle, &stdin).await
    }

    /// Reattach to the server whose runtime directory is `runtime_dir`: the
    /// events repeat `pid` and `ready` (or say `error gone ...`).
    pub async fn attach(handle: &Handle, runtime_dir: &str) -> Result<Self, RemoteError> {
        Self::open(handle, attach_line(runtime_dir).as_bytes()).await
    }

    async fn open(handle: &Handle, stdin: &[u8]) -> Result<Self, RemoteError> {
        let channel = handle
            .channel_open_session()
            .await
            .map_err(RemoteError::Channel)?;
        channel
            .exec(true, EXEC_COMMAND)
            .await
            .map_err(RemoteError::Channel)?;
        let (mut reader, writer) = channel.split();
        writer.data(stdin).await.map_err(RemoteError::Channel)?;

        let (tx, events) = mpsc::channel(64);
        let stderr = Arc::new(Mutex::new(VecDeque::new()));
        let stderr_tail = stderr.clone();
        tokio::spawn(async move {
            let mut partial = Vec::new();
            let mut err_partial = Vec::new();
            while let Some(msg) = reader.wait().await {
                match msg {
                    ChannelMsg::Data { data } => {
                        for line in split_lines(&mut partial, &data) {
                            match parse_line(&line) {
                                Some(ev) => {
                                    tracing::trace!("remote event {ev:?}");
                                    if tx.send(ev).await.is_err() {
                                        return;
                                    }
                                }
                                None => tracing::debug!("remote: {line}"),
                            }
                        }
                    }
                    ChannelMsg::ExtendedData { data, .. } => {
                        for line in split_lines(&mut err_partial, &data) {
                            tracing::debug!("remote stderr: {line}");
                            if let Ok(mut tail) = stderr_tail.lock() {
                                if tail.len() == STDERR_TAIL {
                                    tail.pop_front();
                                }
                                tail.push_back(line);
                            }
                        }
                    }
                    ChannelMsg::ExitStatus { exit_status } => {
                        let _ = tx.send(Event::Status(exit_status)).await;
                    }
                    ChannelMsg::ExitSignal { signal_name, .. } => {
                        let _ = tx.send(Event::Signal(format!("{signal_name:?}"))).await;
                    }
                    ChannelMsg::Close => break,
                    _ => {}
                }
            }
            let _ = tx.send(Event::Closed).await;
        });
        Ok(Launcher {
            writer,
            events,
            stderr,
        })
    }

    /// What the remote command last wrote on stderr (oldest first).
    pub fn stderr_tail(&self) -> Vec<String> {
        self.stderr
            .lock()
            .map(|t| t.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Ask the launcher to stop Jupyter and clean up.
    pub async fn send_stop(&self) -> Result<(), russh::Error> {
        self.writer.data(&b"stop\n"[..]).await
    }

    /// Ask the server to wait for a detached client indefinitely.
    pub async fn send_keep(&self) -> Result<(), russh::Error> {
        self.writer.data(&b"keep\n"[..]).await
    }

    /// Close our end of the lifeline (the server then waits for a client:
    /// the linger time, or indefinitely after `keep`).
    pub async fn close(&self) {
        let _ = self.writer.eof().await;
    }
}

fn split_lines(partial: &mut Vec<u8>, data: &[u8]) -> Vec<String> {
    partial.extend_from_slice(data);
    let mut lines = Vec::new();
    while let Some(pos) = partial.iter().position(|&b| b == b'\n') {
        let line: Vec<u8> = partial.drain(..=pos).collect();
        lines.push(
            String::from_utf8_lossy(&line[..line.len() - 1])
                .trim_end_matches('\r')
                .to_string(),
        );
    }
    lines
}

/// Test helper: `/bin/sh -n` accepts `text` (a script tunnel sends to a remote shell).
#[cfg(all(test, unix))]
pub(crate) fn assert_sh_parses(name: &str, text: &str) {
    let out = std::process::Command::new("/bin/sh")
        .args(["-n", "-c", text])
        .output()
        .expect("sh runs");
    assert!(
        out.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(unix)]
    use std::io::Write;
    #[cfg(unix)]
    use std::process::{Command, Stdio};
    #[cfg(unix)]
    use std::time::Duration;

    fn spec() -> LaunchSpec {
        LaunchSpec {
            app: App::Lab,
            env: Some("it's \"quoted\" $HOME `x` \\n".into()),
            init: Some("module load cuda\necho 'a\\b'".into()),
            dir: None,
            port_hint: 23456,
            linger_secs: 5,
            timeout_secs: 30,
            slurm: None,
        }
    }

    #[test]
    fn stage1_is_one_line() {
        let line = stage1_line(&spec());
        assert_eq!(line.matches('\n').count(), 1);
        assert!(line.ends_with('\n'));
    }

    /// The exact decoding sh performs must give back the parameters verbatim.
    // The remote scripts run under a POSIX /bin/sh: the test runs one locally.
    #[cfg(unix)]
    #[test]
    fn sh_decodes_the_stage1_line_exactly() {
        let s = spec();
        let line = stage1_line(&s);
        // Replace the bootstrap's work with printing the parameters.
        let probe = r#"IFS= read -r s && eval "$(printf %b "$s" | sed '/^# tunnel bootstrap/,$d')" && printf '%s\n--\n%s\n--\n%s' "$TUNNEL_ENV" "$TUNNEL_INIT" "$TUNNEL_PORT""#;
        let mut child = Command::new("/bin/sh")
            .args(["-c", probe])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("sh runs");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(line.as_bytes())
            .expect("write");
        let out = child.wait_with_output().expect("sh finishes");
        let text = String::from_utf8(out.stdout).expect("utf8");
        assert_eq!(
            text,
            format!(
                "{}\n--\n{}\n--\n23456",
                s.env.as_deref().unwrap_or_default(),
                s.init.as_deref().unwrap_or_default()
            )
        );
    }

    /// The real bootstrap, run by a real /bin/sh: the token ends up only in a
    /// 0600 file of the runtime dir, in no environment and no argv.
    // The remote scripts run under a POSIX /bin/sh: the test runs one locally.
    #[cfg(unix)]
    #[test]
    fn bootstrap_puts_the_token_in_a_private_file_only() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let token = "f00dfeedf00dfeedf00dfeedf00dfeed";
        // Stage 2 stand-in: report what Jupyter's launcher would see.
        let main = r#"stat -c '%a %s' "$TUNNEL_RT/token"; cat "$TUNNEL_RT/token"; echo
env | grep -c -F -f "$TUNNEL_RT/token"; echo "${JUPYTER_TOKEN-unset}"; rm -rf "$TUNNEL_RT""#;
        let text = run_bootstrap(tmp.path(), &spec(), main, token);
        let lines: Vec<&str> = text.lines().collect();
        let n = lines.len();
        assert!(n >= 4, "{text}");
        // 0600, exactly the token (no newline: Jupyter reads the file whole).
        assert_eq!(lines[n - 4], format!("600 {}", token.len()), "{text}");
        assert_eq!(lines[n - 3], token, "{text}");
        assert_eq!(lines[n - 2], "0", "the token is in the environment: {text}");
        assert_eq!(lines[n - 1], "unset", "{text}");
    }

    /// Run the real bootstrap of `spec` with `main` as stage 2 and `token` on
    /// stdin, under a real /bin/sh whose runtime dirs go to `tmp` (and whose
    /// login profile set a JUPYTER_TOKEN); its stdout.
    #[cfg(unix)]
    fn run_bootstrap(tmp: &std::path::Path, spec: &LaunchSpec, main: &str, token: &str) -> String {
        run_bootstrap_with(tmp, spec, main, token, &[])
    }

    /// [`run_bootstrap`] with more environment (a HOME whose profile hangs).
    #[cfg(unix)]
    fn run_bootstrap_with(
        tmp: &std::path::Path,
        spec: &LaunchSpec,
        main: &str,
        token: &str,
        env: &[(&str, &std::path::Path)],
    ) -> String {
        let mut child = Command::new("/bin/sh")
            .args(["-c", STDIN_SCRIPT])
            .env("TMPDIR", tmp)
            .env_remove("XDG_RUNTIME_DIR")
            .env("JUPYTER_TOKEN", "from-a-profile")
            .env("SHELL", "/bin/sh")
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("sh runs");
        let mut stdin = child.stdin.take().expect("stdin");
        stdin
            .write_all(stage1_with(spec, main).as_bytes())
            .expect("write");
        stdin
            .write_all(format!("{token}\n").as_bytes())
            .expect("write");
        drop(stdin);
        let out = child.wait_with_output().expect("sh finishes");
        String::from_utf8(out.stdout).expect("utf8")
    }

    /// [`spec`] with this --init and --timeout.
    #[cfg(unix)]
    fn init_spec(init: &str, timeout_secs: u64) -> LaunchSpec {
        LaunchSpec {
            init: Some(init.into()),
            timeout_secs,
            ..spec()
        }
    }

    /// Processes whose command line contains `needle` (Linux's /proc).
    #[cfg(target_os = "linux")]
    fn processes_with(needle: &str) -> usize {
        std::fs::read_dir("/proc")
            .expect("/proc")
            .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
            .filter(|c| {
                String::from_utf8_lossy(c)
                    .replace('\0', " ")
                    .contains(needle)
            })
            .count()
    }

    /// An --init that hangs is stopped at the deadline, with what it started,
    /// and named; nothing of the launch is left (no runtime dir, no process).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_hung_init_is_stopped_at_the_deadline() {
        let tmp = tempfile::tempdir().expect("tempdir");
        // Unique, so that the count below is this test's processes only.
        let marker = format!("{}.5", 400_000 + std::process::id());
        let init = format!("echo waiting for a licence; sleep {marker} & sleep {marker}");
        let start = std::time::Instant::now();
        let text = run_bootstrap(tmp.path(), &init_spec(&init, 2), "echo main ran", "t");
        let took = start.elapsed();
        assert!(
            text.contains(
                "tunnel-remote: error init-timeout the --init command was still running when \
                 --timeout (2s, counted from the login) ran out, so the launch was stopped"
            ),
            "{text}"
        );
        assert!(
            text.contains("tunnel-remote: log waiting for a licence"),
            "{text}"
        );
        assert!(!text.contains("main ran"), "{text}");
        assert!(took < Duration::from_secs(15), "{took:?}");
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(processes_with(&format!("sleep {marker}")), 0);
        assert!(runtime_dirs_in(tmp.path()).is_empty());
    }

    /// An --init that returns in time goes on to stage 2 with its exports and
    /// the guard's pid, by which stage 2 (the same pid as the login shell) ends
    /// the guard, as launch.sh does, and then runs past the deadline; the
    /// guard's own variables are gone.
    #[cfg(unix)]
    #[test]
    fn an_init_in_time_is_not_stopped_later() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let main = "kill \"$TUNNEL_GUARD_PID\"; sleep 2.5; echo \"main ran $FROM_INIT\"; \
                    env | grep -c -e '^TUNNEL_GUARD=' -e '^TUNNEL_DEADLINE='; rm -rf \"$TUNNEL_RT\"";
        let text = run_bootstrap(tmp.path(), &init_spec("export FROM_INIT=yes", 1), main, "t");
        assert!(!text.contains("error"), "{text}");
        assert!(text.contains("main ran yes\n0\n"), "{text}");
    }

    /// A hung --env activation (here a `conda` that never answers) is stopped
    /// at the same deadline and named; nothing of the launch is left.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_hung_env_activation_is_stopped_at_the_deadline() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let bin = tmp.path().join("bin");
        std::fs::create_dir(&bin).expect("bin");
        let marker = format!("{}.75", 400_000 + std::process::id());
        let conda = bin.join("conda");
        std::fs::write(&conda, format!("#!/bin/sh\nsleep {marker}\n")).expect("conda");
        let mode = std::os::unix::fs::PermissionsExt::from_mode(0o755);
        std::fs::set_permissions(&conda, mode).expect("chmod");
        // --init puts it first on PATH (a login profile may reset PATH).
        let spec = LaunchSpec {
            env: Some("myenv".into()),
            ..init_spec(&format!("PATH={}:$PATH; export PATH", bin.display()), 2)
        };
        let main = [COMMON, SETUP, "echo main ran\n"].concat();
        let text = run_bootstrap(tmp.path(), &spec, &main, "t");
        let says = "tunnel-remote: error env-timeout activating --env myenv was still running \
                    when --timeout (2s, counted from the login) ran out";
        assert_stopped_and_clean(tmp.path(), &text, says, &marker);
    }

    /// A launch the guard stopped: named with `says`, stage 2 never ran, and
    /// neither a process of `sleep {marker}` nor a runtime dir is left.
    #[cfg(target_os = "linux")]
    fn assert_stopped_and_clean(tmp: &std::path::Path, text: &str, says: &str, marker: &str) {
        assert!(text.contains(says), "{text}");
        assert!(!text.contains("main ran"), "{text}");
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(processes_with(&format!("sleep {marker}")), 0);
        assert!(runtime_dirs_in(tmp).is_empty());
    }

    /// `tunnel-jupyter.*` dirs left in `tmp`.
    #[cfg(unix)]
    fn runtime_dirs_in(tmp: &std::path::Path) -> Vec<std::path::PathBuf> {
        std::fs::read_dir(tmp)
            .expect("tmp")
            .filter_map(|e| e.ok())
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with("tunnel-jupyter.")
            })
            .map(|e| e.path())
            .collect()
    }

    /// A login profile that hangs is bounded too, and named as such.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_hung_login_profile_is_stopped_and_named() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let home = tmp.path().join("home");
        std::fs::create_dir(&home).expect("home");
        let marker = format!("{}.125", 400_000 + std::process::id());
        std::fs::write(home.join(".profile"), format!("sleep {marker}\n")).expect("profile");
        let spec = LaunchSpec {
            init: None,
            timeout_secs: 2,
            ..spec()
        };
        let text = run_bootstrap_with(tmp.path(), &spec, "echo main ran", "t", &[("HOME", &home)]);
        let says = "tunnel-remote: error login-timeout the login shell's startup files";
        assert_stopped_and_clean(tmp.path(), &text, says, &marker);
    }

    /// The guard is none of the login shell's jobs: an --init that waits for
    /// its own background job (a bare `wait`) returns at once.
    #[cfg(unix)]
    #[test]
    fn a_wait_in_init_does_not_wait_for_the_guard() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let main = "kill \"$TUNNEL_GUARD_PID\"; echo main ran; rm -rf \"$TUNNEL_RT\"";
        let start = std::time::Instant::now();
        let text = run_bootstrap(tmp.path(), &init_spec("sleep 0.2 & wait", 30), main, "t");
        assert!(text.contains("main ran"), "{text}");
        assert!(start.elapsed().as_secs() < 10, "{:?}", start.elapsed());
    }

    /// The hand-off is claimed once: where stage 2 has claimed it (end_guard)
    /// and the guard missed its TERM, the guard does nothing at the deadline;
    /// where the guard has claimed it, end_guard refuses, and stage 2 stops.
    #[cfg(unix)]
    #[test]
    fn the_guard_and_end_guard_claim_the_hand_off_once() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let main =
            "mkdir \"$TUNNEL_RT/guard.done\"; sleep 2.5; echo survived; rm -rf \"$TUNNEL_RT\"";
        let text = run_bootstrap(tmp.path(), &init_spec("true", 1), main, "t");
        assert!(text.contains("survived"), "{text}");
        assert!(!text.contains("error"), "{text}");

        let main = [
            COMMON,
            "mkdir \"$rt/guard.done\"; end_guard || echo refused; remove_rt\n",
        ]
        .concat();
        let text = run_bootstrap(tmp.path(), &init_spec("true", 30), &main, "t");
        assert!(text.contains("refused"), "{text}");
    }

    /// An --init that ends the shell (`exit`) ends the launch; the guard
    /// removes the runtime dir nobody else will.
    #[cfg(unix)]
    #[test]
    fn an_init_that_exits_leaves_no_runtime_dir() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let text = run_bootstrap(tmp.path(), &init_spec("exit 3", 30), "echo main ran", "t");
        assert!(!text.contains("main ran"), "{text}");
        std::thread::sleep(Duration::from_millis(300));
        assert!(runtime_dirs_in(tmp.path()).is_empty(), "{text}");
    }

    /// A guard whose shell is not its parent (the shell died before the guard
    /// started, and the pid may belong to anyone) never kills: past its
    /// deadline it only removes the runtime dir, which nobody else will.
    #[cfg(unix)]
    #[test]
    fn an_orphaned_guard_never_acts() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let rt = tmp.path().join("tunnel-jupyter.test");
        std::fs::create_dir(&rt).expect("rt");
        let out = Command::new("/bin/sh")
            .args(["-c", SETUP_GUARD])
            .env("TUNNEL_RT", &rt)
            .env("TUNNEL_SHELL_PID", "1")
            .env("TUNNEL_DEADLINE", "0")
            .env("TUNNEL_TIMEOUT", "1")
            .output()
            .expect("sh runs");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(!text.contains("error"), "{text}");
        assert!(!rt.exists());
    }

    // The remote scripts run under a POSIX /bin/sh: the test runs one locally.
    #[cfg(unix)]
    #[test]
    fn scripts_are_valid_sh() {
        let main = [COMMON, SETUP, LAUNCH, SESSION].concat();
        let attach = [COMMON, ATTACH, SESSION].concat();
        let doctor = [COMMON, SETUP, DOCTOR].concat();
        for (name, text) in [
            ("bootstrap", BOOTSTRAP),
            ("doctor", doctor.as_str()),
            ("setup guard", SETUP_GUARD),
            ("launch", main.as_str()),
            ("attach", attach.as_str()),
        ] {
            assert_sh_parses(name, text);
        }
    }

    #[test]
    fn parses_events() {
        assert_eq!(
            parse_line("tunnel-remote: ready 8888 /"),
            Some(Event::Ready {
                port: 8888,
                base_url: "/".into()
            })
        );
        assert_eq!(
            parse_line("tunnel-remote: error jupyter-missing jupyter not found"),
            Some(Event::Error {
                kind: "jupyter-missing".into(),
                message: "jupyter not found".into()
            })
        );
        assert_eq!(parse_line("tunnel-remote: stopped"), Some(Event::Stopped));
        assert_eq!(parse_line("Welcome to the cluster!"), None);
        assert_eq!(parse_line("tunnel-remote: ready notaport /"), None);
    }

    #[test]
    fn splits_lines_across_chunks() {
        let mut p = Vec::new();
        assert!(split_lines(&mut p, b"tunnel-remote: rea").is_empty());
        assert_eq!(
            split_lines(&mut p, b"dy 1 /\r\nx\n"),
            vec!["tunnel-remote: ready 1 /", "x"]
        );
        assert!(p.is_empty());
    }

    #[test]
    fn errors_map_to_exit_codes() {
        assert_eq!(
            error_from("jupyter-missing", "m".into(), vec![]).exit(),
            Exit::JupyterMissing
        );
        assert_eq!(
            error_from("jupyter-exited", "m".into(), vec![]).exit(),
            Exit::JupyterFailed
        );
        assert_eq!(
            error_from("env", "m".into(), vec![]).exit(),
            Exit::RemoteSetup
        );
        assert_eq!(
            error_from("timeout", "m".into(), vec![]).exit(),
            Exit::Timeout
        );
    }
}
