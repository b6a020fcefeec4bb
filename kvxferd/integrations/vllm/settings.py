"""The connector's settings: ``kv_connector_extra_config``, validated once at start.

Only ``engine_socket`` is required; the rest are deadlines with defaults that
suit one prefill and one decode instance on a LAN::

    engine_socket      the local daemon's engine socket (its service.engine_socket); with
                       tensor or pipeline parallelism each worker has its own daemon, and
                       ``{rank}`` in the text is replaced by the worker's rank in the
                       instance (pp_stage * tp_size + tp_rank), e.g.
                       ``ipc:///run/kvxferd/engine-{rank}.sock``
    transfer_timeout_s decode side: a fetch not done by then is a load failure
    call_timeout_s     any one call to the local daemon (a dead daemon costs this long)
    close_timeout_s    how long a close waits for writes still in flight
    zero_copy          vLLM's KV cache lives in the daemon's pool: no copies (required on
                       CUDA; the pool's shape is ``pool-config --zero-copy``), see docs/gpu.md
    decode_tp_size     producers: the decode instance's tensor parallel size (default: this
    decode_pp_size     instance's), and pipeline stages (default 1): how many decode ranks read
                       each prefill rank's blocks (docs/topology.md)
    model_id           the model's identity in the topology's compatibility hash (default:
                       vLLM's ``model``); both instances must say the same
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvxferd.errors import ConfigError


class ConnectorSettings(BaseModel):
    """What ``kv_connector_extra_config`` may hold."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine_socket: str = Field(pattern=r"^(ipc|tcp)://.{1,240}$")
    transfer_timeout_s: float = Field(30.0, gt=0, le=3600)
    call_timeout_s: float = Field(5.0, gt=0, le=600)
    close_timeout_s: float = Field(5.0, gt=0, le=600)
    zero_copy: bool = False
    decode_tp_size: int | None = Field(None, ge=1, le=4096)
    decode_pp_size: int = Field(1, ge=1, le=4096)
    model_id: str | None = Field(None, min_length=1, max_length=512)

    def engine_socket_of(self, rank: int) -> str:
        """The engine socket of the worker of ``rank`` (``{rank}`` replaced)."""
        return self.engine_socket.replace("{rank}", str(rank))


def load_settings(extra: dict[str, Any] | None) -> ConnectorSettings:
    """The settings from vLLM's ``kv_connector_extra_config``; ConfigError naming the bad key."""
    try:
        return ConnectorSettings.model_validate(dict(extra or {}))
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "kv_connector_extra_config"
        raise ConfigError(
            f"kv_connector_extra_config[{where!r}]: {first['msg']}"
            + (
                " (e.g. {'engine_socket': 'ipc:///run/kvxferd/engine.sock'})"
                if where == "engine_socket"
                else ""
            )
        ) from None
