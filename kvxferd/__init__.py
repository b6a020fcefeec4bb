"""kvxferd: move KV-cache blocks from prefill to decode ranks, exactly once, never hanging."""

__version__ = "0.2.0"
