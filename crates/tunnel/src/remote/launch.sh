# tunnel launcher: stage 2, runs in /bin/sh with the login environment,
# after common.sh; session.sh follows once Jupyter is ready.
trap 'stop_all; exit 0' HUP TERM INT

if [ -n "${TUNNEL_INIT_STATUS:-}" ]; then
  fail_log=$rt/init.log
  fail init "the --init command failed with status $TUNNEL_INIT_STATUS"
fi

expand_home() {
  case $1 in
    "~") printf '%s\n' "$HOME" ;;
    "~/"*) printf '%s/%s\n' "$HOME" "${1#"~/"}" ;;
    *) printf '%s\n' "$1" ;;
  esac
}

find_conda() {
  for t in conda mamba micromamba; do
    if command -v "$t" >/dev/null 2>&1; then command -v "$t"; return 0; fi
  done
  for p in "${CONDA_EXE:-}" "${MAMBA_EXE:-}" "$HOME/miniforge3/bin/conda" \
    "$HOME/mambaforge/bin/conda" "$HOME/miniconda3/bin/conda" "$HOME/anaconda3/bin/conda" \
    "$HOME/.local/bin/micromamba" "$HOME/bin/micromamba" /opt/conda/bin/conda \
    /opt/miniforge3/bin/conda; do
    if [ -n "$p" ] && [ -x "$p" ]; then printf '%s\n' "$p"; return 0; fi
  done
  return 1
}

# Activate a conda/mamba/micromamba environment (name or prefix) through the
# tool's own shell hook: non-interactive shells do not run `conda init` code.
conda_activate() {
  tool=$1
  envname=$2
  case ${tool##*/} in
    micromamba) hook=$("$tool" shell hook --shell posix 2>>"$rt/init.log"); act=micromamba ;;
    mamba) hook=$("$tool" shell hook --shell posix 2>>"$rt/init.log"); act=mamba ;;
    *) hook=$("$tool" shell.posix hook 2>>"$rt/init.log"); act=conda ;;
  esac
  fail_log=$rt/init.log
  [ -n "$hook" ] || fail env "$tool produced no shell hook"
  eval "$hook" >>"$rt/init.log" 2>&1 || fail env "the $act shell hook failed"
  "$act" activate "$envname" >>"$rt/init.log" 2>&1 ||
    fail env "--env $envname: '$act activate' failed (does it exist? see '$act env list')"
  fail_log=
  say "env $act $envname"
}

if [ -n "$TUNNEL_ENV" ]; then
  e=$(expand_home "$TUNNEL_ENV")
  if [ -d "$e/conda-meta" ]; then
    if tool=$(find_conda); then
      conda_activate "$tool" "$e"
    else
      CONDA_PREFIX=$e
      PATH=$e/bin:$PATH
      export CONDA_PREFIX PATH
      say "env prefix $e"
    fi
  elif [ -d "$e/bin" ]; then
    VIRTUAL_ENV=$e
    PATH=$e/bin:$PATH
    export VIRTUAL_ENV PATH
    unset PYTHONHOME
    say "env venv $e"
  elif [ -d "$e" ]; then
    fail env "--env $e has no bin/ directory: not a virtualenv or conda environment"
  else
    case $e in
      */*) fail env "--env $e: no such directory on the remote" ;;
    esac
    tool=$(find_conda) ||
      fail env "--env $e: not a directory, and no conda, mamba or micromamba found to activate it by name"
    conda_activate "$tool" "$e"
  fi
fi

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
(
  # shellcheck disable=SC2086 # $allow_root is empty or one word
  JUPYTER_RUNTIME_DIR=$rt jupyter "$TUNNEL_APP" --no-browser --ip=127.0.0.1 --port="$TUNNEL_PORT" \
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
# A reattaching client reads the port from here instead of the info file.
printf '%s %s\n' "$port" "${base:-/}" >"$rt/ready"
start_watchdog
say "pid $(cat "$rt/jupyter.pid")"
say "ready $port ${base:-/}"
