"""Diagnose the bounded-wait probe on one GPU: each case in its own process (a trap kills the
context). Prints one line per case with the error record's fields and the elapsed time."""

import subprocess
import sys

CASE = r"""
import sys, time, torch
from mok.launchers import comm
mode, timeout_ns = sys.argv[1], int(sys.argv[2])
flag = torch.zeros(1, dtype=torch.int32, device="cuda")
done = torch.zeros(1, dtype=torch.int32, device="cuda")
record = comm.get_error_record(flag.device)
setter = torch.cuda.Stream()
side = torch.cuda.Stream()
torch.cuda.synchronize()
t0 = time.perf_counter()
msg = "ok"
try:
    if mode == "side":  # probe on a side stream, flag set later on the default stream
        with torch.cuda.stream(side):
            comm.flag_wait_probe(flag, done, 3, timeout_ns=timeout_ns)
        torch.cuda._sleep(20_000_000)
        flag.fill_(3)
    elif mode == "stream":
        comm.flag_wait_probe(flag, done, 3, timeout_ns=timeout_ns)
        with torch.cuda.stream(setter):
            torch.cuda._sleep(20_000_000)
            flag.fill_(3)
    elif mode == "never":
        comm.flag_wait_probe(flag, done, 3, timeout_ns=timeout_ns)
    torch.cuda.synchronize()
except Exception as e:
    msg = "ERR %s: %s" % (type(e).__name__, str(e).splitlines()[0][:120])
elapsed = (time.perf_counter() - t0) * 1e3
print("%-80s %.1f ms record=%s" % (msg, elapsed, record.read()))
"""

for mode, timeout in [("side", 10**9), ("stream", 10**9), ("never", 10**8), ("never", 10**9)]:
    r = subprocess.run(
        [sys.executable, "-c", CASE, mode, str(timeout)], capture_output=True, text=True, timeout=60
    )
    out = r.stdout.strip() or r.stderr.strip()[-400:]
    print(f"{mode:7s} timeout={timeout:>11d} rc={r.returncode} {out}")
