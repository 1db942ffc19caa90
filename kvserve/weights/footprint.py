"""What each stored tensor type costs in memory once loaded, against its bytes in the file.

A layer built from several stored tensors (q, k and v into one qkv layer, of possibly different
types) has its bytes shared among them by their number of values; a tensor object held by two
modules (a tied lm_head reusing the embedding's codes) is counted once; a module no stored tensor
names (a tied lm_head) is counted with the embedding it was made from. The KV pool and rotary
tables are not weights and are not counted.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvserve.weights.loader import EMBEDDING, LM_HEAD, stage_name


def footprint(model: nn.Module, stored: list[tuple[str, str, int, int]]) -> dict[str, dict[str, Any]]:
    """Per stored type: {"tensors", "file_bytes", "memory_bytes", "memory_per_file"}, for the tensors
    `model` holds (a pipeline stage: its share). `stored` is GGUFFile.stored()."""
    modules = dict(model.named_modules())
    counted: set[int] = set()

    def fresh_bytes(tensors: list[torch.Tensor]) -> int:
        """Bytes of `tensors` not yet counted."""
        total = 0
        for t in tensors:
            if id(t) not in counted:
                counted.add(id(t))
                total += t.numel() * t.element_size()
        return total

    # A layer (its codes, scales and bias together) or another module's one parameter (a norm's weight)
    # -> the (type, file bytes, values) of the stored tensors it was made from.
    made_from: dict[tuple[str, str | None], list[tuple[str, int, int]]] = {}
    for name, kind, nbytes, numel in stored:
        module_name, attr = _place(model, name)
        if module_name is not None:
            key = (module_name, None if _is_layer(modules[module_name]) else attr)
            made_from.setdefault(key, []).append((kind, nbytes, numel))
    out: dict[str, dict[str, Any]] = {}
    tied = LM_HEAD in modules and not any(name.startswith(f"{LM_HEAD}.") for name, *_ in stored)
    for (module_name, attr), parts in made_from.items():
        module = modules[module_name]
        memory = fresh_bytes([getattr(module, attr)] if attr else [*module.parameters(), *module.buffers()])
        if module_name == EMBEDDING and tied:  # the lm_head was made from the embedding's tensor
            memory += fresh_bytes([*modules[LM_HEAD].parameters(), *modules[LM_HEAD].buffers()])
        values = sum(numel for _, _, numel in parts)
        for kind, nbytes, numel in parts:
            row = out.setdefault(kind, {"tensors": 0, "file_bytes": 0, "memory_bytes": 0})
            row["tensors"] += 1
            row["file_bytes"] += nbytes
            row["memory_bytes"] += round(memory * numel / values)
    for row in out.values():
        row["memory_per_file"] = round(row["memory_bytes"] / row["file_bytes"], 3) if row["file_bytes"] else None
    return dict(sorted(out.items(), key=lambda item: -item[1]["file_bytes"]))


def _is_layer(module: nn.Module) -> bool:
    """A linear or embedding layer in any of its forms (float, int4, int8 groups, GPU): all its tensors
    (codes, scales, bias) were made from its stored weight and bias."""
    return hasattr(module, "in_features") or hasattr(module, "num_embeddings")


def _place(model: nn.Module, name: str) -> tuple[str | None, str]:
    """(module name in `model`, attribute) of a stored tensor's parameter name; None for another
    pipeline stage's."""
    name = stage_name(model, name)
    if name is None:
        return None, ""
    module_name, attr = name.rsplit(".", 1)
    return module_name, attr
