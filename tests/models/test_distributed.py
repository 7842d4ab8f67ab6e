"""Context parallelism (sparse_attn.distributed) against one process, on CPU with the gloo backend.

Every case runs on each of 2 or 4 forked processes joined by a file store; each process builds the
whole problem from one seed, computes the single-process result itself and compares its own shard
of the parallel result with it. The 2-process cases again on 4 processes and the example script
are marked ``slow`` and run only with ``SPARSE_ATTN_SLOW_TESTS=1``.
"""

import os
import re
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import TOL as ALL_TOL
from torch import nn
from variants import Problem, build, on_route, together

from sparse_attn import EntmaxMultiheadAttention, entmax_attention, record_head_stats
from sparse_attn.distributed import (
    ContextParallelMultiheadAttention,
    context_parallel_attention,
    enable_context_parallel,
    gather_head_density,
    pad_for_context_parallel,
    shard_positions,
    shard_sequence,
    ulysses_attention,
    unshard_sequence,
)

RUN_SLOW = os.environ.get("SPARSE_ATTN_SLOW_TESTS", "").strip().lower() not in ("", "0", "false", "no")
slow = pytest.mark.skipif(not RUN_SLOW, reason="slow distributed test: set SPARSE_ATTN_SLOW_TESTS=1")
SCHEMES = {"allgather": context_parallel_attention, "ulysses": ulysses_attention}
TOL = ALL_TOL["sharded_vs_single"]


def _worker(rank, world, store_path, case, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        case(rank, world, *args)
    finally:
        dist.destroy_process_group()


def _warm_up():
    """Import once, before forking, what every child would otherwise import for itself (sympy alone takes seconds)."""
    import torch._dynamo  # noqa: F401  (activation checkpointing imports it)
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.utils.checkpoint  # noqa: F401

    torch.broadcast_shapes((1,), (2,))  # imports torch.fx.experimental.symbolic_shapes


def _launch(world, case, *args, timeout=120.0):
    """Run ``case(rank, world, *args)`` on ``world`` forked processes; a failure's traceback is re-raised here."""
    _warm_up()
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), case, args), nprocs=world,
                                 join=False, start_method="fork")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    if proc.is_alive():
                        proc.kill()
                pytest.fail(f"{case.__name__} on {world} processes did not finish within {timeout} s")


def _problem(b, h, h_kv, n, d, dv, dtype, seed=0, n_k=None):
    g = torch.Generator().manual_seed(seed)
    n_k = n if n_k is None else n_k
    q = 2 * torch.randn(b, h, n, d, generator=g, dtype=dtype)
    k = 2 * torch.randn(b, h_kv, n_k, d, generator=g, dtype=dtype)
    v = torch.randn(b, h_kv, n_k, dv, generator=g, dtype=dtype)
    dout = torch.randn(b, h, n, dv, generator=g, dtype=dtype)
    alpha = torch.tensor([1.5, 1.25, 2.0, 1.0, 1.75, 1.1, 1.6, 1.9], dtype=dtype)[:h]
    return q, k, v, alpha, dout


def _close(name, got, want, tol):
    """Max abs error within ``tol * (1 + max |want|)``; equal entries (``tau = +inf`` of empty rows) count as 0."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want = got.double(), want.double()
    same = got == want
    err = torch.where(same, 0.0, got - want).abs().max().item() if got.numel() else 0.0
    scale = want.masked_fill(same & want.isinf(), 0.0).abs().max().item() if want.numel() else 0.0
    assert err <= tol * (1 + scale), f"{name}: max error {err}"


ROUTE_OF = {"allgather": "context_parallel", "ulysses": "ulysses"}


def _table_variants(scheme, cfg):
    """``cfg`` with ``shape`` and the variant keywords of every variant the scheme's route runs at once, from the test
    table (tests/variants.py; masks are key padding masks here: ``lengths`` and ``float_mask`` choose them)."""
    b, h, h_kv, n, d, dv = cfg.get("shape", (2, 4, 4, 16, 8, 8))
    problem = Problem(b=b, hq=h, hk=h_kv, nq=n, nk=cfg.get("n_k", n), d=d, dv=dv, seed=5)
    q, k, v, kw = build(together(ROUTE_OF[scheme], mask=None), problem)
    cfg = dict(cfg, shape=(b, h, k.shape[1], n, d, v.shape[-1]), causal=kw.pop("is_causal", False),
               table_kw={n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in kw.items()})
    cfg["table_kw"].pop("enable_gqa", None)  # from the shapes
    return cfg


def _case_attention(rank, world, scheme, cfg):
    """Forward and backward (q, k, v, alpha) of one scheme against ``entmax_attention`` on the whole sequence."""
    if cfg.get("table"):
        cfg = _table_variants(scheme, cfg)
    b, h, h_kv, n, d, dv = cfg.get("shape", (2, 4, 4, 16, 8, 8))
    dtype, causal, lb = cfg.get("dtype", torch.float64), cfg.get("causal", True), cfg.get("load_balance", True)
    n_k = cfg.get("n_k", n)  # cross-attention: keys sharded like the queries, another length
    q, k, v, alpha, dout = _problem(b, h, h_kv, n, d, dv, dtype, n_k=n_k)
    keep = None
    if "lengths" in cfg:
        keep = torch.arange(n_k)[None, :] < torch.tensor(cfg["lengths"])[:, None]
    if cfg.get("float_mask"):
        bias = torch.randn(b, n_k, generator=torch.Generator().manual_seed(3), dtype=dtype)
        keep = bias.masked_fill(~keep, float("-inf")) if keep is not None else bias
    gqa = h_kv != h
    variants = {name: val for name, val in cfg.items() if name in ("window_size", "softcap")}
    if cfg.get("alibi"):  # per batch entry and head
        variants["alibi_slopes"] = torch.rand(b, h, generator=torch.Generator().manual_seed(4), dtype=dtype)
    variants.update({name: val for name, val in cfg.get("table_kw", {}).items() if name != "sinks"})
    sinks = torch.linspace(-1.0, 1.5, h, dtype=dtype) if cfg.get("sinks") else cfg.get("table_kw", {}).get("sinks")
    sinks_leaf = None if sinks is None else sinks.clone().requires_grad_()
    leaves = [t.clone().requires_grad_() for t in (q, k, v, alpha)]
    if "alpha" in cfg:  # one Python float for every head
        leaves[3] = cfg["alpha"]
    bias_leaf = keep.clone().requires_grad_() if cfg.get("float_mask") else None
    want, want_stats = entmax_attention(*leaves, is_causal=causal, enable_gqa=gqa, return_stats=True,
                                        attn_mask=None if keep is None else (
                                            bias_leaf if bias_leaf is not None else keep)[:, None, None, :],
                                        sinks=sinks_leaf, **variants)
    (want * dout).sum().backward()

    def shard(t, dim=2):
        return shard_sequence(t, dim=dim, load_balance=lb)

    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
    a = alpha.clone().requires_grad_() if "alpha" not in cfg else cfg["alpha"]
    kpm = None if keep is None else shard(keep, dim=1).requires_grad_(bias_leaf is not None)
    if sinks is not None:
        variants["sinks"] = sinks.clone().requires_grad_()
    call = SCHEMES[scheme]
    if cfg.get("checkpoint"):  # recomputed in the backward: the collectives run again, in the same order
        def call(*args, **kw):
            return torch.utils.checkpoint.checkpoint(SCHEMES[scheme], *args, use_reentrant=False, **kw)
    out, stats = call(ql, kl, vl, a, is_causal=causal, enable_gqa=gqa, return_stats=True, key_padding_mask=kpm,
                      load_balance=lb, **variants)
    (out * shard(dout)).sum().backward()
    if bias_leaf is not None:
        _close("dmask", kpm.grad, shard(bias_leaf.grad, dim=1), TOL[dtype])
    tol = TOL[dtype]
    if "alpha" not in cfg:
        dist.all_reduce(a.grad)
        _close("dalpha", a.grad, leaves[3].grad, tol)
    if sinks is not None:
        dist.all_reduce(variants["sinks"].grad)
        _close("dsinks", variants["sinks"].grad, sinks_leaf.grad, tol)
    _close("out", out, shard(want), tol)
    _close("unshard(out)", unshard_sequence(out.detach(), load_balance=lb), want, tol)
    for name, got, leaf in (("dq", ql.grad, leaves[0]), ("dk", kl.grad, leaves[1]), ("dv", vl.grad, leaves[2])):
        _close(name, got, shard(leaf.grad), tol)
    assert torch.equal(stats.nnz, shard(want_stats.nnz)) and torch.equal(stats.n_valid, shard(want_stats.n_valid))
    _close("tau", stats.tau, shard(want_stats.tau), tol)
    valid = want_stats.n_valid > 0
    dens = torch.where(valid, want_stats.nnz.double() / want_stats.n_valid.clamp_min(1), 0.0).sum((0, 2))
    _close("density", gather_head_density(stats), dens / valid.sum((0, 2)), 1e-12)


CASES = [
    ("allgather", dict(lengths=[13, 9])),
    ("allgather", dict(checkpoint=True, shape=(1, 4, 2, 8, 8, 8))),
    ("allgather", dict(float_mask=True, lengths=[16, 6], alpha=1.3)),
    ("allgather", dict(causal=False, shape=(2, 4, 2, 16, 8, 8))),
    ("allgather", dict(load_balance=False, shape=(2, 4, 2, 16, 8, 8), dtype=torch.float32)),
    ("allgather", dict(causal=False, shape=(1, 2, 2, 8, 8, 4), lengths=[5], float_mask=True)),
    ("allgather", dict(causal=False, shape=(2, 2, 1, 8, 8, 8), n_k=24, lengths=[24, 17])),
    ("ulysses", dict(lengths=[16, 11], shape=(2, 4, 2, 16, 8, 8))),
    ("ulysses", dict(causal=False, shape=(2, 4, 1, 16, 8, 8))),
    ("allgather", dict(window_size=(3, 2), alibi=True, softcap=2.0, sinks=True, lengths=[16, 10])),
    ("allgather", dict(causal=False, window_size=(2, 5), lengths=[13, 16], float_mask=True)),
    ("allgather", dict(causal=False, window_size=(4, 3), shape=(2, 4, 2, 8, 8, 8), n_k=24, sinks=True)),
    ("allgather", dict(causal=False, window_size=(-1, 2), load_balance=False, softcap=1.5)),
    ("allgather", dict(causal=False, window_size=(5, 0), alibi=True)),
    ("ulysses", dict(causal=False, window_size=(3, 1), alibi=True, sinks=True, softcap=2.0, lengths=[16, 12])),
    # every variant of the scheme's route at once, read from the test table: a new variant joins by its row
    ("allgather", dict(table=True, lengths=[16, 11])),
    ("ulysses", dict(table=True, float_mask=True, lengths=[14, 16])),
]
FOUR_RANK_CASES = [
    ("allgather", dict()),
    ("allgather", dict(lengths=[13, 3], shape=(2, 8, 2, 32, 8, 8))),
    ("allgather", dict(causal=False, load_balance=False, lengths=[30, 1], shape=(2, 4, 4, 32, 8, 8))),
    ("allgather", dict(dtype=torch.float32, shape=(1, 4, 1, 24, 16, 16))),
    ("ulysses", dict(lengths=[13, 9])),
    ("ulysses", dict(checkpoint=True, causal=False)),
    ("ulysses", dict(float_mask=True, alpha=2.0, shape=(1, 4, 4, 8, 8, 8))),
    ("ulysses", dict(causal=False, shape=(2, 4, 2, 8, 8, 4), n_k=24, lengths=[24, 17])),
    ("ulysses", dict(shape=(2, 8, 2, 16, 8, 8))),
    ("ulysses", dict(causal=False, load_balance=False, shape=(2, 4, 4, 8, 8, 4), float_mask=True)),
    ("ulysses", dict(dtype=torch.float32, shape=(1, 8, 8, 24, 16, 16))),
    ("allgather", dict(window_size=(5, 0), sinks=True, alibi=True, shape=(2, 4, 2, 32, 8, 8))),
    ("allgather", dict(causal=False, load_balance=False, window_size=(6, 2), shape=(1, 4, 4, 32, 8, 8))),
    ("ulysses", dict(window_size=(4, 0), sinks=True, alibi=True, shape=(2, 8, 2, 16, 8, 8))),
]


def _case_variants(scheme, cfg) -> set:
    """The variant names (the route table's) a case uses."""
    if cfg.get("table"):
        cfg = _table_variants(scheme, cfg)
    b, h, h_kv, n, d, dv = cfg.get("shape", (2, 4, 4, 16, 8, 8))
    keywords = set(cfg) | set(cfg.get("table_kw", {}))
    flags = {"grad": True, "gqa": h_kv != h, "dv": dv != d, "causal": cfg.get("causal", True),
             "bool_mask": "lengths" in cfg, "float_mask": cfg.get("float_mask"), "mask_grad": cfg.get("float_mask")}
    names = {"window_size": "window", "alibi": "alibi", "alibi_slopes": "alibi", "sinks": "sinks", "softcap": "softcap"}
    return {name for name, on in flags.items() if on} | {names[key] for key in keywords if key in names}


# variants the distributed routes run that no case here compares with one process (each with its reason)
NOT_COMPARED = {"dropout": "each rank draws its own keep mask: no single-process result to compare with"}


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_cases_cover_every_variant_of_the_route(scheme):
    """Every variant the scheme's route runs (the test table's routes) is used by some case, or named above."""
    covered = set().union(*(_case_variants(s, cfg) for s, cfg in CASES + FOUR_RANK_CASES if s == scheme))
    assert set(on_route(ROUTE_OF[scheme])) - set(NOT_COMPARED) == covered


def _case_id(case):
    scheme, cfg = case
    return scheme + "".join(f"-{k}={v}" for k, v in cfg.items()).replace(" ", "")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_two_ranks_match_one_process(case):
    _launch(2, _case_attention, *case)


@pytest.mark.parametrize("case", FOUR_RANK_CASES, ids=_case_id)
def test_four_ranks_match_one_process(case):
    _launch(4, _case_attention, *case)


@pytest.mark.slow
@slow
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_four_ranks_match_one_process_more(case):
    _launch(4, _case_attention, *case)


class _TinyModel(nn.Module):
    """Input projection, one entmax attention with learnable alpha, output head; ``(B, N, 6) -> (B, N, 1)``."""

    def __init__(self, dtype):
        super().__init__()
        self.inp = nn.Linear(6, 16, dtype=dtype)
        self.attn = EntmaxMultiheadAttention(16, 4, batch_first=True, learnable=True, dtype=dtype,
                                             alpha_init=torch.tensor([1.2, 1.5, 1.8, 1.4]))
        self.out = nn.Linear(16, 1, dtype=dtype)

    def forward(self, x, pad):
        hid = self.inp(x)
        a, _ = self.attn(hid, hid, hid, key_padding_mask=pad, need_weights=False, is_causal=True)
        return self.out(a + hid)


def _batch(dtype, n=16):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, n, 6, generator=g, dtype=dtype), torch.randn(2, n, 1, generator=g, dtype=dtype)
    return x, y, torch.arange(n)[None, :] >= torch.tensor([n, n - 5])[:, None]


def _loss(model, x, y, pad, n_real):
    """Squared error summed over real tokens, divided by the number of real tokens of the whole batch."""
    return ((model(x, pad) - y).square() * (~pad)[..., None]).sum() / n_real


def _case_module(rank, world, scheme):
    """The module on shards against EntmaxMultiheadAttention on the whole sequence: outputs, gradients, densities."""
    torch.manual_seed(0)
    ref = _TinyModel(torch.float64)
    cp = _TinyModel(torch.float64)
    cp.load_state_dict(ref.state_dict())
    assert enable_context_parallel(cp, scheme=scheme) == ["attn"]
    assert isinstance(cp.attn, ContextParallelMultiheadAttention)
    x, y, pad = _batch(torch.float64)
    with record_head_stats(ref) as rec_ref:
        _loss(ref, x, y, pad, (~pad).sum()).backward()
    with record_head_stats(cp) as rec_cp:
        local = _loss(cp, shard_sequence(x, dim=1), shard_sequence(y, dim=1), shard_sequence(pad, dim=1), (~pad).sum())
        local.backward()
    for (name, p), (name_cp, q) in zip(ref.named_parameters(), cp.named_parameters()):
        assert name == name_cp
        dist.all_reduce(q.grad)
        _close(f"grad of {name}", q.grad, p.grad, 1e-9)
    _close("recorded density", rec_cp.density(), rec_ref.density(), 1e-12)
    with torch.no_grad():
        want = ref(x, pad)
        got = cp(shard_sequence(x, dim=1), shard_sequence(pad, dim=1))
    _close("output", got, shard_sequence(want, dim=1), 1e-9)


@pytest.mark.parametrize("scheme", ["allgather", "ulysses"])
def test_module_matches_one_process(scheme):
    _launch(2, _case_module, scheme)


def _case_training(rank, world, scheme, wrapper, dp):
    """Three Adam steps with FSDP2 (or DDP) and context parallelism match three steps of one process.

    ``dp > 1``: a ``(dp, cp)`` mesh, each data-parallel group taking one batch element and
    sharding its sequence over ``cp``; FSDP2 shards over ``cp`` and replicates over ``dp`` (HSDP).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if dp > 1:
        mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "cp"))
        cp_group, batch = mesh["cp"], slice(mesh.get_local_rank("dp"), mesh.get_local_rank("dp") + 1)
    else:
        mesh = cp_group = init_device_mesh("cpu", (world,))
        batch = slice(None)
    torch.manual_seed(0)
    ref = _TinyModel(torch.float64)
    cp = _TinyModel(torch.float64)
    cp.load_state_dict(ref.state_dict())
    enable_context_parallel(cp, cp_group, scheme=scheme)
    if wrapper == "fsdp2":
        fully_shard(cp.attn, mesh=mesh)
        fully_shard(cp, mesh=mesh)
        wrapped = cp
    else:
        wrapped = DistributedDataParallel(cp)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=0.05)
    opt_cp = torch.optim.Adam(cp.parameters(), lr=0.05)
    x, y, pad = _batch(torch.float64)
    n_real = (~pad).sum()
    xs, ys, pads = (shard_sequence(t[batch], cp_group, dim=1) for t in (x, y, pad))
    for _ in range(3):
        opt_ref.zero_grad()
        loss_ref = _loss(ref, x, y, pad, n_real)
        loss_ref.backward()
        opt_ref.step()
        opt_cp.zero_grad()
        loss_cp = _loss(wrapped, xs, ys, pads, n_real) * world  # the wrappers average the gradients over all ranks
        loss_cp.backward()
        opt_cp.step()
        total = loss_cp.detach() / world
        dist.all_reduce(total)
        _close("loss", total, loss_ref.detach(), 1e-9)
    for (name, p), q in zip(ref.named_parameters(), cp.parameters()):
        _close(name, q.full_tensor() if wrapper == "fsdp2" else q.detach(), p.detach(), 1e-8)
    assert (ref.attn.alpha - torch.tensor([1.2, 1.5, 1.8, 1.4], dtype=torch.float64)).abs().min() > 1e-3


@pytest.mark.parametrize("scheme,wrapper,world,dp", [
    ("allgather", "fsdp2", 2, 1), ("ulysses", "fsdp2", 2, 1), ("allgather", "ddp", 2, 1),
    ("ulysses", "fsdp2", 4, 1), ("allgather", "fsdp2", 4, 2)])
def test_training_with_learnable_alpha(scheme, wrapper, world, dp):
    _launch(world, _case_training, scheme, wrapper, dp)


def _case_errors(rank, world):
    q = torch.randn(1, 4, 6, 8)
    with pytest.raises(ValueError, match="multiple of 4"):
        shard_sequence(torch.randn(1, 4, 10, 8))
    with pytest.raises(ValueError, match="multiple of 2"):
        context_parallel_attention(q[:, :, :3], q[:, :, :3], q[:, :, :3])
    with pytest.raises(ValueError, match="number of q heads"):
        ulysses_attention(q[:, :3], q[:, :3], q[:, :3])
    with pytest.raises(ValueError, match="k/v heads"):
        ulysses_attention(torch.randn(1, 6, 4, 8), torch.randn(1, 3, 4, 8), torch.randn(1, 3, 4, 8), enable_gqa=True)
    with pytest.raises(ValueError, match="enable_gqa"):
        context_parallel_attention(q, q[:, :2], q[:, :2])
    with pytest.raises(ValueError, match="key_padding_mask"):
        context_parallel_attention(q, q, q, key_padding_mask=torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask"):
        ulysses_attention(q, q, q, key_padding_mask=torch.ones(1, 6, dtype=torch.int64))
    with pytest.raises(ValueError, match="alpha"):
        context_parallel_attention(q, q, q, alpha=2.5)
    with pytest.raises(ValueError, match="same seq_local"):
        context_parallel_attention(q, q[:, :, :4], q[:, :, :4], is_causal=True)
    with pytest.raises(ValueError, match="attn_mask"):
        ulysses_attention(q, q, q, attn_mask=torch.ones(1, 1, 6, 12, dtype=torch.bool))
    with pytest.raises(TypeError, match="group"):
        context_parallel_attention(q, q, q, group="world")
    with pytest.raises(ValueError, match="alibi_slopes with context_parallel_attention needs is_causal"):
        context_parallel_attention(q, q, q, alibi_slopes=torch.ones(4), window_size=(2, 1))
    with pytest.raises(TypeError, match="window_size must be None or a pair"):
        context_parallel_attention(q, q, q, window_size=3)
    with pytest.raises(ValueError, match="sinks"):
        ulysses_attention(q, q, q, sinks=torch.zeros(3))
    mha = ContextParallelMultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match="need_weights"):
        mha(x, x, x)
    with pytest.raises(ValueError, match="attn_mask"):
        mha(x, x, x, need_weights=False, attn_mask=torch.zeros(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="scheme"):
        ContextParallelMultiheadAttention(8, 2, scheme="ring")
    with pytest.raises(ValueError, match="add_bias_kv"):
        ContextParallelMultiheadAttention(8, 2, add_bias_kv=True)


def test_errors_name_the_argument():
    _launch(2, _case_errors)


def _ranks_text(ranks):
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _raises_on_every_rank(patterns, fn, *args, **kw):
    """``fn(*args, **kw)`` raises ValueError on this rank with a message matching every pattern, and every rank's
    message is the same (checked with a collective, which also shows the group still works after the error)."""
    with pytest.raises(ValueError) as info:
        fn(*args, **kw)
    msg = str(info.value)
    for pattern in (patterns,) if isinstance(patterns, str) else patterns:
        assert re.search(pattern, msg), f"{pattern!r} not in {msg!r}"
    msgs = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, msg)
    assert len(set(msgs)) == 1, msgs


def _plain_attention(q, k, v, alpha, **kw):
    return entmax_attention(q, k, v, alpha, **kw)


def _case_mismatched_ranks(rank, world):
    """Arguments that differ across ranks raise the same ValueError on every rank, naming the field and the ranks,
    before any data moves; afterwards the group still computes correctly."""
    odd, last = rank % 2 == 1, rank == world - 1
    odd_ranks, others = _ranks_text(range(1, world, 2)), _ranks_text(range(1, world))
    g = torch.Generator().manual_seed(rank)

    def qkv(h=4, n=8, d=8):
        return [torch.randn(1, h, n, d, generator=g, dtype=torch.float64) for _ in range(3)]

    alpha = torch.linspace(1.2, 1.8, 4, dtype=torch.float64)
    for call in SCHEMES.values():
        fn = call.__name__
        # unequal chunk lengths: 8 rows, 6 on the odd ranks
        _raises_on_every_rank((rf"^{fn} needs the same argument shapes",
                               rf"q\.shape\[2\] \(seq_local\): expected 8 \(as on rank 0\), got 6 on {odd_ranks}",
                               rf"k\.shape\[2\] \(seq_local\): expected 8 \(as on rank 0\), got 6 on {odd_ranks}"),
                              call, *qkv(n=6 if odd else 8), alpha, is_causal=True)
        # unequal head counts (and alpha per head): 8 heads on the last rank
        _raises_on_every_rank((rf"q\.shape\[1\] \(heads\): expected 4 \(as on rank 0\), got 8 on rank {world - 1}",
                               rf"alpha\.shape\[0\]: expected 4 \(as on rank 0\), got 8 on rank {world - 1}"),
                              call, *qkv(h=8 if last else 4),
                              torch.linspace(1.2, 1.8, 8 if last else 4, dtype=torch.float64))
        # unequal head dims
        _raises_on_every_rank((rf"q\.shape\[3\] \(head_dim\): expected 8 \(as on rank 0\), got 16 on {odd_ranks}",
                               rf"v\.shape\[3\] \(value head_dim\): expected 8 \(as on rank 0\), got 16 on "
                               rf"{odd_ranks}"),
                              call, *qkv(d=16 if odd else 8), alpha)
        # alpha a tensor on rank 0, a float elsewhere
        _raises_on_every_rank(rf"alpha: expected a float64 tensor of shape \(4,\) \(as on rank 0\), got 1\.5 on "
                              rf"{others}", call, *qkv(), alpha if rank == 0 else 1.5)
        # dtypes, and a key mask on some ranks only
        _raises_on_every_rank((rf"q\.dtype: expected float64 \(as on rank 0\), got float32 on {odd_ranks}",
                               rf"key_padding_mask: expected a bool tensor of shape \(1, 8\) \(as on rank 0\), "
                               rf"got None on {odd_ranks}"),
                              call, *(t.float() if odd else t for t in qkv()), 1.5,
                              key_padding_mask=None if odd else torch.ones(1, 8, dtype=torch.bool))
        # return_stats on rank 0 only (Ulysses would run one all-to-all more there)
        _raises_on_every_rank(rf"return_stats: expected True \(as on rank 0\), got False on {others}",
                              call, *qkv(), alpha, return_stats=rank == 0)
        # a gradient, so a backward collective, on rank 0 only
        _raises_on_every_rank(rf"q\.requires_grad: expected True \(as on rank 0\), got False on {others}",
                              call, *(t.requires_grad_(rank == 0) for t in qkv()), alpha)
        # one rank's own checks fail (alpha out of range there): it raises its own error, the others name the rank
        with pytest.raises(ValueError) as info:
            call(*qkv(), alpha * 2 if last else alpha)
        if last:
            assert "alpha" in str(info.value) and "same argument" not in str(info.value), info.value
        else:
            assert str(info.value) == (f"{fn}: the arguments of rank {world - 1} of the group are invalid (the "
                                       "error is raised there); every rank stops here before any data moves")
    _raises_on_every_rank(rf"window_size: expected \(4, 0\) \(as on rank 0\), got None on {odd_ranks}",
                          context_parallel_attention, *qkv(), 1.5, is_causal=True,
                          window_size=None if odd else (4, 0))
    _raises_on_every_rank(rf"attn_fn \(its qualified name\): expected None \(as on rank 0\), "
                          rf"got '[\w.]*_plain_attention' on {odd_ranks}",
                          ulysses_attention, *qkv(), 1.5, attn_fn=_plain_attention if odd else None)
    _raises_on_every_rank(rf"call different functions at the same point: context_parallel_attention on rank 0, "
                          rf"ulysses_attention on {others}",
                          ulysses_attention if rank else context_parallel_attention, *qkv(), alpha)
    _raises_on_every_rank(rf"x\.shape\[2\]: expected 8 \(as on rank 0\), got 6 on {odd_ranks}",
                          unshard_sequence, torch.zeros(1, 4, 6 if odd else 8, 2))
    stats = context_parallel_attention(*qkv(), 1.5, return_stats=True)[1]
    nnz = torch.zeros(1, 8 if last else 4, 8, dtype=torch.int32)
    _raises_on_every_rank(rf"stats\.nnz\.shape\[1\] \(heads\): expected 4 \(as on rank 0\), got 8 on "
                          rf"rank {world - 1}", gather_head_density, stats._replace(nnz=nnz))
    # the group still works: both schemes on matching shards against one process
    q, k, v, alpha, _ = _problem(1, 4, 4, 16, 8, 8, torch.float64)
    want = shard_sequence(entmax_attention(q, k, v, alpha, is_causal=True))
    for call in SCHEMES.values():
        got = call(*(shard_sequence(t) for t in (q, k, v)), alpha, is_causal=True)
        _close(call.__name__, got, want, TOL[torch.float64])
    dist.barrier()


def test_argument_descriptions_of_the_rank_check():
    """What the rank check writes for each kind of argument, and its message, from encoded rows (no processes)."""
    from sparse_attn.models._cp_layout import _ROW, _describe, _encode, _mismatch

    def described(x):
        return _describe(_encode(x))

    assert described(None) == "None" and described(True) == "True" and described(3) == "3"
    assert described(1.25) == "1.25" and described((4, 0)) == "(4, 0)" and described("auto") == "'auto'"
    assert described("x" * 100) == repr("x" * 64) + "..." and described([0.5]) == "an object of another type"
    assert described(torch.zeros(2, 3, dtype=torch.bfloat16)) == "a bfloat16 tensor of shape (2, 3)"
    assert described(torch.zeros(1, 2, 3, 4, 5, 6, 7)) == "a float32 tensor of shape (1, 2, 3, 4, 5, ...)"
    assert described(torch.zeros(2, requires_grad=True)) == "a float32 tensor of shape (2,) requiring grad"
    with torch.no_grad():
        assert described(torch.zeros(2, requires_grad=True)) == "a float32 tensor of shape (2,)"
    args = [("q", torch.zeros(1, 2, 8, 4), ("batch", "heads", "seq_local", "head_dim")), ("alpha", 1.5, None)]

    def row(q, alpha, fn=0):
        return ([0, fn] + _encode(q) + _encode(alpha) + [0] * _ROW)[:_ROW]

    same = row(torch.zeros(1, 2, 8, 4), 1.5)
    assert _mismatch("f", args, [same, same, same]) is None
    msg = _mismatch("f", args, [same, row(torch.zeros(1, 2, 6, 4), 1.5), row(torch.zeros(1, 2, 8, 4), 2.0),
                                row(torch.zeros(1, 2, 4, 4), None)])
    assert msg.endswith("q.shape[2] (seq_local): expected 8 (as on rank 0), got 6 on rank 1 and 4 on rank 3; "
                        "alpha: expected 1.5 (as on rank 0), got 2.0 on rank 2 and None on rank 3"), msg
    msg = _mismatch("f", args, [same, row(torch.zeros(1, 2, 8, 4), 1.5, fn=1), row(torch.zeros(1, 2, 8, 4), 1.5, 9)])
    assert msg == ("the ranks of the group call different functions at the same point: context_parallel_attention "
                   "on rank 0, ulysses_attention on rank 1, function #9 on rank 2"), msg


@pytest.mark.parametrize("world", [2, 4])
def test_mismatched_ranks_raise_the_same_error_everywhere(world):
    """Every rank raises (none hangs, aborts or returns): the launcher fails on a timeout or a killed process, and
    each rank's process group is destroyed after the last case."""
    _launch(world, _case_mismatched_ranks, timeout=60.0)


def _visible(row_pos: int, key: int, is_causal: bool, window) -> bool:
    """Key ``key`` visible to the row at key position ``row_pos`` (bottom-right aligned), by brute force."""
    left, right = window if window is not None else (-1, -1)
    return ((not is_causal or key <= row_pos) and (left < 0 or key >= row_pos - left)
            and (right < 0 or key <= row_pos + right))


def test_key_span_is_tight_and_keeps_the_global_mask():
    """Every (chunk, shift, causal, window): the slice holds exactly the keys some row of the chunk sees (first to
    last), and the kernels' bottom-right rule with the returned window on the slice is the global rule."""
    from sparse_attn.distributed import _key_span

    gen = torch.Generator().manual_seed(0)
    for _ in range(400):
        n_q, n_k = (int(x) for x in torch.randint(1, 24, (2,), generator=gen))
        start = int(torch.randint(0, n_q, (1,), generator=gen))
        end = int(torch.randint(start + 1, n_q + 1, (1,), generator=gen))
        is_causal = bool(torch.randint(0, 2, (1,), generator=gen))
        left, right = (int(x) for x in torch.randint(-1, 8, (2,), generator=gen))
        window = None if (left, right) == (-1, -1) else (left, right)
        shift = n_k - n_q
        lo, hi, win = _key_span(start, end, shift, n_k, is_causal, window)
        seen = [j for j in range(n_k) if any(_visible(p + shift, j, is_causal, window) for p in range(start, end))]
        assert (lo, hi) == ((seen[0], seen[-1] + 1) if seen else (lo, lo)), (start, end, n_k, is_causal, window)
        n = end - start
        for i in range(n):
            for j in range(hi - lo):
                assert _visible(i + hi - lo - n, j, is_causal, win) == _visible(start + i + shift, lo + j, is_causal,
                                                                                  window)


def test_helpers_without_a_process_group():
    assert shard_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert shard_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert shard_positions(8, 2, 1, load_balance=False).tolist() == [4, 5, 6, 7]
    cover = torch.cat([shard_positions(24, 3, r) for r in range(3)])
    assert sorted(cover.tolist()) == list(range(24))
    with pytest.raises(ValueError, match="multiple of 4"):
        shard_positions(6, 2, 0)
    with pytest.raises(ValueError, match="rank"):
        shard_positions(8, 2, 2)
    x = torch.randn(2, 7, 3)
    xp, keep = pad_for_context_parallel(x, 2, dim=1, lengths=torch.tensor([7, 4]))
    assert xp.shape == (2, 8, 3) and torch.equal(xp[:, :7], x) and (xp[:, 7] == 0).all()
    assert keep.tolist() == [[True] * 7 + [False], [True] * 4 + [False] * 4]
    xp, keep = pad_for_context_parallel(torch.randn(1, 2, 9, 4), 3, load_balance=False)
    assert xp.shape == (1, 2, 9, 4) and keep.all()
    with pytest.raises(ValueError, match="lengths"):
        pad_for_context_parallel(x, 2, dim=1, lengths=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="lengths"):
        pad_for_context_parallel(x, 2, dim=1, lengths=torch.tensor([8, 2]))
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            context_parallel_attention(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("variants", [False, True])
@pytest.mark.parametrize("scheme", ["allgather", "ulysses"])
def test_single_rank_nccl(scheme, variants, tmp_path):
    """One NCCL rank: both schemes run the fused kernels and match entmax_attention (float32, causal, GQA; with
    ``variants`` also a 64-key window, ALiBi, a soft cap and sinks, whose gradient is compared too)."""
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs CUDA and NCCL")
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        q, k, v, alpha, dout = (t.cuda() for t in _problem(2, 4, 2, 256, 64, 64, torch.float32))
        sinks = torch.linspace(-1.0, 1.0, 4, device="cuda")
        extra = dict(window_size=(64, 0), alibi_slopes=torch.linspace(0.01, 0.1, 4, device="cuda"),
                     softcap=10.0) if variants else {}
        leaves = [t.clone().requires_grad_() for t in (q, k, v, alpha, sinks)]
        want = entmax_attention(*leaves[:4], is_causal=True, enable_gqa=True,
                                sinks=leaves[4] if variants else None, **extra)
        (want * dout).sum().backward()
        got_leaves = [t.clone().requires_grad_() for t in (q, k, v, alpha, sinks)]
        got = SCHEMES[scheme](*got_leaves[:4], is_causal=True, enable_gqa=True,
                              **(dict(extra, sinks=got_leaves[4]) if variants else {}))
        (got * dout).sum().backward()
        _close("out", got, want, 1e-5)
        names = ("dq", "dk", "dv", "dalpha", "dsinks")[:5 if variants else 4]
        for name, g, w in zip(names, got_leaves, leaves):
            _close(name, g.grad, w.grad, 1e-4)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@slow
def test_example_script_runs():
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples", "context_parallel",
                          "context_parallel.py")
    res = subprocess.run([sys.executable, script, "--steps", "1"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "largest parameter difference from one process after 1 steps" in res.stdout
