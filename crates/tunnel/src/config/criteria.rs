//! `Match` lines: parsed like OpenSSH's `match_cfg_line` (same words, same
//! errors) and evaluated against the state of the resolution so far.

use std::ffi::OsString;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};

use super::lexer;
use super::pattern;
use super::tokens::{self, TokenError, Tokens};

/// A Match line OpenSSH would refuse too (its `match_cfg_line` texts).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// `all` (as written, `!` included) beside other criteria.
    #[error("'{0}' cannot be combined with other Match attributes")]
    AllCombined(String),
    /// A criterion of a newer OpenSSH (lowercased).
    #[error("Match {0} (a criterion of OpenSSH 9.4 and later) is not supported by tunnel")]
    Newer(String),
    #[error("Unsupported Match attribute {0}")]
    Unknown(String),
    #[error("Missing Match criteria for {0}")]
    MissingArgument(String),
    #[error("One or more attributes required for Match")]
    Empty,
}

/// A Match line that cannot be evaluated.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// The HostName that `Match host` compares has a bad token (resolve.rs
    /// expands it before the criteria run).
    #[error("HostName {hostname}: {source}")]
    HostName {
        hostname: String,
        source: TokenError,
    },
    #[error("Match exec {command:?}: {source}")]
    ExecToken { command: String, source: TokenError },
    #[error("Match exec: cannot run {program:?}: {source}")]
    ExecSpawn {
        program: OsString,
        source: std::io::Error,
    },
    /// Killed by a signal: neither a match nor a non-match.
    #[error("Match exec {command:?} exited abnormally ({status})")]
    ExecAbnormal { command: String, status: ExitStatus },
}

/// One criterion of a Match line; `negate` is a leading `!`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Criterion {
    All { negate: bool },
    Canonical { negate: bool },
    Final { negate: bool },
    Host { negate: bool, patterns: String },
    OriginalHost { negate: bool, patterns: String },
    User { negate: bool, patterns: String },
    LocalUser { negate: bool, patterns: String },
    Exec { negate: bool, command: String },
}

/// Criteria that newer OpenSSH versions know; tunnel cannot evaluate them.
const NEWER: &[&str] = &[
    "tagged",
    "localnetwork",
    "version",
    "sessiontype",
    "command",
];

/// Parse the text after `Match`.
pub(super) fn parse(rest: &str) -> Result<Vec<Criterion>, ParseError> {
    let mut cursor = Some(rest);
    let mut criteria = Vec::new();
    let mut attributes = 0;
    while let Some(word) = lexer::strdelim(&mut cursor) {
        if word.is_empty() || word.starts_with('#') {
            break;
        }
        let (negate, name) = match word.strip_prefix('!') {
            Some(n) => (true, n),
            None => (false, word.as_str()),
        };
        let name = name.to_ascii_lowercase();
        if name == "all" {
            let next = lexer::strdelim(&mut cursor);
            let more = next.is_some_and(|n| !n.is_empty() && !n.starts_with('#'));
            if attributes > 1 || more {
                return Err(ParseError::AllCombined(word));
            }
            criteria.push(Criterion::All { negate });
            return Ok(criteria);
        }
        attributes += 1;
        match name.as_str() {
            "canonical" => {
                criteria.push(Criterion::Canonical { negate });
                continue;
            }
            "final" => {
                criteria.push(Criterion::Final { negate });
                continue;
            }
            _ => {}
        }
        let known = ["host", "originalhost", "user", "localuser", "exec"];
        if !known.contains(&name.as_str()) {
            return Err(if NEWER.contains(&name.as_str()) {
                ParseError::Newer(name)
            } else {
                ParseError::Unknown(name)
            });
        }
        let arg = lexer::strdelim(&mut cursor)
            .filter(|a| !a.is_empty() && !a.starts_with('#'))
            .ok_or_else(|| ParseError::MissingArgument(name.clone()))?;
        criteria.push(match name.as_str() {
            "host" => Criterion::Host {
                negate,
                patterns: arg,
            },
            "originalhost" => Criterion::OriginalHost {
                negate,
                patterns: arg,
            },
            "user" => Criterion::User {
                negate,
                patterns: arg,
            },
            "localuser" => Criterion::LocalUser {
                negate,
                patterns: arg,
            },
            _ => Criterion::Exec {
                negate,
                command: arg,
            },
        });
    }
    if attributes == 0 {
        return Err(ParseError::Empty);
    }
    Ok(criteria)
}

/// What a Match line is evaluated against.
pub(super) struct Context<'a> {
    /// The target host name: HostName (expanded) if set so far, else the
    /// host being resolved.
    pub host: &'a str,
    /// The host as given on the command line.
    pub original_host: &'a str,
    /// The remote user so far (User, `user@`, else the local user).
    pub user: &'a str,
    pub local_user: &'a str,
    /// The second pass (after canonicalization or `Match final`).
    pub final_pass: bool,
    /// Values of `%` tokens for `exec`.
    pub tokens: &'a Tokens,
    /// The shell for `exec` (`SHELL -c`); `None`: the platform's
    /// (`$SHELL` or /bin/sh; cmd.exe on Windows, as OpenSSH for Windows).
    pub shell: Option<&'a Path>,
}

/// Whether the criteria hold. `wants_final` is set when a `final` criterion
/// is seen, as OpenSSH does, even on a line that does not match.
pub(super) fn evaluate(
    criteria: &[Criterion],
    cx: &Context<'_>,
    wants_final: &mut bool,
) -> Result<bool, EvalError> {
    let mut result = true;
    for c in criteria {
        let (negate, hit) = match c {
            Criterion::All { negate } => {
                if result {
                    result = !negate;
                }
                return Ok(result);
            }
            Criterion::Canonical { negate } => (*negate, cx.final_pass),
            Criterion::Final { negate } => {
                *wants_final = true;
                (*negate, cx.final_pass)
            }
            Criterion::Host { negate, patterns } => {
                (*negate, pattern::host_in_list(cx.host, patterns))
            }
            Criterion::OriginalHost { negate, patterns } => {
                (*negate, pattern::host_in_list(cx.original_host, patterns))
            }
            Criterion::User { negate, patterns } => {
                (*negate, pattern::user_in_list(cx.user, patterns))
            }
            Criterion::LocalUser { negate, patterns } => {
                (*negate, pattern::user_in_list(cx.local_user, patterns))
            }
            Criterion::Exec { negate, command } => {
                let command =
                    tokens::percent(command, cx.tokens).map_err(|source| EvalError::ExecToken {
                        command: command.clone(),
                        source,
                    })?;
                if !result {
                    // An earlier criterion failed: the command is not run.
                    tracing::trace!("skipped Match exec {command:?}");
                    continue;
                }
                (*negate, run(&command, cx.shell)?)
            }
        };
        if hit == negate {
            result = false;
        }
    }
    Ok(result)
}

/// Run `command` with the user's shell (`$SHELL -c`; `cmd.exe /c` on
/// Windows), stdin and stdout on /dev/null; exit status 0 is a match.
fn run(command: &str, shell: Option<&Path>) -> Result<bool, EvalError> {
    let mut cmd = match shell {
        Some(shell) => {
            let mut c = Command::new(shell);
            c.arg("-c").arg(command);
            c
        }
        None => crate::platform::match_exec_command(command),
    };
    tracing::debug!("Match exec: {cmd:?}");
    let status = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .status()
        .map_err(|source| EvalError::ExecSpawn {
            program: cmd.get_program().to_os_string(),
            source,
        })?;
    match status.code() {
        Some(code) => Ok(code == 0),
        None => Err(EvalError::ExecAbnormal {
            command: command.to_string(),
            status,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cx<'a>(host: &'a str, user: &'a str, tokens: &'a Tokens, final_pass: bool) -> Context<'a> {
        Context {
            host,
            original_host: "lab-1",
            user,
            local_user: "alice",
            final_pass,
            tokens,
            shell: cfg!(unix).then(|| Path::new("/bin/sh")),
        }
    }

    fn eval(line: &str, cx: &Context<'_>) -> bool {
        let mut f = false;
        evaluate(&parse(line).expect("parses"), cx, &mut f).expect("evaluates")
    }

    #[test]
    fn parses_like_openssh() {
        assert_eq!(
            parse("host a,b !user=bob").expect("parses"),
            [
                Criterion::Host {
                    negate: false,
                    patterns: "a,b".into()
                },
                Criterion::User {
                    negate: true,
                    patterns: "bob".into()
                }
            ]
        );
        assert_eq!(
            parse("exec \"test -e /x\" # comment").expect("parses"),
            [Criterion::Exec {
                negate: false,
                command: "test -e /x".into()
            }]
        );
        assert_eq!(
            parse("canonical all").expect("parses"),
            [
                Criterion::Canonical { negate: false },
                Criterion::All { negate: false }
            ]
        );
        let text = |line: &str| parse(line).expect_err("refused").to_string();
        assert_eq!(
            text("all host x"),
            "'all' cannot be combined with other Match attributes"
        );
        assert_eq!(
            text("host a user b !all"),
            "'!all' cannot be combined with other Match attributes"
        );
        assert_eq!(text("host"), "Missing Match criteria for host");
        assert_eq!(text("host #x"), "Missing Match criteria for host");
        assert_eq!(text("bogus x"), "Unsupported Match attribute bogus");
        assert_eq!(
            text("Tagged x"),
            "Match tagged (a criterion of OpenSSH 9.4 and later) is not supported by tunnel"
        );
        assert_eq!(
            text("# nothing"),
            "One or more attributes required for Match"
        );
    }

    #[test]
    fn evaluates_criteria() {
        let t = Tokens::new();
        let c = cx("lab-1", "bob", &t, false);
        assert!(eval("host lab-*", &c));
        assert!(!eval("host lab-*,!lab-1", &c));
        assert!(eval("!host lab-2", &c));
        assert!(eval("originalhost LAB-1", &c));
        assert!(eval("user bob localuser alice", &c));
        assert!(!eval("user bob localuser carol", &c));
        assert!(eval("all", &c));
        assert!(!eval("!all", &c));
        assert!(!eval("final", &c));
        assert!(eval("!canonical", &c));
        let c = cx("lab-1", "bob", &t, true);
        assert!(eval("final", &c));
        assert!(eval("canonical", &c));
    }

    #[test]
    fn final_is_requested_even_when_the_line_fails() {
        let t = Tokens::new();
        let c = cx("x", "bob", &t, false);
        let mut wants = false;
        let hit = evaluate(&parse("host nope final").expect("parses"), &c, &mut wants)
            .expect("evaluates");
        assert!(!hit && wants);
    }

    #[cfg(unix)]
    #[test]
    fn exec_runs_in_the_shell_with_tokens() {
        let dir = tempfile::tempdir().expect("tempdir");
        let marker = dir.path().join("lab-1.bob");
        std::fs::write(&marker, "").expect("write");
        let t = Tokens::new()
            .with('h', "lab-1")
            .with('r', "bob")
            .with('d', dir.path().to_string_lossy());
        let c = cx("lab-1", "bob", &t, false);
        assert!(eval("exec \"test -e %d/%h.%r\"", &c));
        assert!(!eval("exec \"test -e %d/%h.nobody\"", &c));
        assert!(eval("!exec false", &c));
        // Skipped once an earlier criterion failed: this would fail the test otherwise.
        assert!(!eval("host nope exec \"kill -9 $$\"", &c));
        let mut f = false;
        let err = evaluate(&parse("exec \"kill -9 $$\"").expect("parses"), &c, &mut f)
            .expect_err("killed by a signal");
        assert_eq!(
            err.to_string(),
            "Match exec \"kill -9 $$\" exited abnormally (signal: 9 (SIGKILL))"
        );
        let err = evaluate(&parse("exec %Z").expect("parses"), &c, &mut f).expect_err("token");
        assert_eq!(err.to_string(), "Match exec \"%Z\": unknown token %Z");
    }

    /// OpenSSH for Windows runs `Match exec` with system(): cmd.exe.
    #[cfg(windows)]
    #[test]
    fn exec_runs_in_cmd_on_windows() {
        let t = Tokens::new().with('h', "lab-1");
        let c = cx("lab-1", "bob", &t, false);
        assert!(eval("exec \"if %h==lab-1 (exit 0) else (exit 1)\"", &c));
        assert!(!eval("exec \"exit 3\"", &c));
        assert!(eval("!exec \"exit 1\"", &c));
    }
}
