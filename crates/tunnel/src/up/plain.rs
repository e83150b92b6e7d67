//! The usual `tunnel up HOST`: reattach to a server left by `--detach` or
//! start one, serve it, then stop it (or leave it running with --detach).

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;

use super::launch::{self, launch_spec, stop_remote, Remote};
use super::serve::{Finish, Link, Serve};
use super::{Up, UpError};
use crate::connect::Handle;
use crate::platform::Interrupts;
use crate::remote::{Launcher, RemoteError};
use crate::state::{ServerRecord, StateFile};
use crate::token::Token;

/// The plain flow's state; the session is connected and authenticated.
pub(super) struct Plain<'u, 's> {
    pub up: &'u Up<'u>,
    pub state: &'s mut StateFile,
    pub signals: &'s mut Interrupts,
}

impl Plain<'_, '_> {
    pub async fn run(
        &mut self,
        handle: Arc<Handle>,
        detached: Option<ServerRecord>,
        early_listener: Option<TcpListener>,
    ) -> Result<(), UpError> {
        let up = self.up;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(up.args.timeout + 5);
        let remote = match detached {
            Some(rec) => self.reattach(&handle, rec).await?,
            None => None,
        };
        let remote = match remote {
            Some(r) => r,
            None => self.start(&handle, deadline).await?,
        };
        let (session_tx, session_rx) = watch::channel(Some(handle.clone()));
        let mut serve = Serve {
            link: Link {
                args: up.args,
                target: up.target,
                route: up.route,
                handle,
                session: session_tx,
                job: None,
            },
            remote,
            state: &mut *self.state,
            signals: &mut *self.signals,
            deadline,
            t0: up.t0,
        };
        let result = serve.run(session_rx, early_listener).await;
        let handle = serve.link.handle.clone();
        let outcome = finish(up, &mut serve.remote.launcher, serve.signals, result).await;
        let _ = handle
            .disconnect(russh::Disconnect::ByApplication, "", "en")
            .await;
        outcome
    }

    /// The server a `--detach` client left running, if it is still there.
    async fn reattach(
        &mut self,
        handle: &Handle,
        rec: ServerRecord,
    ) -> Result<Option<Remote>, UpError> {
        let alias = &self.up.target.alias;
        let token = Token::from_saved(rec.token);
        let dir = &rec.remote_runtime_dir;
        match launch::reattach(handle, dir, token, self.state, self.signals).await {
            Ok(remote) => {
                tracing::info!(
                    "reattached to the jupyter server left running on {alias} (remote pid {})",
                    self.state.state.remote_pid.unwrap_or_default()
                );
                Ok(Some(remote))
            }
            Err(UpError::Remote(RemoteError::Gone { message })) => {
                tracing::warn!(
                    "the server left running on {alias} is gone ({message}); starting a new one"
                );
                ServerRecord::remove(&self.up.host_key);
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Start Jupyter with a fresh token and wait until it is ready.
    async fn start(
        &mut self,
        handle: &Handle,
        deadline: tokio::time::Instant,
    ) -> Result<Remote, UpError> {
        let args = self.up.args;
        let token = Token::generate().map_err(UpError::Random)?;
        let spec = launch_spec(args, None);
        tracing::info!(
            "starting jupyter {} on {}",
            args.app.subcommand(),
            self.up.target.alias
        );
        let launcher = Launcher::start(handle, &spec, &token).await?;
        Remote::ready(
            launcher,
            token,
            self.state,
            self.signals,
            deadline,
            args.timeout,
        )
        .await
    }
}

/// Stop the server or leave it running, as the serving loop ended.
async fn finish(
    up: &Up<'_>,
    launcher: &mut Launcher,
    signals: &mut Interrupts,
    result: Result<Finish, UpError>,
) -> Result<(), UpError> {
    let (args, target) = (up.args, up.target);
    match result {
        Ok(Finish::Detach) => {
            tracing::info!(
                "left jupyter running on {}: `tunnel up {}` reattaches, `tunnel down {}` stops it",
                target.alias,
                args.target.host,
                args.target.host
            );
            launcher.close().await;
            Ok(())
        }
        Ok(Finish::Stop) => {
            stop_remote(launcher, target, signals, args.linger).await;
            ServerRecord::remove(&up.host_key);
            Ok(())
        }
        // Nothing is left on the remote when it reported the failure itself
        // (it cleans up before saying "error") or when the link is gone.
        Err(
            e @ (UpError::Remote(_)
            | UpError::ConnectionLost { .. }
            | UpError::LauncherEnded { .. }
            | UpError::ServerGone { .. }),
        ) => Err(e),
        Err(e) => {
            stop_remote(launcher, target, signals, args.linger).await;
            Err(e)
        }
    }
}
