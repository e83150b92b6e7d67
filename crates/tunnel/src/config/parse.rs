//! Reading config files into lines tunnel can evaluate: Host and Match
//! lines, Includes (already expanded into the files they name) and option
//! values, checked as OpenSSH checks them, whether or not their block will
//! apply (ssh refuses a bad value anywhere in the file).

use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use super::criteria::{self, Criterion};
use super::jump::{self, Jump, JumpError};
use super::lexer::{self, LexError, Split};
use super::tokens::{self, TokenError};
use super::{include, keywords, ConfigError, LineError, StrictHostKeyChecking};

/// Includes nest at most this deep (OpenSSH's READCONF_MAX_DEPTH).
const MAX_DEPTH: usize = 16;
/// At most this many UserKnownHostsFile/GlobalKnownHostsFile entries.
const MAX_HOSTS_FILES: usize = 32;

/// A bad Host or Match line or option value; shown after the line itself.
/// The texts follow readconf.c's, which users may search for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValueError {
    #[error(transparent)]
    Lex(#[from] LexError),
    #[error(transparent)]
    Match(#[from] criteria::ParseError),
    #[error(transparent)]
    Jump(#[from] JumpError),
    #[error("Host with an empty pattern")]
    EmptyHostPattern,
    #[error("Missing argument.")]
    MissingArgument,
    #[error("extra arguments at end of line")]
    ExtraArguments,
    #[error("Bad port '{0}'")]
    BadPort(String),
    /// A word the option does not take.
    #[error("unsupported option \"{0}\"")]
    Unsupported(String),
    #[error("unsupported option \"{0}\" (expected yes or no)")]
    NotYesNo(String),
    #[error("unsupported option \"{0}\" (expected yes, ask, accept-new, no or off)")]
    NotStrictHostKeyChecking(String),
    #[error("missing time value.")]
    MissingTime,
    #[error("invalid time value \"{0}\".")]
    BadTime(String),
    #[error("integer value \"{0}\" is invalid.")]
    BadInteger(String),
    /// IdentityAgent's `${VAR}` cannot be expanded.
    #[error("Invalid environment expansion {value}: {source}")]
    AgentExpansion { value: String, source: TokenError },
    /// IdentityAgent's `$NAME` is not a variable name.
    #[error("Invalid environment name {0}.")]
    AgentVariable(String),
    #[error("empty argument")]
    EmptyArgument,
    #[error("too many entries (at most {max})", max = MAX_HOSTS_FILES)]
    TooManyFiles,
    #[error("\"none\" argument must appear alone.")]
    NoneNotAlone,
    #[error("invalid domain name \"{0}\"")]
    BadDomain(String),
    #[error("Invalid permitted CNAME \"{0}\"")]
    BadCname(String),
}

/// The parsed config: the files `ssh` would read, in order.
#[derive(Debug, Clone, Default)]
pub struct SshConfig {
    pub(super) files: Vec<ConfigFile>,
}

#[derive(Debug, Clone)]
pub(super) struct ConfigFile {
    pub path: PathBuf,
    /// A user config (`~/.ssh/config`, `-F`, or included from one): relative
    /// Includes are in `~/.ssh`, and its IdentityFiles count as the user's.
    pub user_config: bool,
    pub lines: Vec<Line>,
}

#[derive(Debug, Clone)]
pub(super) struct Line {
    pub number: usize,
    pub item: Item,
}

#[derive(Debug, Clone)]
pub(super) enum Item {
    Host(Vec<String>),
    Match(Vec<Criterion>),
    /// The files an Include line named, each already parsed.
    Include(Vec<ConfigFile>),
    Set(Setting),
    /// A keyword OpenSSH does not know: an error unless IgnoreUnknown,
    /// as set when the line is reached, names it.
    Unknown(String),
    /// A keyword OpenSSH knows and tunnel has no use for.
    Ignored,
}

/// How hostname canonicalization is asked for (`CanonicalizeHostname`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Canonicalize {
    No,
    Yes,
    Always,
}

/// One option value that tunnel uses (or must refuse).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Setting {
    HostName(String),
    User(String),
    Port(u16),
    IdentityFile(String),
    IdentitiesOnly(bool),
    IdentityAgent(String),
    ProxyJump(Jump),
    ProxyCommand(String),
    StrictHostKeyChecking(StrictHostKeyChecking),
    UserKnownHostsFile(Vec<String>),
    GlobalKnownHostsFile(Vec<String>),
    HostKeyAlias(String),
    /// `None` is OpenSSH's `none`: it leaves the option unset.
    ServerAliveInterval(Option<u32>),
    ServerAliveCountMax(u32),
    ConnectTimeout(Option<u32>),
    PubkeyAuthentication(bool),
    PasswordAuthentication(bool),
    KbdInteractiveAuthentication(bool),
    HashKnownHosts(bool),
    CheckHostIp(bool),
    CanonicalizeHostname(Canonicalize),
    CanonicalDomains(Vec<String>),
    CanonicalizeMaxDots(u32),
    CanonicalizeFallbackLocal(bool),
    CanonicalizePermittedCnames(Vec<String>),
    KnownHostsCommand(String),
    RevokedHostKeys(String),
    IgnoreUnknown(String),
    /// An option that changes how ssh logs in or connects but that tunnel
    /// does not implement; it is reported when it applies.
    NotHonoured {
        option: &'static str,
        value: String,
    },
}

/// What `load` needs to know about where a file came from.
#[derive(Debug, Clone)]
pub(super) struct Source<'a> {
    pub path: &'a Path,
    pub user_config: bool,
    /// OpenSSH checks the owner and mode of ~/.ssh/config and of included
    /// files (not of a `-F` file or the system config).
    pub check_permissions: bool,
    /// A missing file is an error (`-F FILE`).
    pub required: bool,
}

/// Read and parse one top-level file; `None` if it is absent and optional.
pub(super) fn read_top(
    source: &Source<'_>,
    glob_home: &Path,
) -> Result<Option<ConfigFile>, ConfigError> {
    read_file(source, glob_home, 0)
}

fn read_file(
    source: &Source<'_>,
    glob_home: &Path,
    depth: usize,
) -> Result<Option<ConfigFile>, ConfigError> {
    let path = source.path;
    let text = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == ErrorKind::NotFound && !source.required => {
            tracing::debug!("no ssh config at {}", path.display());
            return Ok(None);
        }
        // fopen(3) opens a directory; reading it gives nothing.
        Err(e) if e.kind() == ErrorKind::IsADirectory => Vec::new(),
        Err(source_err) => {
            return Err(ConfigError::Read {
                path: path.to_path_buf(),
                source: source_err,
            })
        }
    };
    if source.check_permissions {
        let meta = std::fs::metadata(path).map_err(|e| ConfigError::Read {
            path: path.to_path_buf(),
            source: e,
        })?;
        include::check_permissions(path, &meta).map_err(|e| ConfigError::Syntax {
            path: path.to_path_buf(),
            line: 0,
            problem: Box::new(e.into()),
        })?;
    }
    tracing::debug!("reading ssh config {}", path.display());
    let text = String::from_utf8_lossy(&text);
    let mut lines = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let number = i + 1;
        let syntax = |problem: LineError| ConfigError::Syntax {
            path: path.to_path_buf(),
            line: number,
            problem: Box::new(problem),
        };
        let Some(split) = lexer::split_line(raw).map_err(|e| syntax(e.into()))? else {
            continue;
        };
        let item = if split.keyword == "include" {
            Item::Include(read_includes(&split, source, glob_home, depth, number)?)
        } else {
            item(&split).map_err(|source| {
                syntax(LineError::Value {
                    line: raw.trim().to_string(),
                    source,
                })
            })?
        };
        lines.push(Line { number, item });
    }
    Ok(Some(ConfigFile {
        path: path.to_path_buf(),
        user_config: source.user_config,
        lines,
    }))
}

fn read_includes(
    split: &Split<'_>,
    source: &Source<'_>,
    glob_home: &Path,
    depth: usize,
    number: usize,
) -> Result<Vec<ConfigFile>, ConfigError> {
    let syntax = |problem: LineError| ConfigError::Syntax {
        path: source.path.to_path_buf(),
        line: number,
        problem: Box::new(problem),
    };
    if depth >= MAX_DEPTH {
        return Err(syntax(LineError::IncludeDepth { max: MAX_DEPTH }));
    }
    let mut files = Vec::new();
    for arg in lexer::argv_split(split.rest).map_err(|e| syntax(e.into()))? {
        if arg.is_empty() {
            return Err(syntax(LineError::EmptyInclude));
        }
        let found = include::files(&arg, source.user_config, glob_home);
        for path in found.map_err(|e| syntax(e.into()))? {
            let inner = Source {
                path: &path,
                user_config: source.user_config,
                check_permissions: true,
                required: false,
            };
            tracing::debug!(
                "{} line {number}: including {}",
                source.path.display(),
                path.display()
            );
            if let Some(f) = read_file(&inner, glob_home, depth + 1)? {
                files.push(f);
            }
        }
    }
    Ok(files)
}

/// One non-Include line.
fn item(split: &Split<'_>) -> Result<Item, ValueError> {
    let kw = split.keyword.as_str();
    match kw {
        "host" => {
            let patterns = lexer::argv_split(split.rest)?;
            if patterns.iter().any(String::is_empty) {
                return Err(ValueError::EmptyHostPattern);
            }
            Ok(Item::Host(patterns))
        }
        "match" => Ok(Item::Match(criteria::parse(split.rest)?)),
        _ => match setting(kw, split.rest)? {
            Some(s) => Ok(Item::Set(s)),
            None if keywords::ignored(kw) => Ok(Item::Ignored),
            None => Ok(Item::Unknown(kw.to_string())),
        },
    }
}

/// Parse the value of an option tunnel uses; `None` for other keywords.
fn setting(keyword: &str, rest: &str) -> Result<Option<Setting>, ValueError> {
    let args = || lexer::argv_split(rest);
    let s = match keyword {
        "hostname" => Setting::HostName(one(args()?)?),
        "user" => Setting::User(one(args()?)?),
        "port" => {
            let v = one(args()?)?;
            Setting::Port(port(&v).ok_or(ValueError::BadPort(v))?)
        }
        "identityfile" | "identityfile2" => Setting::IdentityFile(one(args()?)?),
        "identitiesonly" => Setting::IdentitiesOnly(flag(args()?)?),
        "identityagent" => Setting::IdentityAgent(identity_agent(one(args()?)?)?),
        "proxyjump" => Setting::ProxyJump(jump::parse(lexer::raw_value(rest))?),
        "proxycommand" => Setting::ProxyCommand(lexer::raw_value(rest).to_string()),
        "knownhostscommand" => Setting::KnownHostsCommand(lexer::raw_value(rest).to_string()),
        "stricthostkeychecking" => Setting::StrictHostKeyChecking(strict(args()?)?),
        "userknownhostsfile" => Setting::UserKnownHostsFile(file_list(args()?)?),
        "globalknownhostsfile" => Setting::GlobalKnownHostsFile(file_list(args()?)?),
        "hostkeyalias" => Setting::HostKeyAlias(one(args()?)?),
        "serveraliveinterval" | "protocolkeepalives" | "setuptimeout" => {
            Setting::ServerAliveInterval(time(args()?)?)
        }
        "serveralivecountmax" => Setting::ServerAliveCountMax(int(args()?)?),
        "connecttimeout" => Setting::ConnectTimeout(time(args()?)?),
        "pubkeyauthentication" | "dsaauthentication" => {
            let v = one(args()?)?;
            Setting::PubkeyAuthentication(
                match multistate(
                    &v,
                    &["true", "yes", "unbound", "host-bound"],
                    &["false", "no"],
                ) {
                    Some(b) => b,
                    None => return Err(ValueError::Unsupported(v)),
                },
            )
        }
        "passwordauthentication" => Setting::PasswordAuthentication(flag(args()?)?),
        "kbdinteractiveauthentication"
        | "challengeresponseauthentication"
        | "skeyauthentication"
        | "tisauthentication" => Setting::KbdInteractiveAuthentication(flag(args()?)?),
        "hashknownhosts" => Setting::HashKnownHosts(flag(args()?)?),
        "checkhostip" => Setting::CheckHostIp(flag(args()?)?),
        "canonicalizehostname" => {
            let v = one(args()?)?;
            Setting::CanonicalizeHostname(match v.to_ascii_lowercase().as_str() {
                "yes" | "true" => Canonicalize::Yes,
                "no" | "false" => Canonicalize::No,
                "always" => Canonicalize::Always,
                _ => return Err(ValueError::Unsupported(v)),
            })
        }
        "canonicaldomains" => Setting::CanonicalDomains(domains(args()?)?),
        "canonicalizemaxdots" => Setting::CanonicalizeMaxDots(int(args()?)?),
        "canonicalizefallbacklocal" => Setting::CanonicalizeFallbackLocal(flag(args()?)?),
        "canonicalizepermittedcnames" => Setting::CanonicalizePermittedCnames(cnames(args()?)?),
        "revokedhostkeys" => Setting::RevokedHostKeys(one(args()?)?),
        "ignoreunknown" => Setting::IgnoreUnknown(one(args()?)?),
        "certificatefile" => not_honoured("CertificateFile", one(args()?)?),
        "pkcs11provider" => not_honoured("PKCS11Provider", one(args()?)?),
        "securitykeyprovider" => not_honoured("SecurityKeyProvider", one(args()?)?),
        "addressfamily" => not_honoured("AddressFamily", one(args()?)?),
        "bindaddress" => not_honoured("BindAddress", one(args()?)?),
        "bindinterface" => not_honoured("BindInterface", one(args()?)?),
        _ => return Ok(None),
    };
    Ok(Some(s))
}

fn not_honoured(option: &'static str, value: String) -> Setting {
    Setting::NotHonoured { option, value }
}

/// Exactly one non-empty argument.
fn one(args: Vec<String>) -> Result<String, ValueError> {
    let mut it = args.into_iter();
    let first = it.next().filter(|a| !a.is_empty());
    let Some(first) = first else {
        return Err(ValueError::MissingArgument);
    };
    if it.next().is_some() {
        return Err(ValueError::ExtraArguments);
    }
    Ok(first)
}

fn multistate(v: &str, yes: &[&str], no: &[&str]) -> Option<bool> {
    if yes.iter().any(|y| v.eq_ignore_ascii_case(y)) {
        Some(true)
    } else if no.iter().any(|n| v.eq_ignore_ascii_case(n)) {
        Some(false)
    } else {
        None
    }
}

fn flag(args: Vec<String>) -> Result<bool, ValueError> {
    let v = one(args)?;
    multistate(&v, &["yes", "true"], &["no", "false"]).ok_or(ValueError::NotYesNo(v))
}

fn strict(args: Vec<String>) -> Result<StrictHostKeyChecking, ValueError> {
    let v = one(args)?;
    Ok(match v.to_ascii_lowercase().as_str() {
        "yes" | "true" => StrictHostKeyChecking::Yes,
        "ask" => StrictHostKeyChecking::Ask,
        "accept-new" => StrictHostKeyChecking::AcceptNew,
        "no" | "off" | "false" => StrictHostKeyChecking::No,
        _ => return Err(ValueError::NotStrictHostKeyChecking(v)),
    })
}

/// A port number (1-65535) or a TCP service name from /etc/services, as
/// OpenSSH's `a2port`; `None` if neither.
pub(super) fn port(s: &str) -> Option<u16> {
    if let Ok(n) = s.strip_prefix('+').unwrap_or(s).parse::<u32>() {
        return u16::try_from(n).ok().filter(|&p| p > 0);
    }
    if s.starts_with('-') && s[1..].bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    service_port(
        s,
        &std::fs::read_to_string("/etc/services").unwrap_or_default(),
    )
}

fn service_port(name: &str, services: &str) -> Option<u16> {
    services.lines().find_map(|line| {
        let line = line.split('#').next().unwrap_or_default();
        let mut fields = line.split_whitespace();
        let service = fields.next()?;
        let (port, proto) = fields.next()?.split_once('/')?;
        if proto != "tcp" || !(service == name || fields.any(|alias| alias == name)) {
            return None;
        }
        port.parse::<u16>().ok().filter(|&p| p > 0)
    })
}

/// A time in seconds (`90`, `1m30s`, `2h`...), or `None` for `none`.
fn time(args: Vec<String>) -> Result<Option<u32>, ValueError> {
    let v = one(args).map_err(|_| ValueError::MissingTime)?;
    if v == "none" {
        return Ok(None);
    }
    match convtime(&v) {
        Some(t) => Ok(Some(t)),
        None => Err(ValueError::BadTime(v)),
    }
}

/// OpenSSH's `convtime`.
fn convtime(s: &str) -> Option<u32> {
    let max = i32::MAX as u64;
    let mut total: u64 = 0;
    let mut rest = s;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return None;
        }
        let n: u64 = rest[..digits].parse().ok().filter(|&n| n <= max)?;
        rest = &rest[digits..];
        let mult = match rest.bytes().next() {
            None => 1,
            Some(c) => {
                rest = &rest[1..];
                match c {
                    b's' | b'S' => 1,
                    b'm' | b'M' => 60,
                    b'h' | b'H' => 3600,
                    b'd' | b'D' => 86400,
                    b'w' | b'W' => 604800,
                    _ => return None,
                }
            }
        };
        total = total.checked_add(n.checked_mul(mult).filter(|&v| v <= max)?)?;
        if total > max {
            return None;
        }
    }
    u32::try_from(total).ok()
}

/// A non-negative integer (OpenSSH: 0 to INT_MAX).
fn int(args: Vec<String>) -> Result<u32, ValueError> {
    let v = one(args)?;
    let n = v
        .strip_prefix('+')
        .unwrap_or(&v)
        .parse::<u32>()
        .ok()
        .filter(|&n| n <= i32::MAX as u32);
    n.ok_or(ValueError::BadInteger(v))
}

/// IdentityAgent is checked when read: `${VAR}` must be set and `$NAME`
/// must be a valid name.
fn identity_agent(v: String) -> Result<String, ValueError> {
    if let Err(source) = tokens::dollar(&v) {
        return Err(ValueError::AgentExpansion { value: v, source });
    }
    if let Some(name) = v.strip_prefix('$') {
        if !name.starts_with('{') && !tokens::valid_env_name(name) {
            return Err(ValueError::AgentVariable(v));
        }
    }
    Ok(v)
}

/// UserKnownHostsFile/GlobalKnownHostsFile: files, or `none` alone.
fn file_list(args: Vec<String>) -> Result<Vec<String>, ValueError> {
    if args.is_empty() {
        return Err(ValueError::MissingArgument);
    }
    none_alone(&args)?;
    if args.iter().any(String::is_empty) {
        return Err(ValueError::EmptyArgument);
    }
    if args.len() > MAX_HOSTS_FILES {
        return Err(ValueError::TooManyFiles);
    }
    Ok(args)
}

fn none_alone(args: &[String]) -> Result<(), ValueError> {
    if args.len() > 1 && args.iter().any(|a| a.eq_ignore_ascii_case("none")) {
        return Err(ValueError::NoneNotAlone);
    }
    Ok(())
}

fn domains(args: Vec<String>) -> Result<Vec<String>, ValueError> {
    none_alone(&args)?;
    args.into_iter()
        .map(|d| {
            let lower = d.to_ascii_lowercase();
            let ok = lower
                .bytes()
                .next()
                .is_some_and(|b| b.is_ascii_alphanumeric())
                && !lower.contains("..")
                && lower
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'_');
            if !ok {
                return Err(ValueError::BadDomain(d));
            }
            Ok(lower.strip_suffix('.').unwrap_or(&lower).to_string())
        })
        .collect()
}

fn cnames(args: Vec<String>) -> Result<Vec<String>, ValueError> {
    none_alone(&args)?;
    for a in &args {
        let ok = a.eq_ignore_ascii_case("none")
            || a == "*"
            || a.split_once(':').is_some_and(|(_, to)| !to.is_empty());
        if !ok {
            return Err(ValueError::BadCname(a.clone()));
        }
    }
    Ok(args.into_iter().map(|a| a.to_ascii_lowercase()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(line: &str) -> Result<Option<Setting>, ValueError> {
        let split = lexer::split_line(line)?.expect("not blank");
        setting(&split.keyword, split.rest)
    }

    #[test]
    fn values_as_openssh_reads_them() {
        assert_eq!(set("Port 2222"), Ok(Some(Setting::Port(2222))));
        assert_eq!(set("Port ssh"), Ok(Some(Setting::Port(22))));
        assert!(set("Port 0").is_err());
        assert!(set("Port 65536").is_err());
        assert!(set("Port 22 23").is_err());
        assert_eq!(
            set("ConnectTimeout 1m30s"),
            Ok(Some(Setting::ConnectTimeout(Some(90))))
        );
        assert_eq!(
            set("ConnectTimeout none"),
            Ok(Some(Setting::ConnectTimeout(None)))
        );
        assert!(set("ConnectTimeout 5x").is_err());
        assert!(set("ConnectTimeout -1").is_err());
        assert_eq!(
            set("SetupTimeOut 7"),
            Ok(Some(Setting::ServerAliveInterval(Some(7)))),
            "Debian's alias"
        );
        assert_eq!(
            set("IdentitiesOnly TRUE"),
            Ok(Some(Setting::IdentitiesOnly(true)))
        );
        assert!(set("IdentitiesOnly maybe").is_err());
        assert_eq!(
            set("StrictHostKeyChecking off"),
            Ok(Some(Setting::StrictHostKeyChecking(
                StrictHostKeyChecking::No
            )))
        );
        assert_eq!(
            set("UserKnownHostsFile ~/a \"/b c\""),
            Ok(Some(Setting::UserKnownHostsFile(vec![
                "~/a".into(),
                "/b c".into()
            ])))
        );
        assert!(set("UserKnownHostsFile none /x").is_err());
        assert_eq!(
            set("ChallengeResponseAuthentication no"),
            Ok(Some(Setting::KbdInteractiveAuthentication(false)))
        );
        assert_eq!(
            set("ProxyCommand = nc %h %p"),
            Ok(Some(Setting::ProxyCommand("nc %h %p".into())))
        );
        assert!(set("ProxyJump a,h:port").is_err());
        assert_eq!(set("ForwardAgent yes"), Ok(None));
        assert!(set("IdentityAgent ${TUNNEL_PARSE_TEST_UNSET}").is_err());
        assert!(set("IdentityAgent $BAD-NAME").is_err());
        assert_eq!(
            set("IdentityAgent $SSH_AUTH_SOCK"),
            Ok(Some(Setting::IdentityAgent("$SSH_AUTH_SOCK".into())))
        );
        assert_eq!(
            set("CanonicalDomains Example.COM."),
            Ok(Some(Setting::CanonicalDomains(vec!["example.com".into()])))
        );
        assert!(set("CanonicalizePermittedCNAMEs bad").is_err());
    }

    /// The texts users see after "FILE line N: LINE: " (readconf.c's words).
    #[test]
    fn value_error_texts() {
        let text = |line: &str| {
            let split = lexer::split_line(line).expect("splits").expect("line");
            item(&split).expect_err("refused").to_string()
        };
        for (line, want) in [
            ("Host \"\"", "Host with an empty pattern"),
            ("Host \"a", "invalid quotes"),
            ("Match bogus", "Unsupported Match attribute bogus"),
            ("ProxyJump h:0", "hop \"h:0\": bad port \"0\""),
            ("HostName a b", "extra arguments at end of line"),
            ("HostName \"\"", "Missing argument."),
            ("Port 0", "Bad port '0'"),
            ("PubkeyAuthentication maybe", "unsupported option \"maybe\""),
            ("CanonicalizeHostname maybe", "unsupported option \"maybe\""),
            (
                "IdentitiesOnly maybe",
                "unsupported option \"maybe\" (expected yes or no)",
            ),
            (
                "StrictHostKeyChecking maybe",
                "unsupported option \"maybe\" (expected yes, ask, accept-new, no or off)",
            ),
            ("ConnectTimeout \"\"", "missing time value."),
            ("ConnectTimeout 5x", "invalid time value \"5x\"."),
            ("ServerAliveCountMax -1", "integer value \"-1\" is invalid."),
            (
                "IdentityAgent ${TUNNEL_PARSE_TEST_UNSET}",
                "Invalid environment expansion ${TUNNEL_PARSE_TEST_UNSET}: \
                 environment variable ${TUNNEL_PARSE_TEST_UNSET} is not set",
            ),
            (
                "IdentityAgent $BAD-NAME",
                "Invalid environment name $BAD-NAME.",
            ),
            ("UserKnownHostsFile a \"\"", "empty argument"),
            (
                "UserKnownHostsFile none /x",
                "\"none\" argument must appear alone.",
            ),
            ("CanonicalDomains -a", "invalid domain name \"-a\""),
            (
                "CanonicalizePermittedCNAMEs bad",
                "Invalid permitted CNAME \"bad\"",
            ),
        ] {
            assert_eq!(text(line), want, "{line}");
        }
        let many = format!("UserKnownHostsFile{}", " f".repeat(MAX_HOSTS_FILES + 1));
        assert_eq!(text(&many), "too many entries (at most 32)");
    }

    #[test]
    fn times() {
        assert_eq!(convtime("90"), Some(90));
        assert_eq!(convtime("1h30m"), Some(5400));
        assert_eq!(convtime("1w"), Some(604800));
        assert_eq!(convtime("0"), Some(0));
        assert_eq!(convtime("m"), None);
        assert_eq!(convtime("5q"), None);
        assert_eq!(convtime("99999999999"), None);
    }

    #[test]
    fn services() {
        let db = "ssh\t\t22/tcp\t\t\t# SSH Remote Login Protocol\nhttp 80/tcp www\nfoo 99/udp\n";
        assert_eq!(service_port("ssh", db), Some(22));
        assert_eq!(service_port("www", db), Some(80));
        assert_eq!(service_port("foo", db), None);
    }

    #[test]
    fn items_and_unknown_keywords() {
        let split = lexer::split_line("Bogus yes").expect("ok").expect("line");
        assert!(matches!(item(&split), Ok(Item::Unknown(k)) if k == "bogus"));
        let split = lexer::split_line("SendEnv LANG")
            .expect("ok")
            .expect("line");
        assert!(matches!(item(&split), Ok(Item::Ignored)));
        let split = lexer::split_line("Host \"\"").expect("ok").expect("line");
        assert!(item(&split).is_err());
    }
}
