"""`wholeshard export CKPT OUT`: a checkpoint's model weights as one safetensors file."""

from __future__ import annotations

import argparse
import sys

DTYPES = ("bfloat16", "float16", "float32")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `export` subcommand."""
    p = subparsers.add_parser(
        "export",
        help="write a checkpoint's model weights as one safetensors file",
        description="Consolidate a wholeshard checkpoint's model weights (every state_dict key, "
        "tied aliases included) into one safetensors file for inference; runs in one process.",
    )
    p.add_argument("checkpoint", help="a step-N checkpoint, or a checkpoints directory (latest)")
    p.add_argument("out", help="output file, e.g. model.safetensors")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="cast floating tensors (params come from the fp32 masters when saved); "
        "default: the dtype they were trained in",
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.set_defaults(run=main, parser=p)
    return p


def main(args: argparse.Namespace) -> int:
    """Run `wholeshard export`; returns the exit code."""
    import torch

    from ..checkpoint import CheckpointError, export_checkpoint

    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        tensors = export_checkpoint(
            args.checkpoint, args.out, dtype=dtype, overwrite=args.overwrite
        )
    except (CheckpointError, OSError) as e:  # OSError: an unreadable file, an unwritable `out`
        print(f"wholeshard export: {e}", file=sys.stderr)
        return 1
    nbytes = sum(t.nbytes for t in tensors.values())
    print(f"wrote {len(tensors)} tensors ({nbytes / 1e6:.1f} MB) to {args.out}")
    return 0
