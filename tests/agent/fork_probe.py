"""Run by test_forkserver the way a rank is run: it does what a rank does first (import torch, take an
optimizer step), reports how it was started as JSON on stdout, and exits with the code it is given
(or raises, given `raise`). Its atexit handler says so in the log: a forked rank exits as a cold one."""

import atexit
import json
import os
import sys
import time

WARM_AT_ENTRY = "torch.distributed" in sys.modules  # only a forked rank has it before this line runs
DYNAMO_AT_ENTRY = "torch._dynamo" in sys.modules  # only one forked from the trainer's server has it

import torch  # noqa: E402

model = torch.nn.Linear(8, 8)
optimizer = torch.optim.AdamW(model.parameters())
model(torch.ones(2, 8)).sum().backward()
optimizer.step()

report = {
    "stepped_at": time.time(),  # start-up is over: a rank would now be training
    "argv": sys.argv[1:],
    "name": __name__,
    "warm": WARM_AT_ENTRY,
    "dynamo": DYNAMO_AT_ENTRY,
    "pid": os.getpid(),
    "threads": torch.get_num_threads(),
    "rank": os.environ.get("RANK"),
    "leftover": os.environ.get("FORK_PROBE_LEFTOVER"),
    "cwd": os.getcwd(),
    "path0": sys.path[0],
    "stdin": sys.stdin.read(),
}
print(json.dumps(report), flush=True)
print("probe stderr line", file=sys.stderr)
atexit.register(print, "probe atexit ran")
if sys.argv[1:2] == ["raise"]:
    raise RuntimeError("probe raised")
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
