"""Runs one function on every rank of a CPU gloo group (spawned processes, a FileStore)."""

from __future__ import annotations

import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world_size, store_path, fn, args, result_dir):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
        # Leave together: a rank tearing gloo down while its peer still talks to it can abort
        # in C++ ("terminate called without an active exception").
        dist.barrier()
    except BaseException:
        with open(os.path.join(result_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_on_gloo_group(fn, world_size: int, *args):
    """Run fn(rank, world_size, *args) on `world_size` processes; returns the per-rank results.

    fn must be a module-level function (it is pickled). A failure on any rank re-raises here
    with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        try:
            mp.start_processes(
                _entry,
                args=(world_size, store_path, fn, args, tmp),
                nprocs=world_size,
                join=True,
                start_method="spawn",
            )
        except Exception as exc:
            errors = [
                open(os.path.join(tmp, f)).read()
                for f in sorted(os.listdir(tmp))
                if f.endswith(".err")
            ]
            results = [os.path.join(tmp, f"rank{r}.pt") for r in range(world_size)]
            if errors or not all(os.path.exists(p) for p in results):
                raise RuntimeError("EP worker failed:\n" + "\n".join(errors)) from exc
            # Every rank finished and saved its result; only process teardown failed (gloo's
            # shutdown is not always clean). The results stand.
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world_size)]
