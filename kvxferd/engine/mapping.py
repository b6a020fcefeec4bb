"""The daemon's pool mapped into the engine's process: shared memory on the CPU, a CUDA IPC handle on a GPU.

``attach_pool(describe())`` gives the ``[layers, blocks, block_bytes]`` uint8 view the
engine reads and writes; the daemon owns the memory (docs/engine-api.md, "GPU pools").
"""

from __future__ import annotations

from multiprocessing import resource_tracker, shared_memory

import torch

from kvxferd.engine import engine_protocol as ep
from kvxferd.engine.engine_protocol import EngineReason, PoolInfo
from kvxferd.engine.errors import EngineError
from kvxferd.transfer.pool import TORCH_DTYPES


class _AttachedShm(shared_memory.SharedMemory):
    """A segment we only map: tolerate views that outlive this object (the OS unmaps at the end)."""

    def __del__(self) -> None:
        try:
            self.close()
        except (BufferError, OSError):
            pass


class PoolMapping:
    """The daemon's pool mapped here: ``kv`` as ``[layers, blocks, block_bytes]`` uint8, ``aux`` slots."""

    def __init__(self, info: PoolInfo) -> None:
        lay = info.layout
        self.info = info
        self._shm: _AttachedShm | None = None
        if info.device == "cpu":
            shm = _AttachedShm(name=info.shm_name, create=False)
            # Attaching registered the name with this process's resource tracker, which would
            # unlink the daemon's segment when the engine exits: it is not ours to remove.
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
            self._shm = shm
            if shm.size < info.shm_bytes:
                shm.close()
                raise EngineError(
                    EngineReason.INCOMPATIBLE,
                    f"segment {info.shm_name} has {shm.size} bytes, {info.shm_bytes} expected",
                )
            host = torch.frombuffer(shm.buf, dtype=torch.uint8, count=info.shm_bytes)
            kv_bytes = lay.num_layers * lay.num_blocks * lay.block_bytes
            self.kv = host[lay.kv_offset : lay.kv_offset + kv_bytes].view(
                lay.num_layers, lay.num_blocks, lay.block_bytes
            )
        else:  # pragma: no cover - needs a GPU
            shm = _AttachedShm(name=info.shm_name, create=False)
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
            self._shm = shm
            host = torch.frombuffer(shm.buf, dtype=torch.uint8, count=info.shm_bytes)
            self.kv = _open_cuda_kv(info)
        aux_bytes = lay.aux_slots * lay.aux_slot_bytes
        self.aux = host[lay.aux_offset : lay.aux_offset + aux_bytes].view(
            lay.aux_slots, lay.aux_slot_bytes
        )

    def close(self) -> None:
        """Drop our views and unmap; tensors derived from ``kv`` keep the pages mapped until freed."""
        shm, self._shm = self._shm, None
        if shm is None:
            return
        del self.kv, self.aux
        try:
            shm.close()
        except BufferError:  # a caller still holds a view; unmapped when the last one goes
            pass


def attach_pool(info: PoolInfo) -> torch.Tensor:
    """Map the daemon's KV pool here: a ``[layers, blocks, block_bytes]`` uint8 tensor.

    On the CPU it is a view of the daemon's POSIX shared memory (same pages, no
    copy); on CUDA it is rebuilt from the IPC handle in ``info``. The tensor keeps
    its mapping alive (``tensor.kvxferd_mapping`` is the :class:`PoolMapping`, with
    ``aux`` and ``close()``); the daemon owns the segment and unlinks it.
    """
    mapping = PoolMapping(info)
    kv = mapping.kv
    kv.kvxferd_mapping = mapping  # type: ignore[attr-defined]
    return kv


def _open_cuda_kv(info: PoolInfo) -> torch.Tensor:  # pragma: no cover - needs a GPU
    """Rebuild the daemon's KV tensor from its CUDA IPC handle (as torch.multiprocessing does).

    Must run in a process other than the daemon (CUDA refuses to open an IPC
    handle in the process that exported it) on the same host.
    """
    if info.cuda_ipc_handle is None:
        raise EngineError(EngineReason.INCOMPATIBLE, "cuda pool without cuda_ipc_handle")
    h = ep.decode_cuda_ipc(info.cuda_ipc_handle)
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        h.device,
        h.handle,
        h.storage_size_bytes,
        h.storage_offset_bytes,
        h.ref_counter_handle,
        h.ref_counter_offset,
        h.event_handle,
        h.event_sync_required,
    )
    dtype = TORCH_DTYPES[info.layout.dtype]
    t = torch.empty((0,), dtype=dtype, device=torch.device("cuda", h.device))
    t.set_(
        torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True),
        h.tensor_offset,
        tuple(h.shape),
        tuple(h.stride),
    )
    lay = info.layout
    return t.view(torch.uint8).view(lay.num_layers, lay.num_blocks, lay.block_bytes)
