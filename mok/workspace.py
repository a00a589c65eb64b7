"""The workspace: owns every buffer a mok layer uses, for one (group, device, T, H, k, capacity).

One GPU (or any CPU run): plain allocations. An EP group on CUDA: torch symmetric memory
(`empty` + `rendezvous`), with each peer's buffer address in `peer_ptrs` and, for the kernels'
unicast loads and stores, in one device table `peer_table` (NVLink multicast is never used). Buffers are allocated once and reused
by every call; `destroy()` releases them explicitly.

`get_workspace` caches workspaces, at most `WORKSPACE_CACHE_SIZE` of one layer shape (its
docstring gives the rule); ops look workspaces up by handle (`workspace_from_handle`).

`MoKWorkspace(...)` itself is the original's constructor: a workspace over the caller's tensors
and pointer lists (the original's fields), which the ops find while the caller holds it.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields

import torch
import torch.distributed as dist

from .config import DEFAULT_WAIT_TIMEOUT_NS, FEATURE_ALIGNMENT, MAX_TOPK, MoKConfig
from .groups import group_rank_size
from .validation import check_int, check_type

# Workspaces get_workspace keeps for one (EP group, device, hidden_size, topk): one per token
# count (and schedule capacity) in use, so a layer called with a few batch sizes keeps them all
# while one called with ever new token counts does not grow without bound.
WORKSPACE_CACHE_SIZE = 4

_NEXT_HANDLE = itertools.count(1)
# Every workspace not destroyed, by handle (the custom ops receive handles).
_LIVE: dict[int, MoKWorkspace] = {}
# get_workspace's cache, least recently used first.
_CACHE: OrderedDict[tuple, MoKWorkspace] = OrderedDict()
# Workspaces the cache evicted (destroyed, buffers freed), by cache key and by handle: a handle
# held past the eviction (a torch.compile graph bakes it in) gets its workspace made anew.
_EVICTED: dict[tuple, MoKWorkspace] = {}
_EVICTED_KEYS: dict[int, tuple] = {}
# Workspaces made by the original's constructor over the caller's tensors, by handle: found by
# the ops while the caller holds them (the original has no destroy(), so none is kept alive).
_CALLER_BUILT: weakref.WeakValueDictionary[int, MoKWorkspace] = weakref.WeakValueDictionary()


@dataclass(eq=False, init=False)
class MoKWorkspace:
    """Buffers and shapes of one mok layer configuration on one rank.

    buffers (name: dtype [shape]):
        x_buffer: bf16 [T, H]                 this rank's tokens, pulled by expert owners
        combine_buffer: bf16 [T*k, H]         expert outputs pushed into slot token*k + j
        d_y_buffer: bf16 [T, H]               grad_output, pulled in backward
        d_x_routed_buffer: bf16 [T*k, H]      d_x rows pushed into slot token*k + j
        router_weight_buffer: fp32 [T, k]     pulled with d_y in backward (w * dY on the expert side)
        d_router_weight_buffer: fp32 [T, k]   router-weight gradient partials pushed back
        all_gather_top_experts_buffer: int32 [P, T, k]   routing ids of every rank
        barrier_buffer: int32 [P]             one arrival counter per peer (unicast flags)
        barrier_epoch_buffer: int32 [2]       this rank's arrival epoch + reader count (own use)

    `barrier_target` (the original's name) is word 0 of barrier_epoch_buffer, int32 [1]: the
    arrivals each rank has made at every peer, which each barrier_all adds 1 to (the original
    counts them over all P ranks, so the two agree for a group of one).

    `MoKWorkspace(group_name=..., ep_rank=..., ..., barrier_target=...)` takes the original's
    fields (`ORIGINAL_FIELDS`, keywords or in that order): a workspace over the caller's tensors
    and pointer lists, not allocated or cached by mok (`caller_buffers`). The ops find it by
    its pointer lists or handle while the caller holds it. It serves tracing (fake tensors,
    torch.compile) at any ep_size and runs at ep_size 1; mok's own workspaces come from
    `get_workspace` / `create_workspace`.

    A group of one uses combine_buffer and d_x_routed_buffer as its slots too (its schedule
    reads the caller's routing ids in place; only the original's raw all-gather op fills its
    all_gather_top_experts_buffer): the buffers serve one op at a time, in stream order, so a
    workspace's ops run on one stream at a time (as an EP group's must).
    """

    handle: int
    group: dist.ProcessGroup | None
    group_name: str
    ep_rank: int
    ep_size: int
    device: torch.device
    num_local_tokens: int
    hidden_size: int
    topk: int
    schedule_capacity: int
    symmetric: bool
    # CTAs of each megakernel launch: None is the SM count; a virtual EP rank gets its share.
    megakernel_ctas: int | None = None
    # Bound of every device wait of this workspace's ops (MoKWaitTimeoutError past it).
    wait_timeout_ns: int = DEFAULT_WAIT_TIMEOUT_NS
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    peer_ptrs: dict[str, list[int]] = field(default_factory=dict)
    # EP > 1 on CUDA: every buffer's peer_ptrs in one device table (`peer_table_of`), uploaded
    # when the workspace is made (a blocking copy later could wait behind a peer's barrier).
    peer_table: torch.Tensor | None = None
    _handles: dict[str, object] = field(default_factory=dict, repr=False)
    destroyed: bool = False
    # Set when a mok op ran on this workspace during CUDA graph capture: the graph holds its
    # buffers' addresses, so the cache never evicts it (destroy() or clear_workspace_cache()).
    graph_captured: bool = False
    # Made by the original's constructor over the caller's tensors (class docstring).
    caller_buffers: bool = False
    # The original's multicast addresses, as given to its constructor (mok's own are 0).
    multicast_ptrs: dict[str, int] = field(default_factory=dict)
    # The original's `barrier_target` tensor, as given to its constructor.
    caller_barrier_target: torch.Tensor | None = None
    # The comm launchers' device tables of this workspace (`mok.launchers.comm.CommState`),
    # made by its first comm call on CUDA; destroy() drops them.
    comm_state: object | None = field(default=None, repr=False)

    def __init__(self, *args, **kwargs) -> None:
        """The original's constructor (`ORIGINAL_FIELDS`): a workspace over the caller's
        tensors; see the class docstring."""
        given = _ORIGINAL_SIGNATURE.bind(*args, **kwargs).arguments
        for name in ("ep_rank", "ep_size", "num_local_tokens", "hidden_size", "topk",
                     "schedule_capacity"):  # fmt: skip
            check_int(name, given[name], minimum=0)
        check_type("group_name", given["group_name"], str)
        device = given["device"]
        check_type("device", device, torch.device)
        _set_fields(
            self, handle=next(_NEXT_HANDLE), group=None, group_name=given["group_name"],
            ep_rank=given["ep_rank"], ep_size=given["ep_size"], device=device,
            num_local_tokens=given["num_local_tokens"], hidden_size=given["hidden_size"],
            topk=given["topk"], schedule_capacity=given["schedule_capacity"], symmetric=False,
            caller_buffers=True, caller_barrier_target=given["barrier_target"],
        )  # fmt: skip
        for name in BUFFER_NAMES:
            self.buffers[name] = given[name]
            self._handles[name] = given[f"{name}_handle"]
            if f"{name}_ptrs" in given:
                self.peer_ptrs[name] = list(given[f"{name}_ptrs"])
            if f"{name}_multicast_ptr" in given:
                self.multicast_ptrs[name] = given[f"{name}_multicast_ptr"]
        _CALLER_BUILT[self.handle] = self

    @classmethod
    def allocated(cls, **values) -> MoKWorkspace:
        """A workspace of mok's own (its fields by name, the rest default), buffers to fill."""
        ws = cls.__new__(cls)
        _set_fields(ws, **values)
        return ws

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def describe(self) -> str:
        """A size report: one line per buffer, then the total."""
        lines = [
            f"MoKWorkspace(rank {self.ep_rank}/{self.ep_size}, {self.device}, "
            f"T={self.num_local_tokens}, H={self.hidden_size}, k={self.topk}, "
            f"capacity={self.schedule_capacity}, "
            f"{'symmetric memory' if self.symmetric else 'plain allocations'})"
        ]
        for name, b in self.buffers.items():
            nbytes = b.numel() * b.element_size()
            lines.append(f"  {name:32s} {str(b.dtype):16s} {list(b.shape)!s:24s} {nbytes:>14,d} B")
        lines.append(f"  {'total':32s} {'':16s} {'':24s} {self.nbytes:>14,d} B")
        return "\n".join(lines)

    def require_alive(self) -> MoKWorkspace:
        if self.destroyed:
            raise ValueError(
                f"workspace has been destroyed (handle {self.handle}, by destroy() or "
                f"clear_workspace_cache()); get a new one with get_workspace()"
            )
        return self

    def destroy(self) -> None:
        """Release every buffer now (collective for an EP group: call it on every rank)."""
        if self.destroyed:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            for callback in _ON_CUDA_DESTROY:
                callback()
        if self.symmetric and self.group is not None:
            dist.barrier(group=self.group)
        self.buffers.clear()
        self.peer_ptrs.clear()
        self.peer_table = None
        self._handles.clear()
        self.caller_barrier_target = None
        self.comm_state = None
        self.destroyed = True
        _LIVE.pop(self.handle, None)
        _CALLER_BUILT.pop(self.handle, None)
        for key, ws in list(_CACHE.items()):
            if ws is self:
                del _CACHE[key]


# What a CUDA workspace's destroy() runs first: the layers above register what they keep that
# holds workspaces' buffers (mok.launchers.plans: this thread's launch plans), so this module
# imports none of them.
_ON_CUDA_DESTROY: list[Callable[[], None]] = []


def on_cuda_destroy(callback: Callable[[], None]) -> Callable[[], None]:
    """Register `callback` to run when a CUDA workspace is destroyed (before its buffers go)."""
    _ON_CUDA_DESTROY.append(callback)
    return callback


def _set_fields(ws: MoKWorkspace, **values) -> None:
    """Every dataclass field of `ws`: from `values`, else its default."""
    for f in fields(MoKWorkspace):
        if f.name in values:
            value = values[f.name]
        elif f.default is not MISSING:
            value = f.default
        elif f.default_factory is not MISSING:
            value = f.default_factory()
        else:
            raise TypeError(f"MoKWorkspace field {f.name} must be given")
        setattr(ws, f.name, value)


# The original's attribute names for the buffers: `<name>`, `<name>_ptrs` (each rank's address)
# and `<name>_handle` (the symmetric-memory handle; None for plain allocations).
# The buffers peers pull rows from and push rows into (the megakernels' rows of the peer table).
DATA_BUFFER_NAMES = (
    "x_buffer",
    "combine_buffer",
    "d_y_buffer",
    "d_x_routed_buffer",
    "router_weight_buffer",
    "d_router_weight_buffer",
)
BUFFER_NAMES = (*DATA_BUFFER_NAMES, "all_gather_top_experts_buffer", "barrier_buffer")
# The peer table's row length: one int64 address per rank, for up to 127 ranks (the packed
# (rank, row) int32's limit). Rows are BUFFER_NAMES, in order (mok/dsl_kernels/common/peers.py).
PEER_TABLE_ROW = 128
# The buffers the original addresses through NVLink multicast (mok never does: its are 0).
MULTICAST_BUFFER_NAMES = ("all_gather_top_experts_buffer", "barrier_buffer")


def _original_fields() -> tuple[str, ...]:
    """The original's MoKWorkspace fields, in its order (its constructor's parameters)."""
    names = ["group_name", "ep_rank", "ep_size", "device", "num_local_tokens", "hidden_size",
             "topk", "schedule_capacity"]  # fmt: skip
    for name in BUFFER_NAMES:
        names += [name, f"{name}_handle"]
        if name != "all_gather_top_experts_buffer":  # reached through multicast only
            names.append(f"{name}_ptrs")
        if name in MULTICAST_BUFFER_NAMES:
            names.append(f"{name}_multicast_ptr")
    return (*names, "barrier_target")


ORIGINAL_FIELDS = _original_fields()
_ORIGINAL_SIGNATURE = inspect.Signature(
    [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in ORIGINAL_FIELDS]
)
MoKWorkspace.__init__.__signature__ = inspect.Signature(
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
     *_ORIGINAL_SIGNATURE.parameters.values()]
)  # fmt: skip


def _buffer_property(name: str, kind: str):
    if kind == "tensor":
        return property(lambda self: self.buffers[name], doc=f"The {name} tensor.")
    if kind == "ptrs":
        return property(lambda self: self.peer_ptrs[name], doc=f"{name} on every rank (int).")
    return property(lambda self: self._handles.get(name), doc=f"{name}'s symmetric handle.")


for _name in BUFFER_NAMES:
    setattr(MoKWorkspace, _name, _buffer_property(_name, "tensor"))
    setattr(MoKWorkspace, f"{_name}_ptrs", _buffer_property(_name, "ptrs"))
    setattr(MoKWorkspace, f"{_name}_handle", _buffer_property(_name, "handle"))
for _name in MULTICAST_BUFFER_NAMES:
    # NVLink multicast is never used (it can take shared GPU hosts down): never a live address
    # in mok's own workspaces; a caller-built one keeps what it was given.
    setattr(MoKWorkspace, f"{_name}_multicast_ptr", property(
        lambda self, name=_name: self.multicast_ptrs.get(name, 0),
        doc="0 (mok never multicasts), or what the original's constructor was given."))  # fmt: skip


def _barrier_target(self: MoKWorkspace) -> torch.Tensor:
    if self.caller_barrier_target is not None:
        return self.caller_barrier_target
    return self.buffers["barrier_epoch_buffer"][:1]


MoKWorkspace.barrier_target = property(
    _barrier_target,
    doc="The barrier's device-side target, int32 [1]: this rank's arrival epoch (word 0 of "
    "barrier_epoch_buffer; mok keeps it on the device so graph replays need no host count).",
)


def workspace_from_handle(handle: int) -> MoKWorkspace:
    """The live workspace with this handle (custom ops receive handles, not objects).

    The handle of a workspace get_workspace's cache evicted stays valid: its workspace is made
    anew (an EP group's on CUDA, made collectively, raises instead: call get_workspace).
    """
    ws = _LIVE.get(handle)
    if ws is None:
        ws = _CALLER_BUILT.get(handle)
    if ws is None:
        ws = _remake_evicted(handle)
    # Not while torch.compile traces (the capture state is not a tensor; the compiled graph's
    # ops look the handle up again when they run).
    if (
        not ws.graph_captured
        and ws.device.type == "cuda"
        and not torch.compiler.is_compiling()
        and capturing()
    ):
        ws.graph_captured = True
    return ws


def capturing() -> bool:
    """Whether the current CUDA stream is capturing (torch's C check, without the Python
    wrapper's device lookups: this runs on every op call)."""
    check = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
    return check() if check is not None else torch.cuda.is_current_stream_capturing()


def live_workspaces() -> list[MoKWorkspace]:
    """Every workspace not destroyed, mok's then caller-built ones (the original's raw ops find
    theirs by buffer address)."""
    return [*_LIVE.values(), *_CALLER_BUILT.values()]


def _remake_evicted(handle: int) -> MoKWorkspace:
    key = _EVICTED_KEYS.get(handle)
    if key is None:
        raise ValueError(
            f"workspace_handle must name a live MoKWorkspace, got {handle}: destroyed (destroy(), "
            f"clear_workspace_cache()) or never made"
        )
    ws = _EVICTED[key]
    if ws.symmetric:
        raise ValueError(
            f"workspace_handle {handle} names an EP-group workspace (group "
            f"{ws.group_name!r}, {ws.device}, num_local_tokens={ws.num_local_tokens}, "
            f"hidden_size={ws.hidden_size}, topk={ws.topk}) that get_workspace's cache evicted "
            f"(it keeps {WORKSPACE_CACHE_SIZE} token counts per layer shape); symmetric memory is "
            f"made collectively, not inside an op: call get_workspace with these shapes on every "
            f"rank first, or keep a reference to the workspace"
        )
    for victim in _pick_victims(key):
        _evict(victim)
    _revive(key, ws)
    return ws


def _check_device(device) -> torch.device:
    if isinstance(device, str):
        device = torch.device(device)
    check_type("device", device, torch.device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"device must be a cpu or cuda device, got {device} (mok runs kernels on CUDA and its "
            f"PyTorch reference path on CPU)"
        )
    if device.type == "cuda":
        from .runtime import select_arch  # noqa: PLC0415 - GPU-only import, keeps CPU imports light

        check_cuda_available("device", device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", index)
        select_arch(device)  # MoKUnsupportedDeviceError for a GPU no shipped cubin serves
    return device


def check_cuda_available(name: str, device: torch.device) -> None:
    """Raise ValueError naming `name` unless the CUDA device `device` exists here."""
    if not torch.cuda.is_available():
        raise ValueError(
            f"{name} must be an available device, got {device} but torch.cuda.is_available() is "
            f"False (mok runs CPU tensors on its PyTorch reference path: use device='cpu')"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"{name} must be an available device, got {device} but only {count} CUDA "
            f"device(s) are visible"
        )


def _group_rank_size(group) -> tuple[int, int]:
    if group is not None:
        check_type("group", group, dist.ProcessGroup)
    return group_rank_size(group)


def validate_workspace_args(
    config: MoKConfig,
    group: dist.ProcessGroup | None,
    *,
    device: torch.device | str,
    num_local_tokens: int,
    hidden_size: int,
    topk: int,
    num_local_experts: int | None = None,
) -> None:
    """Raise a clear error (ValueError, or MoKInputError for a wrong type) unless the arguments
    make a workspace: the checks `get_workspace` and `create_workspace` run first."""
    _checked_args(config, group, device, num_local_tokens, hidden_size, topk, num_local_experts)


def _checked_args(config, group, device, num_local_tokens, hidden_size, topk, num_local_experts):
    """(device, ep_rank, ep_size, capacity) of valid workspace arguments."""
    check_type("config", config, MoKConfig)
    config.validate()
    device = _check_device(device)
    check_int("num_local_tokens", num_local_tokens, minimum=1)
    check_int("hidden_size", hidden_size, minimum=FEATURE_ALIGNMENT, multiple_of=FEATURE_ALIGNMENT)
    check_int("topk", topk, minimum=1)
    if topk > MAX_TOPK:
        raise ValueError(f"topk must be <= {MAX_TOPK}, got {topk}")
    if num_local_experts is not None:
        check_int("num_local_experts", num_local_experts, minimum=1)
    ep_rank, ep_size = _group_rank_size(group)
    capacity = config.schedule_capacity(
        num_local_tokens=num_local_tokens,
        topk=topk,
        ep_size=ep_size,
        num_local_experts=num_local_experts or 0,
    )
    return device, ep_rank, ep_size, capacity


def create_workspace(
    config: MoKConfig,
    group: dist.ProcessGroup | None,
    *,
    device: torch.device | str,
    num_local_tokens: int,
    hidden_size: int,
    topk: int,
    num_local_experts: int | None = None,
) -> MoKWorkspace:
    """A new workspace, not cached (`get_workspace` returns the cached one); collective for an
    EP group. Destroy it with `destroy()`."""
    device, ep_rank, ep_size, capacity = _checked_args(
        config, group, device, num_local_tokens, hidden_size, topk, num_local_experts
    )
    if ep_size > 1:
        _check_same_shapes(group, device, (num_local_tokens, hidden_size, topk))
    return allocate_workspace(
        group, ep_rank, ep_size, device, num_local_tokens, hidden_size, topk, capacity
    )


_ARGS_MEMO: dict[tuple, tuple] = {}
_ARGS_MEMO_SIZE = 64


def get_workspace(
    config: MoKConfig,
    group: dist.ProcessGroup | None,
    *,
    device: torch.device | str,
    num_local_tokens: int,
    hidden_size: int,
    topk: int,
    num_local_experts: int | None = None,
) -> MoKWorkspace:
    """The cached workspace for (group, device, T, H, k, capacity); made on first use.

    `group=None` is an EP group of one. For an EP group this is collective (every rank calls it
    with the same shapes, checked once here, in the same order). `num_local_experts` (beyond the
    original API) reserves schedule room for each expert's padding to the GEMM tile height;
    without it the capacity is the original's and small layers with many experts may overflow it.

    Cache bound: at most `WORKSPACE_CACHE_SIZE` (4) workspaces per (group, device, hidden_size,
    topk), i.e. per layer shape, one per token count (and capacity). Making one more destroys the
    least recently used one that is not in use; in use means referenced outside the cache (a
    variable of yours, an autograd graph between forward and backward) or run on during CUDA
    graph capture (the graph holds its addresses: such a workspace is never evicted; free it
    with `destroy()` or `clear_workspace_cache()`). While every one is in use the cache holds
    more. An evicted workspace's handle stays valid (a torch.compile graph bakes handles in):
    an op given it makes the workspace anew, except an EP group's on CUDA, whose symmetric
    memory is made collectively: that op raises, naming the shapes to call get_workspace with.
    For an EP group on CUDA the ranks evict only a workspace every rank finds unused (agreed in
    the all-gather that checks the shapes). A call that raises leaves no workspace behind.
    """
    # Arguments already checked for a cached workspace: one lookup (a layer calls this on every
    # step). Only a device with an index is memoised: 'cuda' alone means the current device.
    memo = None
    if device.__class__ is torch.device and (device.index is not None or device.type == "cpu"):
        memo = (id(config), id(group), device, num_local_tokens, hidden_size, topk,
                num_local_experts)  # fmt: skip
        hit = _ARGS_MEMO.get(memo)
        if hit is not None and hit[0] is config and hit[1] is group:
            cached = _CACHE.get(hit[2])
            if cached is not None:
                _CACHE.move_to_end(hit[2])
                return cached
    device, ep_rank, ep_size, capacity = _checked_args(
        config, group, device, num_local_tokens, hidden_size, topk, num_local_experts
    )
    group_key = None if group is None else group.group_name
    key = (group_key, device, num_local_tokens, hidden_size, topk, capacity)
    if memo is not None:
        if len(_ARGS_MEMO) >= _ARGS_MEMO_SIZE:
            _ARGS_MEMO.clear()
        _ARGS_MEMO[memo] = (config, group, key)  # holds config and group: their ids stay theirs
    cached = _CACHE.get(key)
    if cached is not None:
        _CACHE.move_to_end(key)
        return cached
    victims = _pick_victims(key)
    if ep_size > 1:
        # One all-gather checks the shapes and, for symmetric memory (destroyed collectively),
        # agrees on the victims: those every rank found unused, in one order.
        proposal = [(k[2], k[5]) for k in victims]  # (T, capacity)
        proposals = _check_same_shapes(group, device, (num_local_tokens, hidden_size, topk),
                                       proposal)  # fmt: skip
        if device.type == "cuda":
            victims = agreed_victims(victims, proposals)
    for victim in victims:
        _evict(victim)
    evicted = _EVICTED.get(key)
    if evicted is not None:
        # This key's workspace was evicted: the same handle again (held handles stay valid).
        _revive(key, evicted)
        return evicted
    ws = allocate_workspace(
        group, ep_rank, ep_size, device, num_local_tokens, hidden_size, topk, capacity
    )
    _CACHE[key] = ws
    return ws


def clear_workspace_cache() -> None:
    """Destroy every cached workspace (collective for EP groups); evicted workspaces' handles
    stop being valid."""
    for ws in list(_CACHE.values()):
        ws.destroy()
    _CACHE.clear()
    _EVICTED.clear()
    _EVICTED_KEYS.clear()


def _pick_victims(key: tuple) -> list[tuple]:
    """The cache keys to evict before adding `key` (least recently used first): as many unused
    ones as bring its layer shape back within WORKSPACE_CACHE_SIZE, at most that many."""
    group_key, device, _, hidden_size, topk, _ = key
    shape = (group_key, device, hidden_size, topk)
    same_shape = [k for k in _CACHE if (k[0], k[1], k[3], k[4]) == shape]
    excess = min(len(same_shape) + 1 - WORKSPACE_CACHE_SIZE, WORKSPACE_CACHE_SIZE)
    if excess <= 0:
        return []
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return []  # destroy() synchronises, which capture forbids
    unused = [
        k for k in same_shape if not _CACHE[k].graph_captured and not _referenced_elsewhere(k)
    ]
    return unused[:excess]


def agreed_victims(victims: list[tuple], proposals: list[list[tuple[int, int]]]) -> list[tuple]:
    """This rank's `victims` (cache keys) that every rank proposed (`proposals`: each rank's
    (T, capacity) pairs), in one order on every rank: what an EP group destroys together."""
    agreed = set.intersection(*(set(p) for p in proposals))
    return sorted((k for k in victims if (k[2], k[5]) in agreed), key=lambda k: (k[2], k[5]))


class _Probe:
    """Stands in for a workspace to count the references the cache itself holds."""


def _referenced_elsewhere(key: tuple) -> bool:
    """Whether the cached workspace at `key` has references beyond the cache's and the handle
    registry's: counted against a probe held the same way, so the count is right whatever the
    interpreter's own references (they differ between Python versions)."""
    probe = _Probe()
    held = ({0: probe}, {0: probe})  # as _CACHE and _LIVE hold the workspace
    own = sys.getrefcount(probe)
    del held
    ws = _CACHE[key]
    return sys.getrefcount(ws) > own


def _evict(key: tuple) -> None:
    ws = _CACHE[key]
    ws.destroy()  # removes it from _CACHE and _LIVE
    _EVICTED[key] = ws
    _EVICTED_KEYS[ws.handle] = key


def _revive(key: tuple, ws: MoKWorkspace) -> None:
    """Buffers again for an evicted workspace (same handle, shapes and settings), cached."""
    try:
        _fill_buffers(ws)
    except BaseException:
        # Out of memory, say: the workspace stays evicted, holding nothing.
        for table in (ws.buffers, ws.peer_ptrs, ws._handles):
            table.clear()
        ws.peer_table = None
        raise
    ws.destroyed = False
    del _EVICTED[key]
    del _EVICTED_KEYS[ws.handle]
    _LIVE[ws.handle] = ws
    _CACHE[key] = ws


def _check_same_shapes(
    group, device, shapes: tuple[int, int, int], proposal: list[tuple[int, int]] = ()
) -> list[list[tuple[int, int]]]:
    """Raise unless `shapes` are equal on every EP rank; returns every rank's `proposal` (the
    (T, capacity) of each workspace it would evict, at most WORKSPACE_CACHE_SIZE, gathered in
    the same message, padded to a fixed size with -1)."""
    # One-time setup, so a host read of the gathered shapes is fine here.
    comm_device = device if dist.get_backend(group) != "gloo" else torch.device("cpu")
    padded = [v for pair in proposal for v in pair]
    padded += [-1] * (2 * WORKSPACE_CACHE_SIZE - len(padded))
    local = torch.tensor((*shapes, *padded), dtype=torch.int64, device=comm_device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    proposals = []
    for rank, other in enumerate(gathered):
        values = other.tolist()
        if tuple(values[:3]) != shapes:
            raise ValueError(
                f"(num_local_tokens, hidden_size, topk) must be equal on every EP rank: this rank "
                f"has {shapes}, rank {rank} has {tuple(values[:3])}"
            )
        pairs = zip(values[3::2], values[4::2], strict=True)
        proposals.append([pair for pair in pairs if pair[0] >= 0])
    return proposals


def _buffer_specs(ep_size, num_tokens, hidden, topk):
    bf16, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    return {
        "x_buffer": ((num_tokens, hidden), bf16),
        "combine_buffer": ((num_tokens * topk, hidden), bf16),
        "d_y_buffer": ((num_tokens, hidden), bf16),
        "d_x_routed_buffer": ((num_tokens * topk, hidden), bf16),
        "router_weight_buffer": ((num_tokens, topk), f32),
        "d_router_weight_buffer": ((num_tokens, topk), f32),
        "all_gather_top_experts_buffer": ((ep_size, num_tokens, topk), i32),
        "barrier_buffer": ((ep_size,), i32),
        "barrier_epoch_buffer": ((2,), i32),
    }


def allocate_workspace(
    group, ep_rank, ep_size, device, num_tokens, hidden, topk, capacity, *, plain: bool = False
) -> MoKWorkspace:
    """A new workspace's buffers, registered live: symmetric memory for an EP group on CUDA,
    plain allocations otherwise or with `plain` (a virtual group then sets the peer table)."""
    symmetric = ep_size > 1 and device.type == "cuda" and not plain
    ws = MoKWorkspace.allocated(
        handle=next(_NEXT_HANDLE),
        group=group,
        group_name="" if group is None else group.group_name,
        ep_rank=ep_rank,
        ep_size=ep_size,
        device=device,
        num_local_tokens=num_tokens,
        hidden_size=hidden,
        topk=topk,
        schedule_capacity=capacity,
        symmetric=symmetric,
    )
    _fill_buffers(ws)
    _LIVE[ws.handle] = ws
    return ws


def _fill_buffers(ws: MoKWorkspace) -> None:
    group, ep_size, device, symmetric = ws.group, ws.ep_size, ws.device, ws.symmetric
    specs = _buffer_specs(ep_size, ws.num_local_tokens, ws.hidden_size, ws.topk)
    for name, (shape, dtype) in specs.items():
        if symmetric:
            import torch.distributed._symmetric_memory as symm_mem  # noqa: PLC0415

            buf = symm_mem.empty(*shape, dtype=dtype, device=device)
            handle = symm_mem.rendezvous(buf, group.group_name)
            ws._handles[name] = handle
            ws.peer_ptrs[name] = [int(handle.buffer_ptrs[p]) for p in range(ep_size)]
        else:
            buf = torch.empty(shape, dtype=dtype, device=device)
            ws.peer_ptrs[name] = [buf.data_ptr()]
        # Counters start at zero; data buffers are poisoned so an unwritten read shows up as NaN.
        if dtype == torch.int32:
            buf.zero_()
        else:
            buf.fill_(float("nan"))
        ws.buffers[name] = buf
    if symmetric:
        dist.barrier(group=group)
        upload_peer_table(ws)


def peer_table_of(ws: MoKWorkspace) -> torch.Tensor:
    """The EP group's peer table from ws.peer_ptrs: int64 [len(BUFFER_NAMES), PEER_TABLE_ROW]
    on the workspace's device, row b the addresses of buffer BUFFER_NAMES[b] on every rank (0 past
    the EP size, and for a buffer without peer_ptrs). One-time setup: a blocking copy, outside
    graph capture."""
    table = torch.zeros(len(BUFFER_NAMES), PEER_TABLE_ROW, dtype=torch.int64)
    for row, name in enumerate(BUFFER_NAMES):
        pointers = ws.peer_ptrs.get(name)
        if pointers is None:
            continue
        if len(pointers) != ws.ep_size:
            raise ValueError(
                f"workspace.peer_ptrs[{name!r}] has {len(pointers)} entries, expected ep_size = "
                f"{ws.ep_size}"
            )
        # Addresses as int64 bits (a pointer past 2^63 wraps to the same 64 bits).
        table[row, : len(pointers)] = torch.tensor(
            [p - (1 << 64) if p >= 1 << 63 else p for p in pointers], dtype=torch.int64
        )
    return table.to(ws.device)


def upload_peer_table(ws: MoKWorkspace) -> None:
    """ws.peer_table from ws.peer_ptrs (`peer_table_of`)."""
    ws.peer_table = peer_table_of(ws)
