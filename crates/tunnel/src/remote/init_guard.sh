# tunnel --init guard: started by bootstrap.sh's login shell beside --init, as
# `sh -c "$TUNNEL_GUARD"`, so $$ is this guard and $PPID that login shell.
# --init runs in the login shell itself (its exports must reach Jupyter), where
# nothing reads the client's stop request: without a bound, an --init that
# hangs (a module system waiting on a licence server) would outlive `tunnel up`
# for good. At TUNNEL_DEADLINE it names the hang, ends the login shell and
# everything --init started, and removes the runtime directory. The login
# shell kills this guard as soon as --init returns.
trap '' PIPE
shell=$PPID
while [ "$(date +%s)" -lt "$TUNNEL_DEADLINE" ]; do
  sleep 1 </dev/null >/dev/null 2>&1
  kill -0 "$shell" 2>/dev/null || exit 0
done
# The login shell's descendants (but not this guard's), found before the shell
# dies and they lose their parent.
below=$(ps -eo pid=,ppid= 2>/dev/null | awk -v shell="$shell" -v me="$$" '
  { up[$1] = $2 }
  END {
    for (p in up) {
      q = p; n = 0
      while ((q in up) && q != shell && q != me && n < 256) { q = up[q]; n++ }
      if (q == shell) print p
    }
  }')
printf 'tunnel-remote: error init-timeout %s\n' "the --init command did not finish within ${TUNNEL_TIMEOUT}s, so it and what it started were stopped; run it by hand in an ssh session to see where it waits (one that is only slow needs a larger tunnel up --timeout)"
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
