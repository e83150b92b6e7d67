//! `%gpuhelp [MAGIC]`: what each magic does.

use super::{bundle, html_escape, parse_args, Magic, MagicContext, MagicError, Output};
use clap::{CommandFactory, Parser};

/// Every magic name, for `%gpuhelp NAME` validation and completion (a test keeps it in step
/// with the registry).
pub const MAGIC_NAMES: [&str; 7] = [
    "gpuhelp",
    "gpumem",
    "emptycache",
    "maxbatch",
    "oom",
    "envcheck",
    "echo",
];

/// Describe the GPU magics; with a name, that magic's full help.
#[derive(Parser, Debug)]
#[command(name = "%gpuhelp", disable_version_flag = true)]
struct Args {
    /// The magic to describe (without %).
    #[arg(value_parser = clap::builder::PossibleValuesParser::new(MAGIC_NAMES))]
    magic: Option<String>,
}

pub struct GpuHelp;

impl Magic for GpuHelp {
    fn name(&self) -> &'static str {
        "gpuhelp"
    }

    fn summary(&self) -> &'static str {
        "List the GPU magics, or show one magic's full help (%gpuhelp gpumem)."
    }

    fn command(&self) -> clap::Command {
        Args::command()
    }

    fn run(&self, argv: Vec<String>, ctx: &MagicContext) -> Result<(), MagicError> {
        let Some(args) = parse_args::<Args>(argv, ctx)? else {
            return Ok(());
        };
        if let Some(name) = args.magic {
            let text = ctx
                .registry
                .help_text(&name)
                .ok_or_else(|| ctx.registry.unknown(&name))?;
            ctx.stdout(text);
            return Ok(());
        }
        let mut text = String::from("GPU magics (add ? or --help to any of them for details):\n");
        let mut html = String::from(
            "<table><thead><tr><th style=\"text-align:left\">magic</th>\
             <th style=\"text-align:left\">what it does</th></tr></thead><tbody>",
        );
        for magic in ctx.registry.magics() {
            text.push_str(&format!("  %{:<10} {}\n", magic.name(), magic.summary()));
            html.push_str(&format!(
                "<tr><td style=\"text-align:left\"><code>%{}</code></td>\
                 <td style=\"text-align:left\">{}</td></tr>",
                magic.name(),
                html_escape(magic.summary())
            ));
        }
        html.push_str("</tbody></table>");
        ctx.out.emit(Output::Display {
            data: bundle(text, Some(html)),
            display_id: None,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::MAGIC_NAMES;
    use crate::magics::Registry;

    #[test]
    fn magic_names_match_the_registry() {
        let registry = Registry::new();
        let mut names: Vec<&str> = registry.magics().map(|m| m.name()).collect();
        let mut listed = MAGIC_NAMES.to_vec();
        names.sort_unstable();
        listed.sort_unstable();
        assert_eq!(names, listed);
    }
}
