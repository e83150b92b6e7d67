//! `tunnel doctor HOST`: walk the way to a notebook one step at a time and
//! say, on stdout, which step fails and what to do about it.
//!
//! Every step goes through the code `tunnel up` uses (config resolution,
//! `route`, `auth`, the remote bootstrap and setup scripts), so a passing
//! doctor means `up` gets that far too. The exit status is the one `up`
//! would end with at the first failing step.

use std::time::Duration;

use crate::cli::{App, DoctorArgs};
use crate::config::{self, LocalUser, Sources, Target};
use crate::connect::{ConnectError, Handle, HostKeyError};
use crate::exit::{Exit, HasExit};
use crate::remote::{Event, LaunchSpec, Launcher};
use crate::route::{self, Passed, RouteError};

/// The remote checks run a login shell, maybe conda's hook and `jupyter
/// --version` (a Python start-up): slow on a busy login node, never minutes.
const REMOTE_TIMEOUT: Duration = Duration::from_secs(120);
/// The remote stops a hung --init, --env or check after this (its guard,
/// `setup_guard.sh`), in time to name it before [`REMOTE_TIMEOUT`] gives up.
const INIT_TIMEOUT: Duration = Duration::from_secs(100);
/// How long to wait for the log lines that follow a remote `error`.
const LOG_GRACE: Duration = Duration::from_secs(3);

#[derive(Debug, thiserror::Error)]
#[error("tunnel doctor: the {step} step failed (see above)")]
pub struct DoctorError {
    step: String,
    exit: Exit,
}

impl HasExit for DoctorError {
    fn exit(&self) -> Exit {
        self.exit
    }
}

/// Prints the report lines.
struct Report;

impl Report {
    fn ok(&self, step: &str, detail: impl AsRef<str>) {
        println!("ok    {step:<12} {}", detail.as_ref());
    }

    fn note(&self, step: &str, detail: impl AsRef<str>) {
        println!("warn  {step:<12} {}", detail.as_ref());
    }

    /// Print the failure and what to do; the error `main` reports carries
    /// the exit code.
    fn fail(&self, step: &str, why: impl AsRef<str>, todo: &str, exit: Exit) -> DoctorError {
        let mut lines = why.as_ref().lines();
        println!("FAIL  {step:<12} {}", lines.next().unwrap_or_default());
        for l in lines {
            println!("      {:<12} {}", "", l.trim_start());
        }
        println!("      {:<12} what to do: {todo}", "");
        DoctorError {
            step: step.to_string(),
            exit,
        }
    }
}

fn hop_label(route: &[Target], i: usize) -> String {
    let t = &route[i];
    let role = if i + 1 < route.len() {
        format!("jump host {}", i + 1)
    } else {
        "target".to_string()
    };
    format!(
        "{role} {} ({}@{} port {})",
        t.alias, t.user, t.host_name, t.port
    )
}

pub async fn run(args: DoctorArgs) -> Result<(), DoctorError> {
    let r = Report;
    let route = resolve(&r, &args)?;
    let handle = open(&r, &route).await?;
    let spec = LaunchSpec {
        app: App::Server,
        env: args.remote.env.clone(),
        init: args.remote.init.clone(),
        dir: None,
        port_hint: 0,
        linger_secs: 0,
        timeout_secs: INIT_TIMEOUT.as_secs(),
        slurm: None,
    };
    let launcher = Launcher::doctor(&handle, &spec).await.map_err(|e| {
        r.fail(
            "remote shell",
            format!("cannot run a command: {e}"),
            "check that `ssh HOST true` works (a ForceCommand or a restricted account stops it)",
            e.exit(),
        )
    })?;
    let result = tokio::time::timeout(REMOTE_TIMEOUT, remote_checks(&r, launcher, &args)).await;
    match result {
        Ok(r) => r,
        Err(_) => Err(r.fail(
            "remote",
            format!(
                "no answer within {}s from the remote checks",
                REMOTE_TIMEOUT.as_secs()
            ),
            "log in with ssh and look for a login profile or --init command that waits for input",
            Exit::Timeout,
        )),
    }
}

/// The ssh config's route to the host (jump hosts first), reported as the "config" check.
fn resolve(r: &Report, args: &DoctorArgs) -> Result<Vec<Target>, DoctorError> {
    let config_fail = |e: &dyn HasExitDisplay| {
        r.fail(
            "config",
            e.text(),
            "fix the ssh config (-F CONFIG, else ~/.ssh/config) or the host argument",
            e.code(),
        )
    };
    let local = LocalUser::current().map_err(|e| config_fail(&e))?;
    let sources = Sources::new(args.target.config.as_deref(), &local.home);
    let ssh_config = config::load(&sources, &local).map_err(|e| config_fail(&e))?;
    let route = config::resolve_route(
        &ssh_config,
        &args.target.host,
        &local,
        args.target.jump.as_deref(),
    )
    .map_err(|e| config_fail(&e))?;
    let Some(target) = route.last() else {
        return Err(r.fail(
            "config",
            "no host to connect to",
            "give a host alias or name",
            Exit::Usage,
        ));
    };
    let via: Vec<&str> = route[..route.len() - 1]
        .iter()
        .map(|t| t.alias.as_str())
        .collect();
    r.ok(
        "config",
        format!(
            "{} is {}@{} port {}{}",
            args.target.host,
            target.user,
            target.host_name,
            target.port,
            if via.is_empty() {
                String::new()
            } else {
                format!(", via {}", via.join(" -> "))
            }
        ),
    );
    Ok(route)
}

/// Connects hop by hop, reporting each connection, host key and login; a failure is put on
/// the hop whose step came next.
async fn open(r: &Report, route: &[Target]) -> Result<Handle, DoctorError> {
    let mut last: Option<(usize, Passed)> = None;
    let opened = route::open_reporting(route, false, |i, step| {
        let label = hop_label(route, i);
        match step {
            Passed::Connected => {
                r.ok("connect", &label);
                r.ok("host key", format!("{label}: matches known_hosts"));
            }
            Passed::Authenticated => r.ok("auth", &label),
        }
        last = Some((i, step));
    })
    .await;
    opened.map_err(|e| {
        let hop = match last {
            None => 0,
            Some((i, Passed::Connected)) => i,
            Some((i, Passed::Authenticated)) => i + 1,
        };
        let label = hop_label(route, hop.min(route.len() - 1));
        route_failure(r, &label, &e)
    })
}

/// Errors whose message and exit code the report shows.
trait HasExitDisplay {
    fn text(&self) -> String;
    fn code(&self) -> Exit;
}

impl<E: std::fmt::Display + HasExit> HasExitDisplay for E {
    fn text(&self) -> String {
        self.to_string()
    }
    fn code(&self) -> Exit {
        self.exit()
    }
}

fn route_failure(r: &Report, label: &str, e: &RouteError) -> DoctorError {
    // The label already names the hop: show the inner error without the
    // route's own "jump host ..." prefix.
    match e {
        RouteError::Connect {
            source: ConnectError::HostKey(key),
            ..
        } => {
            r.ok("connect", label);
            let todo = match key {
                HostKeyError::Unknown { .. } => {
                    "check the fingerprint with the host's admin; if it is right, record it \
                     (`tunnel up --accept-new HOST` once, or `ssh HOST`)"
                }
                _ => {
                    "do not connect until the host's admin confirms the new key; then \
                     remove the old entry as shown and record the new one"
                }
            };
            r.fail("host key", format!("{label}: {key}"), todo, e.exit())
        }
        RouteError::Connect { source, .. } => {
            let todo = match source {
                ConnectError::UnknownAlias { .. } | ConnectError::Dns { .. } => {
                    "check the Host/HostName spelling in the ssh config, and DNS or VPN"
                }
                _ => {
                    "check HostName and Port in the ssh config, that sshd runs there, \
                      and the network (VPN, firewall)"
                }
            };
            r.fail("connect", format!("{label}: {source}"), todo, e.exit())
        }
        RouteError::Auth { source, .. } => r.fail(
            "auth",
            format!("{label}: {source}"),
            "check User (ssh config or USER@HOST) and that your public key is in that \
             user's ~/.ssh/authorized_keys; set IdentityFile or `ssh-add` the key; \
             a one-time code needs a terminal",
            e.exit(),
        ),
    }
}

/// Steps on the remote, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Stage {
    Shell,
    Init,
    Env,
    Jupyter,
    Gpu,
}

impl Stage {
    fn name(self) -> &'static str {
        match self {
            Stage::Shell => "remote shell",
            Stage::Init => "init",
            Stage::Env => "env",
            Stage::Jupyter => "jupyter",
            Stage::Gpu => "gpu",
        }
    }
}

struct Remote<'a> {
    r: &'a Report,
    args: &'a DoctorArgs,
    /// Every stage before this one has been reported.
    next: Stage,
    /// The remote shell started (its runtime dir came back).
    shell_up: bool,
    /// nvidia-smi's lines so far.
    gpus: Vec<String>,
}

impl Remote<'_> {
    /// One line of the remote checks' output; true at the last one.
    fn check(&mut self, line: &str) -> bool {
        let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
        match word {
            "shell" => {
                self.reach(Stage::Jupyter);
                tracing::debug!("remote login shell {rest}");
            }
            "jupyter" => {
                self.reach(Stage::Jupyter);
                self.r.ok("jupyter", rest);
                self.next = Stage::Gpu;
            }
            "gpu" => self.gpus.push(rest.to_string()),
            "gpu-done" => {
                let shown = if self.gpus.is_empty() {
                    "nvidia-smi lists no GPU".to_string()
                } else {
                    self.gpus.join("; ")
                };
                self.r.ok("gpu", shown);
            }
            "gpu-absent" => self.r.ok(
                "gpu",
                "no nvidia-smi on the remote PATH: no NVIDIA GPU visible (fine for \
                 CPU work; on a cluster, a GPU node or --init 'module load cuda' may be needed)",
            ),
            "gpu-failed" => self.r.note(
                "gpu",
                format!(
                    "nvidia-smi is there but failed: {rest} (driver not loaded, or no \
                     GPU allocated to this session)"
                ),
            ),
            "done" => return true,
            _ => tracing::debug!("remote check {line}"),
        }
        false
    }

    /// Report the stages before `stage` that passed without their own
    /// event (no --init given, or --init ran fine).
    fn reach(&mut self, stage: Stage) {
        while self.next < stage {
            match self.next {
                Stage::Init => match &self.args.remote.init {
                    Some(cmd) => self.r.ok("init", format!("`{cmd}` ran")),
                    None => self.r.ok("init", "none given"),
                },
                Stage::Env if self.args.remote.env.is_none() => {
                    self.r.ok("env", "none given: the login shell's PATH")
                }
                _ => {}
            }
            self.next = match self.next {
                Stage::Shell => Stage::Init,
                Stage::Init => Stage::Env,
                Stage::Env => Stage::Jupyter,
                Stage::Jupyter | Stage::Gpu => Stage::Gpu,
            };
        }
    }
}

async fn remote_checks(
    r: &Report,
    mut launcher: Launcher,
    args: &DoctorArgs,
) -> Result<(), DoctorError> {
    let mut st = Remote {
        r,
        args,
        next: Stage::Shell,
        shell_up: false,
        gpus: Vec::new(),
    };
    let mut status = None;
    loop {
        let ev = launcher.events.recv().await.unwrap_or(Event::Closed);
        match ev {
            Event::Runtime(dir) => {
                st.shell_up = true;
                r.ok(
                    "remote shell",
                    format!("/bin/sh runs; private runtime dir {dir}"),
                );
                st.next = Stage::Init;
            }
            Event::Env(e) => {
                st.reach(Stage::Env);
                r.ok("env", format!("activated ({e})"));
                st.next = Stage::Jupyter;
            }
            Event::Check(c) => {
                if st.check(&c) {
                    return Ok(());
                }
            }
            Event::Error { kind, message } => {
                let log = log_tail(&mut launcher).await;
                let why = if log.is_empty() {
                    message
                } else {
                    format!("{message}\n{}", log.join("\n"))
                };
                let (stage, todo, exit) = remote_failure(&kind);
                st.reach(stage);
                return Err(r.fail(stage.name(), why, todo, exit));
            }
            Event::Status(s) => status = Some(s),
            Event::Closed | Event::Signal(_) => {
                let stage = if st.shell_up { st.next } else { Stage::Shell };
                let how = status
                    .map(|s| format!(" (exit status {s})"))
                    .unwrap_or_default();
                return Err(r.fail(
                    stage.name(),
                    format!("the remote command ended before the checks finished{how}"),
                    "log in with `ssh HOST` and check that the login shell starts cleanly \
                     (a profile that exits, or a ForceCommand)",
                    Exit::RemoteSetup,
                ));
            }
            Event::Root
            | Event::Pid(_)
            | Event::Ready { .. }
            | Event::Exited(_)
            | Event::Log(_)
            | Event::Stopped
            | Event::Kept => {}
        }
    }
}

/// The stage a remote error of `kind` failed at, what to do about it, and the exit code.
fn remote_failure(kind: &str) -> (Stage, &'static str, Exit) {
    match kind {
        "init" => (
            Stage::Init,
            "run the --init command by hand after `ssh HOST` to see why it fails",
            Exit::RemoteSetup,
        ),
        "login-timeout" => (
            Stage::Shell,
            "log in with `ssh HOST` and look in ~/.profile or ~/.bash_profile for a command \
             that waits",
            Exit::Timeout,
        ),
        "init-timeout" => (
            Stage::Init,
            "run the --init command by hand after `ssh HOST` to see where it waits (a module \
             system, a licence server, a prompt)",
            Exit::Timeout,
        ),
        "env-timeout" | "setup-timeout" => (
            Stage::Env,
            "activate the environment by hand after `ssh HOST` (`conda activate NAME`) to see \
             where it waits (conda on a slow shared file system)",
            Exit::Timeout,
        ),
        "checks-timeout" => (
            Stage::Jupyter,
            "run `jupyter --version` and `nvidia-smi -L` by hand after `ssh HOST`: one of \
             them waits",
            Exit::Timeout,
        ),
        "env" => (
            Stage::Env,
            "give --env a venv or conda prefix path, or a name from \
             `conda env list` on the remote",
            Exit::RemoteSetup,
        ),
        "jupyter-missing" => (
            Stage::Jupyter,
            "pip install jupyterlab into the remote environment, or point --env \
             at the one that has it",
            Exit::JupyterMissing,
        ),
        "jupyter-broken" => (
            Stage::Jupyter,
            "reinstall jupyter in that environment (pip install --force-reinstall \
             jupyterlab)",
            Exit::JupyterFailed,
        ),
        _ => (
            Stage::Shell,
            "check the remote's /tmp (or $TMPDIR, $XDG_RUNTIME_DIR): it must be \
             writable",
            Exit::RemoteSetup,
        ),
    }
}

/// The log lines the remote sends after an `error` event.
async fn log_tail(launcher: &mut Launcher) -> Vec<String> {
    let mut log = Vec::new();
    let deadline = tokio::time::Instant::now() + LOG_GRACE;
    while let Ok(Some(ev)) = tokio::time::timeout_at(deadline, launcher.events.recv()).await {
        match ev {
            Event::Log(l) => log.push(l),
            Event::Closed => break,
            _ => {}
        }
    }
    log
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The remote's setup guard fires well before the client gives up on the
    /// remote, so its error (which names the step) is what the user sees.
    #[test]
    fn a_hung_step_is_a_timeout_at_its_stage() {
        assert!(INIT_TIMEOUT + Duration::from_secs(10) <= REMOTE_TIMEOUT);
        for (kind, stage, says) in [
            ("login-timeout", Stage::Shell, "~/.profile"),
            ("init-timeout", Stage::Init, "--init"),
            ("env-timeout", Stage::Env, "conda activate"),
            ("checks-timeout", Stage::Jupyter, "nvidia-smi"),
        ] {
            let (at, todo, exit) = remote_failure(kind);
            assert_eq!((at, exit), (stage, Exit::Timeout), "{kind}");
            assert!(todo.contains(says), "{kind}: {todo}");
        }
        assert_eq!(remote_failure("init").2, Exit::RemoteSetup);
    }
}
