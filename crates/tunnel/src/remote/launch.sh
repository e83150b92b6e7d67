# tunnel launcher: stage 2, runs in /bin/sh with the login environment,
# after common.sh and setup.sh; session.sh follows once Jupyter is ready.
end_guard || exit 1
case $TUNNEL_APP in
  lab) pkg=jupyterlab ;;
  notebook) pkg=notebook ;;
  *) pkg=jupyter_server ;;
esac
command -v jupyter >/dev/null 2>&1 ||
  fail jupyter-missing "jupyter not found on the remote PATH ($PATH); install it (pip install $pkg) or select its environment with --env"
command -v "jupyter-$TUNNEL_APP" >/dev/null 2>&1 ||
  fail jupyter-missing "'jupyter $TUNNEL_APP' is not installed in $(dirname "$(command -v jupyter)") (pip install $pkg)"

d=$(expand_home "${TUNNEL_DIR:-~}")
cd "$d" 2>/dev/null || fail dir "--dir $d: no such directory on the remote"

allow_root=
if [ "$(id -u)" = 0 ]; then
  allow_root=--allow-root
  say "root"
fi

unset TUNNEL_INIT TUNNEL_INIT_STATUS TUNNEL_ENV TUNNEL_DIR
: >"$rt/jupyter.log"
# The subshell owns Jupyter so it can `wait` for it and record its exit. It
# holds none of this channel's descriptors: the channel must be able to close
# (client gone or detached) while Jupyter keeps running. Only Jupyter (and so
# its kernels) gets JUPYTER_RUNTIME_DIR: helpers such as the watchdog must not
# look like part of the server.
# The token comes from its 0600 file (bootstrap.sh); a JUPYTER_TOKEN from a
# login profile would win over the file and end up in every kernel's
# environment.
unset JUPYTER_TOKEN
(
  # shellcheck disable=SC2086 # $allow_root is empty or one word
  JUPYTER_RUNTIME_DIR=$rt JUPYTER_TOKEN_FILE=$rt/token jupyter "$TUNNEL_APP" --no-browser --ip=127.0.0.1 --port="$TUNNEL_PORT" \
    --ServerApp.port_retries=50 $allow_root </dev/null >>"$rt/jupyter.log" 2>&1 &
  jp=$!
  printf '%s\n' "$jp" >"$rt/jupyter.pid"
  wait "$jp"
  st=$?
  printf '%s\n' "$st" >"$rt/jupyter.exit" 2>/dev/null
) </dev/null >/dev/null 2>&1 &

# Jupyter writes jpserver-<pid>.json (0600) once it listens; it holds the real
# port. `jupyter` execs the app, so <pid> is normally the one we started: test
# that name with a builtin (no forks stealing CPU from Jupyter's start), and
# look for any info file now and then in case a wrapper changed the pid.
deadline=$(($(date +%s) + TUNNEL_TIMEOUT))
port=
n=0
while :; do
  if [ -s "$rt/jupyter.exit" ]; then
    fail_log=$rt/jupyter.log
    fail jupyter-exited "jupyter $TUNNEL_APP exited with status $(cat "$rt/jupyter.exit") before it was ready"
  fi
  [ -n "${jp:-}" ] || jp=$(cat "$rt/jupyter.pid" 2>/dev/null)
  info=
  if [ -n "$jp" ] && [ -f "$rt/jpserver-$jp.json" ]; then
    info=$rt/jpserver-$jp.json
  elif [ $((n % 25)) -eq 24 ]; then
    info=$(find "$rt" -maxdepth 1 \( -name 'jpserver-*.json' -o -name 'nbserver-*.json' \) 2>/dev/null | head -n 1)
  fi
  n=$((n + 1))
  if [ -n "$info" ]; then
    port=$(sed -n 's/.*"port": *\([0-9][0-9]*\).*/\1/p' "$info" | head -n 1)
    base=$(sed -n 's/.*"base_url": *"\([^"]*\)".*/\1/p' "$info" | head -n 1)
    [ -n "$port" ] && break
  fi
  if [ $((n % 25)) -eq 0 ] && [ "$(date +%s)" -ge "$deadline" ]; then
    fail_log=$rt/jupyter.log
    fail timeout "jupyter $TUNNEL_APP did not write its server info within ${TUNNEL_TIMEOUT}s"
  fi
  nap 0.02
done
# Jupyter has read the token file by the time it writes its info file (which
# holds the token, 0600): drop our copy. A Jupyter too old for
# JUPYTER_TOKEN_FILE made up its own token, which the client cannot know.
tok=
IFS= read -r tok <"$rt/token"
rm -f "$rt/token"
case $(cat "$info" 2>/dev/null) in
  *"\"token\": \"$tok\""*) ;;
  *) fail_log=$rt/jupyter.log
     fail jupyter-exited "jupyter $TUNNEL_APP ignored JUPYTER_TOKEN_FILE (jupyter_server is too old; upgrade it: pip install -U jupyter_server)" ;;
esac
tok=
# A reattaching client reads the port from here instead of the info file.
printf '%s %s\n' "$port" "${base:-/}" >"$rt/ready"
start_watchdog
say "pid $(cat "$rt/jupyter.pid")"
say "ready $port ${base:-/}"
