"""Train a small adaptively sparse Transformer on a synthetic sequence-to-sequence task.

A small reproduction of the analysis in Correia, Niculae & Martins (2019), "Adaptively Sparse Transformers":
an encoder-decoder Transformer whose
three attention blocks (encoder self-attention, decoder self-attention, context attention) are
:class:`sparse_attn.modules.EntmaxMultiheadAttention`, trained in three variants

* ``softmax``  -- alpha = 1 in every head (the baseline),
* ``entmax15`` -- fixed alpha = 1.5 in every head,
* ``adaptive`` -- one learnable alpha per head, ``alpha = 1 + sigmoid(a)`` with ``a ~ N(0, 1)``
  drawn at random as in the paper; the logits ``a`` train with a 10x learning rate
  (``--alpha-lr-mult``) so that a run of a few hundred steps shows the trajectories the paper
  saw over many thousand,

on a task that needs no download: reverse (default) or sort a random string of digits. Both
need sharp, position- or content-specific context attention, so sparse heads have something
to find.

Every variant writes ``<out>/<variant>/checkpoint.pt``; the run writes its reports to ``<out>`` (default: a
folder of this command's own, ``runs/train`` plus the options that differ from their defaults, e.g.
``runs/train-variant=adaptive,task=sort,seed=1``; see ``run_folders.py``):
``metrics.json`` / ``metrics.csv`` (validation loss, token and sequence accuracy per variant),
``head_stats.csv`` (alpha, density per head), ``alpha_trajectories.csv`` and the figures
``fig2_alpha_trajectories.png`` ... ``fig6_head_diversity.png`` (the paper's Figs. 2-6),
``training_loss.png`` and ``summary.txt`` (also printed).
Layers and heads are counted from 0 everywhere (as in the module names ``decoder.1.cross_attn``
and in :meth:`sparse_attn.stats.HeadStatsRecorder.table`); ``metrics.json`` is strict JSON, with
null where a value is undefined (the JS diversity of length-1 sequences, which has no row with
two keys).

Usage::

    python examples/seq2seq/train_sparse_transformer.py --variant all --out runs/mine
    python examples/seq2seq/train_sparse_transformer.py --variant adaptive --steps 2000 --d-model 128

On a CUDA machine the attention runs the fused Triton kernels; on CPU the materialized
reference path.
"""


import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this example's modules and examples/run_folders.py

from run_folders import add_device_option, positive_int, resolve_device, run_folder  # noqa: E402
from seq2seq_figures import FIGURES, plot_figures  # noqa: E402
from seq2seq_model import (  # noqa: E402
    BLOCKS,
    SparseSeq2SeqTransformer,
    block_of,
    build_model,
    by_block,
    current_alphas,
    load_checkpoint,
    variant_attention_kwargs,
)
from seq2seq_reports import summary_text, write_reports  # noqa: E402
from seq2seq_task import TASKS, VARIANTS, Config, make_batch, validation_batches  # noqa: E402
from seq2seq_training import RunResult, evaluate, train_variant  # noqa: E402

# The names this script offered before it was split into modules (inference.py and the tests import them).
__all__ = [
    "VARIANTS", "TASKS", "BLOCKS", "FIGURES", "Config", "RunResult", "SparseSeq2SeqTransformer", "block_of", "by_block",
    "build_model", "build_parser", "current_alphas", "evaluate", "load_checkpoint", "main", "make_batch",
    "plot_figures", "resolve_device", "summary_text", "train_variant", "validation_batches", "variant_attention_kwargs",
    "write_reports",
]


def build_parser() -> argparse.ArgumentParser:
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--variant", choices=VARIANTS + ("all",), default="all", help="attention variant to train")
    p.add_argument("--task", choices=TASKS, default=d.task, help="synthetic task")
    p.add_argument("--length", type=positive_int, default=d.length, help="sequence length (digits)")
    p.add_argument("--vocab", type=positive_int, default=d.vocab, help="number of distinct digits")
    p.add_argument("--d-model", type=positive_int, default=d.d_model, help="model width")
    p.add_argument("--heads", type=positive_int, default=d.heads, help="attention heads per block")
    p.add_argument("--layers", type=positive_int, default=d.layers, help="encoder layers (= decoder layers)")
    p.add_argument("--d-ff", type=positive_int, default=d.d_ff, help="feed-forward width")
    p.add_argument("--dropout", type=float, default=d.dropout, help="dropout (attention weights and residuals)")
    p.add_argument("--steps", type=positive_int, default=d.steps, help="training steps per variant")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size, help="training batch size")
    p.add_argument("--lr", type=float, default=d.lr, help="peak Adam learning rate")
    p.add_argument("--alpha-lr-mult", type=float, default=d.alpha_lr_mult,
                   help="learning-rate multiplier of the alpha logits")
    p.add_argument("--warmup", type=positive_int, default=d.warmup, help="linear warm-up steps")
    p.add_argument("--val-size", type=positive_int, default=d.val_size, help="validation examples")
    p.add_argument("--seed", type=int, default=d.seed, help="random seed (data, weights, initial alphas)")
    p.add_argument("--log-every", type=positive_int, default=d.log_every, help="record alphas every N steps")
    add_device_option(p)
    p.add_argument("--threads", type=positive_int, default=1,
                   help="CPU threads for torch (this model's matrices are too small to gain from more)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: runs/train, plus -<option>=<value>,... for every option that "
                        "differs from its default)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-figures", action="store_true", help="reports without figures")
    return p


def main(argv=None) -> list[RunResult]:
    """Command line entry point; returns the :class:`RunResult` of every variant trained."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.out = args.out or run_folder("train", parser, args)
    if args.d_model % args.heads:
        raise SystemExit(f"--d-model ({args.d_model}) must be divisible by --heads ({args.heads})")
    if not 0.0 <= args.dropout < 1.0:
        raise SystemExit(f"--dropout must be in [0, 1), got {args.dropout}")
    device = str(resolve_device(args.device))
    variants = VARIANTS if args.variant == "all" else (args.variant,)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        results = []
        for variant in variants:
            cfg = Config(variant=variant, task=args.task, length=args.length, vocab=args.vocab, d_model=args.d_model,
                         heads=args.heads, layers=args.layers, d_ff=args.d_ff, dropout=args.dropout, steps=args.steps,
                         batch_size=args.batch_size, lr=args.lr, alpha_lr_mult=args.alpha_lr_mult, warmup=args.warmup,
                         val_size=args.val_size, seed=args.seed, log_every=args.log_every, device=device)
            results.append(train_variant(cfg, args.out, progress=not args.no_progress))
        print(write_reports(cfg, results, args.out, figures=not args.no_figures))
    finally:
        torch.set_num_threads(previous_threads)
    return results


if __name__ == "__main__":
    main()
