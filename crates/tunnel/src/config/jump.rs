//! ProxyJump (and `-J`) values: `none`, or comma-separated hops, each
//! `[user@]host[:port]` or `ssh://[user@]host[:port]`, parsed as OpenSSH's
//! `parse_jump` does.

use std::fmt;

use super::tokens::{self, Tokens};

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
    pub(super) fn expand(&self, tokens: &Tokens) -> Result<Jump, String> {
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
                    .collect::<Result<Vec<_>, String>>()?;
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
pub fn parse(value: &str) -> Result<Jump, String> {
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
        .map(parse_hop)
        .collect::<Result<Vec<_>, String>>()?;
    let extra = text.rfind(',').map(|i| text[..i].to_string());
    Ok(Jump::Hops { extra, hops })
}

fn parse_hop(spec: &str) -> Result<Hop, String> {
    let bad = |why: &str| format!("hop {spec:?}: {why}");
    if let Some(uri) = spec.strip_prefix("ssh://") {
        return parse_uri(uri).map_err(|e| bad(&e));
    }
    let (user, rest) = match spec.rfind('@') {
        Some(0) => return Err(bad("empty user name")),
        Some(i) => (Some(spec[..i].to_string()), &spec[i + 1..]),
        None => (None, spec),
    };
    let (host, port) = split_host_port(rest).map_err(|e| bad(&e))?;
    Ok(Hop { user, host, port })
}

fn parse_uri(uri: &str) -> Result<Hop, String> {
    let (user, rest) = match uri.find('@') {
        Some(i) => {
            let info = &uri[..i];
            let name = info.split(';').next().unwrap_or_default();
            if name.is_empty() {
                return Err("empty user name".into());
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
            return Err("a path is not allowed".into());
        }
    }
    Ok(Hop { user, host, port })
}

/// `host[:port]` or `[host]:port`.
pub(super) fn split_host_port(s: &str) -> Result<(String, Option<u16>), String> {
    let (host_part, after) = split_delim(s, false)?;
    let host = clean_host(host_part);
    if host_part.is_empty() {
        return Err("empty host".into());
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
fn split_delim(s: &str, slash: bool) -> Result<HostAndRest<'_>, String> {
    let end = if s.starts_with('[') {
        s.find(']').map(|i| i + 1).ok_or("unclosed '['")?
    } else {
        s.find([':', '/']).unwrap_or(s.len())
    };
    let (host, rest) = s.split_at(end);
    match rest.chars().next() {
        None => Ok((host, None)),
        Some(c @ ':') => Ok((host, Some((c, &rest[1..])))),
        Some(c @ '/') if slash => Ok((host, Some((c, &rest[1..])))),
        Some(_) => Err(format!("unexpected {rest:?} after the host")),
    }
}

fn clean_host(h: &str) -> String {
    match h.strip_prefix('[').and_then(|x| x.strip_suffix(']')) {
        Some(inner) => inner.to_string(),
        None => h.to_string(),
    }
}

fn port_number(p: &str) -> Result<u16, String> {
    match super::parse::port(p) {
        Some(n) => Ok(n),
        None => Err(format!("bad port {p:?}")),
    }
}

fn valid_domain(name: &str) -> Result<(), String> {
    let first = name.bytes().next().ok_or("empty host")?;
    if !first.is_ascii_alphanumeric() {
        return Err(format!("host {name:?} starts with an invalid character"));
    }
    if name.contains("..") {
        return Err(format!("host {name:?} has consecutive dots"));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'_')
    {
        return Err(format!("host {name:?} has invalid characters"));
    }
    Ok(())
}

fn url_decode(s: &str) -> Result<String, String> {
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
                    .ok_or_else(|| format!("bad %-escape in {s:?}"))?;
                out.push(hex);
                i += 3;
            }
            b'/' => return Err(format!("'/' in user name {s:?}")),
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| format!("user name {s:?} is not UTF-8"))
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
