# tunnel session: the client's lifeline once Jupyter is ready, after launch.sh
# (first start) or attach.sh (reattach). Reads the client's commands from
# stdin. EOF means this client is gone; the watchdog (common.sh) then gives a
# client TUNNEL_LINGER seconds to come back before it stops Jupyter. The
# newest session owns $rt/lifeline.pid, so an older one whose connection
# died unnoticed cannot take the server down with it.
printf '%s\n' "$$" >"$rt/lifeline.pid"
# Tell this session's client when Jupyter exits on its own (File > Shut Down).
(
  while [ ! -s "$rt/jupyter.exit" ]; do
    nap 1
    lp=
    read -r lp <"$rt/lifeline.pid" 2>/dev/null
    [ "$lp" = "$$" ] || exit 0
  done
  [ -e "$rt/stopping" ] || say "exited $(cat "$rt/jupyter.exit")"
) &
notifier=$!
while IFS= read -r cmd; do
  case $cmd in
    stop)
      kill "$notifier" 2>/dev/null
      stop_all
      say "stopped"
      exit 0
      ;;
    keep)
      : >"$rt/keep"
      say "kept"
      ;;
  esac
done
kill "$notifier" 2>/dev/null
# A job step dies with its srun on the login node: nobody can come back to
# it, so stop now rather than linger (the job ends with this process).
if [ -n "${TUNNEL_SLURM:-}" ]; then
  stop_all
  exit 0
fi
lp=
read -r lp <"$rt/lifeline.pid" 2>/dev/null
[ "$lp" = "$$" ] && rm -f "$rt/lifeline.pid"
exit 0
