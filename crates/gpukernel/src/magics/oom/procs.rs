//! Who holds the rest of the card: NVML's processes on one GPU, each marked as this notebook's
//! kernel, gpukernel itself, another kernel of the same user, or a stale one.

use gpuprobe::GpuProcess;
use serde::Serialize;
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The Python kernel whose cell failed.
    ThisKernel,
    /// This gpukernel (its own libtorch, after a libtorch `%maxbatch`).
    ThisGpukernel,
    /// Another Jupyter kernel of the same user.
    YourKernel,
    /// Any other process of the same user.
    YourProcess,
    /// Someone else's, or one /proc does not show (another container).
    Other,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProcessView {
    pub pid: u32,
    pub used_memory: Option<u64>,
    pub user: Option<String>,
    pub command: Option<String>,
    pub role: Role,
    /// Why it looks abandoned (a kernel whose server or connection file is gone).
    pub stale: Option<String>,
}

/// Marks each process; `kernel_pid` is the Python kernel behind us.
pub fn classify(processes: &[GpuProcess], kernel_pid: Option<u32>) -> Vec<ProcessView> {
    let me = std::process::id();
    let my_user = gpuprobe::process::details(me).user;
    processes
        .iter()
        .map(|p| {
            let command = p.details.command.clone();
            let same_user = my_user.is_some() && p.details.user == my_user;
            let is_kernel = command.as_deref().is_some_and(looks_like_kernel);
            let role = if Some(p.pid) == kernel_pid {
                Role::ThisKernel
            } else if p.pid == me {
                Role::ThisGpukernel
            } else if same_user && is_kernel {
                Role::YourKernel
            } else if same_user {
                Role::YourProcess
            } else {
                Role::Other
            };
            let stale = match role {
                Role::YourKernel | Role::YourProcess if is_kernel => {
                    stale_reason(p.pid, command.as_deref().unwrap_or(""))
                }
                _ => None,
            };
            ProcessView {
                pid: p.pid,
                used_memory: p.used_memory,
                user: p.details.user.clone(),
                command,
                role,
                stale,
            }
        })
        .collect()
}

fn looks_like_kernel(command: &str) -> bool {
    [
        "ipykernel",
        "gpukernel",
        "jupyter-kernel",
        "kernel_launcher",
    ]
    .iter()
    .any(|k| command.contains(k))
}

/// A kernel is stale when what started it is gone: it was re-parented to init (its Jupyter
/// server died), or the connection file on its command line no longer exists.
pub fn stale_reason(pid: u32, command: &str) -> Option<String> {
    if parent_pid(pid) == Some(1) {
        return Some("orphaned: its Jupyter server is gone (parent is init)".into());
    }
    connection_file(command)
        .filter(|file| !Path::new(file).exists())
        .map(|file| format!("its connection file {file} no longer exists"))
}

fn parent_pid(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(1)?.parse().ok()
}

fn connection_file(command: &str) -> Option<&str> {
    let mut words = command.split_whitespace();
    while let Some(word) = words.next() {
        if word == "-f" || word == "--connection-file" {
            return words.next();
        }
        if let Some(file) = word
            .strip_prefix("--connection-file=")
            .or_else(|| word.strip_prefix("-f="))
        {
            return Some(file);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kernel_whose_connection_file_is_gone_is_stale() {
        assert_eq!(
            connection_file("python -m ipykernel_launcher -f /tmp/k.json"),
            Some("/tmp/k.json")
        );
        assert_eq!(
            connection_file("gpukernel run --connection-file=/x.json"),
            Some("/x.json")
        );
        let reason = stale_reason(
            std::process::id(),
            "python -m ipykernel_launcher -f /nonexistent/kernel-1.json",
        );
        assert!(reason.unwrap().contains("/nonexistent/kernel-1.json"));
        let here = std::env::current_exe().unwrap();
        let command = format!("ipykernel_launcher -f {}", here.display());
        assert_eq!(stale_reason(std::process::id(), &command), None);
    }

    #[test]
    fn this_process_is_marked() {
        let me = std::process::id();
        let processes = vec![GpuProcess {
            pid: me,
            used_memory: Some(1),
            details: gpuprobe::process::details(me),
        }];
        let views = classify(&processes, Some(me + 1));
        assert_eq!(views[0].role, Role::ThisGpukernel);
        let views = classify(&processes, Some(me));
        assert_eq!(views[0].role, Role::ThisKernel);
    }
}
