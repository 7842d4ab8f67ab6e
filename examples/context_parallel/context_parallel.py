"""Context parallelism on CPU: one sequence split over processes (gloo), checked against one process.

Usage::

    python examples/context_parallel/context_parallel.py                        # 2 processes, all-gather K/V
    python examples/context_parallel/context_parallel.py --world 4 --scheme ulysses
    python examples/context_parallel/context_parallel.py --memory-table         # docs/scaling.md's analytic table

Each process (forked, joined by a file store) first runs ``context_parallel_attention`` /
``ulysses_attention`` on its shards of random q, k, v and compares its rows and gradients with
``entmax_attention`` on the whole sequence. It then trains a small causal language model
(``nn.TransformerEncoder`` whose attention is swapped for entmax with a learnable alpha per
head, made context parallel with ``enable_context_parallel`` and sharded with FSDP2) for a few
steps next to a single-process copy, and prints the losses, the alphas and the largest
parameter difference. On CUDA machines use the ``nccl`` backend and CUDA tensors instead.
"""

import argparse
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from sparse_attn import entmax_attention, swap_attention
from sparse_attn.distributed import (
    context_parallel_attention,
    enable_context_parallel,
    shard_positions,
    shard_sequence,
    ulysses_attention,
)

SCHEMES = {"allgather": context_parallel_attention, "ulysses": ulysses_attention}


def check_attention(scheme: str) -> float:
    """Largest difference between this rank's rows / gradients and one process's, causal GQA float64."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 32, 16, generator=g, dtype=torch.float64) for h in (8, 4, 4))
    alpha = torch.linspace(1.0, 2.0, 8, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v, alpha)]
    out = entmax_attention(*full, is_causal=True, enable_gqa=True)
    out.square().sum().backward()
    local = [shard_sequence(t).requires_grad_() for t in (q, k, v)] + [alpha.clone().requires_grad_()]
    out_local = SCHEMES[scheme](*local, is_causal=True, enable_gqa=True)
    out_local.square().sum().backward()
    dist.all_reduce(local[3].grad)  # alpha is replicated: its gradient is the sum over ranks
    diffs = [(out_local - shard_sequence(out)).abs().max()]
    diffs += [(a.grad - shard_sequence(b.grad)).abs().max() for a, b in zip(local[:3], full[:3])]
    diffs.append((local[3].grad - full[3].grad).abs().max())
    return max(float(d.detach()) for d in diffs)


class TinyLM(nn.Module):
    """Token and position embeddings, a causal Transformer encoder, a vocabulary head."""

    def __init__(self, vocab=16, d_model=32, n_heads=4, layers=2, max_len=256):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 64, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens, positions):
        return self.head(self.body(self.tok(tokens) + self.pos(positions), is_causal=True))


def train(rank: int, world: int, scheme: str, steps: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    ref = TinyLM().double()
    swap_attention(ref, alpha=1.5, learnable=True)
    model = TinyLM().double()
    swap_attention(model, alpha=1.5, learnable=True)
    model.load_state_dict(ref.state_dict())
    enable_context_parallel(model, mesh, scheme=scheme)
    for layer in model.body.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt_ref, opt = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (ref, model))

    n = 64
    tokens = (torch.arange(n + 1)[None, :] * torch.tensor([[3], [5]])) % 16     # two periodic sequences
    inputs, targets = tokens[:, :-1], tokens[:, 1:]                            # shift before sharding
    positions = torch.arange(n).expand(2, n)
    local = [shard_sequence(t, mesh, dim=1) for t in (inputs, targets)]
    local_pos = shard_positions(n, world, rank).expand(2, -1)                 # global positions of local rows
    assert torch.equal(local_pos, shard_sequence(positions, mesh, dim=1))
    for step in range(steps):
        losses = []
        for m, o, (x, y, p) in ((ref, opt_ref, (inputs, targets, positions)), (model, opt, (*local, local_pos))):
            o.zero_grad()
            loss = nn.functional.cross_entropy(m(x, p).flatten(0, 1), y.flatten())  # mean over local tokens
            loss.backward()  # FSDP2 averages gradients over the ranks: the mean over all tokens
            o.step()
            losses.append(loss.detach())
        dist.all_reduce(losses[1])  # equal shards: the mean of the local means is the global mean
        if rank == 0:
            print(f"step {step}: loss {losses[1].item() / world:.6f} (one process: {losses[0].item():.6f})")
    with torch.no_grad():
        diff = max(float((p.full_tensor() - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    alpha = model.body.layers[0].self_attn.alpha.detach()
    alpha = alpha.full_tensor() if hasattr(alpha, "full_tensor") else alpha  # FSDP2 shards alpha_logit
    if rank == 0:
        print(f"layer 0 alpha per head: {[round(a, 4) for a in alpha.tolist()]}")
        print(f"largest parameter difference from one process after {steps} steps: {diff:.2e}")


def worker(rank: int, world: int, store: str, scheme: str, steps: int) -> None:
    torch.set_num_threads(1)
    # the model's output is a view (a 3-d Linear); nothing modifies it in place, so the warning does not apply
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        err = torch.tensor(check_attention(scheme), dtype=torch.float64)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"{scheme} on {world} ranks: largest difference from one process (out, dq, dk, dv, dalpha): "
                  f"{err.item():.2e}")
        train(rank, world, scheme, steps)
    finally:
        dist.destroy_process_group()


def memory_table(heads=32, kv_heads=8, head_dim=128, world=8, batch=1, nbytes=2,
                 lengths=(32768, 131072, 524288, 1048576)) -> str:
    """Analytic per-rank memory and traffic of one attention layer (no run: formulas of docs/scaling.md)."""
    kv_after = max(kv_heads, world)  # Ulysses repeats kv heads up to P when H_kv < P
    rows = ["| N | local q, k, v, out | all-gather: gathered K, V | Ulysses: head shards q, k, v, out | "
            "all-gather traffic (fwd + bwd) | Ulysses traffic (fwd + bwd) |", "|---:|---:|---:|---:|---:|---:|"]
    gib = 2.0 ** 30
    for n in lengths:
        local = batch * n / world * (2 * heads + 2 * kv_heads) * head_dim * nbytes
        gathered = batch * n * 2 * kv_heads * head_dim * nbytes
        shards = batch * n * (2 * heads + 2 * kv_after) / world * head_dim * nbytes
        ag_traffic = 2 * (world - 1) / world * gathered
        ul_traffic = 2 * (world - 1) / world * batch * n / world * (2 * heads + 2 * kv_after) * head_dim * nbytes
        rows.append(f"| {n // 1024}k | {local / gib:.3f} GiB | {gathered / gib:.3f} GiB | {shards / gib:.3f} GiB | "
                    f"{ag_traffic / gib:.3f} GiB | {ul_traffic / gib:.3f} GiB |")
    head = (f"H = {heads}, H_kv = {kv_heads}, D = {head_dim}, P = {world}, batch {batch}, "
            f"{nbytes} bytes per element, per rank and attention layer")
    return head + "\n\n" + "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="number of processes (default 2)")
    parser.add_argument("--scheme", choices=sorted(SCHEMES), default="allgather")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--memory-table", action="store_true", help="print the analytic memory table and exit")
    args = parser.parse_args()
    if args.memory_table:
        print(memory_table())
        print()
        print(memory_table(kv_heads=32))
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args.world, os.path.join(tmp, "store"), args.scheme, args.steps),
                           nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    main()
