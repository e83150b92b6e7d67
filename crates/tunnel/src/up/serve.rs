//! The serving loop: from "Jupyter is ready" to "time to stop". The forward,
//! the URL line and the browser, then watching the launcher: Ctrl-C, Jupyter
//! shut down from its UI, and a lost connection (reconnect and reattach with
//! backoff; with --slurm it ends the tunnel). `--detach` keeps the server.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::watch;

use super::launch::{self, Remote};
use super::{interruptible, now_secs, open_session, UpError};
use crate::browser::{self, RedirectFile};
use crate::cli::UpArgs;
use crate::config::Target;
use crate::connect::Handle;
use crate::forward::{self, ForwardError};
use crate::platform::Interrupts;
use crate::probe;
use crate::remote::{Event, Launcher, RemoteError};
use crate::slurm::SlurmError;
use crate::state::{Phase, ServerRecord, StateFile};

/// Reconnect backoff: first retry after this, doubling up to the cap.
const RETRY_FIRST: Duration = Duration::from_millis(250);
const RETRY_CAP: Duration = Duration::from_secs(4);

/// The SSH side of a running tunnel, re-established after a drop.
pub(super) struct Link<'a> {
    pub args: &'a UpArgs,
    /// Where Jupyter runs (with --slurm: the job's node).
    pub target: &'a Target,
    /// Jump hosts, then HOST.
    pub route: &'a [Target],
    pub handle: Arc<Handle>,
    /// Publishes the current session to the forwarder.
    pub session: watch::Sender<Option<Arc<Handle>>>,
    /// With --slurm: how the forwards reach Jupyter in the job. Any loss
    /// ends the tunnel: a job step cannot be reattached.
    pub job: Option<JobLink>,
}

/// The way to Jupyter in a SLURM job (`up --slurm`).
pub(super) struct JobLink {
    /// The session with the job's node, which carries the forwards (the
    /// login session carries the launcher); `None` when ssh to the node is
    /// closed and each connection goes through a relay job step instead.
    pub node: Option<Arc<Handle>>,
    pub way: forward::Way,
}

/// How a ready tunnel ends without an error.
pub(super) enum Finish {
    /// Stop the remote server.
    Stop,
    /// Leave it running (--detach).
    Detach,
}

/// A tunnel being served: what [`Serve::run`] works with (and hands back,
/// for the stop that follows).
pub(super) struct Serve<'a, 's> {
    pub link: Link<'a>,
    pub remote: Remote,
    pub state: &'s mut StateFile,
    pub signals: &'s mut Interrupts,
    /// The readiness probe gives up here (`--timeout` after the launch).
    pub deadline: tokio::time::Instant,
    pub t0: Instant,
}

/// What ended a wait on a ready launcher.
enum Watched {
    Interrupted(&'static str),
    Exited(String),
    LauncherEnded(String),
    ConnectionLost,
}

impl Serve<'_, '_> {
    /// Forward, probe, announce, then watch until it is time to stop.
    /// `session` is the forwarder's end of `link.session`.
    pub async fn run(
        &mut self,
        session: forward::Session,
        early_listener: Option<TcpListener>,
    ) -> Result<Finish, UpError> {
        tracing::debug!(
            "jupyter listening on remote port {} after {:.2}s",
            self.remote.port,
            self.t0.elapsed().as_secs_f64()
        );
        let (local_port, _forwarder) = self.forward(session, early_listener).await?;
        let (url, base) = self.announce(local_port).await?;
        let _redirect = (!self.link.args.no_browser)
            .then(|| open_browser(self.state, &url))
            .flatten();
        self.watch(&base).await
    }

    /// Listen locally, forward every connection, and wait until Jupyter
    /// answers through it; the local port and the forwarder (aborted on drop).
    async fn forward(
        &mut self,
        session: forward::Session,
        early_listener: Option<TcpListener>,
    ) -> Result<(u16, AbortOnDrop), UpError> {
        let remote_port = self.remote.port;
        let listener = match early_listener {
            Some(l) => l,
            None => forward::bind_near(remote_port).await?,
        };
        let local_port = listener
            .local_addr()
            .map_err(|source| ForwardError::Listen {
                port: remote_port,
                source,
            })?
            .port();
        let way = match &self.link.job {
            Some(job) => job.way.clone(),
            None => forward::Way::Direct(remote_port),
        };
        let forwarder = AbortOnDrop(forward::serve(listener, session, way));
        let remaining = self
            .deadline
            .saturating_duration_since(tokio::time::Instant::now())
            .max(Duration::from_secs(1));
        let (base_url, token) = (&self.remote.base_url, &self.remote.token);
        let probe = probe::wait_ready(local_port, base_url, token, remaining);
        interruptible(self.signals, probe).await??;
        Ok((local_port, forwarder))
    }

    /// Record the ready state, keep the server for --detach, print the URL
    /// (the one stdout line); the URL with its token, and without.
    async fn announce(&mut self, local_port: u16) -> Result<(String, String), UpError> {
        let args = self.link.args;
        let base = format!(
            "http://127.0.0.1:{local_port}{}{}",
            self.remote.base_url,
            args.app.landing_path()
        );
        let url = format!("{base}?token={}", self.remote.token.expose());
        let st = &mut self.state.state;
        st.phase = Phase::Ready;
        st.local_port = Some(local_port);
        st.remote_port = Some(self.remote.port);
        st.url = Some(base.clone());
        self.state.save()?;
        if args.detach {
            self.keep_for_detach().await?;
        }
        let stop_text = match &self.state.state.slurm {
            Some(job) => format!("stop and cancel job {}", job.job_id),
            None if args.detach => "detach, leaving Jupyter running".into(),
            None => "stop".into(),
        };
        tracing::info!(
            "ready after {:.1}s: {base} (Ctrl-C or `tunnel down {}` to {stop_text})",
            self.t0.elapsed().as_secs_f64(),
            self.state.state.host,
        );
        // The one line scripts capture.
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{url}");
        let _ = out.flush();
        Ok((url, base))
    }

    /// Wait on the launcher until the tunnel ends; reconnect after a drop.
    async fn watch(&mut self, base: &str) -> Result<Finish, UpError> {
        let host = self.link.target.alias.clone();
        loop {
            let node = self.link.job.as_ref().and_then(|j| j.node.as_deref());
            match watch_launcher(&mut self.remote.launcher, self.signals, node).await {
                Watched::Interrupted(sig) if self.link.args.detach => {
                    tracing::info!("{sig}: detaching from jupyter on {host}");
                    return Ok(Finish::Detach);
                }
                Watched::Interrupted(sig) => {
                    tracing::info!("{sig}: stopping jupyter on {host}");
                    return Ok(Finish::Stop);
                }
                // File > Shut Down in the Jupyter UI: a normal way to finish.
                Watched::Exited(status) if status == "0" => {
                    tracing::info!("jupyter on {host} was shut down; closing the tunnel");
                    return Ok(Finish::Stop);
                }
                Watched::Exited(status) => return Err(UpError::JupyterStopped { host, status }),
                Watched::LauncherEnded(how) => return Err(UpError::LauncherEnded { host, how }),
                Watched::ConnectionLost if self.link.job.is_some() => {
                    let job = self.state.state.slurm.as_ref().map(|j| j.job_id.clone());
                    return Err(SlurmError::ConnectionLost {
                        host,
                        job: job.unwrap_or_default(),
                    }
                    .into());
                }
                Watched::ConnectionLost => self.recover(base).await?,
            }
        }
    }

    /// After a drop: hold new local connections, reconnect and reattach,
    /// then let them through again.
    async fn recover(&mut self, base: &str) -> Result<(), UpError> {
        let host = &self.link.target.alias;
        let linger = self.link.args.linger;
        let _ = self.link.session.send(None);
        let lost_at = Instant::now();
        tracing::warn!("connection to {host} lost; reconnecting (Jupyter waits up to {linger}s)");
        let Some(launcher) = self.reconnect().await? else {
            tracing::warn!(
                "interrupted while reconnecting; jupyter on {host} stops itself after {linger}s"
            );
            return Err(UpError::Interrupted("interrupted while reconnecting"));
        };
        self.remote.launcher = launcher;
        let _ = self.link.session.send(Some(self.link.handle.clone()));
        if self.link.args.detach {
            self.keep_for_detach().await?;
        }
        tracing::info!(
            "reconnected to {host} after {:.1}s; {base} works again",
            lost_at.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// Re-establish the SSH session with backoff and reattach to the server.
    /// `None` when interrupted. Gives up once the server has surely stopped
    /// (the linger time) or on errors a retry cannot fix (host key, auth).
    async fn reconnect(&mut self) -> Result<Option<Launcher>, UpError> {
        let linger = self.link.args.linger;
        let give_up = Instant::now() + Duration::from_secs(linger.max(1));
        let mut delay = RETRY_FIRST;
        let mut attempt = 0u32;
        loop {
            if interruptible(self.signals, tokio::time::sleep(delay))
                .await
                .is_err()
            {
                return Ok(None);
            }
            attempt += 1;
            let last = match self.reattach_once().await {
                Ok(Some(launcher)) => return Ok(Some(launcher)),
                Ok(None) => return Ok(None),
                Err(Retry::Fatal(e)) => return Err(*e),
                Err(Retry::Again(why)) => why,
            };
            tracing::debug!("reconnect attempt {attempt} failed: {last}");
            if Instant::now() + delay >= give_up {
                return Err(UpError::ConnectionLost {
                    host: self.link.target.alias.clone(),
                    linger,
                    last,
                });
            }
            delay = (delay * 2).min(RETRY_CAP);
        }
    }

    /// One reconnect attempt: a fresh session, then a reattach to the
    /// server's runtime dir. `None` when interrupted.
    async fn reattach_once(&mut self) -> Result<Option<Launcher>, Retry> {
        let link = &mut self.link;
        let handle = match open_session(link.route, link.args.accept_new, self.signals).await {
            Ok(h) => h,
            Err(UpError::Interrupted(_)) => return Ok(None),
            // A changed host key or refused credentials will not get better.
            Err(UpError::Route(e)) if e.is_permanent() => {
                return Err(Retry::Fatal(Box::new(UpError::Route(e))))
            }
            Err(e) => return Err(Retry::Again(e.to_string())),
        };
        let runtime_dir = self.remote.runtime_dir.clone().unwrap_or_default();
        let token = self.remote.token.clone();
        match launch::reattach(&handle, &runtime_dir, token, self.state, self.signals).await {
            Ok(remote) => {
                if Some(remote.port) != self.state.state.remote_port {
                    tracing::debug!("the server now reports port {}", remote.port);
                }
                link.handle = handle;
                Ok(Some(remote.launcher))
            }
            Err(UpError::Remote(RemoteError::Gone { message })) => {
                Err(Retry::Fatal(Box::new(UpError::ServerGone {
                    host: link.target.alias.clone(),
                    why: message,
                })))
            }
            Err(UpError::Interrupted(_)) => Ok(None),
            Err(e) => Err(Retry::Again(e.to_string())),
        }
    }

    /// --detach: the server outlives this client, which records how to come back.
    async fn keep_for_detach(&self) -> Result<(), UpError> {
        let Some(runtime_dir) = self.remote.runtime_dir.clone() else {
            return Ok(());
        };
        if let Err(e) = self.remote.launcher.send_keep().await {
            tracing::warn!("cannot ask the remote to keep jupyter running: {e}");
        }
        let (args, target) = (self.link.args, self.link.target);
        ServerRecord {
            host: self.state.state.host.clone(),
            config: args.target.config.clone(),
            jump: args.target.jump.clone(),
            ssh_user: target.user.clone(),
            ssh_host: target.host_name.clone(),
            ssh_port: target.port,
            app: args.app,
            remote_runtime_dir: runtime_dir,
            remote_port: self.remote.port,
            token: self.remote.token.expose().to_string(),
            saved_at: now_secs(),
        }
        .save()?;
        Ok(())
    }
}

/// Why a reconnect attempt failed: worth another try, or not.
enum Retry {
    Again(String),
    Fatal(Box<UpError>),
}

/// Open the URL through a 0600 redirect file (the token stays out of argv).
fn open_browser(state: &StateFile, url: &str) -> Option<RedirectFile> {
    match RedirectFile::create(state.dir(), &crate::state::key(&state.state.host), url) {
        Ok(f) => {
            browser::open(f.path());
            Some(f)
        }
        Err(e) => {
            tracing::warn!("cannot write the browser redirect file: {e}");
            None
        }
    }
}

/// `node`: a second session the tunnel depends on (--slurm's hop to the
/// job's node), whose loss counts as a lost connection.
async fn watch_launcher(
    launcher: &mut Launcher,
    signals: &mut Interrupts,
    node: Option<&Handle>,
) -> Watched {
    // sshd reports how the launcher ended before closing its channel; a
    // channel that closes without that report went down with the connection.
    let mut launcher_end: Option<String> = None;
    loop {
        let ev = tokio::select! {
            ev = launcher.events.recv() => ev.unwrap_or(Event::Closed),
            sig = signals.recv() => return Watched::Interrupted(sig),
            _ = closed(node) => return Watched::ConnectionLost,
        };
        match ev {
            Event::Exited(status) => return Watched::Exited(status),
            Event::Status(s) => launcher_end = Some(format!("exit status {s}")),
            Event::Signal(s) => launcher_end = Some(format!("killed by SIG{s}")),
            Event::Closed => {
                return match launcher_end {
                    Some(how) => Watched::LauncherEnded(how),
                    None => Watched::ConnectionLost,
                }
            }
            other => tracing::debug!("remote: {other:?}"),
        }
    }
}

/// Resolves once `handle`'s session has ended (russh notices through its
/// keepalives); never for `None`.
async fn closed(handle: Option<&Handle>) {
    let Some(handle) = handle else {
        return std::future::pending().await;
    };
    while !handle.is_closed() {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

pub(super) struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
