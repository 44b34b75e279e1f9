"""Reading a DCP checkpoint directory in one process, no process group.

Only public DCP APIs: ``FileSystemReader.read_metadata()`` says which keys the
checkpoint has (flattened, e.g. ``model.layers.0.lin1.weight``), with each
tensor's global shape and dtype; ``torch.distributed.checkpoint.load(...,
no_dist=True)`` fills full-size tensors we allocate from that metadata (DCP
assembles them from every rank's chunks); ``Metadata.planner_data`` maps each
flattened key back to its place in the nested dict that was saved.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata


def read_metadata(path: str) -> Metadata:
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise SystemExit(f"{path}: not a torch.distributed.checkpoint directory (no .metadata "
                         "file). Pass the directory given to dcp.save(checkpoint_id=...).")
    return FileSystemReader(path).read_metadata()


def key_path(md: Metadata, key: str) -> tuple:
    """Where a flattened key lives in the nested dict that was saved."""
    data = md.planner_data or {}
    path = data.get(key)
    return tuple(path) if path else (key,)


def load_flat(path: str, top: str | None = None) -> tuple[dict[str, Any], Metadata]:
    """``{flattened key: value}``, full tensors on CPU; only keys under ``top``
    (the first element of their nested path) when given."""
    md = read_metadata(path)
    flat: dict[str, Any] = {}
    for k, m in md.state_dict_metadata.items():
        if top is not None and key_path(md, k)[0] != top:
            continue
        flat[k] = (torch.empty(m.size, dtype=m.properties.dtype)
                   if isinstance(m, TensorStorageMetadata) else None)  # objects: filled by load
    if top is not None and not flat:
        tops = sorted({str(key_path(md, k)[0]) for k in md.state_dict_metadata})
        raise SystemExit(f"{path}: no entry under {top!r}; the checkpoint has {tops}.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.load(flat, storage_reader=FileSystemReader(path), no_dist=True)
    return flat, md


def nest(flat: dict[str, Any], md: Metadata) -> dict:
    """Rebuild the nested dict that was saved (lists where the path has indices)."""
    root: dict = {}
    for k, v in flat.items():
        path = key_path(md, k)
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = v
    return _lists(root)


def _lists(node):
    if isinstance(node, dict):
        node = {k: _lists(v) for k, v in node.items()}
        if (node and all(isinstance(k, int) for k in node)
                and sorted(node) == list(range(len(node)))):
            return [node[i] for i in range(len(node))]
    return node
