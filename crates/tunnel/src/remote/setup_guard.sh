# tunnel setup guard: started by bootstrap.sh's login shell before --init, as
# `sh -c 'eval "$TUNNEL_GUARD"'` (a short line in ps), so $$ is this guard and
# $PPID that login shell (and,
# after its exec, stage 2 with the same pid). Until Jupyter's start, which
# launch.sh bounds itself, nothing reads the client's stop request: --init runs
# in the login shell (its exports must reach Jupyter), then --env's activation
# and doctor's checks. Without a bound, one that hangs (a module system waiting
# on a licence server, conda on a stalled file system, a wedged nvidia-smi)
# would outlive `tunnel up` for good. At TUNNEL_DEADLINE the guard names the
# step that hung ($TUNNEL_RT/stage, written as each begins), ends the shell and
# everything it started, and removes the runtime directory. launch.sh, doctor.sh
# and `fail` end the guard (end_guard in common.sh).
trap '' PIPE
shell=$PPID
# Gone, or a zombie its parent has not reaped yet: this guard holds the
# channel's stdout, so a parent that reads to EOF before it reaps must not wait
# for the deadline.
alive() {
  kill -0 "$shell" 2>/dev/null || return 1
  case $(ps -o stat= -p "$shell" 2>/dev/null) in Z*) return 1 ;; esac
}
while [ "$(date +%s)" -lt "$TUNNEL_DEADLINE" ]; do
  sleep 1 </dev/null >/dev/null 2>&1
  alive || exit 0
done
stage=init
read -r stage <"$TUNNEL_RT/stage" 2>/dev/null
case $stage in
  env) kind=env-timeout what="activating --env $TUNNEL_ENV" ;;
  checks) kind=checks-timeout what="the checks (jupyter --version, nvidia-smi -L)" ;;
  setup) kind=setup-timeout what="the remote setup after --init" ;;
  *) kind=init-timeout what="the --init command" ;;
esac
# The shell's descendants (but not this guard's), found before the shell dies
# and they lose their parent.
below=$(ps -eo pid=,ppid= 2>/dev/null | awk -v shell="$shell" -v me="$$" '
  { up[$1] = $2 }
  END {
    for (p in up) {
      q = p; n = 0
      while ((q in up) && q != shell && q != me && n < 256) { q = up[q]; n++ }
      if (q == shell) print p
    }
  }')
printf 'tunnel-remote: error %s %s\n' "$kind" "$what did not finish within ${TUNNEL_TIMEOUT}s, so it and what it started were stopped; run it by hand in an ssh session to see where it waits (one that is only slow needs a larger tunnel up --timeout)"
tail -n 40 "$TUNNEL_RT/init.log" 2>/dev/null | while IFS= read -r l; do
  printf 'tunnel-remote: log %s\n' "$l"
done
# shellcheck disable=SC2086 # a list of pids
kill -TERM "$shell" $below 2>/dev/null
sleep 1 </dev/null >/dev/null 2>&1
# shellcheck disable=SC2086
kill -KILL $below 2>/dev/null
case $TUNNEL_RT in */tunnel-jupyter.*) rm -rf "$TUNNEL_RT" ;; esac
exit 0
