//! Windows: owner-only ACLs, console control events and a stop pipe for
//! `tunnel down`, other tunnel processes by handle, the user's profile, the
//! agent through OpenSSH for Windows' named pipe (or Pageant), and the
//! browser through the shell.
//!
//! This is the only file of the crate with `unsafe` code. Every block calls
//! one documented Win32 function; the pointers it passes point at live
//! buffers of the size it passes, strings are NUL-terminated UTF-16 that
//! outlive the call, and whatever the function allocates is released by a
//! guard (`OwnedHandle`, `LocalBox`) on every path.

use std::ffi::{c_void, OsStr, OsString};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::windows::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::ptr::{null, null_mut};
use std::sync::OnceLock;

use russh::keys::agent::client::{AgentClient, AgentStream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::windows::named_pipe::{ClientOptions, ServerOptions};
use tokio::signal::windows::{ctrl_break, ctrl_c, ctrl_close, CtrlBreak, CtrlC, CtrlClose};
use tokio::sync::mpsc;
use windows_sys::Win32::Foundation::{
    CloseHandle, GetLastError, LocalFree, ERROR_ACCESS_DENIED, HANDLE, STILL_ACTIVE,
};
use windows_sys::Win32::Security::Authorization::{
    ConvertSecurityDescriptorToStringSecurityDescriptorW, ConvertSidToStringSidW,
    ConvertStringSecurityDescriptorToSecurityDescriptorW, GetNamedSecurityInfoW,
    SetNamedSecurityInfoW, SDDL_REVISION_1, SE_FILE_OBJECT,
};
use windows_sys::Win32::Security::{
    GetSecurityDescriptorDacl, GetTokenInformation, TokenUser, ACL, DACL_SECURITY_INFORMATION,
    OWNER_SECURITY_INFORMATION, PROTECTED_DACL_SECURITY_INFORMATION, PSECURITY_DESCRIPTOR,
    TOKEN_QUERY, TOKEN_USER,
};
use windows_sys::Win32::System::LibraryLoader::{GetModuleHandleW, GetProcAddress};
use windows_sys::Win32::System::SystemInformation::{ComputerNameDnsHostname, GetComputerNameExW};
use windows_sys::Win32::System::Threading::{
    GetCurrentProcess, GetExitCodeProcess, OpenProcess, OpenProcessToken,
    QueryFullProcessImageNameW, PROCESS_NAME_WIN32, PROCESS_QUERY_LIMITED_INFORMATION,
};
use windows_sys::Win32::UI::Shell::ShellExecuteW;
use windows_sys::Win32::UI::WindowsAndMessaging::{FindWindowW, SW_SHOWNORMAL};

use super::sddl;
use crate::config::AgentSocket;

/// What `tunnel --help` says about this platform.
pub const HELP_NOTE: &str = "\
On Windows: state files are in %LOCALAPPDATA%\\tunnel with an owner-only ACL; \
Ctrl-C, Ctrl-Break and closing the console window stop tunnel like SIGINT/SIGTERM \
(a closed window allows Windows' few seconds for it); `tunnel down` asks the \
process to stop through a named pipe; the agent is OpenSSH for Windows' \
(\\\\.\\pipe\\openssh-ssh-agent, or SSH_AUTH_SOCK/IdentityAgent naming a pipe), \
else Pageant; `Match exec` runs through cmd.exe; `~user` is not supported.";

fn wide(s: &OsStr) -> Vec<u16> {
    s.encode_wide().chain(Some(0)).collect()
}

fn last_error() -> io::Error {
    io::Error::last_os_error()
}

/// Closes a kernel handle on drop.
struct OwnedHandle(HANDLE);

impl Drop for OwnedHandle {
    fn drop(&mut self) {
        // SAFETY: the handle came from a successful Open* call and is closed once.
        unsafe { CloseHandle(self.0) };
    }
}

/// Memory the system allocated with LocalAlloc for us; freed on drop.
struct LocalBox(*mut c_void);

impl Drop for LocalBox {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: the pointer was returned by a function documented to
            // allocate it with LocalAlloc, and is freed once.
            unsafe { LocalFree(self.0) };
        }
    }
}

/// A NUL-terminated UTF-16 string at `p` as a Rust string.
///
/// # Safety
/// `p` must point at a NUL-terminated UTF-16 string that stays valid for the call.
unsafe fn from_wide_ptr(p: *const u16) -> String {
    let mut len = 0usize;
    // SAFETY: the caller guarantees a terminating NUL within the allocation.
    while unsafe { *p.add(len) } != 0 {
        len += 1;
    }
    // SAFETY: `len` elements before the NUL are initialized.
    let slice = unsafe { std::slice::from_raw_parts(p, len) };
    OsString::from_wide(slice).to_string_lossy().into_owned()
}

/// The current user's SID in text form (`S-1-5-21-...`), read once.
pub fn user_sid() -> io::Result<String> {
    static SID: OnceLock<String> = OnceLock::new();
    if let Some(s) = SID.get() {
        return Ok(s.clone());
    }
    let mut token: HANDLE = null_mut();
    // SAFETY: GetCurrentProcess returns a pseudo-handle (no close needed);
    // OpenProcessToken writes a new handle into `token`, owned below.
    if unsafe { OpenProcessToken(GetCurrentProcess(), TOKEN_QUERY, &mut token) } == 0 {
        return Err(last_error());
    }
    let token = OwnedHandle(token);
    let mut len = 0u32;
    // SAFETY: a size query: no buffer, `len` receives the size needed.
    unsafe { GetTokenInformation(token.0, TokenUser, null_mut(), 0, &mut len) };
    if len == 0 {
        return Err(last_error());
    }
    // u64 elements: aligned for TOKEN_USER.
    let mut buf = vec![0u64; (len as usize).div_ceil(8)];
    // SAFETY: `buf` holds at least `len` bytes.
    if unsafe { GetTokenInformation(token.0, TokenUser, buf.as_mut_ptr().cast(), len, &mut len) }
        == 0
    {
        return Err(last_error());
    }
    // SAFETY: the call succeeded, so `buf` starts with a TOKEN_USER whose SID
    // points into `buf`, which lives until the end of this function.
    let user = unsafe { &*(buf.as_ptr() as *const TOKEN_USER) };
    let mut text: *mut u16 = null_mut();
    // SAFETY: `user.User.Sid` is a valid SID; the string is LocalAlloc'ed.
    if unsafe { ConvertSidToStringSidW(user.User.Sid, &mut text) } == 0 {
        return Err(last_error());
    }
    let text = LocalBox(text.cast());
    // SAFETY: ConvertSidToStringSidW returned a NUL-terminated string.
    let sid = unsafe { from_wide_ptr(text.0 as *const u16) };
    Ok(SID.get_or_init(|| sid).clone())
}

/// Whether this process runs under Wine (its ntdll exports
/// `wine_get_version`). Wine 8 keeps no DACLs on files: it maps them onto
/// Unix modes, and turns an owner-only DACL into mode 0777 (bits without an
/// entry stay open). Under Wine tunnel therefore leaves Wine's own modes.
pub fn under_wine() -> bool {
    static WINE: OnceLock<bool> = OnceLock::new();
    *WINE.get_or_init(|| {
        let ntdll = wide(OsStr::new("ntdll.dll"));
        // SAFETY: `ntdll` is NUL-terminated; the module handle is not owned
        // (GetModuleHandleW does not add a reference).
        let h = unsafe { GetModuleHandleW(ntdll.as_ptr()) };
        // SAFETY: `h` is a loaded module; the name is a NUL-terminated C string.
        !h.is_null() && unsafe { GetProcAddress(h, c"wine_get_version".as_ptr().cast()) }.is_some()
    })
}

/// Whether tests can read back what `restrict_dir` and `create_private_file`
/// promise (not under Wine: see `under_wine`).
#[cfg(test)]
pub fn access_is_checkable() -> bool {
    !under_wine()
}

/// Gives `path` the owner-only DACL (`sddl::owner_only_dacl`).
fn set_owner_only(path: &Path, dir: bool) -> io::Result<()> {
    if under_wine() {
        tracing::debug!("under Wine: {} keeps Wine's mode", path.display());
        return Ok(());
    }
    set_dacl(path, &sddl::owner_only_dacl(&user_sid()?, dir))
}

/// Sets the DACL described by `sddl_text` on `path`, protected from the
/// parent's inheritable entries.
fn set_dacl(path: &Path, sddl_text: &str) -> io::Result<()> {
    let text = wide(OsStr::new(sddl_text));
    let mut sd: PSECURITY_DESCRIPTOR = null_mut();
    // SAFETY: `text` is NUL-terminated; `sd` receives a LocalAlloc'ed descriptor.
    if unsafe {
        ConvertStringSecurityDescriptorToSecurityDescriptorW(
            text.as_ptr(),
            SDDL_REVISION_1,
            &mut sd,
            null_mut(),
        )
    } == 0
    {
        return Err(last_error());
    }
    let sd = LocalBox(sd);
    let (mut present, mut defaulted) = (0, 0);
    let mut dacl: *mut ACL = null_mut();
    // SAFETY: `sd.0` is the valid descriptor made above; `dacl` points into it.
    if unsafe { GetSecurityDescriptorDacl(sd.0, &mut present, &mut dacl, &mut defaulted) } == 0
        || present == 0
    {
        return Err(io::Error::other("no DACL in the descriptor"));
    }
    let name = wide(path.as_os_str());
    // SAFETY: `name` is NUL-terminated; `dacl` lives as long as `sd`.
    let rc = unsafe {
        SetNamedSecurityInfoW(
            name.as_ptr(),
            SE_FILE_OBJECT,
            DACL_SECURITY_INFORMATION | PROTECTED_DACL_SECURITY_INFORMATION,
            null_mut(),
            null_mut(),
            dacl,
            null(),
        )
    };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc as i32));
    }
    Ok(())
}

/// The owner and DACL of `path` in SDDL.
pub fn security_descriptor_text(path: &Path) -> io::Result<String> {
    let name = wide(path.as_os_str());
    let mut sd: PSECURITY_DESCRIPTOR = null_mut();
    let info = OWNER_SECURITY_INFORMATION | DACL_SECURITY_INFORMATION;
    // SAFETY: `name` is NUL-terminated; `sd` receives a LocalAlloc'ed
    // descriptor; the owner/DACL out-pointers are optional and not asked for.
    let rc = unsafe {
        GetNamedSecurityInfoW(
            name.as_ptr(),
            SE_FILE_OBJECT,
            info,
            null_mut(),
            null_mut(),
            null_mut(),
            null_mut(),
            &mut sd,
        )
    };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc as i32));
    }
    let sd = LocalBox(sd);
    let mut text: *mut u16 = null_mut();
    // SAFETY: `sd.0` is valid; `text` receives a LocalAlloc'ed string.
    if unsafe {
        ConvertSecurityDescriptorToStringSecurityDescriptorW(
            sd.0,
            SDDL_REVISION_1,
            info,
            &mut text,
            null_mut(),
        )
    } == 0
    {
        return Err(last_error());
    }
    let text = LocalBox(text.cast());
    // SAFETY: the conversion returned a NUL-terminated string.
    Ok(unsafe { from_wide_ptr(text.0 as *const u16) })
}

// ---- private files and directories ------------------------------------

/// Creates `dir` and its missing parents; the last one gets an owner-only,
/// protected DACL (inherited by what is created in it).
pub fn create_private_dir_all(dir: &Path) -> io::Result<()> {
    if dir.exists() {
        return Ok(());
    }
    fs::create_dir_all(dir)?;
    restrict_dir(dir)
}

/// Replaces the DACL of an existing directory with one entry: full control
/// for the current user, inherited by files and subdirectories; the
/// parent's entries no longer apply.
pub fn restrict_dir(dir: &Path) -> io::Result<()> {
    set_owner_only(dir, true)
}

/// Creates a new file (it must not exist) that only its owner may open. In
/// a directory from `create_private_dir_all` it inherits the owner-only
/// entry at creation; the DACL is then set explicitly as well, so a file
/// elsewhere is private too.
pub fn create_private_file(path: &Path) -> io::Result<File> {
    let f = OpenOptions::new().write(true).create_new(true).open(path)?;
    set_owner_only(path, false)?;
    Ok(f)
}

/// Opens `path` for appending; a file it creates gets an owner-only DACL
/// (an existing one keeps its ACL, as 0600 applies only at creation).
pub fn open_private_append(path: &Path) -> io::Result<File> {
    let existed = path.exists();
    let f = OpenOptions::new()
        .read(true)
        .append(true)
        .create(true)
        .open(path)?;
    if !existed {
        set_owner_only(path, false)?;
    }
    Ok(f)
}

/// Who may open `path`, for test messages: its security descriptor.
#[cfg(test)]
pub fn describe_access(path: &Path) -> String {
    security_descriptor_text(path).unwrap_or_else(|e| e.to_string())
}

#[cfg(test)]
/// Whether only the current user is let into `path` by its DACL.
pub fn is_private(path: &Path) -> io::Result<bool> {
    let text = security_descriptor_text(path)?;
    sddl::owner_only(&text, &user_sid()?).map_err(io::Error::other)
}

// ---- stop requests ----------------------------------------------------

/// The named pipe an `up` process listens on for `tunnel down`.
fn stop_pipe_name(pid: u32) -> String {
    format!(r"\\.\pipe\tunnel-stop-{pid}")
}

/// The secret `tunnel down` must send: random per process, kept only in
/// this process and in its (owner-only) state file.
pub fn stop_key() -> Option<String> {
    static KEY: OnceLock<String> = OnceLock::new();
    Some(
        KEY.get_or_init(|| {
            let mut b = [0u8; 16];
            getrandom::fill(&mut b).expect("the OS random generator");
            b.iter().map(|x| format!("{x:02x}")).collect()
        })
        .clone(),
    )
}

/// Ctrl-C, Ctrl-Break, closing the console window, and `tunnel down` (the
/// stop pipe) all mean "stop cleanly".
pub struct Interrupts {
    c: CtrlC,
    brk: CtrlBreak,
    close: CtrlClose,
    down: mpsc::Receiver<()>,
}

impl Interrupts {
    pub fn install() -> io::Result<Self> {
        let (tx, down) = mpsc::channel(1);
        let name = stop_pipe_name(std::process::id());
        // The first instance is created here, so a squatter's pipe of that
        // name is an error now rather than a silent `down` that never arrives.
        let first = ServerOptions::new()
            .first_pipe_instance(true)
            .reject_remote_clients(true)
            .access_outbound(false)
            .create(&name)?;
        let key = stop_key().unwrap_or_default();
        tokio::spawn(serve_stop_pipe(first, name, key, tx));
        Ok(Interrupts {
            c: ctrl_c()?,
            brk: ctrl_break()?,
            close: ctrl_close()?,
            down,
        })
    }

    /// Wait for the next one; returns its name.
    pub async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.c.recv() => "Ctrl-C",
            _ = self.brk.recv() => "Ctrl-Break",
            _ = self.close.recv() => "console closed",
            Some(()) = self.down.recv() => "tunnel down",
        }
    }
}

/// Accepts clients one at a time; a client that writes the key (one line,
/// within 2 s) is a stop request, anything else is dropped.
async fn serve_stop_pipe(
    mut server: tokio::net::windows::named_pipe::NamedPipeServer,
    name: String,
    key: String,
    tx: mpsc::Sender<()>,
) {
    loop {
        if server.connect().await.is_ok() {
            let mut buf = vec![0u8; 256];
            let mut got = 0usize;
            let read = async {
                while got < buf.len() {
                    match server.read(&mut buf[got..]).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            got += n;
                            if buf[..got].contains(&b'\n') {
                                break;
                            }
                        }
                    }
                }
            };
            let _ = tokio::time::timeout(std::time::Duration::from_secs(2), read).await;
            let line = String::from_utf8_lossy(&buf[..got]);
            if constant_time_eq(line.trim().as_bytes(), key.as_bytes()) {
                let _ = tx.send(()).await;
            } else {
                tracing::debug!("stop pipe: a client without the key");
            }
        }
        server = match ServerOptions::new()
            .reject_remote_clients(true)
            .access_outbound(false)
            .create(&name)
        {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("`tunnel down` cannot reach this process any more ({e})");
                return;
            }
        };
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Asks the `up` process `pid` to stop as on Ctrl-C, through its stop pipe
/// with the key from its state file.
pub async fn request_stop(pid: u32, stop_key: Option<&str>) -> io::Result<()> {
    let key = stop_key.ok_or_else(|| {
        io::Error::other("its state file has no stop key (started by an older tunnel?)")
    })?;
    let name = stop_pipe_name(pid);
    let mut client = loop {
        match ClientOptions::new().read(false).write(true).open(&name) {
            Ok(c) => break c,
            // All instances busy: the server makes a new one at once.
            Err(e) if e.raw_os_error() == Some(231) => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await
            }
            Err(e) => return Err(e),
        }
    };
    client.write_all(format!("{key}\n").as_bytes()).await?;
    client.flush().await?;
    Ok(())
}

/// Whether `pid` is a live process whose program is a `tunnel` (a process
/// of another user counts as live: it cannot be inspected).
pub fn is_tunnel_alive(pid: u32) -> bool {
    // SAFETY: OpenProcess takes plain values; the handle is owned below.
    let h = unsafe { OpenProcess(PROCESS_QUERY_LIMITED_INFORMATION, 0, pid) };
    if h.is_null() {
        // SAFETY: reads the calling thread's last-error value.
        return unsafe { GetLastError() } == ERROR_ACCESS_DENIED;
    }
    let h = OwnedHandle(h);
    let mut code = 0u32;
    // SAFETY: `h` is a process handle with query rights; `code` is a u32.
    if unsafe { GetExitCodeProcess(h.0, &mut code) } == 0 || code != STILL_ACTIVE as u32 {
        return false;
    }
    let mut buf = vec![0u16; 32768];
    let mut len = buf.len() as u32;
    // SAFETY: `buf` holds `len` u16s; `len` receives the length written.
    if unsafe { QueryFullProcessImageNameW(h.0, PROCESS_NAME_WIN32, buf.as_mut_ptr(), &mut len) }
        == 0
    {
        return true;
    }
    let image = OsString::from_wide(&buf[..len as usize]);
    Path::new(&image)
        .file_name()
        .is_some_and(|n| n.to_string_lossy().to_ascii_lowercase().contains("tunnel"))
}

// ---- the local user ---------------------------------------------------

/// The user as OpenSSH for Windows sees them: the profile directory as the
/// home, the lowercased account name, uid 1 (its getuid()), and the DNS
/// host name.
pub fn me() -> super::Me {
    let name = std::env::var("USERNAME")
        .ok()
        .filter(|u| !u.is_empty())
        .map(|u| u.to_lowercase())
        .unwrap_or_else(|| "user".into());
    super::Me {
        home: dirs::home_dir(),
        name,
        uid: 1,
        hostname: dns_host_name().unwrap_or_default(),
    }
}

fn dns_host_name() -> Option<String> {
    let mut buf = vec![0u16; 256];
    let mut len = buf.len() as u32;
    // SAFETY: `buf` holds `len` u16s; on success `len` is the length without the NUL.
    if unsafe { GetComputerNameExW(ComputerNameDnsHostname, buf.as_mut_ptr(), &mut len) } == 0 {
        return std::env::var("COMPUTERNAME").ok();
    }
    Some(
        OsString::from_wide(&buf[..len as usize])
            .to_string_lossy()
            .into_owned(),
    )
}

/// Another user's home (`~user`): not looked up on Windows.
pub fn home_of(_user: &str) -> Option<PathBuf> {
    None
}

// ---- ssh_config rules -------------------------------------------------

/// `%PROGRAMDATA%\ssh`, where OpenSSH for Windows keeps ssh_config and
/// ssh_known_hosts.
pub fn system_ssh_dir() -> String {
    let base = std::env::var("PROGRAMDATA").unwrap_or_else(|_| r"C:\ProgramData".into());
    format!(r"{base}\ssh")
}

/// OpenSSH for Windows' `is_absolute_path`: `\x`, `/x`, `C:x`.
pub fn include_is_absolute(arg: &str) -> bool {
    let b = arg.as_bytes();
    arg.starts_with('/')
        || arg.starts_with('\\')
        || (b.len() >= 2 && b[0].is_ascii_alphabetic() && b[1] == b':')
}

/// OpenSSH for Windows turns `\` into `/` before glob (so `\` escapes nothing).
pub fn include_pattern(arg: String) -> String {
    arg.replace('\\', "/")
}

/// A glob pattern's root (`C:/`, `/`) and the rest, `/`-separated.
pub fn glob_root(pattern: &str) -> (PathBuf, &str) {
    let b = pattern.as_bytes();
    if b.len() >= 3 && b[0].is_ascii_alphabetic() && b[1] == b':' && b[2] == b'/' {
        return (PathBuf::from(format!("{}\\", &pattern[..2])), &pattern[3..]);
    }
    match pattern.strip_prefix('/') {
        Some(rest) => (PathBuf::from("\\"), rest),
        None => (PathBuf::new(), pattern),
    }
}

/// A config file someone else could have written, or whose owner cannot
/// be compared (unix.rs has the Unix one).
#[derive(Debug, thiserror::Error)]
pub enum ConfigPermissionError {
    #[error("cannot find the current user's SID: {source}")]
    NoSid { source: io::Error },
    #[error(
        "bad owner or permissions on {} ({source}; it must be yours, SYSTEM's or \
         Administrators', and writable by no one else)",
        path.display()
    )]
    Insecure {
        path: PathBuf,
        source: sddl::InsecureConfig,
    },
}

/// OpenSSH for Windows' `check_secure_file_permission`: owned by the user,
/// SYSTEM or Administrators, writable by no one else.
pub fn check_config_permissions(
    path: &Path,
    _meta: &fs::Metadata,
) -> Result<(), ConfigPermissionError> {
    let text = match security_descriptor_text(path) {
        Ok(t) => t,
        Err(e) => {
            tracing::debug!("cannot read the ACL of {}: {e}", path.display());
            return Ok(());
        }
    };
    let sid = user_sid().map_err(|source| ConfigPermissionError::NoSid { source })?;
    sddl::config_file_secure(&text, &sid).map_err(|source| ConfigPermissionError::Insecure {
        path: path.to_path_buf(),
        source,
    })
}

/// `Match exec`: OpenSSH for Windows runs it with system(), i.e. cmd.exe /c.
pub fn match_exec_command(command: &str) -> Command {
    use std::os::windows::process::CommandExt;
    let comspec = std::env::var_os("ComSpec").unwrap_or_else(|| "cmd.exe".into());
    let mut c = Command::new(comspec);
    // raw_arg: cmd.exe does its own parsing of the rest of the line.
    c.arg("/c").raw_arg(command);
    c
}

// ---- ssh-agent --------------------------------------------------------

pub type Agent = AgentClient<Box<dyn AgentStream + Send + Unpin>>;

/// OpenSSH for Windows' agent, when SSH_AUTH_SOCK is not set.
pub const DEFAULT_AGENT_PIPE: &str = r"\\.\pipe\openssh-ssh-agent";

/// Connects to the agent: IdentityAgent's pipe, else SSH_AUTH_SOCK's, else
/// OpenSSH for Windows' default pipe; if that one does not exist, Pageant
/// when it runs. `Ok(None)`: no agent (IdentityAgent none, or nothing runs).
pub async fn connect_agent(socket: &AgentSocket) -> Result<Option<Agent>, russh::keys::Error> {
    let path: OsString = match socket {
        AgentSocket::Disabled => return Ok(None),
        AgentSocket::Path(p) => p.clone().into_os_string(),
        AgentSocket::Env => match std::env::var_os("SSH_AUTH_SOCK").filter(|s| !s.is_empty()) {
            Some(s) => s,
            None => {
                return match AgentClient::connect_named_pipe(DEFAULT_AGENT_PIPE).await {
                    Ok(a) => Ok(Some(a.dynamic())),
                    Err(russh::keys::Error::IO(e)) if e.kind() == io::ErrorKind::NotFound => {
                        connect_pageant().await
                    }
                    Err(e) => Err(e),
                }
            }
        },
    };
    AgentClient::connect_named_pipe(&path)
        .await
        .map(|a| Some(a.dynamic()))
}

/// Whether Pageant runs: it always has its hidden window of class and
/// title "Pageant" (also when it serves a named pipe too).
fn pageant_runs() -> bool {
    let name = wide(OsStr::new("Pageant"));
    // SAFETY: both strings are NUL-terminated and outlive the call; the
    // returned window handle is only compared with null, never used.
    !unsafe { FindWindowW(name.as_ptr(), name.as_ptr()) }.is_null()
}

async fn connect_pageant() -> Result<Option<Agent>, russh::keys::Error> {
    // russh's Pageant stream "connects" even with no Pageant (it fails on the
    // first request), so look for it first: no Pageant is no agent.
    if !pageant_runs() {
        tracing::debug!("no OpenSSH agent pipe and no Pageant window");
        return Ok(None);
    }
    match AgentClient::connect_pageant().await {
        Ok(a) => Ok(Some(a.dynamic())),
        Err(e) => {
            tracing::debug!("no OpenSSH agent pipe, and no Pageant ({e})");
            Ok(None)
        }
    }
}

// ---- the browser ------------------------------------------------------

/// Opens `file` with its registered program (ShellExecuteW "open"): no
/// command line of ours carries the URL, only the file's path.
pub fn open_browser(file: &Path) {
    let verb = wide(OsStr::new("open"));
    let path = wide(file.as_os_str());
    // SAFETY: both strings are NUL-terminated and outlive the call; the
    // other pointers are documented as optional.
    let rc = unsafe {
        ShellExecuteW(
            null_mut(),
            verb.as_ptr(),
            path.as_ptr(),
            null(),
            null(),
            SW_SHOWNORMAL,
        )
    } as isize;
    // Values above 32 mean success.
    if rc <= 32 {
        tracing::warn!("cannot open a browser (ShellExecute error {rc}); open the URL yourself");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_user_has_a_sid_and_a_profile() {
        let sid = user_sid().expect("sid");
        assert!(sid.starts_with("S-1-"), "{sid}");
        let me = me();
        assert!(me.home.is_some_and(|h| h.is_absolute()));
        assert_eq!(me.uid, 1, "OpenSSH for Windows' getuid()");
        assert!(!me.name.is_empty() && me.name == me.name.to_lowercase());
        assert!(home_of("someone").is_none());
    }

    #[test]
    fn a_private_dir_gets_the_owner_only_dacl() {
        let top = tempfile::tempdir().expect("tempdir");
        let d = top.path().join("x").join("state");
        create_private_dir_all(&d).expect("create");
        let f = d.join("f.json");
        drop(create_private_file(&f).expect("file"));
        assert!(create_private_file(&f).is_err(), "create_new");
        let text = security_descriptor_text(&d).expect("read the descriptor");
        assert!(text.contains("D:"), "{text}");
        if access_is_checkable() {
            assert_eq!(is_private(&d).ok(), Some(true), "{}", describe_access(&d));
            assert_eq!(is_private(&f).ok(), Some(true), "{}", describe_access(&f));
        } else {
            eprintln!("under Wine: {text} (Wine maps DACLs onto Unix modes)");
        }
    }

    #[test]
    fn own_process_is_a_live_tunnel_and_a_bogus_pid_is_not() {
        // The test binary is tunnel-<hash>.exe.
        assert!(is_tunnel_alive(std::process::id()));
        assert!(!is_tunnel_alive(u32::MAX - 3));
    }

    #[test]
    fn include_paths_follow_openssh_for_windows() {
        assert!(include_is_absolute(r"C:\Users\a\cfg"));
        assert!(include_is_absolute("c:/x"));
        assert!(include_is_absolute(r"\\server\share\x"));
        assert!(include_is_absolute("/x"));
        assert!(!include_is_absolute("conf.d/*"));
        assert_eq!(
            include_pattern(r"C:\Users\a\*.conf".into()),
            "C:/Users/a/*.conf"
        );
        assert_eq!(
            glob_root("C:/Users/a/*.conf"),
            (PathBuf::from(r"C:\"), "Users/a/*.conf")
        );
        assert_eq!(glob_root("/x/y"), (PathBuf::from(r"\"), "x/y"));
        assert_eq!(glob_root("x/y"), (PathBuf::new(), "x/y"));
        assert!(system_ssh_dir().ends_with(r"\ssh"));
    }

    #[test]
    fn match_exec_runs_cmd() {
        let ok = match_exec_command("exit 0").status().expect("cmd runs");
        assert!(ok.success());
        let no = match_exec_command("exit 7").status().expect("cmd runs");
        assert_eq!(no.code(), Some(7));
    }

    /// `tunnel down`'s path: the key on the stop pipe is a stop request;
    /// a client without it is not.
    #[tokio::test]
    async fn the_stop_pipe_takes_the_key_only() {
        let mut interrupts = Interrupts::install().expect("install");
        let key = stop_key().expect("a key on Windows");
        let pid = std::process::id();
        // A wrong key: ignored.
        request_stop(pid, Some("not-the-key"))
            .await
            .expect("connects");
        let waited =
            tokio::time::timeout(std::time::Duration::from_millis(500), interrupts.recv()).await;
        assert!(waited.is_err(), "a wrong key stopped it");
        assert!(request_stop(pid, None).await.is_err(), "no key, no request");
        request_stop(pid, Some(&key)).await.expect("connects");
        let got = tokio::time::timeout(std::time::Duration::from_secs(10), interrupts.recv())
            .await
            .expect("the stop arrives");
        assert_eq!(got, "tunnel down");
    }

    /// The agent transport: a named pipe speaking the agent protocol (here a
    /// minimal agent with no keys) is reached through `IdentityAgent`.
    #[tokio::test]
    async fn the_agent_is_reached_through_a_named_pipe() {
        let name = format!(r"\\.\pipe\tunnel-test-agent-{}", std::process::id());
        let mut server = ServerOptions::new()
            .first_pipe_instance(true)
            .create(&name)
            .expect("pipe");
        let agent = tokio::spawn(async move {
            server.connect().await.expect("client");
            let mut len = [0u8; 4];
            server.read_exact(&mut len).await.expect("len");
            let mut msg = vec![0u8; u32::from_be_bytes(len) as usize];
            server.read_exact(&mut msg).await.expect("msg");
            assert_eq!(msg, [11], "SSH_AGENTC_REQUEST_IDENTITIES");
            // SSH_AGENT_IDENTITIES_ANSWER with no keys.
            server
                .write_all(&[0, 0, 0, 5, 12, 0, 0, 0, 0])
                .await
                .expect("answer");
        });
        let mut client = connect_agent(&AgentSocket::Path(PathBuf::from(&name)))
            .await
            .expect("connects")
            .expect("an agent");
        let ids = client.request_identities().await.expect("identities");
        assert!(ids.is_empty());
        agent.await.expect("agent task");
        let missing = AgentSocket::Path(PathBuf::from(r"\\.\pipe\tunnel-no-such-agent"));
        assert!(connect_agent(&missing).await.is_err());
        assert!(connect_agent(&AgentSocket::Disabled)
            .await
            .expect("ok")
            .is_none());
        // No Pageant (as under Wine): no agent, quietly, rather than one that fails later.
        if !pageant_runs() {
            assert!(connect_pageant().await.expect("ok").is_none());
        }
    }
}
