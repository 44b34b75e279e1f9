"""Convert a torch.distributed.checkpoint (DCP) directory into one file, offline.

    python -m tools.dcp_to_torch CKPT_DIR out.pt                  # everything, torch.save
    python -m tools.dcp_to_torch CKPT_DIR model.safetensors --key model

No process group and no GPU are needed: one process reads every rank's
chunks and writes full tensors. ``.pt``: the nested dict that was saved
(e.g. ``{"model": ..., "optim": ...}``), loadable with ``torch.load``.
``.safetensors`` (needs the ``safetensors`` package: ``pip install
fsdp_compose[tools]``): tensors only, keys joined with ``.``; with ``--key
model`` the keys are the module's own FQNs, so ``module.load_state_dict(
safetensors.torch.load_file(path))`` works on a plain ``nn.Module``.
Peak memory: the selected tensors, once.
"""
from __future__ import annotations

import argparse
import sys

import torch

from tools._dcp import load_flat, nest


def _flatten_tensors(tree, prefix: str, out: dict, skipped: list) -> None:
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) \
        if isinstance(tree, (list, tuple)) else None
    if items is None:
        if isinstance(tree, torch.Tensor):
            out[prefix] = tree.contiguous()
        else:
            skipped.append(prefix)
        return
    for k, v in items:
        _flatten_tensors(v, f"{prefix}.{k}" if prefix else str(k), out, skipped)


def convert(src: str, dst: str, key: str | None = None) -> dict:
    flat, md = load_flat(src, key)
    tree = nest(flat, md)
    if key is not None:
        tree = tree[key]
    if dst.endswith(".safetensors"):
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise SystemExit("writing .safetensors needs the safetensors package: "
                             "pip install safetensors (or fsdp_compose[tools]).") from None
        tensors: dict = {}
        skipped: list = []
        _flatten_tensors(tree, "", tensors, skipped)
        save_file(tensors, dst)
        if skipped:
            print(f"skipped {len(skipped)} non-tensor entries (safetensors holds tensors only): "
                  f"{', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}", file=sys.stderr)
    else:
        torch.save(tree, dst)
    return tree


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.dcp_to_torch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="DCP checkpoint directory (checkpoint_id of dcp.save)")
    ap.add_argument("output", help="output file: *.pt (torch.save) or *.safetensors")
    ap.add_argument("--key", default=None,
                    help="only this top-level entry, e.g. 'model' (its keys become the top level)")
    args = ap.parse_args(argv)
    tree = convert(args.checkpoint, args.output, args.key)
    n = len(tree) if isinstance(tree, dict) else 1
    print(f"wrote {args.output} ({n} top-level entries)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
