#!/bin/sh
# tunnel up --slurm: this job only holds the allocation. Jupyter runs in a
# job step that tunnel starts with `srun --jobid=$SLURM_JOB_ID --overlap`,
# its token on the step's stdin: nothing secret is in this script. The job
# ends when that step's launcher does (Ctrl-C, `tunnel down`, lost client),
# or when none starts within the grace time (the client went away while the
# job was pending), so a forgotten job does not sit on a GPU until its limit.
grace=TUNNEL_GRACE_SECS
f=${TMPDIR:-/tmp}/tunnel-slurm-$SLURM_JOB_ID.step
waited=0
while [ ! -s "$f" ]; do
  [ "$waited" -ge "$grace" ] && exit 0
  sleep 1
  waited=$((waited + 1))
done
read -r pid <"$f"
while kill -0 "$pid" 2>/dev/null; do sleep 2; done
rm -f "$f"
