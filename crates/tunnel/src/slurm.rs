//! `tunnel up LOGIN --slurm "SBATCH ARGS"`: the SLURM commands run on the
//! login node, over the login connection.
//!
//! - [`submit`]: `sbatch --parsable` with a batch script (`remote/batch.sh`)
//!   that only holds the allocation; it knows no token.
//! - [`query`] / [`wait_running`]: `squeue` until the job runs, reporting
//!   state and reason (`PENDING (Resources)`) as they change.
//! - [`srun_wrapper`]: the job step that runs the usual launcher inside the
//!   allocation (`srun --jobid=ID --overlap ...`); the launcher script and the
//!   token reach it on srun's stdin, so neither is on a command line, in the
//!   job script or in slurmctld's records.
//! - [`cancel`]: `scancel`, then wait until squeue no longer lists the job.
//!
//! Every command goes through [`remote::EXEC_COMMAND`] (the script on stdin):
//! the user's login shell can be anything, and the `--slurm` arguments are
//! quoted for `/bin/sh` only.

use std::time::Duration;

use russh::ChannelMsg;

use crate::connect::Handle;
use crate::exit::{Exit, HasExit};
use crate::platform::Interrupts;
use crate::remote::{self, EXEC_COMMAND, STDIN_SCRIPT};

const BATCH: &str = include_str!("remote/batch.sh");

/// The job's name in squeue (the user's `-J`/`--job-name` wins).
pub const JOB_NAME: &str = "jupyter-tunnel";
/// How long the batch script waits for the Jupyter step before it ends the
/// job: tunnel starts the step seconds after the job runs, so only a client
/// that went away while the job was pending takes this long.
pub const STEP_GRACE_SECS: u64 = 300;
/// squeue, sbatch and scancel answer in seconds; a hung controller must not
/// hang tunnel.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);
/// Poll squeue every second at first (a free node starts the job at once),
/// then every few seconds: a pending job may wait for hours, and a busy
/// controller should not be polled hard.
const POLL_FAST: Duration = Duration::from_secs(1);
const POLL_FAST_COUNT: u32 = 30;
const POLL_SLOW: Duration = Duration::from_secs(5);

/// Non-interactive ssh sessions may lack the SLURM commands on PATH (module
/// systems put them there in profile scripts): read the profiles then. Their
/// stdin is /dev/null so they cannot eat the lines meant for srun.
const PATH_FIX: &str = "command -v squeue >/dev/null 2>&1 || \
{ . /etc/profile; [ -r \"$HOME/.profile\" ] && . \"$HOME/.profile\"; } </dev/null >/dev/null 2>&1\n";

#[derive(Debug, thiserror::Error)]
pub enum SlurmError {
    #[error("--slurm {args:?}: {reason}")]
    BadArgs { args: String, reason: String },
    #[error(
        "sbatch on {host} refused the job{}:\n{}\n\
         The --slurm arguments go to sbatch as given: correct them and try again.",
        status_text(*status),
        indent(stderr)
    )]
    Submit {
        host: String,
        status: Option<u32>,
        stderr: String,
    },
    #[error(
        "{command} on {host} failed{}:\n{}\n\
         Is {host} a SLURM login node? The SLURM commands must be on PATH in an ssh session there.",
        status_text(*status),
        indent(stderr)
    )]
    Command {
        host: String,
        command: &'static str,
        status: Option<u32>,
        stderr: String,
    },
    #[error("cannot run {command} on {host}: {source}")]
    Channel {
        host: String,
        command: &'static str,
        source: russh::Error,
    },
    #[error("timed out after {}s waiting for {command} on {host}", COMMAND_TIMEOUT.as_secs())]
    Timeout { host: String, command: &'static str },
    #[error("{command} on {host} answered {answer:?}, which tunnel does not understand")]
    Unexpected {
        host: String,
        command: &'static str,
        answer: String,
    },
    #[error("job {job} ended before it started running ({last})")]
    NeverRan { job: String, last: String },
    #[error(
        "the connection to {host} was lost while job {job} ran Jupyter; with --slurm tunnel \
         does not reconnect (the job step ends with its srun on the login node)"
    )]
    ConnectionLost { host: String, job: String },
    #[error("job {job} ended while Jupyter ran in it ({how})")]
    Ended { job: String, how: String },
}

fn status_text(status: Option<u32>) -> String {
    status
        .map(|s| format!(" (exit status {s})"))
        .unwrap_or_default()
}

fn indent(text: &str) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.is_empty() {
        return "  (no message)".into();
    }
    lines
        .iter()
        .map(|l| format!("  {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

impl HasExit for SlurmError {
    fn exit(&self) -> Exit {
        match self {
            SlurmError::BadArgs { .. } => Exit::Usage,
            SlurmError::Submit { .. }
            | SlurmError::Command { .. }
            | SlurmError::Unexpected { .. }
            | SlurmError::NeverRan { .. }
            | SlurmError::Ended { .. } => Exit::Slurm,
            SlurmError::Channel { .. } | SlurmError::ConnectionLost { .. } => Exit::ConnectionLost,
            SlurmError::Timeout { .. } => Exit::Timeout,
        }
    }
}

/// `--slurm "-p gpu --gres=gpu:1"` split as a shell would (quotes allowed).
pub fn sbatch_args(raw: &str) -> Result<Vec<String>, SlurmError> {
    shlex::split(raw).ok_or_else(|| SlurmError::BadArgs {
        args: raw.to_string(),
        reason: "unbalanced quotes".into(),
    })
}

/// The arguments as a user would type them: quoted only where a shell needs it.
pub fn args_text(args: &[String]) -> String {
    let plain = |a: &str| {
        !a.is_empty()
            && a.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_./:=,@%+".contains(&b))
    };
    args.iter()
        .map(|a| {
            if plain(a) {
                a.clone()
            } else {
                remote::sh_quote(a)
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// What one remote command printed.
#[derive(Debug, Default)]
struct Output {
    status: Option<u32>,
    stdout: String,
    stderr: String,
}

/// Run `script` with `/bin/sh` on the login node; its output once it ends.
async fn run_sh(
    handle: &Handle,
    host: &str,
    command: &'static str,
    script: &str,
) -> Result<Output, SlurmError> {
    let channel_err = |source| SlurmError::Channel {
        host: host.to_string(),
        command,
        source,
    };
    let run = async {
        let mut channel = handle.channel_open_session().await?;
        channel.exec(true, EXEC_COMMAND).await?;
        channel
            .data(remote::escape_line(&format!("{PATH_FIX}{script}")).as_bytes())
            .await?;
        channel.eof().await?;
        let (mut out, mut err, mut status) = (Vec::new(), Vec::new(), None);
        while let Some(msg) = channel.wait().await {
            match msg {
                ChannelMsg::Data { data } => out.extend_from_slice(&data),
                ChannelMsg::ExtendedData { data, .. } => err.extend_from_slice(&data),
                ChannelMsg::ExitStatus { exit_status } => status = Some(exit_status),
                ChannelMsg::Close => break,
                _ => {}
            }
        }
        Ok(Output {
            status,
            stdout: String::from_utf8_lossy(&out).into_owned(),
            stderr: String::from_utf8_lossy(&err).into_owned(),
        })
    };
    match tokio::time::timeout(COMMAND_TIMEOUT, run).await {
        Err(_) => Err(SlurmError::Timeout {
            host: host.to_string(),
            command,
        }),
        Ok(Err(e)) => Err(channel_err(e)),
        Ok(Ok(out)) => {
            tracing::trace!("{command} on {host}: {out:?}");
            Ok(out)
        }
    }
}

/// A name for this submission's step file (not a secret: it only keeps a
/// stale file from an earlier job with the same id from being mistaken for
/// this one's).
pub fn step_key() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The batch script, with its grace time and step key filled in.
pub fn batch_script(step_key: &str) -> String {
    BATCH
        .replace("TUNNEL_GRACE_SECS", &STEP_GRACE_SECS.to_string())
        .replace("TUNNEL_STEP_KEY", step_key)
}

/// Submit the holding job; its id. sbatch's own message when it refuses.
/// `step_key` must be the one the job step's launcher is given.
pub async fn submit(
    handle: &Handle,
    host: &str,
    args: &[String],
    step_key: &str,
) -> Result<String, SlurmError> {
    let quoted: Vec<String> = args.iter().map(|a| remote::sh_quote(a)).collect();
    // Our defaults come first so that the user's -J/-o (later) win.
    let script = format!(
        "exec sbatch --parsable --job-name={JOB_NAME} --output=/dev/null {args} <<'TUNNEL_BATCH'\n\
         {batch}TUNNEL_BATCH\n",
        args = quoted.join(" "),
        batch = batch_script(step_key),
    );
    let out = run_sh(handle, host, "sbatch", &script).await?;
    if out.status != Some(0) {
        return Err(SlurmError::Submit {
            host: host.to_string(),
            status: out.status,
            stderr: if out.stderr.trim().is_empty() {
                out.stdout
            } else {
                out.stderr
            },
        });
    }
    // `--parsable` prints `ID` or `ID;CLUSTER`.
    let id = out
        .stdout
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty())
        .and_then(|l| l.split(';').next())
        .unwrap_or_default()
        .to_string();
    if !valid_job_id(&id) {
        return Err(SlurmError::Unexpected {
            host: host.to_string(),
            command: "sbatch --parsable",
            answer: out.stdout,
        });
    }
    if !out.stderr.trim().is_empty() {
        // Warnings (a default partition, a rounded time limit) are the user's business.
        for line in out.stderr.lines().filter(|l| !l.trim().is_empty()) {
            tracing::warn!("{line}");
        }
    }
    Ok(id)
}

/// Job ids are numbers; anything else must not reach a command line.
fn valid_job_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 20 && id.bytes().all(|b| b.is_ascii_digit())
}

/// Node names are host names; anything else must not reach a command line.
pub fn valid_node(node: &str) -> bool {
    !node.is_empty()
        && node.len() <= 253
        && !node.starts_with('-')
        && node
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
}

/// One squeue line about the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobStatus {
    /// PENDING, RUNNING, COMPLETING, ...
    pub state: String,
    /// Why it is pending (`Resources`, `Priority`, ...); "None" when running.
    pub reason: String,
    /// The job's nodes, as squeue abbreviates them (`gpu[01-02]`).
    pub nodes: String,
    /// The node that runs the batch script (the first one): where Jupyter runs.
    pub batch_host: String,
    /// Seconds left before the time limit; `None` when unlimited or unknown.
    pub time_left: Option<u64>,
}

impl JobStatus {
    pub fn is_running(&self) -> bool {
        self.state == "RUNNING"
    }

    /// States a job does not come back from (COMPLETING included: it is
    /// being torn down).
    pub fn has_ended(&self) -> bool {
        matches!(
            self.state.as_str(),
            "COMPLETING"
                | "COMPLETED"
                | "CANCELLED"
                | "FAILED"
                | "TIMEOUT"
                | "NODE_FAIL"
                | "PREEMPTED"
                | "BOOT_FAIL"
                | "DEADLINE"
                | "OUT_OF_MEMORY"
                | "REVOKED"
                | "SPECIAL_EXIT"
        )
    }

    /// `PENDING (Resources)`, `RUNNING on gpu01, 1h59m left`.
    pub fn describe(&self) -> String {
        let mut s = self.state.clone();
        if self.is_running() {
            s.push_str(&format!(" on {}", self.nodes));
            if let Some(left) = self.time_left {
                s.push_str(&format!(", {} left", duration_text(left)));
            }
        } else if !self.reason.is_empty() && self.reason != "None" {
            s.push_str(&format!(" ({})", self.reason));
        }
        s
    }
}

/// `1h02m`, `59m58s`, `3d04h`.
pub fn duration_text(secs: u64) -> String {
    match secs {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m{:02}s", s / 60, s % 60),
        s if s < 86400 => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
        s => format!("{}d{:02}h", s / 86400, (s % 86400) / 3600),
    }
}

const SQUEUE_FORMAT: &str = "%T|%r|%N|%B|%L";

fn parse_status(line: &str) -> Option<JobStatus> {
    let mut f = line.trim().splitn(5, '|');
    let state = f.next()?.trim().to_string();
    let reason = f.next()?.trim().to_string();
    let nodes = f.next()?.trim().to_string();
    let batch_host = f.next()?.trim().to_string();
    let time_left = parse_time_left(f.next()?.trim());
    if state.is_empty() {
        return None;
    }
    Some(JobStatus {
        state,
        reason,
        nodes,
        batch_host,
        time_left,
    })
}

/// squeue's `%L`: `[days-]hours:minutes:seconds`, `minutes:seconds`, or a
/// word (`UNLIMITED`, `NOT_SET`, `INVALID`).
fn parse_time_left(s: &str) -> Option<u64> {
    let (days, rest) = match s.split_once('-') {
        Some((d, r)) => (d.parse::<u64>().ok()?, r),
        None => (0, s),
    };
    let parts: Vec<u64> = rest
        .split(':')
        .map(|p| p.parse::<u64>().ok())
        .collect::<Option<_>>()?;
    // squeue's numbers are the remote's: no overflow on absurd ones.
    let (h, m, s) = match parts.as_slice() {
        [h, m, s] => (*h, *m, *s),
        [m, s] => (0, *m, *s),
        [s] => (0, 0, *s),
        _ => return None,
    };
    days.checked_mul(86400)?
        .checked_add(h.checked_mul(3600)?)?
        .checked_add(m.checked_mul(60)?)?
        .checked_add(s)
}

/// The job's line in squeue; `None` once squeue no longer knows the job.
pub async fn query(
    handle: &Handle,
    host: &str,
    job: &str,
) -> Result<Option<JobStatus>, SlurmError> {
    let script = format!("exec squeue -h -j {job} -o '{SQUEUE_FORMAT}'\n");
    let out = run_sh(handle, host, "squeue", &script).await?;
    if out.status == Some(0) {
        let Some(line) = out.stdout.lines().find(|l| !l.trim().is_empty()) else {
            return Ok(None);
        };
        return parse_status(line).map(Some).ok_or(SlurmError::Unexpected {
            host: host.to_string(),
            command: "squeue",
            answer: out.stdout,
        });
    }
    // A job purged from the controller's memory is "invalid" to squeue.
    if out.stderr.contains("Invalid job id") {
        return Ok(None);
    }
    Err(SlurmError::Command {
        host: host.to_string(),
        command: "squeue",
        status: out.status,
        stderr: out.stderr,
    })
}

/// How [`wait_running`] ended.
pub enum Waited {
    Running(JobStatus),
    Interrupted(&'static str),
}

/// Poll squeue until the job runs; `changed` hears each new state/reason.
pub async fn wait_running(
    handle: &Handle,
    host: &str,
    job: &str,
    signals: &mut Interrupts,
    mut changed: impl FnMut(&JobStatus),
) -> Result<Waited, SlurmError> {
    let mut last: Option<JobStatus> = None;
    let mut last_error = String::new();
    let mut polls = 0u32;
    loop {
        match query(handle, host, job).await {
            Ok(Some(st)) => {
                let moved = last
                    .as_ref()
                    .is_none_or(|l| l.state != st.state || l.reason != st.reason);
                if moved {
                    changed(&st);
                }
                if st.is_running() && !st.batch_host.is_empty() {
                    return Ok(Waited::Running(st));
                }
                if st.has_ended() {
                    return Err(SlurmError::NeverRan {
                        job: job.to_string(),
                        last: st.describe(),
                    });
                }
                last = Some(st);
            }
            Ok(None) => {
                return Err(SlurmError::NeverRan {
                    job: job.to_string(),
                    last: match &last {
                        Some(l) => format!("last seen {}; squeue no longer lists it", l.describe()),
                        None => "squeue never listed it".into(),
                    },
                })
            }
            // A lost connection will not come back by polling.
            Err(e @ SlurmError::Channel { .. }) => return Err(e),
            // A controller that is restarting or overloaded: say so once, keep waiting.
            Err(e) => {
                let text = e.to_string();
                if text != last_error {
                    tracing::warn!("{text}; still waiting");
                    last_error = text;
                }
            }
        }
        polls += 1;
        let pause = if polls < POLL_FAST_COUNT {
            POLL_FAST
        } else {
            POLL_SLOW
        };
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            sig = signals.recv() => return Ok(Waited::Interrupted(sig)),
        }
    }
}

/// The script, run by `/bin/sh` on the login node, that starts the launcher
/// as a step of `job` on `node`: srun gets the rest of stdin (the launcher
/// line and the token) and hands it to the step, whose `/bin/sh` reads the
/// launcher line as [`remote::EXEC_COMMAND`] would. `--overlap` shares the
/// CPUs, memory and GPUs that the batch script holds; the step inherits the
/// allocation's environment (CUDA_VISIBLE_DEVICES included).
pub fn srun_wrapper(job: &str, node: &str) -> String {
    format!(
        "{PATH_FIX}exec srun --jobid={job} --overlap --nodes=1 --ntasks=1 --nodelist={node} \
         --job-name={JOB_NAME} /bin/sh -c {}\n",
        remote::sh_quote(STDIN_SCRIPT)
    )
}

/// The relay a job step runs where ssh to the node is closed: every
/// forwarded connection, multiplexed over its stdin/stdout (framing in
/// [`crate::relay`]), to Jupyter on the node's 127.0.0.1
/// (`python3 -c RELAY PORT`). Half-closes are passed on, so HTTP and
/// websockets end as they would over a direct channel. stdin's end (the
/// tunnel is gone) ends it.
pub const RELAY_PY: &str = r#"import os, socket, struct, sys, threading
port = int(sys.argv[1])
lock = threading.Lock()
socks = {}
def send(kind, cid, data=b""):
    v = memoryview(struct.pack(">cII", kind, cid, len(data)) + data)
    with lock:
        while v:
            v = v[os.write(1, v):]
def pump(cid, s):
    try:
        while True:
            d = s.recv(65536)
            if not d:
                break
            send(b"D", cid, d)
        send(b"E", cid)
    except OSError:
        send(b"C", cid)
buf = bytearray()
def fill(n):
    while len(buf) < n:
        d = os.read(0, 262144)
        if not d:
            return False
        buf.extend(d)
    return True
while fill(9):
    kind, cid, n = struct.unpack(">cII", bytes(buf[:9]))
    if not fill(9 + n):
        break
    data = bytes(buf[9:9 + n])
    del buf[:9 + n]
    s = socks.get(cid)
    try:
        if kind == b"O":
            s = socket.create_connection(("127.0.0.1", port))
            socks[cid] = s
            threading.Thread(target=pump, args=(cid, s), daemon=True).start()
        elif s is None:
            continue
        elif kind == b"D":
            s.sendall(data)
        elif kind == b"E":
            s.shutdown(socket.SHUT_WR)
        elif kind == b"C":
            del socks[cid]
            s.close()
    except OSError:
        socks.pop(cid, None)
        if s is not None:
            s.close()
        send(b"C", cid)
"#;

/// The script (run by `/bin/sh` on the login node, the rest of its stdin
/// being the relay's frames) that starts the relay as a step of `job` on
/// `node`, for Jupyter on its `port`: the fallback where ssh to the node is
/// closed. `--unbuffered`: srun would otherwise hold output back until a
/// newline, which binary traffic may never send.
pub fn relay_wrapper(job: &str, node: &str, port: u16) -> String {
    let finder = "for p in python3 python; do command -v \"$p\" >/dev/null 2>&1 && \
                  exec \"$p\" -c \"$0\" \"$1\"; done; \
                  echo \"tunnel relay: no python3 on $(hostname)\" >&2; exit 127";
    format!(
        "{PATH_FIX}exec srun --unbuffered --quiet --jobid={job} --overlap --nodes=1 --ntasks=1 \
         --nodelist={node} --job-name=jupyter-relay /bin/sh -c {} {} {port}\n",
        remote::sh_quote(finder),
        remote::sh_quote(RELAY_PY)
    )
}

/// scancel the job and wait (up to about 40 s) until squeue no longer lists
/// it, so that its processes are gone when tunnel exits. `Ok(false)` when it
/// was still listed at the end.
pub async fn cancel(handle: &Handle, host: &str, job: &str) -> Result<bool, SlurmError> {
    let script = format!(
        "scancel {job} 2>/dev/null\n\
         i=0\n\
         while [ \"$i\" -lt 40 ]; do\n\
         \x20 s=$(squeue -h -j {job} -o %T 2>/dev/null)\n\
         \x20 [ -z \"$s\" ] && exit 0\n\
         \x20 sleep 1\n\
         \x20 i=$((i + 1))\n\
         done\n\
         echo \"$s\"\n\
         exit 3\n"
    );
    let out = run_sh(handle, host, "scancel", &script).await?;
    match out.status {
        Some(0) => Ok(true),
        Some(3) => Ok(false),
        status => Err(SlurmError::Command {
            host: host.to_string(),
            command: "scancel",
            status,
            stderr: out.stderr,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_sbatch_args_like_a_shell() {
        assert_eq!(
            sbatch_args("-p gpu --gres=gpu:1 --time=02:00:00 -J 'my job'").expect("valid"),
            vec![
                "-p",
                "gpu",
                "--gres=gpu:1",
                "--time=02:00:00",
                "-J",
                "my job"
            ]
        );
        assert!(sbatch_args("").expect("empty is fine").is_empty());
        let args = sbatch_args("-p gpu --time=1:00:00 -J 'my job'").expect("valid");
        assert_eq!(args_text(&args), "-p gpu --time=1:00:00 -J 'my job'");
        let err = sbatch_args("-p 'gpu").expect_err("unbalanced");
        assert_eq!(err.exit(), Exit::Usage);
    }

    #[test]
    fn parses_squeue_lines() {
        assert_eq!(
            parse_status("RUNNING|None|gpu[01-02]|gpu01|1-02:03:04"),
            Some(JobStatus {
                state: "RUNNING".into(),
                reason: "None".into(),
                nodes: "gpu[01-02]".into(),
                batch_host: "gpu01".into(),
                time_left: Some(86400 + 2 * 3600 + 3 * 60 + 4),
            })
        );
        let pending = parse_status("PENDING|Resources||n/a|UNLIMITED").expect("parses");
        assert_eq!(pending.time_left, None);
        assert_eq!(pending.describe(), "PENDING (Resources)");
        assert!(!pending.is_running() && !pending.has_ended());
        assert_eq!(parse_time_left("59:58"), Some(3598));
        assert_eq!(parse_time_left("NOT_SET"), None);
        assert_eq!(parse_time_left("18446744073709551615:00:00"), None);
        assert_eq!(parse_time_left("18446744073709551615-0:0:1"), None);
        assert_eq!(parse_status(""), None);
        let running = parse_status("RUNNING|None|gpu01|gpu01|1:59:58").expect("parses");
        assert_eq!(running.describe(), "RUNNING on gpu01, 1h59m left");
    }

    #[test]
    fn ids_and_node_names_are_checked_before_they_reach_a_command_line() {
        assert!(valid_job_id("12345"));
        assert!(!valid_job_id("12;rm -rf ~"));
        assert!(!valid_job_id(""));
        assert!(valid_node("gpu-01.cluster"));
        assert!(!valid_node("-oProxyCommand=x"));
        assert!(!valid_node("a b"));
        assert!(!valid_node("n/a"));
    }

    // The remote scripts run under a POSIX /bin/sh: the test runs one locally.
    #[cfg(unix)]
    #[test]
    fn the_scripts_are_valid_sh_and_hold_no_secret() {
        let batch = batch_script("0123abcd");
        assert!(batch.starts_with("#!/bin/sh\n"));
        assert!(batch.contains("tunnel-slurm-$SLURM_JOB_ID.0123abcd"));
        assert!(!batch.contains("TOKEN") && !batch.contains("TUNNEL_"));
        for (name, text) in [
            ("batch", batch),
            ("srun", srun_wrapper("12", "gpu01")),
            ("relay", relay_wrapper("12", "gpu01", 8888)),
            ("path", PATH_FIX.to_string()),
        ] {
            remote::assert_sh_parses(name, &text);
        }
    }

    // scancel signals the batch script and the launcher at once; the launcher's "stopping"
    // mark can land while the script removes the runtime directory, which then survives
    // (seen in CI: `test_a_job_ended_from_outside_ends_the_tunnel_with_its_state`). The
    // race is made certain here by an `rm` that lets that write land in its first removal.
    #[cfg(unix)]
    #[test]
    fn a_write_during_the_removal_does_not_leave_the_runtime_directory_behind() {
        use std::os::unix::fs::PermissionsExt;
        use std::process::{Command, Stdio};
        use std::time::{Duration, Instant};

        let dir = tempfile::tempdir().expect("temp dir");
        let tmp = dir.path();
        let rt = tmp.join("tunnel-jupyter.test");
        std::fs::create_dir(&rt).expect("runtime dir");
        for name in ["jupyter.pid", "token", "jupyter.log"] {
            std::fs::write(rt.join(name), "x").expect("a runtime file");
        }
        let bin = tmp.join("bin");
        std::fs::create_dir(&bin).expect("bin dir");
        let fake_rm = bin.join("rm");
        std::fs::write(
            &fake_rm,
            "#!/bin/sh\n\
             # The first removal of a directory: its files go, then the launcher's mark lands.\n\
             if [ ! -e \"$TMPDIR/raced\" ] && [ \"$1\" = -rf ]; then\n\
               : > \"$TMPDIR/raced\"\n\
               /bin/rm -rf \"$2\"/*\n\
               : > \"$2/stopping\"\n\
               exit 1\n\
             fi\n\
             exec /bin/rm \"$@\"\n",
        )
        .expect("fake rm");
        std::fs::set_permissions(&fake_rm, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        // The launcher, alive until the script is signalled (as scancel leaves it).
        let mut launcher = Command::new("sleep").arg("30").spawn().expect("sleep");
        std::fs::write(
            tmp.join("tunnel-slurm-7.k1"),
            format!("{} {}\n", launcher.id(), rt.display()),
        )
        .expect("step file");
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut script = Command::new("/bin/sh")
            .arg("-c")
            .arg(batch_script("k1"))
            .env("TMPDIR", tmp)
            .env("SLURM_JOB_ID", "7")
            .env("PATH", path)
            .stdin(Stdio::null())
            .spawn()
            .expect("batch script");
        std::thread::sleep(Duration::from_millis(300));
        let term = Command::new("kill")
            .args(["-TERM", &script.id().to_string()])
            .status()
            .expect("kill");
        assert!(term.success());
        let started = Instant::now();
        let status = loop {
            if let Some(status) = script.try_wait().expect("wait") {
                break status;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the script did not end"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let _ = launcher.kill();
        let _ = launcher.wait();
        assert!(status.success(), "{status:?}");
        assert!(tmp.join("raced").exists(), "the race was not staged");
        assert!(
            !rt.exists(),
            "left behind: {:?}",
            std::fs::read_dir(&rt).map(|d| d.count())
        );
        assert!(!tmp.join("tunnel-slurm-7.k1").exists());
    }

    #[test]
    fn srun_runs_the_same_reader_as_exec_command() {
        assert!(EXEC_COMMAND.contains(STDIN_SCRIPT));
        let w = srun_wrapper("7", "gpu01");
        assert!(w.contains("--jobid=7 --overlap"));
        assert!(w.contains("--nodelist=gpu01"));
        assert!(w.ends_with(&format!("{}\n", remote::sh_quote(STDIN_SCRIPT))));
    }
}
