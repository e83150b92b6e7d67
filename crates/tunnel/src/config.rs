//! Resolution of a host alias the way `ssh` resolves it from its config files.
//!
//! Parsing (Host patterns, negation, Include) is done by `ssh2-config`; this
//! module turns its output into a [`Target`]: everything the connection needs,
//! with OpenSSH's defaults filled in and `~`, `%`-tokens and `${VAR}` expanded.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ssh2_config::{ParseRule, SshConfig};

use crate::exit::{Exit, HasExit};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read ssh config {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot parse ssh config {}: {source}", path.display())]
    Parse {
        path: PathBuf,
        source: ssh2_config::SshParserError,
    },
    #[error("ssh config option {option} {value:?}: {reason}")]
    Invalid {
        option: &'static str,
        value: String,
        reason: String,
    },
    #[error(
        "host {alias} uses {option} {value}, which this version of tunnel does not support yet; \
         use ProxyJump (or -J) for jump hosts"
    )]
    Unsupported {
        alias: String,
        option: &'static str,
        value: String,
    },
    #[error("empty host name")]
    EmptyHost,
    #[error("no home directory found (set HOME)")]
    NoHome,
}

impl HasExit for ConfigError {
    fn exit(&self) -> Exit {
        match self {
            ConfigError::EmptyHost => Exit::Usage,
            _ => Exit::Config,
        }
    }
}

/// How unknown host keys are treated (`StrictHostKeyChecking`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StrictHostKeyChecking {
    /// Never accept an unknown key.
    Yes,
    /// Ask the user (refuse when there is no terminal). OpenSSH's default.
    Ask,
    /// Accept and record unknown keys.
    AcceptNew,
    /// OpenSSH's `no`: accept and record unknown keys. A changed key is still
    /// refused here, unlike OpenSSH.
    No,
}

/// Where to find the ssh agent (`IdentityAgent`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentSocket {
    /// `$SSH_AUTH_SOCK`, if set.
    Env,
    Path(PathBuf),
    Disabled,
}

/// Everything needed to reach one host, as resolved from the ssh config.
#[derive(Debug, Clone)]
pub struct Target {
    /// The name the user typed (lowercased, as ssh does), without `user@`.
    pub alias: String,
    pub host_name: String,
    pub port: u16,
    pub user: String,
    /// True when a `Host` block other than a bare `*` matched the alias, or
    /// the user gave HostName/Port explicitly: the alias is "known".
    pub configured: bool,
    pub identity_files: Vec<PathBuf>,
    /// Whether `identity_files` came from the config (else OpenSSH's defaults).
    pub identity_files_explicit: bool,
    pub identities_only: bool,
    pub identity_agent: AgentSocket,
    pub pubkey_authentication: bool,
    pub password_authentication: bool,
    /// KbdInteractiveAuthentication (or its old name,
    /// ChallengeResponseAuthentication): 2FA prompts.
    pub kbd_interactive_authentication: bool,
    pub user_known_hosts: Vec<PathBuf>,
    pub global_known_hosts: Vec<PathBuf>,
    pub strict_host_key_checking: StrictHostKeyChecking,
    pub hash_known_hosts: bool,
    pub host_key_alias: Option<String>,
    pub connect_timeout: Option<Duration>,
    pub server_alive_interval: Option<Duration>,
    pub server_alive_count_max: usize,
    /// ProxyJump hops as written (`[user@]host[:port]`), empty for none.
    pub proxy_jump: Vec<String>,
}

impl Target {
    /// The name under which the host key is looked up and recorded, in
    /// known_hosts syntax (`host` or `[host]:port`). A HostKeyAlias is used
    /// as is, without the port, as OpenSSH does: it exists to name a host
    /// reached through a forward or on a shared address.
    pub fn known_hosts_name(&self) -> String {
        if let Some(alias) = &self.host_key_alias {
            return alias.clone();
        }
        if self.port == 22 {
            self.host_name.clone()
        } else {
            format!("[{}]:{}", self.host_name, self.port)
        }
    }
}

/// Which config files to read.
#[derive(Debug, Clone)]
pub struct Sources {
    /// Files in precedence order (first value obtained wins, as in ssh).
    pub files: Vec<PathBuf>,
    /// `-F` was given: a missing file is an error.
    pub explicit: bool,
}

impl Sources {
    /// `-F FILE`, else `~/.ssh/config` then `/etc/ssh/ssh_config`.
    pub fn new(explicit: Option<&Path>, home: &Path) -> Self {
        match explicit {
            Some(p) => Sources {
                files: vec![p.to_path_buf()],
                explicit: true,
            },
            None => Sources {
                files: vec![
                    home.join(".ssh").join("config"),
                    PathBuf::from("/etc/ssh/ssh_config"),
                ],
                explicit: false,
            },
        }
    }
}

/// Local facts that `%`-tokens and defaults expand to.
#[derive(Debug, Clone)]
pub struct LocalUser {
    pub home: PathBuf,
    pub name: String,
    pub uid: u32,
}

impl LocalUser {
    pub fn current() -> Result<Self, ConfigError> {
        let home = dirs::home_dir().ok_or(ConfigError::NoHome)?;
        let uid = nix::unistd::getuid();
        let name = std::env::var("USER")
            .ok()
            .filter(|u| !u.is_empty())
            .or_else(|| {
                nix::unistd::User::from_uid(uid)
                    .ok()
                    .flatten()
                    .map(|u| u.name)
            })
            .unwrap_or_else(|| uid.to_string());
        Ok(LocalUser {
            home,
            name,
            uid: uid.as_raw(),
        })
    }
}

/// Read and parse the config files.
pub fn load(sources: &Sources, local: &LocalUser) -> Result<SshConfig, ConfigError> {
    let mut config = SshConfig::default().home_dir(&local.home);
    let rules = ParseRule::ALLOW_UNKNOWN_FIELDS | ParseRule::ALLOW_UNSUPPORTED_FIELDS;
    for path in &sources.files {
        let file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !sources.explicit => {
                tracing::debug!("no ssh config at {}", path.display());
                continue;
            }
            Err(source) => {
                return Err(ConfigError::Read {
                    path: path.clone(),
                    source,
                })
            }
        };
        tracing::debug!("reading ssh config {}", path.display());
        config = config
            .parse(&mut BufReader::new(file), rules)
            .map_err(|source| ConfigError::Parse {
                path: path.clone(),
                source,
            })?;
    }
    Ok(config)
}

/// Resolve against an already parsed config (unit tests use this directly).
pub fn resolve_in(
    config: &SshConfig,
    host_arg: &str,
    local: &LocalUser,
) -> Result<Target, ConfigError> {
    let (cli_user, host) = match host_arg.rsplit_once('@') {
        Some((u, h)) => (Some(u.to_string()), h),
        None => (None, host_arg),
    };
    if host.is_empty() {
        return Err(ConfigError::EmptyHost);
    }
    // ssh lowercases the host name before matching Host patterns.
    let alias = host.to_ascii_lowercase();
    let params = config.query(&alias);
    let extra = &params.unsupported_fields;

    if params
        .ignored_fields
        .keys()
        .any(|k| k.eq_ignore_ascii_case("match"))
    {
        tracing::warn!(
            "the ssh config has a Match block; tunnel does not evaluate Match, \
             so its options may be applied as if they belonged to the Host block above it"
        );
    }

    let configured = config
        .get_hosts()
        .iter()
        .any(|h| h.intersects(&alias) && h.pattern.iter().any(|c| !c.negated && c.pattern != "*"));

    let port = params.port.unwrap_or(22);
    let user = cli_user
        .or_else(|| params.user.clone())
        .unwrap_or_else(|| local.name.clone());
    let host_name = match &params.host_name {
        Some(h) => expand_tokens(h, "HostName", &Tokens::hostname_only(&alias))?,
        None => alias.clone(),
    };

    if let Some(v) = extra.get("proxycommand").map(|v| v.join(" ")) {
        if !v.eq_ignore_ascii_case("none") && !v.is_empty() {
            return Err(ConfigError::Unsupported {
                alias,
                option: "ProxyCommand",
                value: v,
            });
        }
    }
    let proxy_jump = jump_list(params.proxy_jump.as_deref().unwrap_or_default());

    let tokens = Tokens {
        home: local.home.to_string_lossy().into_owned(),
        local_user: local.name.clone(),
        uid: local.uid.to_string(),
        host: host_name.clone(),
        alias: alias.clone(),
        user: user.clone(),
        port: port.to_string(),
    };
    let path = |raw: &str, option: &'static str| -> Result<PathBuf, ConfigError> {
        let expanded = expand_tokens(raw, option, &tokens)?;
        let expanded = expand_env(&expanded, option)?;
        Ok(expand_tilde(&expanded, &local.home))
    };

    let (identity_files, identity_files_explicit) = match &params.identity_file {
        Some(files) if !files.is_empty() => (
            files
                .iter()
                .map(|f| path(&f.to_string_lossy(), "IdentityFile"))
                .collect::<Result<Vec<_>, _>>()?,
            true,
        ),
        _ => (
            [
                "id_rsa",
                "id_ecdsa",
                "id_ecdsa_sk",
                "id_ed25519",
                "id_ed25519_sk",
            ]
            .iter()
            .map(|n| local.home.join(".ssh").join(n))
            .collect(),
            false,
        ),
    };

    let identity_agent = match first(extra, "identityagent") {
        None => AgentSocket::Env,
        Some(v) if v.eq_ignore_ascii_case("none") => AgentSocket::Disabled,
        Some(v) if v == "SSH_AUTH_SOCK" => AgentSocket::Env,
        Some(v) => {
            // `IdentityAgent $VAR` names an environment variable holding the socket.
            if let Some(var) = v.strip_prefix('$') {
                match std::env::var(var) {
                    Ok(p) => AgentSocket::Path(PathBuf::from(p)),
                    Err(_) => AgentSocket::Disabled,
                }
            } else {
                AgentSocket::Path(path(&v, "IdentityAgent")?)
            }
        }
    };

    let known_hosts_list =
        |key: &str, option: &'static str, default: &[PathBuf]| match extra.get(key) {
            None => Ok(default.to_vec()),
            Some(values) if values.len() == 1 && values[0].eq_ignore_ascii_case("none") => {
                Ok(Vec::new())
            }
            Some(values) => values.iter().map(|v| path(v, option)).collect(),
        };
    let user_known_hosts = known_hosts_list(
        "userknownhostsfile",
        "UserKnownHostsFile",
        &[
            local.home.join(".ssh/known_hosts"),
            local.home.join(".ssh/known_hosts2"),
        ],
    )?;
    let global_known_hosts = known_hosts_list(
        "globalknownhostsfile",
        "GlobalKnownHostsFile",
        &[
            PathBuf::from("/etc/ssh/ssh_known_hosts"),
            PathBuf::from("/etc/ssh/ssh_known_hosts2"),
        ],
    )?;

    let strict_host_key_checking = match first(extra, "stricthostkeychecking") {
        None => StrictHostKeyChecking::Ask,
        Some(v) => match v.to_ascii_lowercase().as_str() {
            "yes" | "true" => StrictHostKeyChecking::Yes,
            "ask" => StrictHostKeyChecking::Ask,
            "accept-new" => StrictHostKeyChecking::AcceptNew,
            "no" | "off" | "false" => StrictHostKeyChecking::No,
            _ => {
                return Err(ConfigError::Invalid {
                    option: "StrictHostKeyChecking",
                    value: v,
                    reason: "expected yes, ask, accept-new, no or off".into(),
                })
            }
        },
    };

    let server_alive_count_max = match first(extra, "serveralivecountmax") {
        None => 3,
        Some(v) => v.parse().map_err(|_| ConfigError::Invalid {
            option: "ServerAliveCountMax",
            value: v.clone(),
            reason: "expected a number".into(),
        })?,
    };

    Ok(Target {
        configured: configured || params.host_name.is_some(),
        alias,
        host_name,
        port,
        user,
        identity_files,
        identity_files_explicit,
        identities_only: yes_no(extra, "identitiesonly", "IdentitiesOnly")?.unwrap_or(false),
        identity_agent,
        pubkey_authentication: params.pubkey_authentication.unwrap_or(true),
        password_authentication: yes_no(extra, "passwordauthentication", "PasswordAuthentication")?
            .unwrap_or(true),
        kbd_interactive_authentication: match yes_no(
            extra,
            "kbdinteractiveauthentication",
            "KbdInteractiveAuthentication",
        )? {
            Some(v) => v,
            None => yes_no(
                extra,
                "challengeresponseauthentication",
                "ChallengeResponseAuthentication",
            )?
            .unwrap_or(true),
        },
        user_known_hosts,
        global_known_hosts,
        strict_host_key_checking,
        hash_known_hosts: yes_no(extra, "hashknownhosts", "HashKnownHosts")?.unwrap_or(false),
        host_key_alias: first(extra, "hostkeyalias"),
        connect_timeout: params.connect_timeout.filter(|d| !d.is_zero()),
        server_alive_interval: params.server_alive_interval.filter(|d| !d.is_zero()),
        server_alive_count_max,
        proxy_jump,
    })
}

/// The SSH target for a SLURM compute node reached through the login node
/// `login` (`tunnel up --slurm`). A node with its own `Host` block is resolved
/// as any host, except that it is logged into as the login node's user when
/// the block names no User (cluster accounts are the same on every node).
/// A node the config does not name inherits the login node's settings (keys,
/// known hosts, timeouts) with port 22: that is what `ssh node` typed on the
/// login node would use, and nodes rarely appear in a laptop's config.
pub fn resolve_node(
    config: &SshConfig,
    node: &str,
    local: &LocalUser,
    login: &Target,
) -> Result<Target, ConfigError> {
    let alias = node.to_ascii_lowercase();
    let mut target = resolve_in(config, &alias, local)?;
    if !target.configured {
        return Ok(Target {
            alias: alias.clone(),
            host_name: alias,
            port: 22,
            configured: false,
            host_key_alias: None,
            proxy_jump: Vec::new(),
            ..login.clone()
        });
    }
    if config.query(&alias).user.is_none() {
        target.user = login.user.clone();
    }
    // The node is always reached through the login node.
    target.proxy_jump.clear();
    Ok(target)
}

/// ProxyJump/`-J` values: comma-separated hops; `none` means no jump.
pub fn jump_list<S: AsRef<str>>(values: &[S]) -> Vec<String> {
    let hops: Vec<String> = values
        .iter()
        .flat_map(|v| v.as_ref().split(','))
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .collect();
    if hops.first().is_some_and(|h| h.eq_ignore_ascii_case("none")) {
        Vec::new()
    } else {
        hops
    }
}

/// One ProxyJump hop: `[ssh://][user@]host[:port]` into (`[user@]host`, port).
fn split_hop(hop: &str) -> Result<(String, Option<u16>), ConfigError> {
    let bad = |reason: &str| ConfigError::Invalid {
        option: "ProxyJump",
        value: hop.to_string(),
        reason: reason.to_string(),
    };
    let spec = hop.strip_prefix("ssh://").unwrap_or(hop);
    let (user, rest) = match spec.rsplit_once('@') {
        Some((u, r)) => (Some(u), r),
        None => (None, spec),
    };
    let (host, port) = if let Some(inner) = rest.strip_prefix('[') {
        // [v6addr]:port
        let (h, after) = inner.split_once(']').ok_or_else(|| bad("unclosed '['"))?;
        (h, after.strip_prefix(':'))
    } else {
        match rest.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (rest, None),
        }
    };
    let port = match port {
        Some(p) => Some(
            p.parse::<u16>()
                .map_err(|_| bad("the port is not a number"))?,
        ),
        None => None,
    };
    if host.is_empty() {
        return Err(bad("empty host"));
    }
    let name = match user {
        Some(u) => format!("{u}@{host}"),
        None => host.to_string(),
    };
    Ok((name, port))
}

/// Longest route accepted (ssh has no limit; a loop in the config must end).
const MAX_HOPS: usize = 16;

/// The hops to go through, in order, then the target itself. `cli_jump`
/// (`-J`) replaces the target's ProxyJump. Each hop is resolved as its own
/// host (its User, Port, IdentityFile, known hosts, HostKeyAlias...); a
/// hop's own ProxyJump is followed too, as ssh does.
pub fn resolve_route(
    config: &SshConfig,
    host_arg: &str,
    local: &LocalUser,
    cli_jump: Option<&str>,
) -> Result<Vec<Target>, ConfigError> {
    let target = resolve_in(config, host_arg, local)?;
    let hops = match cli_jump {
        Some(j) => jump_list(&[j]),
        None => target.proxy_jump.clone(),
    };
    let mut route = Vec::new();
    for hop in &hops {
        route.extend(resolve_hop(config, hop, local, 1)?);
    }
    route.push(target);
    Ok(route)
}

fn resolve_hop(
    config: &SshConfig,
    hop: &str,
    local: &LocalUser,
    depth: usize,
) -> Result<Vec<Target>, ConfigError> {
    if depth > MAX_HOPS {
        return Err(ConfigError::Invalid {
            option: "ProxyJump",
            value: hop.to_string(),
            reason: format!("more than {MAX_HOPS} hops (a ProxyJump loop?)"),
        });
    }
    let (name, port) = split_hop(hop)?;
    let mut t = resolve_in(config, &name, local)?;
    if let Some(p) = port {
        t.port = p;
    }
    let mut route = Vec::new();
    for inner in t.proxy_jump.clone() {
        route.extend(resolve_hop(config, &inner, local, depth + 1)?);
    }
    route.push(t);
    Ok(route)
}

fn first(map: &HashMap<String, Vec<String>>, key: &str) -> Option<String> {
    map.get(key).and_then(|v| v.first()).cloned()
}

fn yes_no(
    map: &HashMap<String, Vec<String>>,
    key: &str,
    option: &'static str,
) -> Result<Option<bool>, ConfigError> {
    match first(map, key) {
        None => Ok(None),
        Some(v) => match v.to_ascii_lowercase().as_str() {
            "yes" | "true" => Ok(Some(true)),
            "no" | "false" => Ok(Some(false)),
            _ => Err(ConfigError::Invalid {
                option,
                value: v,
                reason: "expected yes or no".into(),
            }),
        },
    }
}

/// Values for ssh_config's `%` tokens.
struct Tokens {
    home: String,
    local_user: String,
    uid: String,
    host: String,
    alias: String,
    user: String,
    port: String,
}

impl Tokens {
    /// HostName may only use `%h` (the alias) and `%%`.
    fn hostname_only(alias: &str) -> Self {
        Tokens {
            home: String::new(),
            local_user: String::new(),
            uid: String::new(),
            host: alias.to_string(),
            alias: alias.to_string(),
            user: String::new(),
            port: String::new(),
        }
    }
}

fn expand_tokens(raw: &str, option: &'static str, t: &Tokens) -> Result<String, ConfigError> {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let value = match chars.next() {
            Some('%') => "%",
            Some('d') => &t.home,
            Some('u') => &t.local_user,
            Some('i') => &t.uid,
            Some('h') => &t.host,
            Some('n') => &t.alias,
            Some('r') => &t.user,
            Some('p') => &t.port,
            other => {
                return Err(ConfigError::Invalid {
                    option,
                    value: raw.to_string(),
                    reason: match other {
                        Some(c) => format!("unsupported token %{c}"),
                        None => "dangling %".into(),
                    },
                })
            }
        };
        out.push_str(value);
    }
    Ok(out)
}

/// `${VAR}` expansion, as OpenSSH does for file options.
fn expand_env(raw: &str, option: &'static str) -> Result<String, ConfigError> {
    let mut out = String::with_capacity(raw.len());
    let mut rest = raw;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find('}') else {
            return Err(ConfigError::Invalid {
                option,
                value: raw.to_string(),
                reason: "unterminated ${".into(),
            });
        };
        let name = &after[..end];
        let value = std::env::var(name).map_err(|_| ConfigError::Invalid {
            option,
            value: raw.to_string(),
            reason: format!("environment variable {name} is not set"),
        })?;
        out.push_str(&value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

fn expand_tilde(raw: &str, home: &Path) -> PathBuf {
    if raw == "~" {
        home.to_path_buf()
    } else if let Some(rest) = raw.strip_prefix("~/") {
        home.join(rest)
    } else {
        PathBuf::from(raw)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn local() -> LocalUser {
        LocalUser {
            home: PathBuf::from("/home/alice"),
            name: "alice".into(),
            uid: 1000,
        }
    }

    fn parse(text: &str) -> SshConfig {
        SshConfig::default()
            .home_dir("/home/alice")
            .parse(
                &mut text.as_bytes(),
                ParseRule::ALLOW_UNKNOWN_FIELDS | ParseRule::ALLOW_UNSUPPORTED_FIELDS,
            )
            .expect("test config parses")
    }

    const CONFIG: &str = "
Host gpu
    HostName gpu.example.org
    User bob
    Port 2222
    IdentityFile ~/.ssh/id_gpu
    IdentityFile %d/.ssh/%r@%h
    IdentityAgent none
    UserKnownHostsFile ~/.ssh/kh_a /etc/kh_b
    StrictHostKeyChecking accept-new
    ServerAliveInterval 15
    ServerAliveCountMax 4
    HostKeyAlias gpu-key

Host node-* !node-bad
    User carol
    HostName %h.cluster.local

Host *
    User fallback
    ConnectTimeout 7
";

    #[test]
    fn resolves_a_configured_alias() {
        let t = resolve_in(&parse(CONFIG), "gpu", &local()).expect("resolves");
        assert!(t.configured);
        assert_eq!(t.host_name, "gpu.example.org");
        assert_eq!(t.user, "bob");
        assert_eq!(t.port, 2222);
        assert_eq!(
            t.identity_files,
            vec![
                PathBuf::from("/home/alice/.ssh/id_gpu"),
                PathBuf::from("/home/alice/.ssh/bob@gpu.example.org")
            ]
        );
        assert!(t.identity_files_explicit);
        assert_eq!(t.identity_agent, AgentSocket::Disabled);
        assert_eq!(
            t.user_known_hosts,
            vec![
                PathBuf::from("/home/alice/.ssh/kh_a"),
                PathBuf::from("/etc/kh_b")
            ]
        );
        assert_eq!(t.strict_host_key_checking, StrictHostKeyChecking::AcceptNew);
        assert_eq!(t.server_alive_interval, Some(Duration::from_secs(15)));
        assert_eq!(t.server_alive_count_max, 4);
        assert_eq!(t.connect_timeout, Some(Duration::from_secs(7)));
        assert_eq!(t.known_hosts_name(), "gpu-key");
    }

    #[test]
    fn wildcards_negation_and_hostname_token() {
        let cfg = parse(CONFIG);
        let t = resolve_in(&cfg, "node-7", &local()).expect("resolves");
        assert!(t.configured);
        assert_eq!(t.user, "carol");
        assert_eq!(t.host_name, "node-7.cluster.local");
        assert_eq!(t.known_hosts_name(), "node-7.cluster.local");

        // Negated pattern: only `Host *` applies.
        let t = resolve_in(&cfg, "node-bad", &local()).expect("resolves");
        assert!(!t.configured);
        assert_eq!(t.user, "fallback");
        assert_eq!(t.host_name, "node-bad");
    }

    #[test]
    fn defaults_for_an_unknown_name() {
        let t = resolve_in(&parse(""), "Example.COM", &local()).expect("resolves");
        assert!(!t.configured);
        assert_eq!(t.alias, "example.com");
        assert_eq!(t.host_name, "example.com");
        assert_eq!(t.user, "alice");
        assert_eq!(t.port, 22);
        assert!(!t.identity_files_explicit);
        assert!(t
            .identity_files
            .contains(&PathBuf::from("/home/alice/.ssh/id_ed25519")));
        assert_eq!(t.identity_agent, AgentSocket::Env);
        assert_eq!(t.strict_host_key_checking, StrictHostKeyChecking::Ask);
        assert_eq!(
            t.user_known_hosts[0],
            PathBuf::from("/home/alice/.ssh/known_hosts")
        );
        assert_eq!(t.server_alive_interval, None);
    }

    #[test]
    fn user_at_host_overrides_config_user() {
        let t = resolve_in(&parse(CONFIG), "root@gpu", &local()).expect("resolves");
        assert_eq!(t.user, "root");
        assert_eq!(t.host_name, "gpu.example.org");
    }

    #[test]
    fn first_value_wins_like_ssh() {
        let t = resolve_in(
            &parse("Host a\n  Port 1\nHost a\n  Port 2\n  User u2\n"),
            "a",
            &local(),
        )
        .expect("resolves");
        assert_eq!(t.port, 1);
        assert_eq!(t.user, "u2");
    }

    #[test]
    fn proxy_jump_hops_resolve_each_as_its_own_host() {
        let cfg = parse(
            "Host j\n  ProxyJump alice@b1:2201,b2\nHost b1\n  HostName bastion1.example\n  \
             Port 22\nHost b2\n  User carol\n  HostKeyAlias b2-key\n  ProxyJump b0\n",
        );
        let route = resolve_route(&cfg, "j", &local(), None).expect("resolves");
        let names: Vec<(&str, &str, u16)> = route
            .iter()
            .map(|t| (t.user.as_str(), t.host_name.as_str(), t.port))
            .collect();
        assert_eq!(
            names,
            vec![
                ("alice", "bastion1.example", 2201),
                ("alice", "b0", 22),
                ("carol", "b2", 22),
                ("alice", "j", 22),
            ]
        );
        assert_eq!(route[2].known_hosts_name(), "b2-key");
        // -J replaces the configured jumps; `none` disables them.
        let route = resolve_route(&cfg, "j", &local(), Some("x:7")).expect("resolves");
        assert_eq!(route.len(), 2);
        assert_eq!((route[0].host_name.as_str(), route[0].port), ("x", 7));
        let route = resolve_route(&cfg, "j", &local(), Some("none")).expect("resolves");
        assert_eq!(route.len(), 1);
        // A loop ends with a clear error.
        let looped = parse("Host a\n  ProxyJump b\nHost b\n  ProxyJump a\n");
        let err = resolve_route(&looped, "a", &local(), None).expect_err("loop");
        assert!(err.to_string().contains("loop"), "{err}");
        assert_eq!(err.exit(), Exit::Config);
        let err = resolve_route(&cfg, "j", &local(), Some("h:port")).expect_err("bad port");
        assert!(err.to_string().contains("ProxyJump"), "{err}");
        // ProxyCommand is still refused.
        let err = resolve_in(&parse("Host p\n  ProxyCommand nc %h %p\n"), "p", &local())
            .expect_err("ProxyCommand unsupported");
        assert!(matches!(
            err,
            ConfigError::Unsupported {
                option: "ProxyCommand",
                ..
            }
        ));
    }

    #[test]
    fn slurm_nodes_resolve_through_their_block_or_inherit_the_login_node() {
        let cfg = parse(
            "Host login\n  HostName login.hpc.example\n  User a123\n  Port 2222\n  \
             IdentityFile ~/.ssh/hpc\n  ProxyJump gate\n\
             Host gpu*\n  Port 2200\n  ProxyJump elsewhere\n\
             Host cpu7\n  User other\n  HostName 10.0.0.7\n",
        );
        let login = resolve_in(&cfg, "login", &local()).expect("resolves");
        // Not in the config: the login node's user and keys, port 22, no jumps.
        let n = resolve_node(&cfg, "node042", &local(), &login).expect("resolves");
        assert_eq!(
            (
                n.alias.as_str(),
                n.host_name.as_str(),
                n.port,
                n.user.as_str()
            ),
            ("node042", "node042", 22, "a123")
        );
        assert_eq!(n.identity_files, login.identity_files);
        assert!(n.proxy_jump.is_empty());
        // A block without User: its options, the login node's user, still no jumps.
        let n = resolve_node(&cfg, "gpu01", &local(), &login).expect("resolves");
        assert_eq!((n.port, n.user.as_str()), (2200, "a123"));
        assert!(n.proxy_jump.is_empty());
        // A block with its own User wins.
        let n = resolve_node(&cfg, "CPU7", &local(), &login).expect("resolves");
        assert_eq!(
            (n.host_name.as_str(), n.user.as_str()),
            ("10.0.0.7", "other")
        );
    }

    #[test]
    fn bad_values_are_config_errors() {
        let err = resolve_in(
            &parse("Host x\n  StrictHostKeyChecking maybe\n"),
            "x",
            &local(),
        )
        .expect_err("invalid");
        assert!(err.to_string().contains("StrictHostKeyChecking"));
        let err = resolve_in(&parse("Host x\n  IdentityFile ~/%Q\n"), "x", &local())
            .expect_err("bad token");
        assert!(err.to_string().contains("%Q"));
    }

    #[test]
    fn include_and_explicit_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let inc = dir.path().join("inc.conf");
        std::fs::write(&inc, "Host inc\n  HostName 10.1.2.3\n  User incuser\n").expect("write");
        let main = dir.path().join("config");
        let mut f = File::create(&main).expect("create");
        writeln!(f, "Include {}\nHost other\n  Port 3\n", inc.display()).expect("write");
        let sources = Sources::new(Some(&main), Path::new("/home/alice"));
        let t = load(&sources, &local())
            .and_then(|c| resolve_in(&c, "inc", &local()))
            .expect("resolves");
        assert_eq!(t.host_name, "10.1.2.3");
        assert_eq!(t.user, "incuser");

        let missing = Sources::new(Some(&dir.path().join("nope")), Path::new("/home/alice"));
        let err = load(&missing, &local()).expect_err("missing -F file");
        assert!(matches!(err, ConfigError::Read { .. }));
    }

    #[test]
    fn env_expansion() {
        std::env::set_var("TUNNEL_TEST_KEYDIR", "/keys");
        let t = resolve_in(
            &parse("Host e\n  IdentityFile ${TUNNEL_TEST_KEYDIR}/k\n"),
            "e",
            &local(),
        )
        .expect("resolves");
        assert_eq!(t.identity_files, vec![PathBuf::from("/keys/k")]);
    }
}
