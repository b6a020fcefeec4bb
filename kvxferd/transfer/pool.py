"""The KV pool: one region of ``num_layers x num_blocks`` blocks plus auxiliary slots.

On the CPU the pool lives in one POSIX shared-memory segment (``/dev/shm/<name>``)
so an engine process on the same host can map the very same pages; on a GPU
(``device = "cuda"``) the KV region is one CUDA tensor, registered with NIXL as
VRAM, and the auxiliary slots stay in host shared memory. The pool is
registered with the data plane once, at start-up, never per transfer.

Allocators hand out block ids and slot ids; ids are small integers that are
reused only after their owner released them (the owner releases only once no
write can touch them).
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import uuid
from collections.abc import Iterable
from multiprocessing import shared_memory

import numpy as np
import torch

from kvxferd.config import PoolSettings
from kvxferd.errors import Reason, RejectedError
from kvxferd.transfer.layout import Layout

_TORCH_DTYPES = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


def daemon_shm_name(role: str, engine_socket: str) -> str:
    """The pool segment name of the daemon serving ``engine_socket`` on this host.

    Stable across restarts, unlike a library pool's generated name: a daemon
    killed with SIGKILL never unlinks its segment, and its successor on the same
    engine socket finds the leftover by this name and removes it
    (kvxferd/service/preflight.py) instead of needing /dev/shm room for two pools. The
    host name keeps containers that share /dev/shm but not their socket
    directory apart.
    """
    key = f"{socket.gethostname()}\0{engine_socket}".encode()
    return f"kvxferd-{role}-{hashlib.sha256(key).hexdigest()[:16]}"


class KvPool:
    """The registered memory of one process: ``kv[layer, block, elem]`` and ``aux[slot, byte]``."""

    def __init__(self, settings: PoolSettings, owner: str = "kvxferd") -> None:
        self.settings = settings
        self.layout = Layout(
            num_layers=settings.num_layers,
            num_blocks=settings.num_blocks,
            block_bytes=settings.block_bytes,
            dtype=settings.dtype,
            aux_slots=settings.aux_slots,
            aux_slot_bytes=settings.aux_slot_bytes,
        )
        kv_bytes = settings.kv_bytes
        aux_bytes = settings.aux_slots * settings.aux_slot_bytes
        host_bytes = aux_bytes + (kv_bytes if settings.device == "cpu" else 0)
        self.shm_name = settings.shm_name or f"kvxferd-{owner}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(
            name=self.shm_name, create=True, size=host_bytes
        )
        host = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=host_bytes)
        shape = (settings.num_layers, settings.num_blocks, settings.block_elems)
        if settings.device == "cpu":
            self.kv = host[:kv_bytes].view(_TORCH_DTYPES[settings.dtype]).view(shape)
            self.mem_type = "DRAM"
            self.device_id = 0
        else:  # pragma: no cover - needs a GPU; see docs/gpu.md
            dev = torch.device("cuda", settings.cuda_device)
            self.kv = torch.zeros(shape, dtype=_TORCH_DTYPES[settings.dtype], device=dev)
            self.mem_type = "VRAM"
            self.device_id = settings.cuda_device
        self.aux = host[host_bytes - aux_bytes :].view(settings.aux_slots, settings.aux_slot_bytes)
        self._host = host

    @property
    def kv_base(self) -> int:
        return int(self.kv.data_ptr())

    @property
    def aux_base(self) -> int:
        return int(self.aux.data_ptr())

    def kv_bytes_view(self) -> torch.Tensor:
        """The KV region as ``[layer, block, byte]`` (a view, no copy)."""
        return self.kv.view(torch.uint8).view(self.layout.num_layers, self.layout.num_blocks, -1)

    def close(self) -> None:
        """Unmap and unlink the segment. Call only once nothing can write into it."""
        shm, self._shm = self._shm, None
        if shm is None:
            return
        del self.kv, self.aux, self._host
        try:
            shm.close()
        except BufferError:  # a caller still holds a view; the OS reclaims at exit
            pass
        try:
            shm.unlink()
        except FileNotFoundError:
            pass


class IdAllocator:
    """A thread-safe free list of ids ``[0, n)``; used for blocks and aux slots."""

    def __init__(self, n: int, *, shuffle_seed: int | None = None) -> None:
        ids = np.arange(n, dtype=np.int64)
        if shuffle_seed is not None:  # hand ids out scattered, as a real allocator does
            np.random.default_rng(shuffle_seed).shuffle(ids)
        self._free: list[int] = ids.tolist()[::-1]
        self._n = n
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)

    def take(self, count: int) -> np.ndarray:
        """``count`` ids, or BUSY when not enough are free."""
        with self._lock:
            if count > len(self._free):
                raise RejectedError(Reason.BUSY, f"{count} ids asked, {len(self._free)} free")
            out = self._free[-count:] if count else []
            del self._free[len(self._free) - count :]
        return np.array(out[::-1], dtype=np.int64)

    def give_back(self, ids: Iterable[int]) -> None:
        with self._lock:
            self._free.extend(int(i) for i in ids)
