# tunnel setup guard: started by bootstrap.sh just before it execs the login
# shell, as `sh -c 'eval "$TUNNEL_GUARD"'` (a short line in ps). So $$ is this
# guard, and TUNNEL_SHELL_PID its parent: the shell that runs the login, --init
# and stage 2 in turn (exec keeps its pid); the guard is not one of that shell's
# jobs, so a `wait` in --init does not wait for it. Until Jupyter's start, which launch.sh bounds
# itself, nothing reads the client's stop request: a login profile, --init,
# the --env activation or doctor's checks that hang (a module system waiting on
# a licence server, conda on a stalled file system, a wedged nvidia-smi) would
# outlive `tunnel up` for good. At TUNNEL_DEADLINE the guard names the step
# ($TUNNEL_RT/stage, written as each begins), ends the shell and what runs under
# it, and removes the runtime directory. end_guard (common.sh) ends the guard.
# Either side claims the hand-off by creating $TUNNEL_RT/guard.done: only one
# of them acts.
trap '' PIPE
shell=$TUNNEL_SHELL_PID
claim() { mkdir "$TUNNEL_RT/guard.done" 2>/dev/null; }
# The state and parent pid of process $1 ("S 123"), from /proc or ps.
state_of() {
  if [ -r "/proc/$1/stat" ]; then
    s=
    { read -r s <"/proc/$1/stat"; } 2>/dev/null
    s=${s##*) }
    printf '%s\n' "${s%"${s#* * }"}"
  else
    ps -eo pid=,stat=,ppid= 2>/dev/null | awk -v p="$1" '$1 == p { print $2, $3 }'
  fi
}
# The shell is alive while this guard is still its child (a shell that died
# makes the guard an orphan, and its pid may then go to anyone: never act on
# it) and it is not a zombie (this guard holds the channel's stdout, so a
# parent that reads to EOF before it reaps must not wait for the deadline).
# Where neither /proc nor ps can tell the parent, the pid alone has to do.
alive() {
  # shellcheck disable=SC2046 # two words: state and parent
  set -- $(state_of "$$")
  if [ -n "${2:-}" ]; then
    [ "$2" = "$shell" ] || return 1
  else
    kill -0 "$shell" 2>/dev/null || return 1
  fi
  # shellcheck disable=SC2046
  set -- $(state_of "$shell")
  case ${1:-} in Z*) return 1 ;; esac
}
while :; do
  if ! alive; then
    # Ended without end_guard (an --init that ran `exit`): nobody else will
    # remove the runtime directory.
    claim && case $TUNNEL_RT in */tunnel-jupyter.*) rm -rf "$TUNNEL_RT" ;; esac
    exit 0
  fi
  [ "$(date +%s)" -lt "$TUNNEL_DEADLINE" ] || break
  sleep 1 </dev/null >/dev/null 2>&1
done
claim || exit 0
# The last look before killing: the shell may have gone since the loop's.
if ! alive; then
  case $TUNNEL_RT in */tunnel-jupyter.*) rm -rf "$TUNNEL_RT" ;; esac
  exit 0
fi
stage=
{ read -r stage <"$TUNNEL_RT/stage"; } 2>/dev/null
case $stage in
  init) kind=init-timeout what="the --init command" ;;
  env) kind=env-timeout what="activating --env $TUNNEL_ENV" ;;
  checks) kind=checks-timeout what="the checks (jupyter --version, nvidia-smi -L)" ;;
  setup) kind=setup-timeout what="the remote setup after --init" ;;
  *) kind=login-timeout what="the login shell's startup files (~/.profile, ~/.bash_profile)" ;;
esac
# The shell and everything under it, listed before the shell dies and its
# children lose their parent (not this guard, nor what it runs).
below=$(ps -eo pid=,ppid= 2>/dev/null | awk -v shell="$shell" -v me="$$" '
  { up[$1] = $2 }
  END {
    for (p in up) {
      q = p; n = 0
      while ((q in up) && q != shell && q != me && n < 256) { q = up[q]; n++ }
      if (q == shell) print p
    }
  }')
printf 'tunnel-remote: error %s %s\n' "$kind" "$what was still running when --timeout (${TUNNEL_TIMEOUT}s, counted from the login) ran out, so the launch was stopped; run it by hand in an ssh session to see where it waits (one that is only slow needs a larger tunnel up --timeout)"
tail -n 40 "$TUNNEL_RT/init.log" 2>/dev/null | while IFS= read -r l; do
  printf 'tunnel-remote: log %s\n' "$l"
done
# shellcheck disable=SC2086 # a list of pids
kill -TERM "$shell" $below 2>/dev/null
sleep 1 </dev/null >/dev/null 2>&1
# shellcheck disable=SC2086
kill -KILL "$shell" $below 2>/dev/null
case $TUNNEL_RT in */tunnel-jupyter.*) rm -rf "$TUNNEL_RT" ;; esac
exit 0
