"""Diagnose the bounded-wait probe on one GPU: each case in its own process (a trap kills the
context). Prints one line per case."""

import subprocess
import sys

CASE = r"""
import sys, time, torch
from mok.launchers import comm
mode, timeout_ns = sys.argv[1], int(sys.argv[2])
flag = torch.full((1,), 3 if mode == "preset" else 0, dtype=torch.int32, device="cuda")
done = torch.zeros(1, dtype=torch.int32, device="cuda")
torch.cuda.synchronize()
t0 = time.perf_counter()
comm.flag_wait_probe(flag, done, 3, timeout_ns=timeout_ns)
if mode == "stream":
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)
        flag.fill_(3)
elif mode == "host_later":
    time.sleep(0.05)
    torch.cuda.Stream()
try:
    comm.check_errors(flag.device)
    print("ok done=%d %.1f ms" % (done.item(), (time.perf_counter() - t0) * 1e3))
except Exception as e:
    print("ERR %.1f ms %s: %s" % ((time.perf_counter() - t0) * 1e3, type(e).__name__, str(e)[:300]))
"""

for mode, timeout in [
    ("preset", 10**10),
    ("preset", 10**8),
    ("stream", 10**8),
    ("stream", 10**10),
    ("stream", 2**31 - 1),
    ("stream", 2**31 + 1),
    ("host_later", 10**10),
]:
    r = subprocess.run(
        [sys.executable, "-c", CASE, mode, str(timeout)], capture_output=True, text=True, timeout=60
    )
    print(
        f"{mode:10s} timeout={timeout:>12d} rc={r.returncode} {r.stdout.strip()} "
        f"{r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}"
    )
