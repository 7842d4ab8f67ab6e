"""What ``make demo`` runs: train the three variants, print the summary, write the figures, infer.

1. ``train_sparse_transformer.py --variant all``: softmax, fixed 1.5-entmax and adaptive
   (learnable per-head alpha) encoder-decoder Transformers on digit reversal, reports and the
   analogues of Figs. 2-6 of Correia et al. (2019) in ``--out`` (default ``runs/demo``; with training
   options, ``runs/demo-<option>=<value>,...``, so a run with other options keeps its own folder);
2. ``inference.py`` on the adaptive checkpoint: greedy decoding of held-out inputs, a per-layer,
   per-head density and alpha table and ``attention_map_adaptive.png``.

The defaults finish in a few minutes on a 2-core CPU (reference path); on a CUDA machine the
attention runs the fused Triton kernels. Any other option is passed on to the training script,
e.g. ``python examples/seq2seq/demo.py --steps 2000 --d-model 128``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this example's modules and examples/run_folders.py

import inference  # noqa: E402
import train_sparse_transformer  # noqa: E402
from run_folders import add_device_option, run_folder  # noqa: E402


def default_out(train_argv: list[str]) -> Path:
    """``runs/demo``, plus ``-<option>=<value>,...`` for every training option that differs from its default."""
    train_parser = train_sparse_transformer.build_parser()
    return run_folder("demo", train_parser, train_parser.parse_args(train_argv))


def main(argv=None) -> dict:
    """Run training then inference; returns ``{"results": [RunResult], "inference": dict, "seconds": float}``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="other options go to train_sparse_transformer.py")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: runs/demo, plus -<option>=<value>,... for every training "
                             "option that differs from its default)")
    add_device_option(parser)
    parser.add_argument("--variant", default="all", help="variant(s) to train")
    args, rest = parser.parse_known_args(argv)
    train_argv = ["--variant", args.variant, "--device", args.device, *rest]
    args.out = args.out or default_out(train_argv)
    start = time.perf_counter()
    results = train_sparse_transformer.main([*train_argv, "--out", str(args.out)])
    trained = {r.variant: r.checkpoint for r in results}
    checkpoint = trained.get("adaptive", results[-1].checkpoint)
    print()
    info = inference.main(["--checkpoint", checkpoint, "--device", args.device, "--out", str(args.out)])
    seconds = time.perf_counter() - start
    print(f"\ndemo finished in {seconds:.0f} s; reports, figures and checkpoints in {args.out}/")
    return {"results": results, "inference": info, "seconds": seconds}


if __name__ == "__main__":
    main()
