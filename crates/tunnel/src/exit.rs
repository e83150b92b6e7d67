//! Process exit codes.
//!
//! Every failure class has its own code so that scripts wrapping `tunnel` can
//! react to "wrong password" differently from "host key changed". The table in
//! [`HELP`] is printed by `--help`; a unit test keeps it in sync with [`Exit`].

/// Exit status of the `tunnel` process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    Ok,
    Internal,
    Usage,
    Config,
    UnknownAlias,
    Dns,
    Refused,
    Timeout,
    Auth,
    HostKeyChanged,
    HostKeyUnknown,
    JupyterMissing,
    JupyterFailed,
    PortBusy,
    ConnectionLost,
    NoTunnel,
    AlreadyRunning,
    RemoteSetup,
    Slurm,
    Interrupted,
}

impl Exit {
    pub const ALL: [Exit; 20] = [
        Exit::Ok,
        Exit::Internal,
        Exit::Usage,
        Exit::Config,
        Exit::UnknownAlias,
        Exit::Dns,
        Exit::Refused,
        Exit::Timeout,
        Exit::Auth,
        Exit::HostKeyChanged,
        Exit::HostKeyUnknown,
        Exit::JupyterMissing,
        Exit::JupyterFailed,
        Exit::PortBusy,
        Exit::ConnectionLost,
        Exit::NoTunnel,
        Exit::AlreadyRunning,
        Exit::RemoteSetup,
        Exit::Slurm,
        Exit::Interrupted,
    ];

    pub fn code(self) -> u8 {
        match self {
            Exit::Ok => 0,
            Exit::Internal => 1,
            // clap itself exits with 2 on bad arguments.
            Exit::Usage => 2,
            Exit::Config => 3,
            Exit::UnknownAlias => 4,
            Exit::Dns => 5,
            Exit::Refused => 6,
            Exit::Timeout => 7,
            Exit::Auth => 8,
            Exit::HostKeyChanged => 9,
            Exit::HostKeyUnknown => 10,
            Exit::JupyterMissing => 11,
            Exit::JupyterFailed => 12,
            Exit::PortBusy => 13,
            Exit::ConnectionLost => 14,
            Exit::NoTunnel => 15,
            Exit::AlreadyRunning => 16,
            Exit::RemoteSetup => 17,
            Exit::Slurm => 18,
            // 128 + SIGINT, as shells report it.
            Exit::Interrupted => 130,
        }
    }
}

impl From<Exit> for std::process::ExitCode {
    fn from(e: Exit) -> Self {
        std::process::ExitCode::from(e.code())
    }
}

/// Implemented by every error type that can reach `main`, so the binary edge
/// can pick the exit code without knowing the error's internals.
pub trait HasExit {
    fn exit(&self) -> Exit;
}

/// Printed at the end of `--help`.
pub const HELP: &str = "\
Exit codes:
    0  success (also after Ctrl-C or `tunnel down` once the tunnel was up)
    1  internal error (a bug: please report it)
    2  bad command-line arguments
    3  ssh config could not be read, or uses an option this version cannot honour
    4  unknown host alias: not in the ssh config and not a resolvable host name
    5  DNS lookup of the configured HostName failed
    6  connection refused or host unreachable
    7  timed out (TCP connect, SSH handshake, or Jupyter not ready in time)
    8  authentication failed (the methods tried are listed)
    9  host key CHANGED: refused, possible man-in-the-middle
   10  host key unknown and not accepted (use --accept-new or answer the prompt)
   11  jupyter (or the requested app) not found on the remote
   12  jupyter failed to start or stopped unexpectedly (its log is shown)
   13  local port busy
   14  SSH connection lost
   15  no tunnel for that host (down/status)
   16  a tunnel to that host is already running
   17  remote setup failed (--env, --init, --dir or the runtime directory)
   18  --slurm: sbatch refused the job (its message is shown), or the job ended early
  130  interrupted (Ctrl-C/SIGTERM) before the tunnel was ready";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn help_lists_every_code_once() {
        for e in Exit::ALL {
            let needle = format!("{:>5}  ", e.code());
            let hits = HELP.lines().filter(|l| l.starts_with(&needle)).count();
            assert_eq!(
                hits,
                1,
                "exit code {} ({e:?}) listed {hits} times",
                e.code()
            );
        }
        let listed = HELP.lines().skip(1).count();
        assert_eq!(listed, Exit::ALL.len(), "HELP lists codes that Exit lacks");
    }

    #[test]
    fn codes_are_distinct() {
        let mut codes: Vec<u8> = Exit::ALL.iter().map(|e| e.code()).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), Exit::ALL.len());
    }
}
