//! Owner and command line of a process, from `/proc` (Linux).
//!
//! NVML reports pids in the host's pid namespace; inside a container some of them do not exist
//! here, so every lookup is optional.

use std::fs;

/// What `/proc` tells about one pid.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ProcessDetails {
    pub user: Option<String>,
    pub command: Option<String>,
}

/// Reads the owner and command line of `pid`; fields are `None` where `/proc` does not say.
pub fn details(pid: u32) -> ProcessDetails {
    ProcessDetails {
        user: owner_uid(pid).map(|uid| user_name(uid).unwrap_or_else(|| uid.to_string())),
        command: command_line(pid),
    }
}

/// The command line with arguments joined by spaces.
pub fn command_line(pid: u32) -> Option<String> {
    let raw = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let text: Vec<String> = raw
        .split(|b| *b == 0)
        .filter(|part| !part.is_empty())
        .map(|part| String::from_utf8_lossy(part).into_owned())
        .collect();
    if text.is_empty() {
        // Kernel threads and zombies have an empty cmdline; fall back to the short name.
        return fs::read_to_string(format!("/proc/{pid}/comm"))
            .ok()
            .map(|s| format!("[{}]", s.trim()));
    }
    Some(text.join(" "))
}

fn owner_uid(pid: u32) -> Option<u32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Maps a uid to a name through /etc/passwd (no NSS: LDAP users show as numbers).
fn user_name(uid: u32) -> Option<String> {
    let passwd = fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let mut fields = line.split(':');
        let name = fields.next()?;
        let _password = fields.next()?;
        let id: u32 = fields.next()?.parse().ok()?;
        (id == uid).then(|| name.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let me = details(std::process::id());
        let command = me.command.expect("own cmdline is readable");
        assert!(!command.is_empty());
        assert!(me.user.is_some());
    }

    #[test]
    fn missing_pid_gives_nothing() {
        // pid_max is at most 2^22 on Linux, so this pid cannot exist.
        assert_eq!(details(u32::MAX - 1), ProcessDetails::default());
    }
}
