"""Print what a torch.distributed.checkpoint (DCP) directory holds, offline.

    python -m tools.dcp_inspect CKPT_DIR

One line per entry: its flattened FQN (e.g. ``model.layers.0.lin1.weight``,
``optim.state.layers.0.lin1.weight.exp_avg``), global shape, dtype, and how
many chunks (boxes) the saving ranks wrote; objects (e.g. ``param_groups``)
are listed as such. Reads only the metadata file.
"""
from __future__ import annotations

import argparse
import math

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tools._dcp import read_metadata


def describe(path: str) -> list[str]:
    md = read_metadata(path)
    rows, total = [], 0
    for k in sorted(md.state_dict_metadata):
        m = md.state_dict_metadata[k]
        if isinstance(m, TensorStorageMetadata):
            nbytes = math.prod(m.size) * m.properties.dtype.itemsize
            total += nbytes
            rows.append((k, str(tuple(m.size)), str(m.properties.dtype).replace("torch.", ""),
                         f"{len(m.chunks)} chunk{'s' if len(m.chunks) != 1 else ''}"))
        else:
            rows.append((k, "", "(object)", ""))
    w = [max((len(r[i]) for r in rows), default=0) for i in range(4)]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    lines.append(f"{len(rows)} entries, {total / 2**20:.2f} MiB of tensors")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.dcp_inspect", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="DCP checkpoint directory (checkpoint_id of dcp.save)")
    args = ap.parse_args(argv)
    print("\n".join(describe(args.checkpoint)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
