//! Resolution of a host the way `ssh` resolves it from its config files
//! (OpenSSH 9.2's readconf.c and ssh.c are the reference; `ssh -G` is the
//! test oracle, see tests/tunnel/test_config_vs_openssh.py).
//!
//! - [`parse`] reads the files (with [`lexer`] and [`include`]) into lines;
//! - [`resolve`] evaluates them for one host: `Host` patterns ([`pattern`]),
//!   `Match` criteria ([`criteria`]), first value wins ([`options`]), a second
//!   pass after canonicalization ([`canonical`]) or `Match final`, then `~`,
//!   `%` tokens and `${VAR}` ([`tokens`]) and OpenSSH's defaults;
//! - [`show`] prints the result as `ssh -G` does (`tunnel config`).
//!
//! An option tunnel cannot honour (ProxyCommand, KnownHostsCommand,
//! RevokedHostKeys, CNAME rules) is an error, never silently dropped.

mod canonical;
mod criteria;
mod include;
pub mod jump;
mod keywords;
mod lexer;
mod options;
mod parse;
mod pattern;
mod resolve;
pub mod show;
mod tokens;

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::exit::{Exit, HasExit};
use crate::platform::ConfigPermissionError;

pub use jump::Jump;
pub use parse::SshConfig;
#[cfg(test)]
pub use resolve::resolve_in;
pub use resolve::{resolve_node, resolve_route, resolve_with, Request};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read ssh config {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A file (line 0: the file as a whole) that ssh would refuse too. The
    /// problem is boxed: it is the largest part, and every `Result` of the
    /// resolver carries this type.
    #[error("{}{}: {problem}", path.display(), if *line > 0 { format!(" line {line}") } else { String::new() })]
    Syntax {
        path: PathBuf,
        line: usize,
        problem: Box<LineError>,
    },
    #[error("ssh config option {option} {value:?}: {reason}")]
    Invalid {
        option: &'static str,
        value: String,
        reason: InvalidValue,
    },
    #[error("host {alias}: {option} {value} ({at}): {reason}")]
    Unsupported {
        alias: String,
        option: &'static str,
        value: String,
        at: String,
        reason: &'static str,
    },
    #[error(
        "host {host}: no CanonicalDomains suffix resolves it and CanonicalizeFallbackLocal is no"
    )]
    Canonicalize { host: String },
    #[error("empty host name")]
    EmptyHost,
    #[error("no home directory found (no passwd entry and no HOME)")]
    NoHome,
}

/// What is wrong with a config file or one of its lines, found when the
/// file is read or when its lines are evaluated for a host.
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    #[error(transparent)]
    Lex(#[from] lexer::LexError),
    /// A bad value, after the line as written (trimmed).
    #[error("{line}: {source}")]
    Value {
        line: String,
        source: parse::ValueError,
    },
    #[error("Include nested more than {max} deep (does a file include itself?)")]
    IncludeDepth { max: usize },
    #[error("Include with an empty argument")]
    EmptyInclude,
    #[error(transparent)]
    IncludeTilde(#[from] include::SystemTilde),
    #[error(transparent)]
    Permissions(#[from] ConfigPermissionError),
    #[error(transparent)]
    Match(#[from] criteria::EvalError),
    #[error(transparent)]
    IdentityFiles(#[from] options::TooManyIdentityFiles),
    #[error(
        "Bad configuration option: {keyword} (ssh refuses this config too; \
         IgnoreUnknown can name options to skip)"
    )]
    UnknownOption { keyword: String },
}

/// Why an option's value (already read) cannot be used for this host.
#[derive(Debug, thiserror::Error)]
pub enum InvalidValue {
    #[error(transparent)]
    Jump(#[from] jump::JumpError),
    #[error(transparent)]
    Token(#[from] tokens::TokenError),
    #[error("more than {max} hops (a ProxyJump loop?)")]
    TooManyHops { max: usize },
    /// The last hop is the target itself (ssh.c's check).
    #[error("jumphost loop via {host}")]
    JumpLoop { host: String },
}

impl HasExit for ConfigError {
    fn exit(&self) -> Exit {
        match self {
            ConfigError::EmptyHost => Exit::Usage,
            ConfigError::Canonicalize { .. } => Exit::Dns,
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
    /// The name the user typed (lowercased), without `user@`.
    pub alias: String,
    /// The name as typed (ssh's `%n`).
    pub host_arg: String,
    pub host_name: String,
    pub port: u16,
    pub user: String,
    /// The User came from the config (not `user@`, a hop's `user@`, or the
    /// local user name).
    pub user_from_config: bool,
    /// True when a `Host` pattern other than `*` or a `Match` on the host
    /// name applied, or the config set HostName: the alias is "known".
    pub configured: bool,
    pub identity_files: Vec<PathBuf>,
    /// Whether `identity_files` came from the config (else OpenSSH's defaults).
    pub identity_files_explicit: bool,
    pub identities_only: bool,
    pub identity_agent: AgentSocket,
    /// IdentityAgent as `ssh -G` shows it (expanded), if set.
    pub identity_agent_setting: Option<String>,
    pub pubkey_authentication: bool,
    pub password_authentication: bool,
    /// KbdInteractiveAuthentication (or its old name,
    /// ChallengeResponseAuthentication): 2FA prompts.
    pub kbd_interactive_authentication: bool,
    pub user_known_hosts: Vec<PathBuf>,
    pub global_known_hosts: Vec<PathBuf>,
    pub strict_host_key_checking: StrictHostKeyChecking,
    pub hash_known_hosts: bool,
    /// Lowercased, as ssh does.
    pub host_key_alias: Option<String>,
    /// `None`: not set, or 0 (tunnel then uses its own default).
    pub connect_timeout: Option<Duration>,
    /// `None`: not set, or 0 (tunnel then uses its own default).
    pub server_alive_interval: Option<Duration>,
    pub server_alive_count_max: usize,
    /// ProxyJump (or `-J`), `%` tokens expanded; `None` for no jump.
    pub proxy_jump: Option<Jump>,
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

/// One file to read.
#[derive(Debug, Clone)]
struct SourceFile {
    path: PathBuf,
    user_config: bool,
    check_permissions: bool,
    required: bool,
}

/// Which config files to read.
#[derive(Debug, Clone)]
pub struct Sources {
    files: Vec<SourceFile>,
}

impl Sources {
    /// `-F FILE` (`-F none`: no file at all), else `~/.ssh/config` then
    /// `/etc/ssh/ssh_config`.
    pub fn new(explicit: Option<&Path>, home: &Path) -> Self {
        let files = match explicit {
            Some(p) if p.as_os_str().eq_ignore_ascii_case("none") => Vec::new(),
            Some(p) => vec![SourceFile {
                path: p.to_path_buf(),
                user_config: true,
                check_permissions: false,
                required: true,
            }],
            None => vec![
                SourceFile {
                    path: home.join(".ssh").join("config"),
                    user_config: true,
                    check_permissions: true,
                    required: false,
                },
                SourceFile {
                    path: PathBuf::from(crate::platform::system_ssh_dir()).join("ssh_config"),
                    user_config: false,
                    check_permissions: false,
                    required: false,
                },
            ],
        };
        Sources { files }
    }
}

/// Local facts that `%`-tokens and defaults expand to.
#[derive(Debug, Clone)]
pub struct LocalUser {
    /// The passwd home directory (as ssh uses; `$HOME` if there is none).
    pub home: PathBuf,
    pub name: String,
    pub uid: u32,
    /// This machine's name (`%l`; `%L` is its first label).
    pub hostname: String,
}

impl LocalUser {
    pub fn current() -> Result<Self, ConfigError> {
        // The passwd entry on Unix; the profile directory, account name and
        // uid 1 on Windows, as OpenSSH for Windows has them.
        let me = crate::platform::me();
        Ok(LocalUser {
            home: me.home.ok_or(ConfigError::NoHome)?,
            name: me.name,
            uid: me.uid,
            hostname: me.hostname,
        })
    }

    /// Where `~` leads in an Include pattern: glob(3)'s `~` is `$HOME`.
    fn glob_home(&self) -> PathBuf {
        std::env::var_os("HOME")
            .filter(|h| !h.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| self.home.clone())
    }
}

/// Read and parse the config files (Includes are read too).
pub fn load(sources: &Sources, local: &LocalUser) -> Result<SshConfig, ConfigError> {
    let glob_home = local.glob_home();
    let mut config = SshConfig::default();
    for f in &sources.files {
        let source = parse::Source {
            path: &f.path,
            user_config: f.user_config,
            check_permissions: f.check_permissions,
            required: f.required,
        };
        if let Some(file) = parse::read_top(&source, &glob_home)? {
            config.files.push(file);
        }
    }
    Ok(config)
}

/// ProxyJump/`-J` values: comma-separated hops; `none` means no jump.
pub fn parse_jump(value: &str) -> Result<Jump, ConfigError> {
    jump::parse(value).map_err(|e| ConfigError::Invalid {
        option: "ProxyJump",
        value: value.to_string(),
        reason: e.into(),
    })
}

#[cfg(test)]
pub(crate) mod testing {
    //! Helpers for the config unit tests.
    use super::*;

    pub fn local() -> LocalUser {
        LocalUser {
            home: PathBuf::from("/home/alice"),
            name: "alice".into(),
            uid: 1000,
            hostname: "laptop.example.org".into(),
        }
    }

    /// Parse `text` as an `-F` file.
    pub fn parse(text: &str) -> SshConfig {
        try_parse(text).expect("test config parses")
    }

    pub fn try_parse(text: &str) -> Result<SshConfig, ConfigError> {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("config");
        std::fs::write(&path, text).expect("write config");
        load(
            &Sources::new(Some(&path), Path::new("/home/alice")),
            &local(),
        )
    }
}

#[cfg(test)]
mod tests {
    //! The resolver's behaviour from before the OpenSSH-exact rewrite, kept.
    use super::testing::{local, parse};
    use super::*;
    use std::fs::File;
    use std::io::Write;

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
        assert!(t.user_from_config);
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
        // As `ssh -J alice@b1:2201 b2` for the last hop: b2's own ProxyJump
        // (b0) gives way to the hops before it.
        assert_eq!(
            names,
            vec![
                ("alice", "bastion1.example", 2201),
                ("carol", "b2", 22),
                ("alice", "j", 22),
            ]
        );
        assert_eq!(route[1].known_hosts_name(), "b2-key");
        // A single hop's own ProxyJump is followed.
        let route = resolve_route(&cfg, "b2", &local(), None).expect("resolves");
        let names: Vec<&str> = route.iter().map(|t| t.host_name.as_str()).collect();
        assert_eq!(names, ["b0", "b2"]);
        // -J replaces the configured jumps; `none` disables them.
        let route = resolve_route(&cfg, "j", &local(), Some("x:7")).expect("resolves");
        assert_eq!(route.len(), 2);
        assert_eq!((route[0].host_name.as_str(), route[0].port), ("x", 7));
        let route = resolve_route(&cfg, "j", &local(), Some("none")).expect("resolves");
        assert_eq!(route.len(), 1);
        // A loop ends with a clear error.
        let looped = parse("Host a\n  ProxyJump b\nHost b\n  ProxyJump a\n");
        let err = resolve_route(&looped, "a", &local(), None).expect_err("loop");
        assert!(
            err.to_string()
                .ends_with(": more than 16 hops (a ProxyJump loop?)"),
            "{err}"
        );
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
        assert!(n.proxy_jump.is_none());
        // A block without User: its options, the login node's user, still no jumps.
        let n = resolve_node(&cfg, "gpu01", &local(), &login).expect("resolves");
        assert_eq!((n.port, n.user.as_str()), (2200, "a123"));
        assert!(n.proxy_jump.is_none());
        // A block with its own User wins.
        let n = resolve_node(&cfg, "CPU7", &local(), &login).expect("resolves");
        assert_eq!(
            (n.host_name.as_str(), n.user.as_str()),
            ("10.0.0.7", "other")
        );
    }

    #[test]
    fn bad_values_are_config_errors() {
        // A bad value is refused when the file is read, as ssh does.
        let err =
            testing::try_parse("Host x\n  StrictHostKeyChecking maybe\n").expect_err("invalid");
        assert!(err.to_string().contains("StrictHostKeyChecking"), "{err}");
        assert!(err.to_string().contains("line 2"), "{err}");
        assert!(
            err.to_string().ends_with(
                " line 2: StrictHostKeyChecking maybe: unsupported option \"maybe\" \
                 (expected yes, ask, accept-new, no or off)"
            ),
            "{err}"
        );
        assert_eq!(err.exit(), Exit::Config);
        let err = testing::try_parse("Port").expect_err("no value");
        assert!(
            err.to_string()
                .ends_with(" line 1: no argument after keyword \"port\""),
            "{err}"
        );
        let err = testing::try_parse("Include \"\"").expect_err("empty Include");
        assert!(
            err.to_string()
                .ends_with(" line 1: Include with an empty argument"),
            "{err}"
        );
        let err = resolve_in(&parse("Host x\n  IdentityFile ~/%Q\n"), "x", &local())
            .expect_err("bad token");
        assert_eq!(
            err.to_string(),
            "ssh config option IdentityFile \"~/%Q\": unknown token %Q"
        );
        let err = resolve_in(
            &parse("Host x\n  HostName %d\nMatch host y\n"),
            "x",
            &local(),
        )
        .expect_err("bad token for Match host");
        assert!(
            err.to_string()
                .ends_with(" line 3: HostName %d: unknown token %d"),
            "{err}"
        );
        let err = parse_jump("a,h:port").expect_err("bad port");
        assert_eq!(
            err.to_string(),
            "ssh config option ProxyJump \"a,h:port\": hop \"h:port\": bad port \"port\""
        );
    }

    #[test]
    fn include_and_explicit_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let inc = dir.path().join("inc.conf");
        std::fs::write(&inc, "Host inc\n  HostName 10.1.2.3\n  User incuser\n").expect("write");
        let main = dir.path().join("config");
        let mut f = File::create(&main).expect("create");
        writeln!(f, "Include {}\nHost other\n  Port 3\n", inc.display()).expect("write");
        let sources = Sources::new(Some(main.as_path()), Path::new("/home/alice"));
        let t = load(&sources, &local())
            .and_then(|c| resolve_in(&c, "inc", &local()))
            .expect("resolves");
        assert_eq!(t.host_name, "10.1.2.3");
        assert_eq!(t.user, "incuser");

        let nope = dir.path().join("nope");
        let missing = Sources::new(Some(nope.as_path()), Path::new("/home/alice"));
        let err = load(&missing, &local()).expect_err("missing -F file");
        assert!(matches!(err, ConfigError::Read { .. }));
    }

    /// ~/.ssh/config writable by others is refused as ssh refuses it.
    #[cfg(unix)]
    #[test]
    fn group_writable_user_config_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let home = tempfile::tempdir().expect("tempdir");
        let config = home.path().join(".ssh").join("config");
        std::fs::create_dir(home.path().join(".ssh")).expect("mkdir");
        std::fs::write(&config, "Host x\n").expect("write");
        std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o664)).expect("chmod");
        let err = load(&Sources::new(None, home.path()), &local()).expect_err("refused");
        let shown = config.display();
        assert_eq!(
            err.to_string(),
            format!(
                "{shown}: bad owner or permissions on {shown} (it must be yours or root's, \
                 and writable by no one else)"
            )
        );
        assert_eq!(err.exit(), Exit::Config);
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
