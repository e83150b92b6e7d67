//! `tunnel config HOST`: the options tunnel will use, printed as `ssh -G`
//! prints them (lowercase keys, one `key value` per line, ssh's value
//! spellings), or as a JSON object.
//!
//! Where tunnel uses a value of its own, that value is shown, not ssh's:
//! without ConnectTimeout (or with 0) tunnel gives up after
//! [`DEFAULT_CONNECT_TIMEOUT`] where ssh waits for the kernel, and without
//! ServerAliveInterval (or with 0) it probes an idle link every
//! [`DEFAULT_KEEPALIVE`], which ssh does not do.

use serde_json::{json, Map, Value};

use super::{StrictHostKeyChecking, Target};
use crate::connect::{DEFAULT_CONNECT_TIMEOUT, DEFAULT_KEEPALIVE};

/// One option as shown.
#[derive(Debug, Clone, PartialEq)]
enum Shown {
    Text(String),
    Number(u64),
    /// Several values on one line (known hosts files).
    Line(Vec<String>),
    /// One line per value (identity files).
    Repeated(Vec<String>),
}

fn yes_no(b: bool) -> Shown {
    Shown::Text(if b { "yes" } else { "no" }.into())
}

fn true_false(b: bool) -> Shown {
    Shown::Text(if b { "true" } else { "false" }.into())
}

fn paths(p: &[std::path::PathBuf]) -> Vec<String> {
    p.iter().map(|p| p.to_string_lossy().into_owned()).collect()
}

/// The options in `ssh -G`'s order.
fn options(t: &Target) -> Vec<(&'static str, Shown)> {
    let mut out = vec![
        ("host", Shown::Text(t.host_arg.clone())),
        ("user", Shown::Text(t.user.clone())),
        ("hostname", Shown::Text(t.host_name.clone())),
        ("port", Shown::Number(t.port.into())),
        ("hashknownhosts", yes_no(t.hash_known_hosts)),
        ("identitiesonly", yes_no(t.identities_only)),
        (
            "kbdinteractiveauthentication",
            yes_no(t.kbd_interactive_authentication),
        ),
        ("passwordauthentication", yes_no(t.password_authentication)),
        ("pubkeyauthentication", true_false(t.pubkey_authentication)),
        (
            "stricthostkeychecking",
            Shown::Text(
                match t.strict_host_key_checking {
                    StrictHostKeyChecking::Yes => "true",
                    StrictHostKeyChecking::No => "false",
                    StrictHostKeyChecking::Ask => "ask",
                    StrictHostKeyChecking::AcceptNew => "accept-new",
                }
                .into(),
            ),
        ),
        (
            "serveralivecountmax",
            Shown::Number(t.server_alive_count_max as u64),
        ),
        (
            "serveraliveinterval",
            Shown::Number(
                t.server_alive_interval
                    .unwrap_or(DEFAULT_KEEPALIVE)
                    .as_secs(),
            ),
        ),
    ];
    if let Some(a) = &t.host_key_alias {
        out.push(("hostkeyalias", Shown::Text(a.clone())));
    }
    if let Some(a) = &t.identity_agent_setting {
        out.push(("identityagent", Shown::Text(a.clone())));
    }
    out.push(("identityfile", Shown::Repeated(paths(&t.identity_files))));
    out.push((
        "globalknownhostsfile",
        Shown::Line(paths(&t.global_known_hosts)),
    ));
    out.push((
        "userknownhostsfile",
        Shown::Line(paths(&t.user_known_hosts)),
    ));
    out.push((
        "connecttimeout",
        Shown::Number(
            t.connect_timeout
                .unwrap_or(DEFAULT_CONNECT_TIMEOUT)
                .as_secs(),
        ),
    ));
    if let Some(j) = &t.proxy_jump {
        out.push(("proxyjump", Shown::Text(j.to_string())));
    }
    out
}

/// `key value` lines, as `ssh -G`.
pub fn text(t: &Target) -> String {
    let mut s = String::new();
    for (key, value) in options(t) {
        match value {
            Shown::Text(v) => s.push_str(&format!("{key} {v}\n")),
            Shown::Number(n) => s.push_str(&format!("{key} {n}\n")),
            Shown::Line(vs) if vs.is_empty() => s.push_str(&format!("{key} none\n")),
            Shown::Line(vs) => s.push_str(&format!("{key} {}\n", vs.join(" "))),
            Shown::Repeated(vs) => {
                for v in vs {
                    s.push_str(&format!("{key} {v}\n"));
                }
            }
        }
    }
    s
}

/// A JSON object: strings and numbers as in the text form, lists (known
/// hosts files, identity files) as arrays, `[]` for `none`.
pub fn json(t: &Target) -> Value {
    let mut m = Map::new();
    for (key, value) in options(t) {
        let v = match value {
            Shown::Text(v) => json!(v),
            Shown::Number(n) => json!(n),
            Shown::Line(vs) | Shown::Repeated(vs) => json!(vs),
        };
        m.insert(key.to_string(), v);
    }
    Value::Object(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::resolve_in;
    use crate::config::testing::{local, parse};

    #[test]
    fn like_ssh_g() {
        let cfg = parse(
            "Host gpu\n  HostName GPU.example.org\n  User bob\n  Port 2222\n  IdentityFile ~/.ssh/id_gpu\n\
             IdentityFile ~/.ssh/second\n  StrictHostKeyChecking yes\n  UserKnownHostsFile none\n\
             ConnectTimeout 7\n  ServerAliveInterval 15\n  ProxyJump j1,alice@10.0.0.2:22\n",
        );
        let t = resolve_in(&cfg, "gpu", &local()).expect("resolves");
        let out = text(&t);
        let global = format!(
            "globalknownhostsfile {0}/ssh_known_hosts {0}/ssh_known_hosts2\n",
            crate::platform::system_ssh_dir()
        );
        for line in [
            "host gpu\n",
            "user bob\n",
            "hostname gpu.example.org\n",
            "port 2222\n",
            "stricthostkeychecking true\n",
            "identityfile /home/alice/.ssh/id_gpu\nidentityfile /home/alice/.ssh/second\n",
            global.as_str(),
            "userknownhostsfile none\n",
            "connecttimeout 7\n",
            "serveraliveinterval 15\n",
            "proxyjump j1,alice@[10.0.0.2]:22\n",
        ] {
            assert!(out.contains(line), "{line:?} missing from:\n{out}");
        }
        assert!(!out.contains("hostkeyalias"));
        let j = json(&t);
        assert_eq!(j["port"], json!(2222));
        assert_eq!(j["userknownhostsfile"], json!([]));
        assert_eq!(j["identityfile"][1], json!("/home/alice/.ssh/second"));
    }

    #[test]
    fn tunnel_defaults_are_shown() {
        let t = resolve_in(&parse(""), "x", &local()).expect("resolves");
        let out = text(&t);
        assert!(out.contains(&format!(
            "connecttimeout {}\n",
            DEFAULT_CONNECT_TIMEOUT.as_secs()
        )));
        assert!(out.contains(&format!(
            "serveraliveinterval {}\n",
            DEFAULT_KEEPALIVE.as_secs()
        )));
        assert!(out.contains("stricthostkeychecking ask\n"));
        assert!(!out.contains("proxyjump"));
        assert!(!out.contains("identityagent"));
    }
}
