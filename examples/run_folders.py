"""Command-line pieces the example scripts share: where a run writes, the ``--device`` option and the device it names,
positive whole numbers.

Every example writes to ``--out`` when it is given. Without it a command gets a run folder of its own, named after
the script and every option whose value differs from its default, so two commands that differ in an option never
write into each other's folder: ``runs/demo`` for ``make demo``, ``runs/train-variant=adaptive,task=sort,seed=1``
for ``train_sparse_transformer.py --variant adaptive --task sort --seed 1``. Running the same command again
rewrites its own folder.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from pathlib import Path

import torch

RUNS = Path("runs")
NOT_IN_NAMES = ("out", "no_progress", "help")
"""Options that never change what a run computes, so they never name its folder."""
MAX_NAME = 120


def _value_text(value) -> str:
    if isinstance(value, Path):
        value = value.name or str(value)
    elif isinstance(value, (list, tuple)):
        value = "+".join(_value_text(v) for v in value)
    elif isinstance(value, float):
        value = f"{value:g}"
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", str(value))


def option_slug(parser: argparse.ArgumentParser, args: argparse.Namespace, skip: tuple[str, ...] = ()) -> str:
    """``opt=value,...`` for every option of ``parser`` whose value in ``args`` differs from its default (in the
    parser's order; names as typed, without the leading dashes), '' when every option has its default."""
    parts = []
    for action in parser._actions:
        dest = action.dest
        if dest in NOT_IN_NAMES or dest in skip or not action.option_strings or not hasattr(args, dest):
            continue
        value, default = getattr(args, dest), action.default
        if isinstance(default, str) and action.type is not None:  # argparse converts string defaults too
            default = action.type(default)
        if value == default:
            continue
        name = action.option_strings[-1].lstrip("-")
        parts.append(name if value is True else f"{name}={_value_text(value)}")
    slug = ",".join(parts)
    if len(slug) > MAX_NAME:  # keep the name readable and unique
        slug = f"{slug[:MAX_NAME - 9]}~{hashlib.sha1(slug.encode()).hexdigest()[:8]}"
    return slug


def run_folder(name: str, parser: argparse.ArgumentParser, args: argparse.Namespace,
               skip: tuple[str, ...] = ()) -> Path:
    """The default output folder of a command: ``runs/<name>``, plus ``-<options>`` when any option differs from
    its default (see :func:`option_slug`)."""
    slug = option_slug(parser, args, skip)
    return RUNS / (f"{name}-{slug}" if slug else name)


def device_arg(text: str) -> str:
    """``--device``: ``auto`` (CUDA when available), ``cpu`` or ``cuda[:i]``; an unavailable device stops the
    command with a usage message (argparse's error, no traceback)."""
    if text == "auto":
        return text
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise argparse.ArgumentTypeError(f"expected 'auto', 'cpu' or 'cuda[:i]', got {text!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text!r}: CUDA is not available on this machine (torch.cuda.is_available() is False); "
                f"use --device cpu, or auto to take CUDA when there is one")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise argparse.ArgumentTypeError(f"expected 'auto', 'cpu' or 'cuda[:i]', got {text!r}")
    return text


def add_device_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=device_arg, default="auto",
                        help="'auto' (CUDA when available), 'cpu' or 'cuda[:i]'")


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; other names are checked and passed through."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device must be 'auto', 'cpu' or an available CUDA device, got {device!r} "
                         "but CUDA is not available")
    return torch.device(device)


def positive_int(text: str) -> int:
    """An option's whole number above zero (argparse's usage message otherwise)."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value
