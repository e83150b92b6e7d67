# tunnel bootstrap: stage 1 of the remote launch. Runs in /bin/sh.
#
# It arrives as the first line of the exec channel's stdin (the command line
# sshd shows in `ps` stays short and constant); the remaining stdin lines are
# the token, then the client's commands ("stop"). EOF on stdin means the
# client is gone. The client prepends TUNNEL_* assignments to this text.
#
# The token stays in this shell's (unexported) variable only until it is in
# a 0600 file of the private runtime dir: Jupyter reads it through
# JUPYTER_TOKEN_FILE, so no environment (Jupyter's, its kernels', its
# terminals') and no command line ever holds it. printf is a builtin: no exec.
IFS= read -r tunnel_token || exit 90
unset JUPYTER_TOKEN
umask 077
tunnel_say() { printf 'tunnel-remote: %s\n' "$*"; }
tunnel_base=${XDG_RUNTIME_DIR:-}
if [ -z "$tunnel_base" ] || [ ! -d "$tunnel_base" ] || [ ! -w "$tunnel_base" ]; then
  tunnel_base=${TMPDIR:-/tmp}
fi
TUNNEL_RT=$(mktemp -d "$tunnel_base/tunnel-jupyter.XXXXXXXX" 2>/dev/null) || {
  tunnel_say "error setup cannot create a private runtime directory under $tunnel_base"
  exit 91
}
chmod 700 "$TUNNEL_RT"
if [ -n "$tunnel_token" ]; then
  printf '%s' "$tunnel_token" >"$TUNNEL_RT/token" || {
    tunnel_say "error setup cannot write the token file in $TUNNEL_RT"
    rm -rf "$TUNNEL_RT"
    exit 91
  }
fi
unset tunnel_token
tunnel_say "runtime $TUNNEL_RT"
# In a SLURM job step (tunnel up --slurm), the job's batch script holds the
# allocation for as long as this process lives (the execs below keep its pid):
# tell it which pid to watch, and which runtime directory to remove if this
# process is killed before it can. No secret here.
if [ -n "${TUNNEL_SLURM:-}" ] && [ -n "${SLURM_JOB_ID:-}" ]; then
  printf '%s %s\n' "$$" "$TUNNEL_RT" >"${TMPDIR:-/tmp}/tunnel-slurm-$SLURM_JOB_ID.$TUNNEL_SLURM"
fi
export TUNNEL_RT TUNNEL_MAIN TUNNEL_INIT TUNNEL_ENV TUNNEL_DIR TUNNEL_APP TUNNEL_PORT TUNNEL_LINGER TUNNEL_TIMEOUT TUNNEL_SLURM
# The user's login shell sets up PATH, modules, etc. as an interactive ssh
# login would; --init runs there (so shell functions such as `module` exist),
# then the rest runs in /bin/sh, whose behaviour we know. csh/fish users get
# /bin/sh as the login shell, since --init is written in sh syntax.
case ${SHELL:-} in
  */bash|*/zsh|*/ksh|*/mksh|*/dash|*/sh|*/ash) tunnel_login=$SHELL ;;
  *) tunnel_login=/bin/sh ;;
esac
[ -x "$tunnel_login" ] || tunnel_login=/bin/sh
# The login, --init and the setup after it are bounded by TUNNEL_TIMEOUT from
# here (setup_guard.sh). Started from this shell, the guard is a child of the
# pid the login shell takes over, but none of its jobs.
printf 'login\n' >"$TUNNEL_RT/stage"
TUNNEL_GUARD=$TUNNEL_GUARD TUNNEL_SHELL_PID=$$ TUNNEL_DEADLINE=$(($(date +%s) + TUNNEL_TIMEOUT)) \
  /bin/sh -c 'eval "$TUNNEL_GUARD"' &
TUNNEL_GUARD_PID=$!
export TUNNEL_GUARD_PID
unset TUNNEL_GUARD
exec "$tunnel_login" -l -c 'if [ -n "$TUNNEL_INIT" ]; then echo init >"$TUNNEL_RT/stage"; eval "$TUNNEL_INIT" </dev/null >>"$TUNNEL_RT/init.log" 2>&1 || TUNNEL_INIT_STATUS=$?; export TUNNEL_INIT_STATUS; fi; exec /bin/sh -c "eval \"\$TUNNEL_MAIN\""'
