//! `%echo [--stderr] TEXT...`: print text, for notes and logs in scripted notebooks
//! (papermill, nbclient) run on the magics-only kernel.

use super::{parse_args, Magic, MagicContext, MagicError, Output, StreamName};
use clap::{CommandFactory, Parser};

/// Print the arguments, separated by spaces, like the shell's echo.
#[derive(Parser, Debug)]
#[command(name = "%echo", disable_version_flag = true)]
struct Args {
    /// Write to stderr instead of stdout.
    #[arg(long)]
    stderr: bool,
    /// The words to print.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    text: Vec<String>,
}

pub struct Echo;

impl Magic for Echo {
    fn name(&self) -> &'static str {
        "echo"
    }

    fn summary(&self) -> &'static str {
        "Print text to stdout (or --stderr)."
    }

    fn command(&self) -> clap::Command {
        Args::command()
    }

    fn run(&self, argv: Vec<String>, ctx: &MagicContext) -> Result<(), MagicError> {
        let Some(args) = parse_args::<Args>(argv, ctx)? else {
            return Ok(());
        };
        let name = if args.stderr {
            StreamName::Stderr
        } else {
            StreamName::Stdout
        };
        ctx.out.emit(Output::Stream {
            name,
            text: format!("{}\n", args.text.join(" ")),
        });
        Ok(())
    }
}
