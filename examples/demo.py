"""What ``make demo`` runs: train the three variants, print the summary, write the figures, infer.

1. ``train_sparse_transformer.py --variant all``: softmax, fixed 1.5-entmax and adaptive
   (learnable per-head alpha) encoder-decoder Transformers on digit reversal, reports and the
   analogues of Figs. 2-6 of Correia et al. (2019) in ``--out`` (default ``runs/demo``);
2. ``inference.py`` on the adaptive checkpoint: greedy decoding of held-out inputs, a per-layer,
   per-head density and alpha table and ``attention_map_adaptive.png``.

The defaults finish in a few minutes on a 2-core CPU (reference path); on a CUDA machine the
attention runs the fused Triton kernels. Any other option is passed on to the training script,
e.g. ``python examples/demo.py --steps 2000 --d-model 128``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import inference  # noqa: E402
import train_sparse_transformer  # noqa: E402


def main(argv=None) -> dict:
    """Run training then inference; returns ``{"results": [RunResult], "inference": dict, "seconds": float}``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="other options go to train_sparse_transformer.py")
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="output folder")
    parser.add_argument("--device", default="auto", help="'auto' (CUDA when available), 'cpu' or 'cuda[:i]'")
    parser.add_argument("--variant", default="all", help="variant(s) to train")
    args, rest = parser.parse_known_args(argv)
    start = time.perf_counter()
    results = train_sparse_transformer.main(
        ["--variant", args.variant, "--out", str(args.out), "--device", args.device, *rest])
    trained = {r.variant: r.checkpoint for r in results}
    checkpoint = trained.get("adaptive", results[-1].checkpoint)
    print()
    info = inference.main(["--checkpoint", checkpoint, "--device", args.device, "--out", str(args.out)])
    seconds = time.perf_counter() - start
    print(f"\ndemo finished in {seconds:.0f} s; reports, figures and checkpoints in {args.out}/")
    return {"results": results, "inference": info, "seconds": seconds}


if __name__ == "__main__":
    main()
