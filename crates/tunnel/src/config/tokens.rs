//! ssh_config(5) TOKENS (`%h`, `%r`, ...), ENVIRONMENT VARIABLES (`${VAR}`)
//! and `~` in file names, expanded as OpenSSH's misc.c does: one pass from
//! left to right, so an expanded value is never expanded again; an unknown
//! token, a missing variable or a bad `~user` is an error, never left as
//! it is.

use std::path::Path;

/// Why a value cannot be expanded; shown after the option and its value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// `${NAME` without its `}`: what follows the `${`.
    #[error("environment variable '{0}' missing closing '}}'")]
    UnclosedVariable(String),
    #[error("zero-length environment variable")]
    EmptyVariable,
    #[error("environment variable ${{{0}}} is not set")]
    UnsetVariable(String),
    #[error("a '%' at the end (write %% for a literal %)")]
    TrailingPercent,
    /// A token this option does not take.
    #[error("unknown token %{0}")]
    UnknownToken(char),
    /// `~user` for a user this machine does not know; `raw` is the whole value.
    #[error("no such user {user} (in {raw})")]
    NoSuchUser { user: String, raw: String },
}

/// Values of the `%` tokens that an option accepts; a token without a
/// value here is unknown to that option.
#[derive(Debug, Clone, Default)]
pub(super) struct Tokens {
    values: Vec<(char, String)>,
}

impl Tokens {
    pub fn new() -> Self {
        Tokens::default()
    }

    pub fn with(mut self, token: char, value: impl Into<String>) -> Self {
        self.values.push((token, value.into()));
        self
    }

    fn get(&self, token: char) -> Option<&str> {
        self.values
            .iter()
            .find(|(t, _)| *t == token)
            .map(|(_, v)| v.as_str())
    }
}

/// Expand `%` tokens only.
pub(super) fn percent(raw: &str, tokens: &Tokens) -> Result<String, TokenError> {
    expand(raw, Some(tokens), false)
}

/// Expand `${VAR}` only.
pub(super) fn dollar(raw: &str) -> Result<String, TokenError> {
    expand(raw, None, true)
}

/// Expand `%` tokens and `${VAR}` in one pass.
pub(super) fn percent_dollar(raw: &str, tokens: &Tokens) -> Result<String, TokenError> {
    expand(raw, Some(tokens), true)
}

fn expand(raw: &str, tokens: Option<&Tokens>, env: bool) -> Result<String, TokenError> {
    let mut out = String::with_capacity(raw.len());
    let mut rest = raw;
    while let Some(c) = rest.chars().next() {
        if env && rest.starts_with("${") {
            let inner = &rest[2..];
            let Some(end) = inner.find('}') else {
                return Err(TokenError::UnclosedVariable(inner.to_string()));
            };
            let name = &inner[..end];
            if name.is_empty() {
                return Err(TokenError::EmptyVariable);
            }
            match std::env::var(name) {
                Ok(v) => out.push_str(&v),
                Err(_) => return Err(TokenError::UnsetVariable(name.to_string())),
            }
            rest = &inner[end + 1..];
            continue;
        }
        rest = &rest[c.len_utf8()..];
        let Some(tokens) = tokens.filter(|_| c == '%') else {
            out.push(c);
            continue;
        };
        let Some(t) = rest.chars().next() else {
            return Err(TokenError::TrailingPercent);
        };
        rest = &rest[t.len_utf8()..];
        if t == '%' {
            out.push('%');
            continue;
        }
        match tokens.get(t) {
            Some(v) => out.push_str(v),
            None => return Err(TokenError::UnknownToken(t)),
        }
    }
    Ok(out)
}

/// Where `~` and `~user` lead.
pub(super) trait Homes {
    /// The current user's home (OpenSSH: the passwd entry's directory).
    fn own(&self) -> &Path;
    /// Another user's home, if that user exists.
    fn of(&self, user: &str) -> Option<std::path::PathBuf>;
}

/// OpenSSH's `tilde_expand`: `~`, `~/path`, `~user` and `~user/path`; any
/// other string is returned as it is.
pub(super) fn tilde(raw: &str, homes: &dyn Homes) -> Result<String, TokenError> {
    let Some(after) = raw.strip_prefix('~') else {
        return Ok(raw.to_string());
    };
    let (user, path) = match after.find('/') {
        Some(0) => (None, after.trim_start_matches('/')),
        Some(i) => (Some(&after[..i]), after[i + 1..].trim_start_matches('/')),
        None if after.is_empty() => (None, ""),
        None => (Some(after), ""),
    };
    let home = match user {
        None => homes.own().to_string_lossy().into_owned(),
        Some(u) => homes
            .of(u)
            .ok_or_else(|| TokenError::NoSuchUser {
                user: u.to_string(),
                raw: raw.to_string(),
            })?
            .to_string_lossy()
            .into_owned(),
    };
    let slash = if home.ends_with('/') { "" } else { "/" };
    Ok(format!("{home}{slash}{path}"))
}

/// A name for `IdentityAgent $NAME`: letters, digits and `_` only.
pub(super) fn valid_env_name(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    struct Fixed;
    impl Homes for Fixed {
        fn own(&self) -> &Path {
            Path::new("/home/alice")
        }
        fn of(&self, user: &str) -> Option<PathBuf> {
            (user == "bob").then(|| PathBuf::from("/home/bob/"))
        }
    }

    #[test]
    fn percent_tokens() {
        let t = Tokens::new()
            .with('h', "gpu")
            .with('r', "bob")
            .with('p', "22");
        assert_eq!(percent("%r@%h:%p", &t).expect("ok"), "bob@gpu:22");
        assert_eq!(percent("100%%", &t).expect("ok"), "100%");
        assert_eq!(
            percent("%d", &t).expect_err("unknown").to_string(),
            "unknown token %d"
        );
        assert!(percent("x%", &t).is_err());
        // A value is not expanded again.
        let t = Tokens::new().with('h', "%r");
        assert_eq!(percent("%h", &t).expect("ok"), "%r");
        // Without env expansion, ${X} stays.
        assert_eq!(percent("${X}", &t).expect("ok"), "${X}");
    }

    #[test]
    fn env_vars() {
        std::env::set_var("TUNNEL_TOKENS_TEST", "/keys%h");
        let t = Tokens::new().with('h', "gpu");
        assert_eq!(
            percent_dollar("${TUNNEL_TOKENS_TEST}/%h", &t).expect("ok"),
            "/keys%h/gpu",
            "a variable's value is not token-expanded"
        );
        assert_eq!(dollar("$HOME_IS_LITERAL").expect("ok"), "$HOME_IS_LITERAL");
        let text = |r: Result<String, TokenError>| r.expect_err("refused").to_string();
        assert_eq!(
            text(dollar("${TUNNEL_TOKENS_UNSET_VAR}")),
            "environment variable ${TUNNEL_TOKENS_UNSET_VAR} is not set"
        );
        assert_eq!(text(dollar("${}")), "zero-length environment variable");
        assert_eq!(
            text(dollar("${OPEN")),
            "environment variable 'OPEN' missing closing '}'"
        );
        assert_eq!(
            text(percent("x%", &t)),
            "a '%' at the end (write %% for a literal %)"
        );
    }

    #[test]
    fn tildes() {
        assert_eq!(tilde("~", &Fixed).expect("ok"), "/home/alice/");
        assert_eq!(tilde("~/", &Fixed).expect("ok"), "/home/alice/");
        assert_eq!(
            tilde("~//.ssh/x", &Fixed).expect("ok"),
            "/home/alice/.ssh/x"
        );
        assert_eq!(tilde("~bob/k", &Fixed).expect("ok"), "/home/bob/k");
        assert_eq!(tilde("~bob", &Fixed).expect("ok"), "/home/bob/");
        assert_eq!(
            tilde("~nobody/k", &Fixed)
                .expect_err("unknown user")
                .to_string(),
            "no such user nobody (in ~nobody/k)"
        );
        assert_eq!(tilde("/abs/~x", &Fixed).expect("ok"), "/abs/~x");
        assert_eq!(tilde("rel", &Fixed).expect("ok"), "rel");
    }

    #[test]
    fn env_names() {
        assert!(valid_env_name("SSH_AUTH_SOCK2"));
        assert!(!valid_env_name(""));
        assert!(!valid_env_name("A-B"));
    }
}
