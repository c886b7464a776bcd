"""A plain script whose rank 1 never exits after its work (as a process stuck in a destructor at
exit would): the run must complete after the exit grace and stop it."""

import os
import threading

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
tensor = torch.ones(1)
dist.all_reduce(tensor)
print(f"rank {dist.get_rank()}: done, sum {tensor.item():g}", flush=True)
dist.destroy_process_group()
if os.environ["RANK"] == "1":
    threading.Event().wait()  # lingers forever
