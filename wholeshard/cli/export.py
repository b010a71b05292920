"""`wholeshard export CKPT OUT`: a checkpoint's model weights as one safetensors file, or
(`--format hf`) a checkpoint of a transformers model as a transformers model directory."""

from __future__ import annotations

import argparse
import sys

from . import interrupt

DTYPES = ("bfloat16", "float16", "float32")
FORMATS = ("safetensors", "hf")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `export` subcommand."""
    p = subparsers.add_parser(
        "export",
        help="write a checkpoint's model as safetensors or a transformers model directory",
        description="Consolidate a wholeshard checkpoint's model weights for inference, in one "
        "process. --format safetensors (default): one safetensors file with every state_dict "
        "key, tied aliases included. --format hf: a transformers model directory (config, "
        "sharded safetensors, tokenizer, generation config) for "
        "AutoModelForCausalLM.from_pretrained; needs a checkpoint of a transformers model "
        "(wholeshard train --model hf:DIR or hf-config:FILE) and transformers and safetensors "
        "(pip install 'wholeshard[hf]').",
    )
    p.add_argument("checkpoint", help="a step-N checkpoint, or a checkpoints directory (latest)")
    p.add_argument(
        "out", help="output: a file (model.safetensors), or a directory with --format hf"
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="safetensors",
        help="safetensors: one file of the weights; hf: a transformers model directory "
        "(default: safetensors)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="cast floating tensors (params come from the fp32 masters when saved); "
        "default: the dtype they were trained in",
    )
    p.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="with --format hf: the largest weights file (e.g. 5GB, 500MB); above it the "
        "weights are sharded with an index (default: 5GB)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.set_defaults(run=main, parser=p)
    return p


def main(args: argparse.Namespace) -> int:
    """Run `wholeshard export`; returns the exit code."""
    if args.max_shard_size is not None and args.format != "hf":
        return _fail("--max-shard-size needs --format hf (a safetensors export is one file)")
    import torch

    from ..checkpoint import CheckpointError, export_checkpoint, export_hf

    dtype = getattr(torch, args.dtype) if args.dtype else None
    # OSError: an unreadable file, an unwritable `out`; ImportError: no transformers;
    # ValueError: a bad --max-shard-size, a dtype safetensors cannot hold
    try:
        with interrupt.raises():  # each export removes its partial output on the way out
            if args.format == "hf":
                kw = {} if args.max_shard_size is None else {"max_shard_size": args.max_shard_size}
                out = export_hf(
                    args.checkpoint, args.out, dtype=dtype, overwrite=args.overwrite, **kw
                )
            else:
                tensors = export_checkpoint(
                    args.checkpoint, args.out, dtype=dtype, overwrite=args.overwrite
                )
    except (CheckpointError, OSError, ImportError, ValueError) as e:
        return _fail(str(e))
    if args.format == "hf":
        files = sorted(p.name for p in out.iterdir())
        print(f"wrote a transformers model directory to {out}: {', '.join(files)}")
        return 0
    nbytes = sum(t.nbytes for t in tensors.values())
    print(f"wrote {len(tensors)} tensors ({nbytes / 1e6:.1f} MB) to {args.out}")
    return 0


def _fail(message: str) -> int:
    print(f"wholeshard export: {message}", file=sys.stderr)
    return 1
