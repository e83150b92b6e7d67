//! Command-line interface (clap derive).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::exit;

/// Bounds of `--linger` and `--timeout`: far beyond any real use, and far
/// below where deadline arithmetic (`Instant + secs`) could overflow.
pub const MAX_LINGER_SECS: u64 = 7 * 24 * 3600;
pub const MAX_TIMEOUT_SECS: u64 = 24 * 3600;

const ABOUT: &str =
    "Starts Jupyter on a remote host bound to 127.0.0.1 with a fresh random token, \
forwards a local port to it over the same SSH connection, prints the URL and opens the browser. \
Ctrl-C stops the remote server and its kernels.";

/// ABOUT, then what differs on this platform (nothing on Linux and macOS).
fn long_about() -> String {
    match crate::platform::HELP_NOTE {
        "" => ABOUT.to_string(),
        note => format!("{ABOUT}\n\n{note}"),
    }
}

#[derive(Debug, Parser)]
#[command(
    name = "tunnel",
    version,
    about = "One command from a laptop to a safe Jupyter notebook on a remote machine, over SSH",
    long_about = long_about(),
    after_help = exit::HELP
)]
pub struct Cli {
    /// More progress detail on stderr (-v: debug, -vv: trace, including russh).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start Jupyter on HOST and forward it to a local port; runs until Ctrl-C.
    #[command(after_help = exit::HELP)]
    Up(UpArgs),
    /// Stop the tunnel to HOST started from another terminal (and its remote server).
    #[command(after_help = exit::HELP)]
    Down(DownArgs),
    /// Show the running tunnels, or one of them in detail.
    #[command(after_help = exit::HELP)]
    Status(StatusArgs),
    /// List the running tunnels, one per line.
    #[command(after_help = exit::HELP)]
    Ls(LsArgs),
    /// Check each step from the ssh config to Jupyter on HOST (and its
    /// GPUs) and say which one fails and what to do; starts nothing.
    #[command(after_help = exit::HELP)]
    Doctor(DoctorArgs),
    /// Print the options tunnel will use for HOST, resolved from the ssh
    /// config as `ssh -G` does (Host, Match, Include, tokens); starts nothing.
    #[command(after_help = exit::HELP)]
    Config(ConfigArgs),
}

/// Which host, and how ssh reaches it: read from the ssh config as `ssh` reads it.
#[derive(Debug, Args)]
pub struct HostArgs {
    /// Host alias from the ssh config (or a host name), optionally as USER@HOST.
    pub host: String,

    /// ssh config file to read instead of ~/.ssh/config and /etc/ssh/ssh_config
    /// (`none`: no file).
    #[arg(short = 'F', long = "config", value_name = "CONFIG")]
    pub config: Option<PathBuf>,

    /// Jump hosts to go through, comma-separated `[user@]host[:port]`, as
    /// ssh -J (replaces the host's ProxyJump; each hop uses its own config).
    #[arg(short = 'J', long = "jump", value_name = "HOPS")]
    pub jump: Option<String>,
}

/// The Python environment Jupyter runs in on the remote.
#[derive(Debug, Args)]
pub struct RemoteEnvArgs {
    /// Python environment on the remote: a venv or conda prefix path, or a
    /// conda/mamba/micromamba environment name.
    #[arg(long, value_name = "ENV")]
    pub env: Option<String>,

    /// Shell command run on the remote before activating --env (e.g. "module load cuda").
    #[arg(long, value_name = "CMD")]
    pub init: Option<String>,
}

#[derive(Debug, Args)]
pub struct ConfigArgs {
    #[command(flatten)]
    pub target: HostArgs,

    /// Print a JSON object instead of `key value` lines.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct DoctorArgs {
    #[command(flatten)]
    pub target: HostArgs,

    #[command(flatten)]
    pub remote: RemoteEnvArgs,
}

#[derive(Debug, Args)]
pub struct UpArgs {
    #[command(flatten)]
    pub target: HostArgs,

    #[command(flatten)]
    pub remote: RemoteEnvArgs,

    /// Remote directory Jupyter starts in (default: the remote home).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<String>,

    /// Local port to listen on (default: the remote port if free, else the next free one).
    #[arg(long, value_name = "N")]
    pub port: Option<u16>,

    /// Which Jupyter application to start.
    #[arg(long, value_enum, default_value_t = App::Lab)]
    pub app: App,

    /// Do not open a browser; just print the URL.
    #[arg(long)]
    pub no_browser: bool,

    /// Accept and record the host key if the host is not yet in known_hosts
    /// (a changed key is still refused).
    #[arg(long)]
    pub accept_new: bool,

    /// Leave Jupyter running on the remote when this client exits (Ctrl-C,
    /// lost connection): a later `tunnel up HOST` reattaches to it (same
    /// kernels, same token) and `tunnel down HOST` stops it.
    #[arg(long)]
    pub detach: bool,

    /// Seconds the remote server waits for the client after the connection
    /// vanishes without a goodbye, before it stops itself; tunnel keeps
    /// trying to reconnect for as long (at most a week).
    #[arg(
        long,
        value_name = "SECS",
        default_value_t = 120,
        value_parser = clap::value_parser!(u64).range(0..=MAX_LINGER_SECS)
    )]
    pub linger: u64,

    /// Seconds for the remote's login shell, --init and --env together, and
    /// again for Jupyter to start and answer /api/status (1 to a day).
    #[arg(
        long,
        value_name = "SECS",
        default_value_t = 90,
        value_parser = clap::value_parser!(u64).range(1..=MAX_TIMEOUT_SECS)
    )]
    pub timeout: u64,

    /// HOST is a SLURM login node: submit a job with these sbatch options
    /// (e.g. "-p gpu --gres=gpu:1 --time=02:00:00"), wait for it to run,
    /// start Jupyter inside it on its node and forward it through the login
    /// node (ssh to the node as one more hop, or a relay job step per
    /// connection where that is closed). Ctrl-C or `tunnel down` cancels
    /// the job.
    #[arg(
        long,
        value_name = "SBATCH ARGS",
        allow_hyphen_values = true,
        conflicts_with = "detach"
    )]
    pub slurm: Option<String>,
}

#[derive(Debug, Args)]
pub struct DownArgs {
    /// Host alias given to `tunnel up`.
    pub host: String,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Only this host alias.
    pub host: Option<String>,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct LsArgs {
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum App {
    Lab,
    Notebook,
    Server,
}

impl App {
    /// The `jupyter` subcommand that starts this app.
    pub fn subcommand(self) -> &'static str {
        match self {
            App::Lab => "lab",
            App::Notebook => "notebook",
            App::Server => "server",
        }
    }

    /// Path (below the server's base_url) the browser should land on.
    pub fn landing_path(self) -> &'static str {
        match self {
            App::Lab => "lab",
            App::Notebook => "tree",
            App::Server => "",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn up_parses_all_options() {
        let cli = Cli::try_parse_from([
            "tunnel",
            "-v",
            "up",
            "gpu",
            "-F",
            "/tmp/cfg",
            "--env",
            "torch",
            "--init",
            "module load cuda",
            "--dir",
            "~/work",
            "--port",
            "9999",
            "--app",
            "notebook",
            "--no-browser",
            "--accept-new",
            "--linger",
            "5",
        ])
        .expect("valid command line");
        assert_eq!(cli.verbose, 1);
        let Command::Up(up) = cli.command else {
            panic!("expected up");
        };
        assert_eq!(up.target.host, "gpu");
        assert_eq!(up.port, Some(9999));
        assert_eq!(up.app, App::Notebook);
        assert_eq!(up.linger, 5);
        assert!(up.no_browser && up.accept_new);
        assert_eq!(up.slurm, None);
    }

    #[test]
    fn linger_and_timeout_are_bounded() {
        for (opt, max) in [
            ("--linger", MAX_LINGER_SECS),
            ("--timeout", MAX_TIMEOUT_SECS),
        ] {
            let ok = Cli::try_parse_from(["tunnel", "up", "h", opt, &max.to_string()]);
            assert!(ok.is_ok(), "{opt} {max}");
            for bad in [
                (max + 1).to_string(),
                u64::MAX.to_string(),
                "18446744073709551616".into(),
                "-1".into(),
            ] {
                let err = Cli::try_parse_from(["tunnel", "up", "h", opt, &bad])
                    .expect_err("out of range");
                assert_eq!(err.exit_code(), 2, "{opt} {bad}");
            }
        }
        assert!(Cli::try_parse_from(["tunnel", "up", "h", "--timeout", "0"]).is_err());
        assert!(Cli::try_parse_from(["tunnel", "up", "h", "--linger", "0"]).is_ok());
    }

    #[test]
    fn slurm_takes_sbatch_options_as_one_value() {
        let cli = Cli::try_parse_from(["tunnel", "up", "login", "--slurm", "-p gpu --gres=gpu:1"])
            .expect("valid command line");
        let Command::Up(up) = cli.command else {
            panic!("expected up");
        };
        assert_eq!(up.slurm.as_deref(), Some("-p gpu --gres=gpu:1"));
        assert!(
            Cli::try_parse_from(["tunnel", "up", "login", "--slurm", "", "--detach"]).is_err(),
            "--detach cannot apply to a job step"
        );
    }

    #[test]
    fn config_parses_its_options() {
        let cli = Cli::try_parse_from(["tunnel", "config", "lab-1", "-F", "/tmp/cfg", "--json"])
            .expect("valid command line");
        let Command::Config(c) = cli.command else {
            panic!("expected config");
        };
        assert_eq!(c.target.host, "lab-1");
        assert_eq!(
            c.target.config.as_deref(),
            Some(std::path::Path::new("/tmp/cfg"))
        );
        assert!(c.json && c.target.jump.is_none());
        assert!(
            Cli::try_parse_from(["tunnel", "config"]).is_err(),
            "HOST is required"
        );
    }

    #[test]
    fn help_documents_exit_codes() {
        let help = Cli::command().render_long_help().to_string();
        assert!(help.contains("Exit codes:"));
        assert!(help.contains("host key CHANGED"));
    }
}
