# tunnel doctor: stage 2 of a check-only run, after common.sh and setup.sh.
# Starts nothing: reports where jupyter is, its version and the GPUs, then
# removes the runtime directory bootstrap.sh made.
{ printf 'checks\n' >"$rt/stage"; } 2>/dev/null
say "check shell ${SHELL:-/bin/sh}"
if ! jp=$(command -v jupyter 2>/dev/null); then
  fail jupyter-missing "jupyter not found on the remote PATH ($PATH); install it (pip install jupyterlab) or select its environment with --env"
fi
# `jupyter --version` lists every component; the server is the one tunnel
# starts. Older installs lack that listing: ask the module itself.
v=$(jupyter --version 2>/dev/null | sed -n 's/^jupyter_server *: *//p')
if [ -z "$v" ]; then
  for py in python3 python; do
    v=$("$py" -m jupyter_server --version 2>/dev/null) && [ -n "$v" ] && break
    v=
  done
fi
if [ -z "$v" ]; then
  fail jupyter-broken "$jp is there, but neither 'jupyter --version' nor 'python -m jupyter_server --version' names a jupyter_server version; reinstall it (pip install jupyterlab)"
fi
say "check jupyter $jp jupyter_server $v"
if command -v nvidia-smi >/dev/null 2>&1; then
  if out=$(nvidia-smi -L 2>&1); then
    printf '%s\n' "$out" | while IFS= read -r l; do [ -n "$l" ] && say "check gpu $l"; done
    say "check gpu-done"
  else
    say "check gpu-failed $(printf '%s' "$out" | tr '\n' ' ')"
  fi
else
  say "check gpu-absent"
fi
end_guard || exit 1
remove_rt
say "check done"
