# tunnel remote setup: --init's status and --env activation, shared by the
# launcher (launch.sh) and `tunnel doctor` (doctor.sh). Runs in /bin/sh
# after common.sh, with the login environment; says `env ...`, or fails
# with `error init|env ...`.
trap 'stop_all; exit 0' HUP TERM INT
{ printf 'setup\n' >"$rt/stage"; } 2>/dev/null

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
  { printf 'env\n' >"$rt/stage"; } 2>/dev/null
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

