"""Where a virtual-EP step blocks the host: one P = 2 training step with a stack dump of every
thread after 4 s of no progress, then the error record."""

import faulthandler
import sys
import time

import torch

from mok import functional as F
from mok.testing import make_inputs, rank_inputs, run_layer_step
from mok.virtual_ep import VirtualEPGroup

faulthandler.dump_traceback_later(6, repeat=True, file=sys.stderr)
size = int(sys.argv[1]) if len(sys.argv) > 1 else 2
config = F.MoKConfig(schedule_capacity_multiplier=1.0)
inputs = make_inputs(2048, 512, 512, 16, 4, seed=1, device="cuda")
# A group of one first: imports and first-call setup are slow, and would count against the
# peers' bounded waits.
one = VirtualEPGroup(1)
(ws_one,) = one.workspaces(
    config, num_local_tokens=2048, hidden_size=512, topk=4, num_local_experts=16
)
(expected,) = one.run(lambda rank: run_layer_step(config, ws_one, inputs, 16))
F.check_errors(ws_one)
group = VirtualEPGroup(size)
spaces = group.workspaces(
    config, num_local_tokens=2048 // size, hidden_size=512, topk=4, num_local_experts=16 // size
)
for ws in spaces:
    ws.wait_timeout_ns = 5_000_000_000
shards = [rank_inputs(inputs, r, size) for r in range(size)]
start = time.time()


def step(rank):
    print(f"{time.time() - start:.2f}s rank {rank} issuing", flush=True)
    result = run_layer_step(config, spaces[rank], shards[rank], 16 // size)
    print(f"{time.time() - start:.2f}s rank {rank} issued", flush=True)
    return result


results = group.run(step)
group.join()
try:
    for ws in spaces:
        F.check_errors(ws)
    print("step done", time.time() - start, flush=True)
    got = torch.cat([r[0] for r in results])
    print("out bitwise equal to P = 1:", torch.equal(got, expected[0]), flush=True)
    d_x = torch.cat([r[2][0] for r in results])
    print("d_x bitwise equal to P = 1:", torch.equal(d_x, expected[2][0]), flush=True)
    d_r = torch.cat([r[2][1] for r in results])
    print("d_router bitwise equal to P = 1:", torch.equal(d_r, expected[2][1]), flush=True)
    dg = torch.cat([r[2][2] for r in results])
    print("d_gate bitwise equal to P = 1:", torch.equal(dg, expected[2][2]), flush=True)
except Exception as error:
    print(type(error).__name__, error, flush=True)
faulthandler.cancel_dump_traceback_later()
