"""The ``fsdp-compose`` command line."""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-compose", description="fsdp_compose: composable, zero-copy fully-sharded data "
        "parallelism for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="train a small Llama on the shipped text with fully_shard",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Train a small character-level Llama on the shipped text, each block and "
        "the root sharded with fully_shard, and print a summary. Spawns --world-size gloo "
        "CPU ranks, or joins a torchrun job (NCCL on CUDA) when RANK/WORLD_SIZE are set. "
        "With --tp N (2-D): the blocks are tensor-parallel over N ranks (parallelize_module) "
        "and fully_shard-ed over the other world/N, e.g. --world-size 4 --tp 2.",
    )
    from fsdp_compose.demo.train import add_arguments

    add_arguments(demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from fsdp_compose.demo.train import DemoArgumentError, run

        try:
            run(args)
        except DemoArgumentError as e:
            parser.error(f"demo: {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
