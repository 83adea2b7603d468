"""NUMA binding of elastic ranks, as torch defines it (``numa_options``,
``torch.numa.binding``): rank ``i`` runs on CPUs near GPU ``i``.

The modes, by torch's ``AffinityMode`` values:

- ``node``: every allowed CPU of the GPU's NUMA node;
- ``socket``: those of every NUMA node on the GPU's socket;
- ``exclusive``: the node's physical cores split evenly among the node's
  GPUs (the lower GPU indices get one more core when they do not divide);
- ``core-complex``: one group of cores sharing the last-level cache on the
  node, a different one per GPU of the node while there are enough.

"Allowed" is this process's CPU affinity.  Function ranks bind themselves
before the function runs (every thread that has the main thread's affinity,
as torch does); binaries are started through ``numactl --physcpubind``, as
torch starts them, with CPUs the launcher works out.  Finding a GPU's NUMA
node takes torch with CUDA (the GPU's PCI address), and sysfs.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from typing import Any

log = logging.getLogger(__name__)

MODES = ("node", "socket", "exclusive", "core-complex")
SYSFS = "/sys"  # where the topology is read (tests point it at a tree of their own)


def parse_cpu_list(text: str) -> set[int]:
    """``{0, 1, 2, 4}`` for sysfs's ``"0-2,4"``."""
    cpus: set[int] = set()
    for item in text.strip().split(","):
        item = item.strip()
        if not item:
            continue
        first, _, last = item.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def format_cpu_list(cpus: Iterable[int]) -> str:
    """``"0-2,4"`` for ``{0, 1, 2, 4}``: what ``numactl --physcpubind`` takes."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


# ------------------------------------------------------------------- GPUs


def gpu_count() -> int:
    """The GPUs torch sees (through NVML where it can: this initialises no
    CUDA context, so "fork" launches stay usable)."""
    import torch

    return int(torch.cuda.device_count())


def gpu_numa_node(gpu_index: int) -> int:
    """The NUMA node of GPU ``gpu_index`` (0 where sysfs says -1, on
    machines with one node).  Initialises CUDA in this process."""
    import torch

    props: Any = torch.cuda.get_device_properties(gpu_index)
    address = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    with open(f"{SYSFS}/bus/pci/devices/{address}/numa_node") as f:
        return max(int(f.read().strip()), 0)


# --------------------------------------------------------------- topology


class Topology:
    """The machine's NUMA nodes, sockets, cores and caches, read from
    sysfs, and which GPU sits on which node.

    Args:
        root: the sysfs mount.
        gpu_node: GPU index -> its NUMA node.
        gpus: how many GPUs there are.
        allowed: the CPUs a rank may use (this process's affinity).
    """

    def __init__(
        self,
        root: str | None = None,
        gpu_node: Callable[[int], int] | None = None,
        gpus: Callable[[], int] | None = None,
        allowed: set[int] | None = None,
    ) -> None:
        self.root = SYSFS if root is None else root
        self.gpu_node = gpu_numa_node if gpu_node is None else gpu_node
        self.gpus = gpu_count if gpus is None else gpus
        self.allowed = os.sched_getaffinity(0) if allowed is None else allowed

    def _read(self, path: str) -> str:
        with open(os.path.join(self.root, path)) as f:
            return f.read()

    def nodes(self) -> set[int]:
        return parse_cpu_list(self._read("devices/system/node/possible"))

    def node_cpus(self, node: int) -> set[int]:
        """The allowed CPUs of ``node``."""
        try:
            cpus = parse_cpu_list(self._read(f"devices/system/node/node{node}/cpulist"))
        except FileNotFoundError:
            raise RuntimeError(f"sysfs lists no CPUs for NUMA node {node}") from None
        return cpus & self.allowed

    def socket(self, cpu: int) -> int:
        return int(self._read(f"devices/system/cpu/cpu{cpu}/topology/physical_package_id"))

    def core(self, cpu: int) -> int:
        """The physical core of ``cpu``: its lowest hyperthread sibling."""
        siblings = self._read(f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        return min(parse_cpu_list(siblings))

    def last_cache(self, cpu: int) -> int:
        """The last-level (data or unified) cache of ``cpu``: the lowest
        CPU sharing it."""
        folder = f"devices/system/cpu/cpu{cpu}/cache"
        best_level, sharers = -1, {cpu}
        for entry in sorted(os.listdir(os.path.join(self.root, folder))):
            if not (entry.startswith("index") and entry[5:].isdecimal()):
                continue
            if self._read(f"{folder}/{entry}/type").strip() not in ("Data", "Unified"):
                continue
            level = int(self._read(f"{folder}/{entry}/level"))
            if level > best_level:
                best_level = level
                sharers = parse_cpu_list(self._read(f"{folder}/{entry}/shared_cpu_list"))
        return min(sharers)

    def node_gpus(self, node: int) -> list[int]:
        """The GPUs on ``node``, in index order."""
        return [gpu for gpu in range(self.gpus()) if self.gpu_node(gpu) == node]


def _grouped(cpus: Iterable[int], key: Callable[[int], int]) -> dict[int, set[int]]:
    groups: dict[int, set[int]] = {}
    for cpu in cpus:
        groups.setdefault(key(cpu), set()).add(cpu)
    return groups


def _socket_cpus(topology: Topology, node: int) -> set[int]:
    socket = topology.socket(min(topology.node_cpus(node)))
    cpus: set[int] = set()
    for other in topology.nodes():
        allowed = topology.node_cpus(other)
        if allowed and topology.socket(min(allowed)) == socket:
            cpus |= allowed
    return cpus


def _exclusive_cpus(topology: Topology, gpu: int, node: int) -> set[int]:
    gpus = topology.node_gpus(node)
    cores = sorted(_grouped(topology.node_cpus(node), topology.core).items())
    share, extra = divmod(len(cores), len(gpus))
    if share < 1:
        raise RuntimeError(
            f"NUMA node {node} has {len(cores)} physical cores for its {len(gpus)} GPUs: "
            "too few to give each its own"
        )
    index = gpus.index(gpu)
    start = index * share + min(index, extra)
    end = start + share + (1 if index < extra else 0)
    return set().union(*(cpus for _core, cpus in cores[start:end]))


def _core_complex_cpus(topology: Topology, gpu: int, node: int) -> set[int]:
    gpus = topology.node_gpus(node)
    caches = _grouped(topology.node_cpus(node), topology.last_cache)
    # The largest groups first, then by lowest CPU.
    ordered = [cpus for _key, cpus in sorted(caches.items(), key=lambda i: (-len(i[1]), i[0]))]
    return ordered[gpus.index(gpu) % len(ordered)]


def cpus_for(mode: str, gpu: int, topology: Topology) -> set[int]:
    """The CPUs a rank using GPU ``gpu`` is bound to in ``mode``.

    Raises:
        RuntimeError, OSError: the topology cannot be read, or leaves no CPU.
    """
    node = topology.gpu_node(gpu)
    if mode == "node":
        cpus = topology.node_cpus(node)
    elif mode == "socket":
        cpus = _socket_cpus(topology, node)
    elif mode == "exclusive":
        cpus = _exclusive_cpus(topology, gpu, node)
    else:
        cpus = _core_complex_cpus(topology, gpu, node)
    if not cpus:
        raise RuntimeError(f"no allowed CPU to bind to near GPU {gpu} (NUMA node {node}, {mode})")
    return cpus


def bind_this_process(cpus: set[int]) -> None:
    """Bind this process's threads to ``cpus``: the calling thread, and
    every other that still has its original affinity (one set apart on
    purpose keeps it), as torch does."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    for name in os.listdir("/proc/self/task"):
        try:
            tid = int(name)
            if os.sched_getaffinity(tid) == before:
                os.sched_setaffinity(tid, cpus)
        except (ValueError, OSError):
            pass  # that thread ended meanwhile


# ------------------------------------------------------------ the binding


class NumaBinding:
    """``numa_options``, checked by the launcher: the mode, whether to go on
    unbound when binding fails, and for binary ranks what to run them
    through (``numactl`` and each rank's CPUs)."""

    def __init__(self, mode: str, fall_back: bool) -> None:
        self.mode = mode
        self.fall_back = fall_back
        self.numactl = ""
        self.binary_cpus: dict[int, str] = {}

    def __repr__(self) -> str:
        return f"NumaBinding(mode={self.mode!r}, fall_back={self.fall_back})"

    def failed(self, what: str, exc: BaseException) -> None:
        """Binding failed: go on unbound (with a warning) if the options say
        so, else raise ``exc``."""
        if not self.fall_back:
            raise exc
        log.warning("NUMA binding failed (%s: %s); %s runs unbound", type(exc).__name__, exc, what)

    def bind_rank(self, rank: int) -> None:
        """In a function rank: bind it near GPU ``rank``."""
        try:
            bind_this_process(cpus_for(self.mode, rank, Topology()))
        except Exception as exc:
            self.failed(f"rank {rank}", exc)

    def wrap_argv(self, rank: int, argv: list[str]) -> list[str]:
        """A binary rank's argv, run through numactl where it is bound."""
        cpus = self.binary_cpus.get(rank)
        if cpus is None:
            return argv
        return ["numactl", f"--physcpubind={cpus}", *argv]


def _why_not_here(nprocs: int) -> str | None:
    """Why ranks cannot be bound here, or None."""
    if not os.path.exists(os.path.join(SYSFS, "devices/system/node/possible")):
        return f"this machine shows no NUMA information ({SYSFS}/devices/system/node)"
    try:
        count = gpu_count()
    except ImportError:
        return "finding each rank's GPU takes torch, which is not installed"
    if count < nprocs:
        return (
            f"rank i is bound to the CPUs near GPU i, and torch sees {count} GPU(s) for "
            f"{nprocs} rank(s)"
        )
    return None


def binding(
    options: Any, nprocs: int, binary: str | None, env: Mapping[str, str]
) -> NumaBinding | None:
    """Check torch's ``numa_options`` (an ``affinity_mode`` among
    :data:`MODES`, ``should_fall_back_if_binding_fails``) for ``nprocs``
    ranks before anything starts; None for no binding.  For a ``binary``,
    work out each rank's CPUs and find ``numactl`` (on ``env``'s PATH).

    Raises:
        ValueError: an unknown affinity mode.
        RuntimeError: binding cannot apply here (no NUMA information, no
            torch, fewer GPUs than ranks, no numactl for a binary), unless
            the options say to fall back, which logs a warning instead.
    """
    mode = getattr(options, "affinity_mode", None)
    mode = getattr(mode, "value", mode)
    if mode not in MODES:
        raise ValueError(
            f"numa_options: affinity_mode {mode!r} is not one of " + ", ".join(map(repr, MODES))
        )
    numa = NumaBinding(mode, bool(getattr(options, "should_fall_back_if_binding_fails", False)))
    try:
        problem = _why_not_here(nprocs)
        if problem is not None:
            raise RuntimeError(f"numa_options cannot apply: {problem}")
        if binary is not None:
            numactl = shutil.which("numactl", path=env.get("PATH", os.defpath))
            if numactl is None:
                raise RuntimeError(
                    "numa_options: binary ranks are bound through numactl, not found"
                )
            topology = Topology()
            numa.binary_cpus = {
                rank: format_cpu_list(cpus_for(mode, rank, topology)) for rank in range(nprocs)
            }
            numa.numactl = numactl
    except (RuntimeError, OSError) as exc:
        numa.failed("every rank", exc)
        return None
    return numa
