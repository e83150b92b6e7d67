//! `tunnel`: one command from a laptop to a safe remote Jupyter notebook.
//! See crates/tunnel/README.md for the design.

mod auth;
mod browser;
mod cli;
mod config;
mod config_cmd;
mod connect;
mod doctor;
mod exit;
mod forward;
mod known_hosts;
mod manage;
mod platform;
mod probe;
mod prompt;
mod relay;
mod remote;
mod route;
mod sanitize;
mod slurm;
mod state;
mod token;
mod up;

use std::fmt;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

use crate::cli::{Cli, Command};

#[cfg(target_env = "musl")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
use crate::exit::{Exit, HasExit};

/// Plain "tunnel: ..." lines on stderr: these are messages for a person.
struct Plain;

impl<S, N> FormatEvent<S, N> for Plain
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut w: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        match *meta.level() {
            Level::ERROR => write!(w, "tunnel: error: ")?,
            Level::WARN => write!(w, "tunnel: warning: ")?,
            Level::INFO => write!(w, "tunnel: ")?,
            l => write!(
                w,
                "tunnel: [{} {}] ",
                l.as_str().to_ascii_lowercase(),
                meta.target()
            )?,
        }
        // Log lines carry text from the remote (srun's and sbatch's words,
        // chatty profiles at debug level): no escape sequence gets through.
        let mut text = String::new();
        ctx.field_format()
            .format_fields(Writer::new(&mut text), event)?;
        writeln!(w, "{}", sanitize::for_terminal(&text))
    }
}

fn init_tracing(verbose: u8) {
    let default = match verbose {
        0 => "warn,tunnel=info",
        1 => "warn,tunnel=debug",
        _ => "info,tunnel=trace,russh=debug",
    };
    let filter = EnvFilter::try_from_env("TUNNEL_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .event_format(Plain)
        .try_init();
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Up(args) => up::run(args).await?,
        Command::Down(args) => manage::down(args).await?,
        Command::Status(args) => manage::status(args)?,
        Command::Ls(args) => manage::ls(args)?,
        Command::Doctor(args) => doctor::run(args).await?,
        Command::Config(args) => config_cmd::run(&args)?,
    }
    Ok(())
}

/// The exit code for an error that reached `main`.
fn exit_of(err: &anyhow::Error) -> Exit {
    if let Some(e) = err.downcast_ref::<up::UpError>() {
        e.exit()
    } else if let Some(e) = err.downcast_ref::<manage::ManageError>() {
        e.exit()
    } else if let Some(e) = err.downcast_ref::<doctor::DoctorError>() {
        e.exit()
    } else if let Some(e) = err.downcast_ref::<config::ConfigError>() {
        e.exit()
    } else {
        Exit::Internal
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.verbose);
    // One thread, like OpenSSH: a notebook's traffic is latency-bound, and
    // hopping between worker threads on every packet costs more than a
    // second core buys (measured in bench/tunnel).
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tunnel: error: cannot start the async runtime: {e}");
            return Exit::Internal.into();
        }
    };
    let result = runtime.block_on(run(cli));
    // A prompt blocked on the terminal must not keep the process alive.
    runtime.shutdown_timeout(Duration::from_millis(200));
    match result {
        Ok(()) => Exit::Ok.into(),
        Err(e) => {
            // Errors quote the remote (Jupyter's log tail, srun's stderr).
            eprintln!("tunnel: error: {}", sanitize::for_terminal(&e.to_string()));
            exit_of(&e).into()
        }
    }
}
