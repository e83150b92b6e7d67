//! ProxyJump (and `-J`) values: `none`, or comma-separated hops, each
//! `[user@]host[:port]` or `ssh://[user@]host[:port]`, parsed as OpenSSH's
//! `parse_jump` does.

use std::fmt;

use super::tokens::{self, TokenError, Tokens};

/// A hop that cannot be parsed, as written, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("hop {spec:?}: {source}")]
pub struct JumpError {
    pub spec: String,
    pub source: HopError,
}

/// What is wrong with one hop (`[user@]host[:port]` or an `ssh://` URI).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HopError {
    #[error("empty user name")]
    EmptyUser,
    #[error("empty host")]
    EmptyHost,
    #[error("unclosed '['")]
    UnclosedBracket,
    /// What follows the host where only `:port` (or a URI's `/`) may.
    #[error("unexpected {0:?} after the host")]
    AfterHost(String),
    #[error("bad port {0:?}")]
    BadPort(String),
    #[error("host {0:?} starts with an invalid character")]
    BadFirstCharacter(String),
    #[error("host {0:?} has consecutive dots")]
    ConsecutiveDots(String),
    #[error("host {0:?} has invalid characters")]
    InvalidCharacters(String),
    #[error("a path is not allowed")]
    Path,
    /// A URI's user name, as written.
    #[error("bad %-escape in {0:?}")]
    BadEscape(String),
    #[error("'/' in user name {0:?}")]
    SlashInUser(String),
    #[error("user name {0:?} is not UTF-8")]
    UserNotUtf8(String),
}

/// One hop of a ProxyJump list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hop {
    pub user: Option<String>,
    pub host: String,
    pub port: Option<u16>,
}

impl fmt::Display for Hop {
    /// `[user@]host[:port]`, an IPv6 or numeric host in brackets, as
    /// `ssh -G` prints the last hop.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(u) = &self.user {
            write!(f, "{u}@")?;
        }
        let numeric =
            self.host.contains(':') || self.host.bytes().all(|b| b.is_ascii_digit() || b == b'.');
        if numeric {
            write!(f, "[{}]", self.host)?;
        } else {
            write!(f, "{}", self.host)?;
        }
        if let Some(p) = self.port {
            write!(f, ":{p}")?;
        }
        Ok(())
    }
}

/// A ProxyJump setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Jump {
    /// `ProxyJump none`.
    Disabled,
    /// The hops in the order they are visited. `extra` is the text before
    /// the last hop, kept as written, for display as `ssh -G` does.
    Hops {
        extra: Option<String>,
        hops: Vec<Hop>,
    },
}

impl Jump {
    pub fn hops(&self) -> &[Hop] {
        match self {
            Jump::Disabled => &[],
            Jump::Hops { hops, .. } => hops,
        }
    }

    /// The same hops with `%h %n %p %r %%` expanded in each host and user
    /// (ssh_config(5): ProxyJump accepts these tokens).
    pub(super) fn expand(&self, tokens: &Tokens) -> Result<Jump, TokenError> {
        match self {
            Jump::Disabled => Ok(Jump::Disabled),
            Jump::Hops { extra, hops } => {
                let hops = hops
                    .iter()
                    .map(|h| {
                        Ok(Hop {
                            user: h
                                .user
                                .as_deref()
                                .map(|u| tokens::percent(u, tokens))
                                .transpose()?,
                            host: tokens::percent(&h.host, tokens)?,
                            port: h.port,
                        })
                    })
                    .collect::<Result<Vec<_>, TokenError>>()?;
                let extra = extra
                    .as_deref()
                    .map(|e| tokens::percent(e, tokens))
                    .transpose()?;
                Ok(Jump::Hops { extra, hops })
            }
        }
    }
}

impl fmt::Display for Jump {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Jump::Disabled => write!(f, "none"),
            Jump::Hops { extra, hops } => {
                if let Some(e) = extra {
                    write!(f, "{e},")?;
                }
                match hops.last() {
                    Some(h) => write!(f, "{h}"),
                    None => Ok(()),
                }
            }
        }
    }
}

/// Parse a ProxyJump value (`-J` takes the same syntax).
pub fn parse(value: &str) -> Result<Jump, JumpError> {
    let text = match value.find('#') {
        Some(i) => &value[..i],
        None => value,
    }
    .trim_end();
    if text.eq_ignore_ascii_case("none") {
        return Ok(Jump::Disabled);
    }
    let hops = text
        .split(',')
        .map(|spec| {
            parse_hop(spec).map_err(|source| JumpError {
                spec: spec.to_string(),
                source,
            })
        })
        .collect::<Result<Vec<_>, JumpError>>()?;
    let extra = text.rfind(',').map(|i| text[..i].to_string());
    Ok(Jump::Hops { extra, hops })
}

fn parse_hop(spec: &str) -> Result<Hop, HopError> {
    if let Some(uri) = spec.strip_prefix("ssh://") {
        return parse_uri(uri);
    }
    let (user, rest) = match spec.rfind('@') {
        Some(0) => return Err(HopError::EmptyUser),
        Some(i) => (Some(spec[..i].to_string()), &spec[i + 1..]),
        None => (None, spec),
    };
    let (host, port) = split_host_port(rest)?;
    Ok(Hop { user, host, port })
}

fn parse_uri(uri: &str) -> Result<Hop, HopError> {
    let (user, rest) = match uri.find('@') {
        Some(i) => {
            let info = &uri[..i];
            let name = info.split(';').next().unwrap_or_default();
            if name.is_empty() {
                return Err(HopError::EmptyUser);
            }
            (Some(url_decode(name)?), &uri[i + 1..])
        }
        None => (None, uri),
    };
    let (host_part, after) = split_delim(rest, true)?;
    let host = clean_host(host_part);
    valid_domain(&host)?;
    let mut port = None;
    if let Some((delim, tail)) = after {
        let mut path = tail;
        if delim == ':' {
            let (p, rest) = match tail.find('/') {
                Some(i) => (&tail[..i], &tail[i + 1..]),
                None => (tail, ""),
            };
            port = Some(port_number(p)?);
            path = rest;
        }
        if !path.is_empty() {
            return Err(HopError::Path);
        }
    }
    Ok(Hop { user, host, port })
}

/// `host[:port]` or `[host]:port`.
pub(super) fn split_host_port(s: &str) -> Result<(String, Option<u16>), HopError> {
    let (host_part, after) = split_delim(s, false)?;
    let host = clean_host(host_part);
    if host_part.is_empty() {
        return Err(HopError::EmptyHost);
    }
    let port = match after {
        Some((_, p)) if !p.is_empty() => Some(port_number(p)?),
        _ => None,
    };
    Ok((host, port))
}

/// The host part of a hop, and its delimiter with what follows it.
type HostAndRest<'a> = (&'a str, Option<(char, &'a str)>);

/// OpenSSH's `hpdelim2`: the host part and what follows its delimiter
/// (`:`, or `/` where `slash` allows).
fn split_delim(s: &str, slash: bool) -> Result<HostAndRest<'_>, HopError> {
    let end = if s.starts_with('[') {
        s.find(']')
            .map(|i| i + 1)
            .ok_or(HopError::UnclosedBracket)?
    } else {
        s.find([':', '/']).unwrap_or(s.len())
    };
    let (host, rest) = s.split_at(end);
    match rest.chars().next() {
        None => Ok((host, None)),
        Some(c @ ':') => Ok((host, Some((c, &rest[1..])))),
        Some(c @ '/') if slash => Ok((host, Some((c, &rest[1..])))),
        Some(_) => Err(HopError::AfterHost(rest.to_string())),
    }
}

fn clean_host(h: &str) -> String {
    match h.strip_prefix('[').and_then(|x| x.strip_suffix(']')) {
        Some(inner) => inner.to_string(),
        None => h.to_string(),
    }
}

fn port_number(p: &str) -> Result<u16, HopError> {
    super::parse::port(p).ok_or_else(|| HopError::BadPort(p.to_string()))
}

fn valid_domain(name: &str) -> Result<(), HopError> {
    let first = name.bytes().next().ok_or(HopError::EmptyHost)?;
    if !first.is_ascii_alphanumeric() {
        return Err(HopError::BadFirstCharacter(name.to_string()));
    }
    if name.contains("..") {
        return Err(HopError::ConsecutiveDots(name.to_string()));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'_')
    {
        return Err(HopError::InvalidCharacters(name.to_string()));
    }
    Ok(())
}

fn url_decode(s: &str) -> Result<String, HopError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = s
                    .get(i + 1..i + 3)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .filter(|&b| b != 0)
                    .ok_or_else(|| HopError::BadEscape(s.to_string()))?;
                out.push(hex);
                i += 3;
            }
            b'/' => return Err(HopError::SlashInUser(s.to_string())),
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| HopError::UserNotUtf8(s.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hop(user: Option<&str>, host: &str, port: Option<u16>) -> Hop {
        Hop {
            user: user.map(str::to_string),
            host: host.into(),
            port,
        }
    }

    #[test]
    fn hops_in_order() {
        let j = parse("alice@b1:2201,b2,ssh://u@10.0.0.1:33,[::1]:4").expect("parses");
        assert_eq!(
            j.hops(),
            [
                hop(Some("alice"), "b1", Some(2201)),
                hop(None, "b2", None),
                hop(Some("u"), "10.0.0.1", Some(33)),
                hop(None, "::1", Some(4)),
            ]
        );
        // As ssh -G prints it: the earlier hops as written, the last normalised.
        assert_eq!(
            j.to_string(),
            "alice@b1:2201,b2,ssh://u@10.0.0.1:33,[::1]:4"
        );
        assert_eq!(parse("10.1.2.3").expect("parses").to_string(), "[10.1.2.3]");
        assert_eq!(parse("None").expect("parses"), Jump::Disabled);
        assert_eq!(
            parse("a # comment").expect("parses").hops(),
            [hop(None, "a", None)]
        );
    }

    #[test]
    fn bad_hops() {
        for bad in ["h:port", "@h", "h:0", "h:70000", "[::1", "ssh://h/path", ""] {
            assert!(parse(bad).is_err(), "{bad:?} should be refused");
        }
        // The texts users see (and the Python tests read).
        let text = |v: &str| parse(v).expect_err("refused").to_string();
        assert_eq!(text("a,h:port"), r#"hop "h:port": bad port "port""#);
        assert_eq!(text("@h"), r#"hop "@h": empty user name"#);
        assert_eq!(text("[::1"), r#"hop "[::1": unclosed '['"#);
        assert_eq!(text(""), r#"hop "": empty host"#);
        assert_eq!(text("h/x"), r#"hop "h/x": unexpected "/x" after the host"#);
        assert_eq!(
            text("ssh://h/path"),
            r#"hop "ssh://h/path": a path is not allowed"#
        );
        assert_eq!(
            text("ssh://-h"),
            r#"hop "ssh://-h": host "-h" starts with an invalid character"#
        );
        assert_eq!(
            text("ssh://a..b"),
            r#"hop "ssh://a..b": host "a..b" has consecutive dots"#
        );
        assert_eq!(
            text("ssh://a!b"),
            r#"hop "ssh://a!b": host "a!b" has invalid characters"#
        );
        assert_eq!(
            text("ssh://u%zz@h"),
            r#"hop "ssh://u%zz@h": bad %-escape in "u%zz""#
        );
        assert_eq!(
            text("ssh://a/b@h"),
            r#"hop "ssh://a/b@h": '/' in user name "a/b""#
        );
        assert_eq!(
            text("ssh://%ff@h"),
            r#"hop "ssh://%ff@h": user name "%ff" is not UTF-8"#
        );
    }

    #[test]
    fn tokens_in_hops() {
        let t = Tokens::new().with('h', "gpu").with('r', "bob");
        let j = parse("%r@%h-jump:2200")
            .expect("parses")
            .expand(&t)
            .expect("expands");
        assert_eq!(j.hops(), [hop(Some("bob"), "gpu-jump", Some(2200))]);
    }
}
