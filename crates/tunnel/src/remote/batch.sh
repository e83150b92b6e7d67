#!/bin/sh
# tunnel up --slurm: this job only holds the allocation. Jupyter runs in a
# job step that tunnel starts with `srun --jobid=$SLURM_JOB_ID --overlap`,
# its token on the step's stdin: nothing secret is in this script. The job
# ends when that step's launcher does (Ctrl-C, `tunnel down`, lost client),
# or when none starts within the grace time (the client went away while the
# job was pending), so a forgotten job does not sit on a GPU until its limit.
# The step writes its launcher's pid and runtime directory to $f; the file's
# name is unique to this submission (job ids can repeat, e.g. after a
# controller reset).
grace=TUNNEL_GRACE_SECS
f=${TMPDIR:-/tmp}/tunnel-slurm-$SLURM_JOB_ID.TUNNEL_STEP_KEY
# The launcher removes its runtime directory when it stops Jupyter, unless
# it is killed first (scancel, the time limit, srun gone): then this does.
# Signalled with this script, the launcher may still write into it (its
# "stopping" mark) while rm runs, and a file made then leaves the directory
# behind: removed again until it is gone (made only once, it stays gone).
cleanup() {
  if [ -s "$f" ]; then
    read -r pid rt <"$f"
    case ${rt:-} in
      */tunnel-jupyter.*)
        tries=0
        while [ -d "$rt" ] && [ "$tries" -lt 50 ]; do
          rm -rf "$rt" 2>/dev/null
          [ -d "$rt" ] || break
          sleep 0.1 2>/dev/null || sleep 1
          tries=$((tries + 1))
        done
        ;;
    esac
  fi
  rm -f "$f"
}
trap 'cleanup; exit 0' TERM INT HUP
waited=0
while [ ! -s "$f" ]; do
  [ "$waited" -ge "$grace" ] && exit 0
  # In the background, so that scancel's SIGTERM is handled at once.
  sleep 1 &
  wait $!
  waited=$((waited + 1))
done
read -r pid rt <"$f"
while kill -0 "$pid" 2>/dev/null; do
  sleep 2 &
  wait $!
done
cleanup
