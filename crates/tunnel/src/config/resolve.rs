//! Evaluating the parsed config for one host, as ssh does: a first pass over
//! the files, HostName and canonicalization, a second (final) pass if
//! canonicalization is on or a `Match final` asked for one, then defaults
//! and `~`/`%`/`${}` expansion into a [`Target`].

use std::path::{Path, PathBuf};
use std::time::Duration;

use sha1::{Digest, Sha1};

use super::canonical::{self, Outcome, Resolver};
use super::criteria;
use super::jump::{Hop, Jump};
use super::options::{Options, Origin};
use super::parse::{Canonicalize, ConfigFile, Item, SshConfig};
use super::pattern::{self, ListMatch};
use super::tokens::{self, Homes, Tokens};
use super::{
    AgentSocket, ConfigError, InvalidValue, LineError, LocalUser, StrictHostKeyChecking, Target,
};

/// Longest route accepted (ssh has no limit; a loop in the config must end).
const MAX_HOPS: usize = 16;

/// OpenSSH's default identity files, in its order.
const DEFAULT_IDENTITIES: &[&str] = &[
    "~/.ssh/id_rsa",
    "~/.ssh/id_ecdsa",
    "~/.ssh/id_ecdsa_sk",
    "~/.ssh/id_ed25519",
    "~/.ssh/id_ed25519_sk",
    "~/.ssh/id_xmss",
    "~/.ssh/id_dsa",
];

/// What the command line says besides the host: `-l`, `-p`, `-J` (for a
/// jump host, its `user@`, `:port` and the hops before it).
#[derive(Debug, Clone, Default)]
pub struct Request {
    pub user: Option<String>,
    pub port: Option<u16>,
    pub jump: Option<Jump>,
}

/// Resolve `host_arg` as `ssh [-l USER] [-p PORT] [-J HOPS] HOST` would.
pub fn resolve_with(
    config: &SshConfig,
    host_arg: &str,
    request: &Request,
    local: &LocalUser,
) -> Result<Target, ConfigError> {
    resolve(config, host_arg, request, local, &canonical::System)
}

/// Resolve against an already parsed config (unit tests use this directly).
pub fn resolve_in(
    config: &SshConfig,
    host_arg: &str,
    local: &LocalUser,
) -> Result<Target, ConfigError> {
    resolve(
        config,
        host_arg,
        &Request::default(),
        local,
        &canonical::System,
    )
}

/// The hops to go through, in order, then the target itself. `cli_jump`
/// (`-J`) replaces the target's ProxyJump. As with ssh, the last hop is
/// reached through the hops before it (its own ProxyJump does not apply),
/// and the first hop's own ProxyJump is followed; each hop is otherwise
/// resolved as its own host (User, Port, IdentityFile, HostKeyAlias...), its
/// `user@` and `:port` taking precedence over its config.
pub fn resolve_route(
    config: &SshConfig,
    host_arg: &str,
    local: &LocalUser,
    cli_jump: Option<&str>,
) -> Result<Vec<Target>, ConfigError> {
    let request = Request {
        jump: cli_jump.map(super::parse_jump).transpose()?,
        ..Request::default()
    };
    let target = resolve(config, host_arg, &request, local, &canonical::System)?;
    let mut route = hops_before(config, &target, local, 1)?;
    route.push(target);
    Ok(route)
}

fn hops_before(
    config: &SshConfig,
    target: &Target,
    local: &LocalUser,
    depth: usize,
) -> Result<Vec<Target>, ConfigError> {
    let hops = target
        .proxy_jump
        .as_ref()
        .map(Jump::hops)
        .unwrap_or_default();
    let Some((last, earlier)) = hops.split_last() else {
        return Ok(Vec::new());
    };
    if depth > MAX_HOPS {
        return Err(ConfigError::Invalid {
            option: "ProxyJump",
            value: last.to_string(),
            reason: InvalidValue::TooManyHops { max: MAX_HOPS },
        });
    }
    let request = Request {
        user: last.user.clone(),
        port: last.port,
        jump: (!earlier.is_empty()).then(|| Jump::Hops {
            extra: (earlier.len() > 1).then(|| {
                let before: Vec<String> = earlier[..earlier.len() - 1]
                    .iter()
                    .map(Hop::to_string)
                    .collect();
                before.join(",")
            }),
            hops: earlier.to_vec(),
        }),
    };
    let hop = resolve(config, &last.host, &request, local, &canonical::System)?;
    let mut route = hops_before(config, &hop, local, depth + 1)?;
    route.push(hop);
    Ok(route)
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
            host_arg: alias.clone(),
            host_name: alias,
            port: 22,
            configured: false,
            host_key_alias: None,
            proxy_jump: None,
            ..login.clone()
        });
    }
    if !target.user_from_config {
        target.user = login.user.clone();
    }
    // The node is always reached through the login node.
    target.proxy_jump = None;
    Ok(target)
}

/// The state one pass over the files works with.
struct Pass<'a> {
    /// What Host patterns are matched against: the host as typed in the
    /// first pass, the final host name in the second.
    host: &'a str,
    /// The host as typed (`Match originalhost`, `%n`).
    original: &'a str,
    final_pass: bool,
    local: &'a LocalUser,
}

pub(super) fn resolve(
    config: &SshConfig,
    host_arg: &str,
    request: &Request,
    local: &LocalUser,
    resolver: &dyn Resolver,
) -> Result<Target, ConfigError> {
    let (cli_user, host) = match host_arg.rsplit_once('@') {
        Some(("", _)) => return Err(ConfigError::EmptyHost),
        Some((u, h)) => (Some(u.to_string()), h),
        None => (None, host_arg),
    };
    if host.is_empty() {
        return Err(ConfigError::EmptyHost);
    }
    let mut opts = Options {
        user: request.user.clone().or(cli_user),
        port: request.port,
        jump: request.jump.clone(),
        ..Options::default()
    };
    let mut wants_final = false;
    let first = Pass {
        host,
        original: host,
        final_pass: false,
        local,
    };
    evaluate(config, &mut opts, &first, &mut wants_final)?;
    let hostname_configured = opts.hostname.is_some();

    // HostName takes effect (with %h), then the name is normalised.
    let mut name = match &opts.hostname {
        Some(h) => expand_hostname(h, host)?,
        None => host.to_string(),
    };
    if opts.hostname.is_some() {
        opts.hostname = Some(name.clone());
    }
    let mode = opts.canonicalize_hostname.unwrap_or(Canonicalize::No);
    if let Some(addr) = canonical::numeric_address(&name) {
        name = addr;
    } else {
        name = name.to_ascii_lowercase();
        if mode != Canonicalize::No && opts.has_permitted_cnames() {
            return Err(unsupported_cnames(host, &opts));
        }
        match canonical::canonicalize(&name, opts.port.unwrap_or(22), &opts, resolver) {
            Outcome::Unchanged => {}
            Outcome::Renamed(n) => name = n,
            Outcome::NotFound => return Err(ConfigError::Canonicalize { host: name }),
        }
    }
    if mode != Canonicalize::No {
        wants_final = true;
    }
    if wants_final {
        tracing::debug!("re-reading the ssh config for {name} (final pass)");
        opts.hostname = Some(name.clone());
        let second = Pass {
            host: &name,
            original: host,
            final_pass: true,
            local,
        };
        let mut ignored = false;
        evaluate(config, &mut opts, &second, &mut ignored)?;
    }
    finish(opts, host, name, hostname_configured, local)
}

fn expand_hostname(raw: &str, host: &str) -> Result<String, ConfigError> {
    tokens::percent(raw, &Tokens::new().with('h', host)).map_err(|e| ConfigError::Invalid {
        option: "HostName",
        value: raw.to_string(),
        reason: e.into(),
    })
}

fn unsupported_cnames(alias: &str, opts: &Options) -> ConfigError {
    let (rules, at) = match &opts.permitted_cnames {
        Some((r, at)) => (r.join(" "), at.to_string()),
        None => (String::new(), String::new()),
    };
    ConfigError::Unsupported {
        alias: alias.to_string(),
        option: "CanonicalizePermittedCNAMEs",
        value: rules,
        at,
        reason: "tunnel cannot follow DNS CNAMEs when canonicalizing host names; \
                 remove the rules or set CanonicalizeHostname no",
    }
}

/// One pass over every file.
fn evaluate(
    config: &SshConfig,
    opts: &mut Options,
    pass: &Pass<'_>,
    wants_final: &mut bool,
) -> Result<(), ConfigError> {
    for file in &config.files {
        let mut active = true;
        evaluate_file(file, opts, pass, &mut active, false, wants_final)?;
    }
    Ok(())
}

/// The lines of one file. `active`: whether the current block applies (an
/// included file starts in the including block's state); `never`: inside
/// an Include of a block that does not apply, nothing does.
fn evaluate_file(
    file: &ConfigFile,
    opts: &mut Options,
    pass: &Pass<'_>,
    active: &mut bool,
    never: bool,
    wants_final: &mut bool,
) -> Result<(), ConfigError> {
    for line in &file.lines {
        let origin = Origin {
            path: file.path.clone(),
            line: line.number,
        };
        let syntax = |problem: LineError| ConfigError::Syntax {
            path: file.path.clone(),
            line: line.number,
            problem: Box::new(problem),
        };
        match &line.item {
            Item::Host(patterns) => {
                *active = false;
                if never {
                    continue;
                }
                let named;
                (*active, named) = host_applies(patterns, pass.host, &origin);
                if *active {
                    tracing::trace!("{origin}: Host {} applies", patterns.join(" "));
                    opts.configured |= named;
                }
            }
            Item::Match(criteria) => {
                let hit = evaluate_match(criteria, opts, pass, wants_final)
                    .map_err(|e| syntax(e.into()))?;
                *active = !never && hit;
                if *active {
                    tracing::trace!("{origin}: Match applies");
                    opts.configured |= criteria.iter().any(|c| {
                        matches!(
                            c,
                            criteria::Criterion::Host { negate: false, .. }
                                | criteria::Criterion::OriginalHost { negate: false, .. }
                        )
                    });
                }
            }
            Item::Include(files) => {
                let was = *active;
                for f in files {
                    evaluate_file(f, opts, pass, active, never || !was, wants_final)?;
                    // A Match inside the included file does not leak out.
                    *active = was;
                }
            }
            Item::Set(setting) => {
                if *active {
                    opts.apply(setting, file.user_config, &origin)
                        .map_err(|e| syntax(e.into()))?;
                }
            }
            Item::Unknown(keyword) => {
                let ignored = opts.ignore_unknown.as_deref().is_some_and(|list| {
                    pattern::match_list(keyword, list, true) == ListMatch::Positive
                });
                if !ignored {
                    return Err(syntax(LineError::UnknownOption {
                        keyword: keyword.clone(),
                    }));
                }
            }
            Item::Ignored => {}
        }
    }
    Ok(())
}

/// Whether a `Host` line's patterns apply to `host`, and whether one that
/// matched names it (not just `*`). A negated match rules the line out.
fn host_applies(patterns: &[String], host: &str, origin: &Origin) -> (bool, bool) {
    let (mut active, mut named) = (false, false);
    for p in patterns {
        let (negated, pat) = match p.strip_prefix('!') {
            Some(rest) => (true, rest),
            None => (false, p.as_str()),
        };
        if pattern::matches(host, pat) {
            if negated {
                tracing::trace!("{origin}: Host skipped: negated match for {pat}");
                return (false, false);
            }
            active = true;
            named |= pat != "*";
        }
    }
    (active, named)
}

fn evaluate_match(
    criteria: &[criteria::Criterion],
    opts: &Options,
    pass: &Pass<'_>,
    wants_final: &mut bool,
) -> Result<bool, criteria::EvalError> {
    let host = match &opts.hostname {
        Some(h) if pass.final_pass => h.clone(),
        Some(h) => tokens::percent(h, &Tokens::new().with('h', pass.host)).map_err(|source| {
            criteria::EvalError::HostName {
                hostname: h.clone(),
                source,
            }
        })?,
        None => pass.host.to_string(),
    };
    let port = opts.port.unwrap_or(22).to_string();
    let user = opts.user.clone().unwrap_or_else(|| pass.local.name.clone());
    let key_alias = opts.host_key_alias.clone().unwrap_or_else(|| host.clone());
    let values = Tokens::new()
        .with(
            'C',
            connection_hash(&pass.local.hostname, &host, &port, &user),
        )
        .with('L', short_hostname(&pass.local.hostname))
        .with('d', pass.local.home.to_string_lossy())
        .with('h', host.clone())
        .with('k', key_alias)
        .with('l', pass.local.hostname.clone())
        .with('n', pass.original)
        .with('p', port)
        .with('r', user.clone())
        .with('u', pass.local.name.clone())
        .with('i', pass.local.uid.to_string());
    let cx = criteria::Context {
        host: &host,
        original_host: pass.original,
        user: &user,
        local_user: &pass.local.name,
        final_pass: pass.final_pass,
        tokens: &values,
        shell: None,
    };
    criteria::evaluate(criteria, &cx, wants_final)
}

/// `%C`: SHA-1 of `%l%h%p%r`, in hex.
fn connection_hash(local_host: &str, host: &str, port: &str, user: &str) -> String {
    let mut h = Sha1::new();
    for part in [local_host, host, port, user] {
        h.update(part.as_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn short_hostname(full: &str) -> String {
    full.split('.').next().unwrap_or_default().to_string()
}

impl Homes for LocalUser {
    fn own(&self) -> &Path {
        &self.home
    }
    fn of(&self, user: &str) -> Option<PathBuf> {
        crate::platform::home_of(user)
    }
}

/// Defaults, expansion and the checks for what tunnel cannot honour.
fn finish(
    opts: Options,
    host_arg: &str,
    host_name: String,
    hostname_configured: bool,
    local: &LocalUser,
) -> Result<Target, ConfigError> {
    let alias = host_arg.to_ascii_lowercase();
    refuse_unhonourable(&opts, &alias)?;
    warn_not_honoured(&opts, &alias);

    let port = opts.port.unwrap_or(22);
    let user = opts.user.clone().unwrap_or_else(|| local.name.clone());
    let host_key_alias = opts.host_key_alias.as_ref().map(|a| a.to_ascii_lowercase());
    let x = Expander {
        values: path_tokens(local, host_arg, &host_name, port, &user, &host_key_alias),
        local,
    };
    let identity_files_explicit = !opts.identity_files.is_empty();
    let identity_files = x.identity_files(&opts)?;
    let user_known_hosts = x.user_known_hosts(&opts)?;
    let global_known_hosts = x.global_known_hosts(&opts)?;
    let identity_agent_setting = opts
        .identity_agent
        .as_deref()
        .map(|a| {
            x.path(a, "IdentityAgent")
                .map(|p| p.to_string_lossy().into_owned())
        })
        .transpose()?;
    let identity_agent = agent_socket(identity_agent_setting.as_deref());
    let proxy_jump = proxy_jump(&opts, host_arg, &host_name, port, &user)?;

    let server_alive_count_max = alive_count_max(opts.server_alive_count_max, &alias);
    let seconds = |v: Option<u32>| v.filter(|&s| s > 0).map(|s| Duration::from_secs(s.into()));
    Ok(Target {
        configured: opts.configured || hostname_configured,
        user_from_config: opts.user_from_config,
        alias,
        host_arg: host_arg.to_string(),
        host_name,
        port,
        user,
        identity_files,
        identity_files_explicit,
        identities_only: opts.identities_only.unwrap_or(false),
        identity_agent,
        identity_agent_setting,
        pubkey_authentication: opts.pubkey_authentication.unwrap_or(true),
        password_authentication: opts.password_authentication.unwrap_or(true),
        kbd_interactive_authentication: opts.kbd_interactive_authentication.unwrap_or(true),
        user_known_hosts,
        global_known_hosts,
        strict_host_key_checking: opts
            .strict_host_key_checking
            .unwrap_or(StrictHostKeyChecking::Ask),
        hash_known_hosts: opts.hash_known_hosts.unwrap_or(false),
        host_key_alias,
        connect_timeout: seconds(opts.connect_timeout),
        server_alive_interval: seconds(opts.server_alive_interval),
        server_alive_count_max,
        proxy_jump,
    })
}

/// The `%` tokens of the path options (IdentityFile, UserKnownHostsFile,
/// IdentityAgent), as ssh.c sets them up once the host is final.
fn path_tokens(
    local: &LocalUser,
    host_arg: &str,
    host_name: &str,
    port: u16,
    user: &str,
    host_key_alias: &Option<String>,
) -> Tokens {
    let port_text = port.to_string();
    Tokens::new()
        .with(
            'C',
            connection_hash(&local.hostname, host_name, &port_text, user),
        )
        .with('L', short_hostname(&local.hostname))
        .with('i', local.uid.to_string())
        .with(
            'k',
            host_key_alias
                .clone()
                .unwrap_or_else(|| host_arg.to_string()),
        )
        .with('l', local.hostname.clone())
        .with('n', host_arg)
        .with('p', port_text)
        .with('d', local.home.to_string_lossy())
        .with('h', host_name)
        .with('r', user)
        .with('u', local.name.clone())
}

/// `~`, `%` tokens and `${VAR}` in path options.
struct Expander<'a> {
    values: Tokens,
    local: &'a LocalUser,
}

impl Expander<'_> {
    fn path(&self, raw: &str, option: &'static str) -> Result<PathBuf, ConfigError> {
        let invalid = |e: tokens::TokenError| ConfigError::Invalid {
            option,
            value: raw.to_string(),
            reason: e.into(),
        };
        let t = tokens::tilde(raw, self.local).map_err(invalid)?;
        Ok(PathBuf::from(
            tokens::percent_dollar(&t, &self.values).map_err(invalid)?,
        ))
    }

    /// The configured IdentityFiles, else OpenSSH's defaults (`none` dropped).
    fn identity_files(&self, opts: &Options) -> Result<Vec<PathBuf>, ConfigError> {
        let configured: Vec<&str> = if opts.identity_files.is_empty() {
            DEFAULT_IDENTITIES.to_vec()
        } else {
            opts.identity_files
                .iter()
                .map(|f| f.path.as_str())
                .collect()
        };
        configured
            .into_iter()
            .filter(|f| !f.eq_ignore_ascii_case("none"))
            .map(|f| self.path(f, "IdentityFile"))
            .collect()
    }

    fn user_known_hosts(&self, opts: &Options) -> Result<Vec<PathBuf>, ConfigError> {
        let defaults = ["~/.ssh/known_hosts", "~/.ssh/known_hosts2"];
        match &opts.user_known_hosts {
            Some(files) if is_none(files) => Ok(Vec::new()),
            Some(files) => files
                .iter()
                .map(|f| self.path(f, "UserKnownHostsFile"))
                .collect(),
            None => defaults
                .iter()
                .map(|f| self.path(f, "UserKnownHostsFile"))
                .collect(),
        }
    }

    /// GlobalKnownHostsFile takes `~` but no tokens.
    fn global_known_hosts(&self, opts: &Options) -> Result<Vec<PathBuf>, ConfigError> {
        let Some(files) = &opts.global_known_hosts else {
            let dir = crate::platform::system_ssh_dir();
            return Ok(vec![
                PathBuf::from(format!("{dir}/ssh_known_hosts")),
                PathBuf::from(format!("{dir}/ssh_known_hosts2")),
            ]);
        };
        if is_none(files) {
            return Ok(Vec::new());
        }
        files
            .iter()
            .map(|f| {
                tokens::tilde(f, self.local)
                    .map(PathBuf::from)
                    .map_err(|e| ConfigError::Invalid {
                        option: "GlobalKnownHostsFile",
                        value: f.clone(),
                        reason: e.into(),
                    })
            })
            .collect()
    }
}

/// Where the agent is, from IdentityAgent (already expanded).
fn agent_socket(setting: Option<&str>) -> AgentSocket {
    match setting {
        None | Some("SSH_AUTH_SOCK") => AgentSocket::Env,
        Some("none") => AgentSocket::Disabled,
        // `$NAME`: the socket is in that environment variable.
        Some(v) if v.starts_with('$') && !v.starts_with("${") => match std::env::var_os(&v[1..]) {
            Some(p) => AgentSocket::Path(PathBuf::from(p)),
            None => AgentSocket::Disabled,
        },
        Some(v) => AgentSocket::Path(PathBuf::from(v)),
    }
}

/// ProxyJump with its tokens expanded; a jump to the target itself is a loop.
fn proxy_jump(
    opts: &Options,
    host_arg: &str,
    host_name: &str,
    port: u16,
    user: &str,
) -> Result<Option<Jump>, ConfigError> {
    if let Some(last) = opts.jump.as_ref().and_then(|j| j.hops().last()) {
        // ssh.c: a jump to the target itself, as the same user on the same port.
        if last.host == host_name
            && last.port.unwrap_or(22) == port
            && last.user.as_deref().unwrap_or(user) == user
        {
            return Err(ConfigError::Invalid {
                option: "ProxyJump",
                value: last.to_string(),
                reason: InvalidValue::JumpLoop {
                    host: last.host.clone(),
                },
            });
        }
    }
    let jump_tokens = Tokens::new()
        .with('h', host_name)
        .with('n', host_arg)
        .with('p', port.to_string())
        .with('r', user);
    match &opts.jump {
        None | Some(Jump::Disabled) => Ok(None),
        Some(j) => j
            .expand(&jump_tokens)
            .map(Some)
            .map_err(|e| ConfigError::Invalid {
                option: "ProxyJump",
                value: j.to_string(),
                reason: e.into(),
            }),
    }
}

/// ServerAliveCountMax as tunnel can apply it: to russh 0 means "never give
/// up", to ssh "give up at the first silent interval"; one unanswered
/// probe is the nearest tunnel can do.
fn alive_count_max(configured: Option<u32>, alias: &str) -> usize {
    match configured {
        None => 3,
        Some(0) => {
            tracing::warn!(
                "host {alias}: ServerAliveCountMax 0: tunnel gives up after one unanswered \
                 keepalive (ssh gives up at the first silent interval)"
            );
            1
        }
        Some(n) => n as usize,
    }
}

fn is_none(files: &[String]) -> bool {
    files
        .first()
        .is_some_and(|f| f.eq_ignore_ascii_case("none"))
}

/// Options whose effect tunnel cannot reproduce, where ignoring them would
/// connect somewhere else or accept a key ssh would refuse.
fn refuse_unhonourable(opts: &Options, alias: &str) -> Result<(), ConfigError> {
    let refuse = |option: &'static str, (value, at): &(String, Origin), reason: &'static str| {
        ConfigError::Unsupported {
            alias: alias.to_string(),
            option,
            value: value.clone(),
            at: at.to_string(),
            reason,
        }
    };
    let refused = [
        (
            &opts.proxy_command,
            "ProxyCommand",
            "tunnel does not support ProxyCommand; use ProxyJump (or -J) for jump hosts",
        ),
        (
            &opts.known_hosts_command,
            "KnownHostsCommand",
            "tunnel does not support KnownHostsCommand (it reads only known_hosts files)",
        ),
        (
            &opts.revoked_host_keys,
            "RevokedHostKeys",
            "tunnel does not check revoked host keys, so it will not connect where ssh would refuse a revoked key",
        ),
    ];
    for (value, option, reason) in refused {
        if let Some(set) = value
            .as_ref()
            .filter(|(v, _)| !v.eq_ignore_ascii_case("none"))
        {
            return Err(refuse(option, set, reason));
        }
    }
    Ok(())
}

/// Options tunnel does not implement but can do without: say so.
fn warn_not_honoured(opts: &Options, alias: &str) {
    if let Some((true, at)) = &opts.check_host_ip {
        tracing::warn!(
            "host {alias}: CheckHostIP yes ({at}) is not supported: the host key is checked \
             under the host name (or HostKeyAlias) only"
        );
    }
    for (option, value, at) in &opts.not_honoured {
        tracing::warn!(
            "host {alias}: {option} {value} ({at}) is not supported by tunnel and has no effect"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::{local, parse, try_parse};
    use crate::exit::{Exit, HasExit};
    use std::collections::HashMap;

    /// A Windows home (backslashes) and Windows paths, as OpenSSH for Windows
    /// resolves them: `~/` appends `/` and the rest, `%d` is the home as it
    /// is, a backslash before a letter or `.` stays (argv_split keeps an
    /// unknown escape), `\\` is one backslash.
    #[test]
    fn windows_paths_resolve_as_openssh_for_windows() {
        let cfg = parse(
            "Host w\n  IdentityFile ~/.ssh/id_w\n  IdentityFile %d\\keys\\id_x\n\
             IdentityFile C:\\Keys\\id_y\n  IdentityFile \"C:\\\\Program Files\\\\k\"\n\
             UserKnownHostsFile ~/.ssh/kh %d\\.ssh\\kh2\n  IdentityAgent \\\\\\\\.\\\\pipe\\\\agent\n",
        );
        let mut me = local();
        me.home = PathBuf::from(r"C:\Users\Alice");
        let t = resolve_in(&cfg, "w", &me).expect("resolves");
        let text = |v: &[PathBuf]| -> Vec<String> {
            v.iter().map(|p| p.to_string_lossy().into_owned()).collect()
        };
        assert_eq!(
            text(&t.identity_files),
            [
                r"C:\Users\Alice/.ssh/id_w",
                r"C:\Users\Alice\keys\id_x",
                r"C:\Keys\id_y",
                r"C:\Program Files\k"
            ]
        );
        assert_eq!(
            text(&t.user_known_hosts),
            [r"C:\Users\Alice/.ssh/kh", r"C:\Users\Alice\.ssh\kh2"]
        );
        // `\\\\.\\pipe\\agent` in the file is the pipe `\\.\pipe\agent`.
        assert_eq!(
            t.identity_agent,
            AgentSocket::Path(PathBuf::from(r"\\.\pipe\agent"))
        );
    }

    struct Table(HashMap<&'static str, bool>);
    impl Resolver for Table {
        fn resolves(&self, name: &str, _port: u16) -> bool {
            self.0.get(name).copied().unwrap_or(false)
        }
    }

    fn with_dns(
        config: &SshConfig,
        host: &str,
        names: &[&'static str],
    ) -> Result<Target, ConfigError> {
        let table = Table(names.iter().map(|n| (*n, true)).collect());
        resolve(config, host, &Request::default(), &local(), &table)
    }

    #[test]
    fn match_blocks_apply_only_when_they_match() {
        // The issue's case: these options must not reach lab-2.
        let cfg = parse(
            "Host lab-*\n  User labuser\nMatch host lab-1\n  StrictHostKeyChecking no\n  \
             UserKnownHostsFile /dev/null\nHost *\n  StrictHostKeyChecking yes\n",
        );
        let lab1 = resolve_in(&cfg, "lab-1", &local()).expect("resolves");
        assert_eq!(lab1.strict_host_key_checking, StrictHostKeyChecking::No);
        assert_eq!(lab1.user_known_hosts, [PathBuf::from("/dev/null")]);
        let lab2 = resolve_in(&cfg, "lab-2", &local()).expect("resolves");
        assert_eq!(lab2.user, "labuser");
        assert_eq!(lab2.strict_host_key_checking, StrictHostKeyChecking::Yes);
        assert_eq!(
            lab2.user_known_hosts[0],
            PathBuf::from("/home/alice/.ssh/known_hosts")
        );
    }

    #[test]
    fn match_host_sees_the_hostname_and_originalhost_the_alias() {
        let cfg = parse(
            "Host lab-*\n  HostName 10.0.0.1\nMatch host lab-1\n  Port 1\n\
             Match originalhost lab-1\n  User orig\nMatch host 10.0.0.*\n  IdentitiesOnly yes\n",
        );
        let t = resolve_in(&cfg, "lab-1", &local()).expect("resolves");
        assert_eq!(t.port, 22, "Match host compares the HostName");
        assert_eq!(t.user, "orig");
        assert!(t.identities_only);
    }

    #[test]
    fn host_patterns_are_case_sensitive_against_the_name_typed() {
        let cfg = parse("Host gpu\n  User bob\n");
        assert_eq!(
            resolve_in(&cfg, "gpu", &local()).expect("resolves").user,
            "bob"
        );
        let t = resolve_in(&cfg, "GPU", &local()).expect("resolves");
        assert_eq!(
            t.user, "alice",
            "ssh matches Host against the name as typed"
        );
        assert_eq!(t.host_name, "gpu", "but the host name is lowercased");
    }

    #[test]
    fn match_final_reads_again_with_the_real_host_name() {
        let cfg = parse(
            "Host foo\n  HostName Bar\nMatch final host bar\n  User fin\n\
             Host bar\n  Port 99\nMatch !final\n  IdentityFile ~/first\n",
        );
        let t = resolve_in(&cfg, "foo", &local()).expect("resolves");
        assert_eq!(t.host_name, "bar");
        assert_eq!(t.user, "fin");
        assert_eq!(
            t.port, 99,
            "Host patterns match the HostName in the final pass"
        );
        assert_eq!(t.identity_files, [PathBuf::from("/home/alice/first")]);
        // Without `Match final` there is one pass: Host bar never applies to foo.
        let t = resolve_in(
            &parse("Host foo\n  HostName bar\nHost bar\n  Port 99\n"),
            "foo",
            &local(),
        )
        .expect("resolves");
        assert_eq!(t.port, 22);
    }

    #[test]
    fn canonicalization_then_a_second_pass() {
        let cfg = parse(
            "CanonicalizeHostname yes\nCanonicalDomains a.example b.example\n\
             Match canonical host *.b.example\n  User canon\nHost gpu.b.example\n  Port 2200\n",
        );
        let t = with_dns(&cfg, "gpu", &["gpu.b.example."]).expect("resolves");
        assert_eq!(
            (t.host_name.as_str(), t.user.as_str(), t.port),
            ("gpu.b.example", "canon", 2200)
        );
        // Not found: the name stays, and the second pass still happens.
        let t = with_dns(&cfg, "cpu", &[]).expect("resolves");
        assert_eq!((t.host_name.as_str(), t.user.as_str()), ("cpu", "alice"));
        let strict = parse(
            "CanonicalizeHostname yes\nCanonicalizeFallbackLocal no\nCanonicalDomains x.example\n",
        );
        let err = with_dns(&strict, "cpu", &[]).expect_err("not found");
        assert_eq!(err.exit(), Exit::Dns);
        let cnames = parse("CanonicalizeHostname yes\nCanonicalizePermittedCNAMEs *.a:*.b\n");
        let err = with_dns(&cnames, "cpu", &[]).expect_err("CNAME rules");
        assert!(
            err.to_string().contains("CanonicalizePermittedCNAMEs"),
            "{err}"
        );
        assert_eq!(err.exit(), Exit::Config);
    }

    #[cfg(unix)] // `test` in the user's shell
    #[test]
    fn match_exec_user_and_negation() {
        let cfg = parse(
            "Match exec \"test %r = bob\"\n  Port 1\nMatch user bob !localuser alice\n  Port 2\n\
             Match user bob localuser alice\n  Port 3\n",
        );
        assert_eq!(
            resolve_in(&cfg, "bob@x", &local()).expect("resolves").port,
            1
        );
        assert_eq!(resolve_in(&cfg, "x", &local()).expect("resolves").port, 22);
        let cfg = parse(
            "Match user bob !localuser alice\n  Port 2\nMatch user bob localuser alice\n  Port 3\n",
        );
        assert_eq!(
            resolve_in(&cfg, "bob@x", &local()).expect("resolves").port,
            3
        );
    }

    #[test]
    fn include_applies_conditionally() {
        let dir = tempfile::tempdir().expect("tempdir");
        let inc = dir.path().join("inc.conf");
        std::fs::write(&inc, "Port 7\nHost other\n  User o\n").expect("write");
        let cfg = parse(&format!(
            "Host a\n  Include {}\nHost b\n  User b-user\n",
            dir.path().join("*.conf").display()
        ));
        let a = resolve_in(&cfg, "a", &local()).expect("resolves");
        assert_eq!(a.port, 7);
        let b = resolve_in(&cfg, "b", &local()).expect("resolves");
        assert_eq!((b.port, b.user.as_str()), (22, "b-user"));
        // The block after an Include is the including file's again.
        let o = resolve_in(&cfg, "other", &local()).expect("resolves");
        assert_eq!(
            o.user, "alice",
            "Host other inside an inactive Include never applies"
        );
    }

    #[test]
    fn unknown_options_refused_unless_ignored() {
        let err = try_parse("Host x\n  Bogus yes\n")
            .and_then(|c| resolve_in(&c, "x", &local()))
            .expect_err("unknown");
        assert!(
            err.to_string().ends_with(
                " line 2: Bad configuration option: bogus (ssh refuses this config too; \
                 IgnoreUnknown can name options to skip)"
            ),
            "{err}"
        );
        let cfg = parse("IgnoreUnknown bog*\nHost x\n  Bogus yes\n  Port 5\n");
        assert_eq!(resolve_in(&cfg, "x", &local()).expect("resolves").port, 5);
        // Unknown even inside a block that does not apply, as in ssh.
        let cfg = parse("Host other\n  Bogus yes\n");
        assert!(resolve_in(&cfg, "x", &local()).is_err());
    }

    #[test]
    fn tokens_expand_per_option() {
        std::env::set_var("TUNNEL_RESOLVE_TEST", "envdir");
        let cfg = parse(
            "Host x\n  HostName %h.example\n  User bob\n  Port 2222\n  HostKeyAlias KeyX\n\
             IdentityFile ~/%r@%h:%p-%n-%k-%L-%l-%u-%i-%%\n  IdentityFile %d/${TUNNEL_RESOLVE_TEST}/k\n\
             UserKnownHostsFile ~/kh/%C\n  GlobalKnownHostsFile ~/g/%h\n  IdentityAgent ~/agent.%h\n",
        );
        let t = resolve_in(&cfg, "x", &local()).expect("resolves");
        assert_eq!(t.host_name, "x.example");
        assert_eq!(
            t.identity_files,
            [
                PathBuf::from(
                    "/home/alice/bob@x.example:2222-x-keyx-laptop-laptop.example.org-alice-1000-%"
                ),
                PathBuf::from("/home/alice/envdir/k"),
            ]
        );
        let hash = connection_hash("laptop.example.org", "x.example", "2222", "bob");
        assert_eq!(
            t.user_known_hosts,
            [PathBuf::from(format!("/home/alice/kh/{hash}"))]
        );
        assert_eq!(
            t.global_known_hosts,
            [PathBuf::from("/home/alice/g/%h")],
            "no tokens here"
        );
        assert_eq!(
            t.identity_agent,
            AgentSocket::Path("/home/alice/agent.x.example".into())
        );
        assert_eq!(t.known_hosts_name(), "keyx");
        let bad = parse("Host x\n  HostName %d\n");
        assert_eq!(
            resolve_in(&bad, "x", &local())
                .expect_err("HostName takes only %h")
                .to_string(),
            "ssh config option HostName \"%d\": unknown token %d"
        );
        let bad = parse("Host x\n  IdentityFile ~/${TUNNEL_RESOLVE_TEST_UNSET}\n");
        assert!(resolve_in(&bad, "x", &local()).is_err());
    }

    #[test]
    fn identity_file_defaults_and_none() {
        let t = resolve_in(&parse(""), "x", &local()).expect("resolves");
        assert!(!t.identity_files_explicit);
        assert_eq!(t.identity_files.len(), 7);
        assert_eq!(
            t.identity_files[6],
            PathBuf::from("/home/alice/.ssh/id_dsa")
        );
        let t = resolve_in(&parse("IdentityFile none\n"), "x", &local()).expect("resolves");
        assert!(t.identity_files_explicit && t.identity_files.is_empty());
    }

    #[test]
    fn addresses_are_normalised() {
        let t = resolve_in(&parse("Host x\n  HostName 127.1\n"), "x", &local()).expect("resolves");
        assert_eq!(t.host_name, "127.0.0.1");
    }

    #[test]
    fn a_jump_to_itself_is_a_loop_as_in_ssh() {
        let cfg = parse("Host bastion\n  ProxyJump bastion\nHost other\n  ProxyJump other:2222\n");
        let err = resolve_in(&cfg, "bastion", &local()).expect_err("loop");
        assert_eq!(
            err.to_string(),
            "ssh config option ProxyJump \"bastion\": jumphost loop via bastion"
        );
        // Another port is another sshd: not a loop.
        assert!(resolve_in(&cfg, "other", &local()).is_ok());
    }

    #[test]
    fn server_alive_count_max_zero_is_one_probe() {
        let t = resolve_in(&parse("ServerAliveCountMax 0\n"), "x", &local()).expect("resolves");
        assert_eq!(t.server_alive_count_max, 1);
        let t = resolve_in(&parse("ServerAliveCountMax 5\n"), "x", &local()).expect("resolves");
        assert_eq!(t.server_alive_count_max, 5);
    }

    #[test]
    fn jump_tokens_and_hop_precedence() {
        let cfg = parse(
            "Host t\n  User tu\n  ProxyJump %r@%h-gw:2200\nHost t-gw\n  User gwuser\n  Port 1\n",
        );
        let route = resolve_route(&cfg, "t", &local(), None).expect("resolves");
        let hops: Vec<(&str, &str, u16)> = route
            .iter()
            .map(|t| (t.user.as_str(), t.host_name.as_str(), t.port))
            .collect();
        assert_eq!(hops, [("tu", "t-gw", 2200), ("tu", "t", 22)]);
    }
}
