"""Where a checkpoint tensor goes in kvserve's model: a parameter, and the shard of a fused one."""

from __future__ import annotations

from typing import NamedTuple


class WeightTarget(NamedTuple):
    name: str  # kvserve parameter name, e.g. "layers.3.self_attn.qkv_proj.weight"
    shard: int | None = None  # for fused parameters: 0/1/2 = q/k/v, 0/1 = gate/up


def shard_offsets(param_name: str, q_size: int, kv_size: int, intermediate_size: int) -> list[int]:
    """Row offsets of the shards of a fused parameter, ending with its total rows."""
    if "qkv_proj" in param_name:
        return [0, q_size, q_size + kv_size, q_size + 2 * kv_size]
    if "gate_up_proj" in param_name:
        return [0, intermediate_size, 2 * intermediate_size]
    raise KeyError(param_name)
