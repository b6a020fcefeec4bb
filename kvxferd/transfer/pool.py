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

import fcntl
import hashlib
import os
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from multiprocessing import shared_memory

import numpy as np
import torch

from kvxferd.config import PoolSettings
from kvxferd.errors import Reason, RejectedError
from kvxferd.transfer.layout import Layout

TORCH_DTYPES = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


SHM_DIR = "/dev/shm"
_HOLD_WAIT_S = 2.0  # a probe holds the lock for microseconds; this only bounds the wait


def daemon_shm_prefix(role: str, engine_socket: str) -> str:
    """What the pool segment names of ``role``'s daemons serving ``engine_socket`` on this
    host start with (the host name keeps containers that share /dev/shm but not their
    socket directory apart)."""
    key = f"{socket.gethostname()}\0{engine_socket}".encode()
    return f"kvxferd-{role}-{hashlib.sha256(key).hexdigest()[:16]}"


def daemon_shm_name(role: str, engine_socket: str) -> str:
    """A new pool segment name for one daemon instance: the prefix, its pid and a random part.

    Never the same for two live daemons, even on one engine socket string (two daemons
    with ``tcp://127.0.0.1:0`` once derived one name, and the second unlinked the first's
    live segment). Engines learn the name from the daemon they attach to (PoolInfo),
    never by derivation. A daemon killed with SIGKILL leaves its segment; its successor
    finds it by the prefix and removes it once no process holds it
    (:func:`holder_alive`, kvxferd/service/preflight.py).
    """
    return f"{daemon_shm_prefix(role, engine_socket)}-{os.getpid()}-{secrets.token_hex(4)}"


def hold(path: str, wait_s: float = 0.0) -> int | None:
    """An open descriptor of ``path`` with an exclusive flock on it, held until closed:
    the mark of a live pool. None where the segment cannot be opened, or not locked within
    ``wait_s`` (a creator waits out another daemon's :func:`holder_alive`, which takes the
    lock for a moment)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.005)
                continue
            os.close(fd)
            return None
        except OSError:
            os.close(fd)
            return None


def holder_alive(path: str) -> bool:
    """True when a live process holds the segment at ``path``: its flock is taken, or the
    pid in its name (``...-PID-RANDOM``) is a live process (a segment just created, before
    its flock). False only when it is a leftover, safe to unlink."""
    fd = hold(path)
    if fd is None:
        return os.path.exists(path)  # locked by someone (or unreadable): leave it alone
    try:
        parts = os.path.basename(path).rsplit("-", 2)
        if len(parts) == 3 and parts[1].isdigit():
            try:
                os.kill(int(parts[1]), 0)
                return True  # its creator lives (it may not have locked it yet)
            except ProcessLookupError:
                pass
            except PermissionError:
                return True
        return False
    finally:
        os.close(fd)


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
        # Held for the pool's life: no other daemon's start-up removes a segment in use.
        self._hold = hold(os.path.join(SHM_DIR, self.shm_name), wait_s=_HOLD_WAIT_S)
        host = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=host_bytes)
        shape = (settings.num_layers, settings.num_blocks, settings.block_elems)
        if settings.device == "cpu":
            self.kv = host[:kv_bytes].view(TORCH_DTYPES[settings.dtype]).view(shape)
            self.mem_type = "DRAM"
            self.device_id = 0
        else:  # pragma: no cover - needs a GPU; see docs/gpu.md
            dev = torch.device("cuda", settings.cuda_device)
            self.kv = torch.zeros(shape, dtype=TORCH_DTYPES[settings.dtype], device=dev)
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
        held, self._hold = self._hold, None
        if held is not None:
            os.close(held)


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
