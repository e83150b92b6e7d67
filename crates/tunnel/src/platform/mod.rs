//! What differs between operating systems, behind one interface: private
//! files and directories, the console's stop requests, other tunnel
//! processes, the local user, the ssh-agent transport, the browser, and the
//! few ssh_config rules that OpenSSH for Windows changes. The flows
//! (`up`, `down`, `config`, ...) call these functions and never test the
//! platform themselves.
//!
//! - `unix.rs` (Linux, macOS): file modes, signals (SIGINT, SIGTERM,
//!   SIGHUP), kill(2), the passwd entry, the agent's Unix socket.
//! - `windows.rs`: owner-only ACLs, console control events and a stop pipe
//!   for `tunnel down`, OpenSSH for Windows' agent pipe and Pageant. It is
//!   the only file of the crate with `unsafe` code; each block says why it
//!   is sound.
//! - `sddl.rs`: reading security descriptors in their text form (SDDL),
//!   pure code, compiled and tested everywhere.

#[cfg_attr(not(windows), allow(dead_code))]
mod sddl;

#[cfg(unix)]
mod unix;
#[cfg(unix)]
pub use unix::*;

#[cfg(windows)]
mod windows;
#[cfg(windows)]
pub use windows::*;

/// The local user as ssh sees them (`me()` fills it per platform): the home
/// (passwd entry or `$HOME`; on Windows the profile directory), the account
/// name (lowercased on Windows), the uid (1 on Windows, its getuid()), and
/// this machine's host name.
pub struct Me {
    pub home: Option<std::path::PathBuf>,
    pub name: String,
    pub uid: u32,
    pub hostname: String,
}

/// Test helper: only the owner may open `path` (mode 0600/0700; on Windows
/// an owner-only DACL). Under Wine, which keeps no DACLs, it says so and
/// checks nothing: the DACL itself is tested in `sddl`.
#[cfg(test)]
pub fn assert_private(path: &std::path::Path) {
    if !access_is_checkable() {
        eprintln!(
            "{}: not checked (Wine maps ACLs onto Unix modes and keeps no DACL)",
            path.display()
        );
        return;
    }
    assert!(
        is_private(path).unwrap_or(false),
        "{} is not private: {}",
        path.display(),
        describe_access(path)
    );
}
