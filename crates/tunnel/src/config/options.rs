//! The options gathered while the config is evaluated: the first value
//! obtained for each option wins, as in ssh; IdentityFile (and
//! CertificateFile) accumulate instead, and the known-hosts and domain
//! lists are taken whole from the first line that sets them.

use std::path::PathBuf;

use super::jump::Jump;
use super::parse::{Canonicalize, Setting};
use super::StrictHostKeyChecking;

/// Where a value came from, for messages about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Origin {
    pub path: PathBuf,
    pub line: usize,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} line {}", self.path.display(), self.line)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct IdentityFile {
    pub path: String,
    /// From a user config (not the system one or the defaults).
    pub user_provided: bool,
}

#[derive(Debug, Clone, Default)]
pub(super) struct Options {
    pub hostname: Option<String>,
    pub user: Option<String>,
    /// The User came from the config, not `user@` or `-l`.
    pub user_from_config: bool,
    pub port: Option<u16>,
    pub identity_files: Vec<IdentityFile>,
    pub identities_only: Option<bool>,
    pub identity_agent: Option<String>,
    pub jump: Option<Jump>,
    pub proxy_command: Option<(String, Origin)>,
    pub strict_host_key_checking: Option<StrictHostKeyChecking>,
    pub user_known_hosts: Option<Vec<String>>,
    pub global_known_hosts: Option<Vec<String>>,
    pub host_key_alias: Option<String>,
    pub server_alive_interval: Option<u32>,
    pub server_alive_count_max: Option<u32>,
    pub connect_timeout: Option<u32>,
    pub pubkey_authentication: Option<bool>,
    pub password_authentication: Option<bool>,
    pub kbd_interactive_authentication: Option<bool>,
    pub hash_known_hosts: Option<bool>,
    pub check_host_ip: Option<(bool, Origin)>,
    pub canonicalize_hostname: Option<Canonicalize>,
    pub canonical_domains: Option<Vec<String>>,
    pub canonicalize_max_dots: Option<u32>,
    pub canonicalize_fallback_local: Option<bool>,
    pub permitted_cnames: Option<(Vec<String>, Origin)>,
    pub known_hosts_command: Option<(String, Origin)>,
    pub revoked_host_keys: Option<(String, Origin)>,
    pub ignore_unknown: Option<String>,
    /// Options tunnel does not implement, first value of each.
    pub not_honoured: Vec<(&'static str, String, Origin)>,
    /// A Host pattern other than `*`, or a Match on the host name, applied.
    pub configured: bool,
}

/// OpenSSH keeps at most this many identity files.
const MAX_IDENTITY_FILES: usize = 100;

/// One IdentityFile more than OpenSSH keeps (its text is ssh's).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Too many identity files specified (max {max})", max = MAX_IDENTITY_FILES)]
pub struct TooManyIdentityFiles;

fn first<T>(slot: &mut Option<T>, value: T) {
    if slot.is_none() {
        *slot = Some(value);
    }
}

impl Options {
    /// Take a setting from an applying line (first value wins).
    pub fn apply(
        &mut self,
        setting: &Setting,
        user_config: bool,
        origin: &Origin,
    ) -> Result<(), TooManyIdentityFiles> {
        let at = || origin.clone();
        match setting {
            Setting::HostName(v) => first(&mut self.hostname, v.clone()),
            Setting::User(v) => {
                if self.user.is_none() {
                    self.user = Some(v.clone());
                    self.user_from_config = true;
                }
            }
            Setting::Port(p) => first(&mut self.port, *p),
            Setting::IdentityFile(path) => {
                let file = IdentityFile {
                    path: path.clone(),
                    user_provided: user_config,
                };
                if !self.identity_files.contains(&file) {
                    if self.identity_files.len() >= MAX_IDENTITY_FILES {
                        return Err(TooManyIdentityFiles);
                    }
                    self.identity_files.push(file);
                }
            }
            Setting::IdentitiesOnly(v) => first(&mut self.identities_only, *v),
            Setting::IdentityAgent(v) => first(&mut self.identity_agent, v.clone()),
            Setting::ProxyJump(j) => {
                // Whichever of ProxyCommand and ProxyJump comes first wins.
                if self.proxy_command.is_none() && self.jump.is_none() {
                    self.jump = Some(j.clone());
                }
            }
            Setting::ProxyCommand(v) => {
                if self.jump.is_none() {
                    first(&mut self.proxy_command, (v.clone(), at()));
                }
            }
            Setting::StrictHostKeyChecking(v) => first(&mut self.strict_host_key_checking, *v),
            Setting::UserKnownHostsFile(v) => first(&mut self.user_known_hosts, v.clone()),
            Setting::GlobalKnownHostsFile(v) => first(&mut self.global_known_hosts, v.clone()),
            Setting::HostKeyAlias(v) => first(&mut self.host_key_alias, v.clone()),
            // `none` leaves the option unset, so a later value still counts.
            Setting::ServerAliveInterval(v) => {
                if let Some(v) = v {
                    first(&mut self.server_alive_interval, *v);
                }
            }
            Setting::ConnectTimeout(v) => {
                if let Some(v) = v {
                    first(&mut self.connect_timeout, *v);
                }
            }
            Setting::ServerAliveCountMax(v) => first(&mut self.server_alive_count_max, *v),
            Setting::PubkeyAuthentication(v) => first(&mut self.pubkey_authentication, *v),
            Setting::PasswordAuthentication(v) => first(&mut self.password_authentication, *v),
            Setting::KbdInteractiveAuthentication(v) => {
                first(&mut self.kbd_interactive_authentication, *v)
            }
            Setting::HashKnownHosts(v) => first(&mut self.hash_known_hosts, *v),
            Setting::CheckHostIp(v) => first(&mut self.check_host_ip, (*v, at())),
            Setting::CanonicalizeHostname(v) => first(&mut self.canonicalize_hostname, *v),
            Setting::CanonicalDomains(v) => first(&mut self.canonical_domains, v.clone()),
            Setting::CanonicalizeMaxDots(v) => first(&mut self.canonicalize_max_dots, *v),
            Setting::CanonicalizeFallbackLocal(v) => {
                first(&mut self.canonicalize_fallback_local, *v)
            }
            Setting::CanonicalizePermittedCnames(v) => {
                first(&mut self.permitted_cnames, (v.clone(), at()))
            }
            Setting::KnownHostsCommand(v) => {
                first(&mut self.known_hosts_command, (v.clone(), at()))
            }
            Setting::RevokedHostKeys(v) => first(&mut self.revoked_host_keys, (v.clone(), at())),
            Setting::IgnoreUnknown(v) => first(&mut self.ignore_unknown, v.clone()),
            Setting::NotHonoured { option, value } => {
                if !self.not_honoured.iter().any(|(o, _, _)| o == option) {
                    self.not_honoured.push((option, value.clone(), at()));
                }
            }
        }
        Ok(())
    }

    /// No ProxyCommand and no ProxyJump (not even `none`): ssh would
    /// connect directly, so it may canonicalize the host name.
    pub fn direct(&self) -> bool {
        let no_command = self
            .proxy_command
            .as_ref()
            .is_none_or(|(c, _)| c.eq_ignore_ascii_case("none"));
        no_command && self.jump.is_none()
    }

    /// CanonicalizePermittedCNAMEs with a rule (not unset, not `none`).
    pub fn has_permitted_cnames(&self) -> bool {
        self.permitted_cnames
            .as_ref()
            .is_some_and(|(rules, _)| !(rules.len() == 1 && rules[0] == "none"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::jump;

    fn origin() -> Origin {
        Origin {
            path: PathBuf::from("/cfg"),
            line: 1,
        }
    }

    #[test]
    fn first_value_wins() {
        let mut o = Options::default();
        for s in [
            Setting::Port(1),
            Setting::Port(2),
            Setting::User("a".into()),
            Setting::User("b".into()),
            Setting::ConnectTimeout(None),
            Setting::ConnectTimeout(Some(5)),
            Setting::ConnectTimeout(Some(6)),
            Setting::UserKnownHostsFile(vec!["/a".into(), "/b".into()]),
            Setting::UserKnownHostsFile(vec!["/c".into()]),
        ] {
            o.apply(&s, true, &origin()).expect("applies");
        }
        assert_eq!(o.port, Some(1));
        assert_eq!(o.user.as_deref(), Some("a"));
        assert!(o.user_from_config);
        assert_eq!(
            o.connect_timeout,
            Some(5),
            "`none` does not count as a value"
        );
        assert_eq!(
            o.user_known_hosts,
            Some(vec!["/a".to_string(), "/b".to_string()])
        );
    }

    #[test]
    fn identity_files_accumulate_without_duplicates() {
        let mut o = Options::default();
        for (path, user) in [("~/a", true), ("~/b", true), ("~/a", true), ("~/a", false)] {
            o.apply(&Setting::IdentityFile(path.into()), user, &origin())
                .expect("applies");
        }
        let paths: Vec<(&str, bool)> = o
            .identity_files
            .iter()
            .map(|f| (f.path.as_str(), f.user_provided))
            .collect();
        assert_eq!(paths, [("~/a", true), ("~/b", true), ("~/a", false)]);
        for i in 3..MAX_IDENTITY_FILES {
            o.apply(&Setting::IdentityFile(format!("~/{i}")), true, &origin())
                .expect("applies");
        }
        let err = o
            .apply(&Setting::IdentityFile("~/one-more".into()), true, &origin())
            .expect_err("too many");
        assert_eq!(
            err.to_string(),
            "Too many identity files specified (max 100)"
        );
    }

    #[test]
    fn proxy_command_and_jump_compete() {
        let j = Setting::ProxyJump(jump::parse("bastion").expect("parses"));
        let c = Setting::ProxyCommand("nc %h %p".into());
        let mut o = Options::default();
        o.apply(&j, true, &origin()).expect("applies");
        o.apply(&c, true, &origin()).expect("applies");
        assert!(o.proxy_command.is_none() && o.jump.is_some());
        assert!(!o.direct());
        let mut o = Options::default();
        o.apply(&c, true, &origin()).expect("applies");
        o.apply(&j, true, &origin()).expect("applies");
        assert!(o.proxy_command.is_some() && o.jump.is_none());
        let mut o = Options::default();
        o.apply(&Setting::ProxyCommand("none".into()), true, &origin())
            .expect("applies");
        assert!(o.direct());
    }
}
