"""Where the time between two %maxbatch trials goes. Run on the GPU machine.

Drives trials.py's functions directly in a real gpu-python kernel (the notebook of
maxbatch_truth.py, a GPT of 166M parameters) and times each part of a trial's cleanup, with
gc.callbacks bracketing every collection. Prints one JSON line per probe.

Usage (repo root, GPU machine): python3 bench/gpu/cleanup_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_kernels  # noqa: E402
import maxbatch_truth  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TRIALS = ROOT / "crates" / "gpukernel" / "src" / "magics" / "maxbatch" / "trials.py"

PROBE = r"""
import gc, time, types, json
_src = open(TRIALS_PATH).read()
T = types.ModuleType('trials_probe'); exec(_src, T.__dict__)
_log = []
def _cb(phase, info, _t=[0.0]):
    if phase == 'start':
        _t[0] = time.perf_counter()
    else:
        _log.append([info['generation'], info['collected'], round((time.perf_counter() - _t[0]) * 1000, 2)])
gc.callbacks.append(_cb)
def timed(f):
    t = time.perf_counter(); r = f(); return r, round((time.perf_counter() - t) * 1000, 2)
print(json.dumps({'freeze_count': gc.get_freeze_count(), 'objects': len(gc.get_objects()),
                  'collect_ms': [timed(gc.collect)[1] for _ in range(3)], 'log': _log}))
_log.clear()
make('g', GPT, tokens(32000, 512))
spec = {'kind': 'module', 'target': 'g', 'input': [512], 'vocab': None, 'amp': None,
        'optimizer': None, 'optimizer_from': None, 'inference': False, 'device': None}
r, ms = timed(lambda: T.prepare(globals(), spec))
print(json.dumps({'prepare_ms': ms, 'laps': r['timings_ms'], 'freeze_count': gc.get_freeze_count(), 'log': _log}))
T.set_loss(globals(), {'kind': 'ce', 'classes': 32000, 'class_dim': -1})
for b in (4, 40, 60, 44):
    _log.clear()
    t, ms = timed(lambda: T.trial(globals(), b, 3))
    print(json.dumps({'batch': b, 'result': t['result'], 'call_ms': ms, 'step_ms': t['ms'],
                      'cleanup': t['cleanup_ms'], 'settle_ms': t['settle_ms'], 'gc': _log}))
# The parts by hand: a step, then sync, then collect, then empty_cache, each timed.
S = T._current()
for b in (40, 60):
    _log.clear()
    torch.cuda.reset_peak_memory_stats()
    try:
        S.step.run(b, 3); res = 'ran'
    except torch.OutOfMemoryError as e:
        res = 'oom'; e.__traceback__ = None; del e
    _, sync = timed(torch.cuda.synchronize)
    _, col = timed(gc.collect)
    _, col2 = timed(gc.collect)
    _, emp = timed(torch.cuda.empty_cache)
    _, rest = timed(S.restore)
    _, sync2 = timed(torch.cuda.synchronize)
    _, emp2 = timed(torch.cuda.empty_cache)
    print(json.dumps({'by_hand': b, 'result': res, 'sync': sync, 'collect': col, 'collect_again': col2,
                      'empty_cache': emp, 'restore': rest, 'sync2': sync2, 'empty2': emp2, 'gc': _log}))
r, ms = timed(lambda: T.close())
print(json.dumps({'close_ms': ms, 'laps': r.get('timings_ms')}))
gc.callbacks.remove(_cb)
"""


def main() -> int:
    device_kernels.install()
    from kernel_client import execute, running_kernel

    with running_kernel("gpu-python") as (_, kc):
        setup = maxbatch_truth.MODELS.replace("CAP", "24.0") + maxbatch_truth.LOOP
        reply, _ = execute(kc, setup, timeout=300)
        assert reply["content"]["status"] == "ok", reply["content"]
        reply, outputs = execute(kc, PROBE.replace("TRIALS_PATH", repr(str(TRIALS))), timeout=300)
        for o in outputs:
            if o["msg_type"] == "stream":
                print(o["content"]["text"], end="")
        if reply["content"]["status"] != "ok":
            print(reply["content"].get("ename"), reply["content"].get("evalue"))
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
