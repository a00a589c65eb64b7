"""Do kernels of two streams overlap on this GPU, and does the probe see a host write?"""

import subprocess
import sys
import time

import torch

a, b = torch.cuda.Stream(), torch.cuda.Stream()
torch.cuda.synchronize()
for label, streams in (("one stream x2", (a, a)), ("two streams", (a, b))):
    t0 = time.perf_counter()
    for s in streams:
        with torch.cuda.stream(s):
            torch.cuda._sleep(400_000_000)  # ~0.2 s each
    torch.cuda.synchronize()
    print(f"{label:14s} {(time.perf_counter() - t0) * 1e3:7.1f} ms")

CASE = r"""
import ctypes, time, torch
from mok.launchers import comm
from mok.runtime import ErrorRecord
flagbuf = ErrorRecord()  # any mapped pinned host buffer: word 0 is our flag
flagbuf.clear()
done = torch.zeros(1, dtype=torch.int32, device="cuda")
record = comm.get_error_record(done.device)
words = (ctypes.c_int32 * 16).from_address(flagbuf.host_ptr)
kernel = __import__("mok.runtime", fromlist=["get_kernel"]).get_kernel("flag_wait_probe")
t0 = time.perf_counter()
kernel.launch((1, 1, 1), {"flag_ptr": flagbuf.device_ptr, "done_ptr": done, "expected": 3,
              "error_record_ptr": record.device_ptr, "rank": 0, "phase": 0,
              "timeout_ns": 2_000_000_000})
time.sleep(0.05)
words[0] = 3
try:
    torch.cuda.synchronize()
    print("host write seen: done=%d after %.0f ms" % (done.item(), (time.perf_counter() - t0) * 1e3))
except Exception as e:
    print("host write NOT seen: %s record=%s" % (type(e).__name__, record.read()))
"""
r = subprocess.run([sys.executable, "-c", CASE], capture_output=True, text=True, timeout=60)
print(r.stdout.strip() or r.stderr.strip()[-600:])
