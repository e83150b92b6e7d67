//! GPU magics: parsing, dispatch, help, completion. No protocol code here: a magic gets a
//! [`MagicContext`] and emits [`Output`]s; the kernel turns them into messages.

mod cancel;
pub mod cell;
mod echo;
mod emptycache;
mod envcheck;
mod gauge;
mod gpumem;
mod help;
mod maxbatch;
mod oom;
mod output;
pub mod python;
mod state;
mod visible;

pub use cancel::CancelToken;
pub use output::{bundle, html_escape, Bundle, MagicError, Output, OutputSink, StreamName};
pub use state::GpuState;

use clap::Parser;

/// Everything a running magic may use.
pub struct MagicContext<'a> {
    pub out: &'a dyn OutputSink,
    pub cancel: &'a CancelToken,
    pub gpu: &'a GpuState,
    pub registry: &'a Registry,
    /// The Python kernel behind us (proxy mode); `None` in the magics-only kernel.
    pub python: Option<&'a dyn python::PythonKernel>,
}

impl MagicContext<'_> {
    pub fn stdout(&self, text: impl Into<String>) {
        self.out.emit(Output::Stream {
            name: StreamName::Stdout,
            text: text.into(),
        });
    }
}

/// One line magic.
pub trait Magic: Send + Sync {
    /// Without the `%`.
    fn name(&self) -> &'static str;
    /// One line for `%gpuhelp`.
    fn summary(&self) -> &'static str;
    /// Its arguments, for help and completion.
    fn command(&self) -> clap::Command;
    /// Runs with `argv[0]` = `%name`.
    fn run(&self, argv: Vec<String>, ctx: &MagicContext) -> Result<(), MagicError>;
}

/// Parses `argv` as `T`. `Ok(None)` means `--help` was shown and there is nothing to run.
pub fn parse_args<T: Parser>(
    argv: Vec<String>,
    ctx: &MagicContext,
) -> Result<Option<T>, MagicError> {
    match T::try_parse_from(argv) {
        Ok(args) => Ok(Some(args)),
        Err(err) => match err.kind() {
            clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => {
                ctx.stdout(err.render().to_string());
                Ok(None)
            }
            _ => Err(MagicError::usage(err.render().to_string().trim_end())),
        },
    }
}

/// The magics this kernel answers.
pub struct Registry {
    magics: Vec<Box<dyn Magic>>,
    /// What `%oom` remembers (it also sees `%maxbatch`'s results).
    oom_notes: std::sync::Arc<oom::Notes>,
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

/// A completion: `matches` replace the code points `cursor_start..cursor_end`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub matches: Vec<String>,
    pub cursor_start: usize,
    pub cursor_end: usize,
}

impl Registry {
    pub fn new() -> Self {
        let oom_notes = std::sync::Arc::new(oom::Notes::default());
        Self {
            oom_notes: oom_notes.clone(),
            magics: vec![
                Box::new(help::GpuHelp),
                Box::new(gpumem::GpuMem),
                Box::new(emptycache::EmptyCache),
                Box::new(maxbatch::MaxBatch),
                Box::new(oom::Oom::new(oom_notes)),
                Box::new(envcheck::EnvCheck),
                Box::new(echo::Echo),
            ],
        }
    }

    pub fn get(&self, name: &str) -> Option<&dyn Magic> {
        self.magics
            .iter()
            .find(|m| m.name() == name)
            .map(|m| m.as_ref())
    }

    pub fn is_ours(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    pub fn magics(&self) -> impl Iterator<Item = &dyn Magic> {
        self.magics.iter().map(|m| m.as_ref())
    }

    fn names_list(&self) -> String {
        self.magics()
            .map(|m| format!("%{}", m.name()))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The error for `%name` that is not ours, listing what is.
    pub fn unknown(&self, name: &str) -> MagicError {
        MagicError::usage(format!(
            "unknown magic %{name}. Available: {} (%gpuhelp describes each).",
            self.names_list()
        ))
    }

    /// Full help of one magic, as text.
    pub fn help_text(&self, name: &str) -> Option<String> {
        let magic = self.get(name)?;
        Some(magic.command().render_long_help().to_string())
    }

    /// Runs one magic line.
    pub fn execute(&self, line: &cell::MagicLine, ctx: &MagicContext) -> Result<(), MagicError> {
        let magic = self
            .get(&line.name)
            .ok_or_else(|| self.unknown(&line.name))?;
        if line.help {
            let text = self.help_text(&line.name).unwrap_or_default();
            ctx.out.emit(Output::Page {
                data: bundle(text, None),
            });
            return Ok(());
        }
        let words = shlex::split(&line.args).ok_or_else(|| {
            MagicError::usage(format!(
                "%{}: unbalanced quotes in {:?}; close the quote or escape it with \\",
                line.name, line.args
            ))
        })?;
        let argv = std::iter::once(format!("%{}", line.name))
            .chain(words)
            .collect();
        if line.name == "maxbatch" {
            // %oom's suggestions use this session's %maxbatch results.
            let tee = oom::Tee {
                inner: ctx.out,
                notes: &self.oom_notes,
            };
            let ctx = MagicContext { out: &tee, ..*ctx };
            return magic.run(argv, &ctx);
        }
        magic.run(argv, ctx)
    }

    /// Completes magic names after `%` and flags (and their values) after a magic name.
    /// `cursor_pos` counts code points, as the protocol does.
    pub fn complete(&self, code: &str, cursor_pos: usize) -> Option<Completion> {
        let before: String = code.chars().take(cursor_pos).collect();
        let line_start = before.rfind('\n').map(|i| i + 1).unwrap_or(0);
        let line = &before[line_start..];
        let line_start_cp = before[..line_start].chars().count();
        let rest = line.strip_prefix('%')?;
        if !rest.contains(char::is_whitespace) {
            let matches: Vec<String> = self
                .magics()
                .filter(|m| m.name().starts_with(rest))
                .map(|m| format!("%{}", m.name()))
                .collect();
            return (!matches.is_empty()).then_some(Completion {
                matches,
                cursor_start: line_start_cp,
                cursor_end: cursor_pos,
            });
        }
        let name = cell::magic_name(line)?;
        let command = self.get(name)?.command();
        let token_start = line.rfind(char::is_whitespace).map(|i| i + 1).unwrap_or(0);
        let token = &line[token_start..];
        let previous = line[..token_start].split_whitespace().last().unwrap_or("");
        let mut matches: Vec<String> = Vec::new();
        if token.starts_with('-') {
            for arg in command.get_arguments().filter(|a| !a.is_hide_set()) {
                if let Some(long) = arg.get_long() {
                    let flag = format!("--{long}");
                    if flag.starts_with(token) {
                        matches.push(flag);
                    }
                }
            }
        } else if let Some(arg) = previous
            .strip_prefix("--")
            .and_then(|long| command.get_arguments().find(|a| a.get_long() == Some(long)))
        {
            matches.extend(
                arg.get_possible_values()
                    .into_iter()
                    .map(|v| v.get_name().to_string())
                    .filter(|v| v.starts_with(token)),
            );
        } else {
            for arg in command.get_positionals() {
                matches.extend(
                    arg.get_possible_values()
                        .into_iter()
                        .map(|v| v.get_name().to_string())
                        .filter(|v| v.starts_with(token)),
                );
            }
        }
        if matches.is_empty() {
            return None;
        }
        matches.sort();
        let token_len = token.chars().count();
        Some(Completion {
            matches,
            cursor_start: cursor_pos - token_len,
            cursor_end: cursor_pos,
        })
    }

    /// Help for the magic on the line under the cursor.
    pub fn inspect(&self, code: &str, cursor_pos: usize) -> Option<String> {
        let byte_pos = code
            .char_indices()
            .nth(cursor_pos)
            .map(|(i, _)| i)
            .unwrap_or(code.len());
        let line_start = code[..byte_pos].rfind('\n').map(|i| i + 1).unwrap_or(0);
        let line = code[line_start..].lines().next().unwrap_or("");
        let name = cell::magic_name(line)?;
        self.help_text(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completes_names_flags_and_values() {
        let registry = Registry::new();
        let c = registry.complete("%gpu", 4).unwrap();
        assert_eq!(c.matches, vec!["%gpuhelp", "%gpumem"]);
        assert_eq!((c.cursor_start, c.cursor_end), (0, 4));

        let code = "x = 1\n%gpumem --js";
        let c = registry.complete(code, code.chars().count()).unwrap();
        assert_eq!(c.matches, vec!["--json"]);
        assert_eq!(c.cursor_end - c.cursor_start, 4);

        let code = "%gpuhelp gpu";
        let c = registry.complete(code, code.len()).unwrap();
        assert_eq!(c.matches, vec!["gpuhelp", "gpumem"]);

        // Hidden flags (gpukernel's own, like %oom --after-error) are not offered.
        let c = registry.complete("%oom --", 7).unwrap();
        assert_eq!(c.matches, vec!["--json", "--release"]);

        assert!(registry.complete("print(1)", 8).is_none());
        assert!(registry.complete("%zzz", 4).is_none());
    }

    #[test]
    fn inspect_finds_the_magic_on_the_cursor_line() {
        let registry = Registry::new();
        let help = registry.inspect("a\n%gpumem --json\nb", 4).unwrap();
        assert!(help.contains("--json"), "{help}");
        assert!(registry.inspect("print(1)", 2).is_none());
    }

    #[test]
    fn unknown_magic_lists_the_valid_ones() {
        let err = Registry::new().unknown("gpumen");
        assert_eq!(err.ename, "UsageError");
        assert!(err.evalue.contains("%gpumem"));
        assert!(err.evalue.contains("%gpuhelp"));
    }
}
