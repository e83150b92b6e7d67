# tunnel remote helpers, shared by the launcher (launch.sh) and a reattach
# (attach.sh). Runs in /bin/sh. Protocol: lines "tunnel-remote: <event> <args>"
# on stdout; see remote.rs.
unset TUNNEL_MAIN
# The client may vanish; writing to a closed channel must not kill us before
# we have stopped Jupyter.
trap '' PIPE
rt=$TUNNEL_RT
say() { printf 'tunnel-remote: %s\n' "$*"; }
nap() { sleep "$1" 2>/dev/null || sleep 1; }

log_tail() {
  [ -s "$1" ] || return 0
  tail -n 40 "$1" 2>/dev/null | while IFS= read -r l; do say "log $l"; done
}

remove_rt() {
  case $rt in */tunnel-jupyter.*) rm -rf "$rt" ;; esac
}

# Stop Jupyter (it shuts its kernels down on SIGTERM), then kill whatever is
# left that belongs to this run: kernels name their connection file, which
# lives in $rt, on their command line.
stop_all() {
  : >"$rt/stopping" 2>/dev/null
  jp=$(cat "$rt/jupyter.pid" 2>/dev/null)
  if [ -n "$jp" ]; then
    kill -TERM "$jp" 2>/dev/null
    i=0
    while [ ! -s "$rt/jupyter.exit" ] && [ "$i" -lt 100 ]; do nap 0.1; i=$((i + 1)); done
    [ -s "$rt/jupyter.exit" ] || kill -KILL "$jp" 2>/dev/null
  fi
  # Only a runtime dir of ours: an empty $rt would match every command line.
  case $rt in
    */tunnel-jupyter.*)
      ps -eo pid=,args= 2>/dev/null | while read -r p a; do
        case $a in *"$rt"/*) [ "$p" != "$$" ] && kill -KILL "$p" 2>/dev/null ;; esac
      done
      ;;
  esac
  remove_rt
}

# The setup's guard (setup_guard.sh) is done once Jupyter's start, which has a
# deadline of its own, begins, or doctor's checks end, or the run fails. Fails
# where the guard has claimed the hand-off first: it has named a hang and is
# stopping this shell, which must not go on.
end_guard() {
  [ -n "${TUNNEL_GUARD_PID:-}" ] || return 0
  mkdir "$rt/guard.done" 2>/dev/null || return 1
  kill "$TUNNEL_GUARD_PID" 2>/dev/null
  unset TUNNEL_GUARD_PID
}

fail_log=
fail() {
  kind=$1
  shift
  end_guard || exit 1
  say "error $kind $*"
  [ -n "$fail_log" ] && log_tail "$fail_log"
  stop_all
  exit 1
}

# Stops Jupyter once no client has held a lifeline (session.sh) for
# TUNNEL_LINGER seconds in a row. A server kept for a detached client
# ($rt/keep) waits for its clients indefinitely, unless Jupyter has exited.
start_watchdog() {
  (
    exec </dev/null >/dev/null 2>&1
    idle=0
    while [ -d "$rt" ] && [ ! -e "$rt/stopping" ]; do
      nap 1
      lp=
      read -r lp <"$rt/lifeline.pid" 2>/dev/null
      if [ -n "$lp" ] && kill -0 "$lp" 2>/dev/null; then
        idle=0
      elif [ -e "$rt/keep" ] && [ ! -s "$rt/jupyter.exit" ]; then
        idle=0
      else
        idle=$((idle + 1))
        if [ "$idle" -ge "$TUNNEL_LINGER" ]; then
          stop_all
          exit 0
        fi
      fi
    done
  ) &
}
