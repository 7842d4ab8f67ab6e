"""Static cost of the fused forward's pass loops on an H100 SM (sm_90), from the SASS of the offline builds.

For each alpha class the forward is built for sm_90 exactly as ``benchmarks/offline/sm90_build.py`` builds it (the
launcher runs on CPU tensors, the JIT binder gives the launch specialization), the cubin is disassembled with the
``nvdisasm`` bundled with that Triton (``-json``: one record per instruction), and then:

1. **Control flow.** Basic blocks are cut at branch targets and after every branch / ``EXIT``; the dominator tree
   is computed, every edge ``u -> h`` whose target ``h`` dominates ``u`` is a back edge, and a natural loop is
   ``h`` plus every block that reaches ``u`` without passing ``h`` (back edges to one header make one loop).
   Loops nest by containment.
2. **The per-key-tile loops.** A *tile loop* is a loop that holds tensor-core instructions (``HGMMA``) and has no
   nested loop that holds any. Each is checked to do the work of exactly one key tile per iteration: its
   ``HGMMA`` multiply-adds (m x n x k of each instruction, per warpgroup, times the warpgroups) must equal
   ``BLOCK_M * BLOCK_N * HEAD_DIM`` (the score product ``Q K^T``) plus, where the loop has an ``HGMMA`` whose A
   operand is in registers (``P V``: the weights come from registers), ``BLOCK_M * HEAD_DIM * BLOCK_N``. Roles:

   * softmax class: exactly one tile loop, holding both products (``softmax``);
   * entmax classes: exactly three tile loops, in address order: ``grid`` (score product only, nested in no
     loop), ``cand`` (score product only, nested in an outer loop, the while-not-done loop over candidate
     passes, which holds neither other tile loop) and ``value`` (the only one with ``P V``, not nested in the
     while loop). With ``n_words == 1`` specialized by the JIT (one bitmap word: ``--n`` at most 32 key tiles)
     the loop over bitmap words disappears and the nesting depths drop by one; the roles do not depend on them.
     The general class's inference build has a second value loop (the accurate log2 that runs only at
     ``alpha - 1 < 1 / FAST_BETA_MAX``): of the two, the shorter (the fast log2) is priced as ``value``.

   Anything else (a missing or extra tile loop, work other than one tile per iteration, a nested loop whose trip
   count is not a compile-time constant, see step 3) raises ``LoopError`` with the loop tree: the script never
   guesses.
3. **One iteration's instructions.** Inside a tile loop the back edges are cut, which leaves a DAG from the
   header to the latches; an iteration is a path through it. Every instruction on the path costs one issue slot
   whether its predicate is true or not. The *live* path is the longest (by instructions: every skippable block
   runs), the *dead* path the shortest (every skippable block skipped). For the grid pass the skippable blocks
   are the per-point work behind ``if live != 0`` (a tile with no score above the lowest grid point) and the
   per-score mask: the dead path is the cost of visiting a dead full tile. Where a loop skips the per-score mask on
   full tiles (``_masking.score_mod``'s ``inside``), the *interior* path is the longest that avoids the mask block
   (``mask_region``): a full tile; the live path is then a boundary tile's. A loop nested in a
   tile loop (a point loop the compiler kept rolled) must be a counted loop: a counter set to a constant before
   it, stepped by a constant and compared with a constant at its back edge (``trip_count``); its own path counts
   that many times.
4. **Cycles per key tile** (one iteration for the whole CTA: ``num_warps`` warps each run the path once) with the
   per-SM rates in ``RATES`` below, a throughput model: the SM is kept busy by warps running this loop, each
   resource serves its instructions at its peak rate, and the tile takes as long as the busiest resource::

       cycles = max over resources r of  (warp-instructions on r per tile) / (rate of r)
              = max(issue, fma pipe, fma-heavy, alu pipe, xu pipe, shuffle, redux, tensor, shared memory)

   No latencies, dependency stalls, bank conflicts, barrier skew or memory traffic beyond shared memory: a lower
   bound that ranks loops by the work they issue. The forward's loops come out issue-bound, except the grid
   pass's dead path and some value passes, which are ALU-bound (compare/select bookkeeping per score).
5. **Per class** (per key tile visible to a query tile, as a ratio to the softmax class's loop of the same head
   dim and causality; each loop on a full tile, its interior path where it has one, as all but the diagonal and
   ragged tiles are): ``dense = grid + c * cand + value`` with ``c = --cand-passes`` candidate passes
   (default 1: bf16 takes 3 passes, grid + 1 candidate + value, on the distributions of docs/kernels.md's pass
   table, ``benchmarks/offline/passes.py``); a fraction ``d`` of dead key tiles costs the grid pass's dead path only
   (the later passes skip them through the bitmap): ``(1 - d) * dense + d * grid_dead``, ``d`` from ``--dead``.
   That assumes a tile is already dead when the grid pass visits it (the running max final before it).

The counts are exact for the SASS that was built; the cycles are a model. Usage (from the project root)::

    python benchmarks/offline/sass_cost.py [--d 64 128] [--classes softmax entmax15 sparsemax general]
        [--causal | --no-causal] [--cand-passes 1] [--dead 0.6 0.9] [--n N] [--markdown] [--json FILE]
        [--mix] [--keep DIR] [--smoke] [--points K,P] [--config BLOCK_M BLOCK_N WARPS] [--train]

``--causal`` / ``--no-causal`` restrict to one setting (default both). ``--train``: the training forward (the
value loop also multiplies ``U V`` for the backward's ``out_u``), of the fused kernel as the other builds (not at
head dim 256, whose second value pass the loop finder does not take). ``--points K,P`` builds every entmax class with
``GRID_K = K`` grid points and ``CAND_P = P`` candidate points per candidate pass instead of the kernel's
``FWD_POINTS`` (powers of two; the kernel takes them as constexprs). ``--smoke``: the softmax and 1.5-entmax
classes at head dim 64, not causal (CI). ``--mix``: the instruction mix of each loop path, per warp, by class and
by opcode, and the grid pass's per-point work (live path minus dead path, per score and grid point). ``--json``:
every number. Prints regs / spills of each build (``sm90_build.analyse``). The full matrix (16 builds) takes about
a minute on two cores, ``--smoke`` about 10 s (20 s with a cold Triton cache).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # a launch's default; set, so Triton does not warn
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sm90_build  # noqa: E402

# ------------------------------------------------------------------------------------------------------------------
# The machine model: one H100 SM (sm_90), rates per SM per clock.
#
# | resource      | lanes/clk/SM | warp-instr/clk/SM | instructions                                                  |
# |---------------|--------------|-------------------|---------------------------------------------------------------|
# | issue         |              | 4                 | every instruction: 4 SMSPs, one warp scheduler each, 1 per clk |
# | fma           | 128          | 4                 | FFMA FADD FMUL (and HFMA2 HADD2 HMUL2), plus the IMAD family   |
# | fmaheavy      | 64           | 2                 | IMAD IMUL IDP (the heavy half of the FMA pipe only)            |
# | alu           | 64           | 2                 | FSETP FSET FSEL FMNMX, integer add/logic/shift/compare/select, |
# |               |              |                   | MOV, P2R/R2P/PLOP3, F2FP/I2FP (packing conversions)            |
# | xu            | 16           | 0.5               | MUFU (ex2 lg2 rcp rsqrt ...), F2F F2I I2F FRND, POPC FLO BREV  |
# | shuffle       | 32           | 1                 | SHFL                                                           |
# | redux         | 16           | 0.5               | REDUX (warp integer reduction): assumed                        |
# | tensor        | 2048 FMA     |                   | HGMMA: m*n*k multiply-adds per warpgroup; dense bf16/fp16 with |
# |               |              |                   | fp32 accumulate = 4096 FLOP/clk/SM (989 TFLOPS = 132 SMs x    |
# |               |              |                   | 1.83 GHz x 4096; A100's SM does 1024 FMA/clk, H100's twice)    |
# | shared memory | 128 B/clk    |                   | LDS STS LDSM STSM LDGSTS bytes (32 lanes, no conflicts), and  |
# |               |              |                   | HGMMA operands read from shared memory (B; A too when SS)      |
#
# Sources: the CUDA C++ Programming Guide's table of arithmetic-instruction throughput (results per clock per SM,
# compute capability 9.0: 32-bit floating-point add/multiply/multiply-add 128; integer add, shift, bitwise ops,
# compare/minimum/maximum and integer multiply(-add) 64; reciprocal, rsqrt, log2, exp2 16; conversions other than
# the 8/16-bit integer ones 16; warp shuffle 32); Nsight Compute's pipe names and what they execute (fma: FP32
# add/mul/fma and IMAD, fmaheavy: the half that also runs IMAD, alu: integer, logic and compare instructions,
# xu: transcendentals and conversions); the H100 whitepaper (4 SM sub-partitions, twice A100's tensor-core rate
# per SM per clock). Assumptions: FP32 compare/select/min/max (FSETP FSET FSEL FMNMX) run on the ALU pipe at the
# compare/min/max rate; MOV is on the ALU pipe (an upper bound where it dual-issues); REDUX at 16 results/clk.
# Uniform-datapath instructions (U*, R2UR, S2UR), barriers, branches, memory instructions, S2R/LDC and NOP cost an
# issue slot only (plus their shared-memory bytes).
# ------------------------------------------------------------------------------------------------------------------
RATES = dict(issue=4.0, fma=4.0, fmaheavy=2.0, alu=2.0, xu=0.5, shuffle=1.0, redux=0.5)
TENSOR_FMA_PER_CLK = 2048.0
SMEM_BYTES_PER_CLK = 128.0
SMSP = 4  # warps of one warpgroup; the issue rate above is 1 per SMSP per clock

# instruction class (the --mix columns) and pipe of each opcode (the part before the first dot)
_CLASS_OPS = {
    "fp32": ("FFMA FADD FMUL FFMA32I FADD32I FMUL32I FSWZADD", "fma"),
    "fp32_cmp": ("FSETP FSET FSEL FMNMX FMNMX3 FCHK", "alu"),
    "half2": ("HFMA2 HADD2 HMUL2", "fma"),
    "half2_cmp": ("HMNMX2 HSETP2 HSET2", "alu"),
    "imad": ("IMAD IMUL IDP IMAD32I IMUL32I IMADSP", "fmaheavy"),
    "int": ("IADD3 IADD IADD32I ISETP LOP3 LOP LOP32I SEL SHF SHL SHR LEA LEA32I IMNMX IABS PRMT SGXT BMSK BFE BFI "
            "MOV MOV32I CS2R VIMNMX VIMNMX3 VIADD VIADDMNMX VABSDIFF VABSDIFF4 ISCADD IMNMX3 FLO2", "alu"),
    "int_xu": ("POPC FLO BREV", "xu"),
    "mufu": ("MUFU", "xu"),
    "conv": ("F2F I2F F2I FRND I2I", "xu"),
    "conv_alu": ("F2FP I2FP F2IP", "alu"),
    "shfl": ("SHFL", "shuffle"),
    "redux": ("REDUX CREDUX", "redux"),
    "tensor": ("HGMMA HMMA IMMA QGMMA IGMMA BGMMA DMMA", "issue"),
    "mem_async": ("LDGSTS LDGDEPBAR UTMALDG UTMASTG UTMAPF UBLKCP", "issue"),
    "mem_global": ("LDG STG LD ST RED REDG ATOM ATOMG LDL STL CCTL", "issue"),
    "mem_shared": ("LDS STS LDSM STSM ATOMS", "issue"),
    "sync": ("BAR DEPBAR WARPGROUP WARPSYNC MEMBAR FENCE ERRBAR SYNCS BSSY BSYNC NANOSLEEP ELECT ARRIVES "
             "USETMAXREG", "issue"),
    "branch": ("BRA BRX JMP JMX EXIT CALL RET BREAK KILL YIELD", "issue"),
    "pred": ("PLOP3 P2R R2P PSETP VOTE VOTEU", "alu"),
    "uniform": ("R2UR S2UR", "issue"),
    "other": ("NOP S2R LDC CS2UR B2R R2B", "issue"),
}
OP_CLASS, OP_PIPE = {}, {}
for _cls, (_ops, _pipe) in _CLASS_OPS.items():
    for _op in _ops.split():
        OP_CLASS[_op], OP_PIPE[_op] = _cls, _pipe
MIX_CLASSES = tuple(_CLASS_OPS) + ("unknown",)

LABEL = {"softmax": "softmax", "entmax15": "1.5-entmax", "sparsemax": "sparsemax", "general": "general (1.25)"}


class LoopError(RuntimeError):
    """The pass loops could not be identified in the SASS (the message holds the loop tree)."""


# ------------------------------------------------------------------------------------------------------------------
# instructions
# ------------------------------------------------------------------------------------------------------------------
_PRED = re.compile(r"^@!?U?P(?:T|\d)$")


@dataclass
class Ins:
    addr: int
    opcode: str  # with modifiers, e.g. "FSETP.GT.AND"
    operands: str
    pred: str  # "" or "@P3", "@!UP0", ...

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def conditional(self) -> bool:
        return self.pred not in ("", "@PT", "@UPT")

    @property
    def never(self) -> bool:
        return self.pred in ("@!PT", "@!UPT")

    @property
    def cls(self) -> str:
        b = self.base
        if b in OP_CLASS:
            return OP_CLASS[b]
        if b.startswith("U"):
            return "uniform"
        return "unknown"

    @property
    def pipe(self) -> str:
        return OP_PIPE.get(self.base, "issue")

    @property
    def target(self):
        if self.base in ("BRA", "JMP", "CALL") and self.operands:
            m = re.search(r"0x[0-9a-f]+", self.operands.split(",")[-1])
            if m:
                return int(m.group(0), 16)
        return None


def disassemble(cubin: bytes, bin_dir: str = sm90_build.BIN) -> list:
    """The instructions of the cubin's one kernel function (``nvdisasm -json``; 16 bytes per sm_90 instruction)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-json", path], capture_output=True, text=True,
                             check=True).stdout
    doc = json.loads(out)
    funcs = [f for part in doc[1:] for f in (part if isinstance(part, list) else [part])
             if isinstance(f, dict) and "sass-instructions" in f]
    if len(funcs) != 1:
        raise LoopError(f"expected one kernel function in the cubin, found {len(funcs)}")
    func = funcs[0]
    recs = func["sass-instructions"]
    if len(recs) * 16 != func["length"]:
        raise LoopError(f"{len(recs)} instructions for {func['length']} bytes: not 16 bytes per instruction")
    out = []
    for n, r in enumerate(recs):
        pred = r.get("predicate", "")
        if not _PRED.match(pred or ""):
            pred = ""  # nvdisasm lists P2R's PR operand as a predicate
        out.append(Ins(func["start"] + 16 * n, r["opcode"], r.get("operands", ""), pred))
    return out


# ------------------------------------------------------------------------------------------------------------------
# control flow: blocks, dominators, natural loops
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class Block:
    first: int  # instruction indices [first, last]
    last: int
    succ: list = field(default_factory=list)  # block indices
    pred: list = field(default_factory=list)


def blocks_of(ins: list) -> list:
    by_addr = {i.addr: n for n, i in enumerate(ins)}
    leaders = {0}
    for n, i in enumerate(ins):
        if i.base in ("BRX", "JMX", "RET", "CALL"):
            raise LoopError(f"{i.opcode} at {i.addr:#x}: indirect branches and calls are not modelled")
        t = i.target
        if i.base in ("BRA", "JMP"):
            if t not in by_addr:
                raise LoopError(f"branch at {i.addr:#x} to {t!r}, not an instruction of the kernel")
            leaders.add(by_addr[t])
        if i.base in ("BRA", "JMP", "EXIT") and n + 1 < len(ins):
            leaders.add(n + 1)
    starts = sorted(leaders)
    blocks = [Block(s, e - 1) for s, e in zip(starts, starts[1:] + [len(ins)])]
    block_at = {b.first: k for k, b in enumerate(blocks)}
    for k, b in enumerate(blocks):
        last = ins[b.last]
        succ = []
        if last.base in ("BRA", "JMP"):
            if not last.never:
                succ.append(block_at[by_addr[last.target]])
            if last.conditional and k + 1 < len(blocks):
                succ.append(k + 1)
        elif last.base == "EXIT":
            if last.conditional and k + 1 < len(blocks):
                succ.append(k + 1)
        elif k + 1 < len(blocks):
            succ.append(k + 1)
        b.succ = list(dict.fromkeys(succ))
        for s in b.succ:
            blocks[s].pred.append(k)
    return blocks


def dominators(blocks: list) -> list:
    """Immediate dominator of each block reachable from block 0 (Cooper, Harvey and Kennedy's iteration on the
    reverse postorder); None for unreachable blocks."""
    order, seen = [], set()
    stack = [(0, iter(blocks[0].succ))]
    seen.add(0)
    while stack:
        node, it = stack[-1]
        nxt = next(it, None)
        if nxt is None:
            stack.pop()
            order.append(node)
        elif nxt not in seen:
            seen.add(nxt)
            stack.append((nxt, iter(blocks[nxt].succ)))
    rpo = order[::-1]
    pos = {b: k for k, b in enumerate(rpo)}
    idom = [None] * len(blocks)
    idom[0] = 0
    changed = True
    while changed:
        changed = False
        for b in rpo[1:]:
            preds = [p for p in blocks[b].pred if idom[p] is not None]
            new = preds[0]
            for p in preds[1:]:
                x, y = p, new
                while x != y:
                    while pos[x] > pos[y]:
                        x = idom[x]
                    while pos[y] > pos[x]:
                        y = idom[y]
                new = x
            if idom[b] != new:
                idom[b], changed = new, True
    return idom


def dominates(idom: list, a: int, b: int) -> bool:
    while True:
        if a == b:
            return True
        if b == 0 or idom[b] is None:
            return False
        b = idom[b]


@dataclass
class Loop:
    header: int  # block index
    latches: list
    body: set  # block indices, header included
    parent: Loop | None = None
    children: list = field(default_factory=list)
    role: str = ""

    @property
    def depth(self) -> int:
        return 0 if self.parent is None else 1 + self.parent.depth


def natural_loops(blocks: list) -> list:
    idom = dominators(blocks)
    latches = collections.defaultdict(list)
    for u, b in enumerate(blocks):
        if idom[u] is None:
            continue
        for h in b.succ:
            if dominates(idom, h, u):
                latches[h].append(u)
    loops = []
    for h, us in sorted(latches.items()):
        body, work = {h}, list(us)
        while work:
            x = work.pop()
            if x not in body:
                body.add(x)
                work.extend(blocks[x].pred)
        loops.append(Loop(h, sorted(us), body))
    for lp in loops:  # the innermost enclosing loop is the smallest strict superset
        outer = [o for o in loops if o is not lp and lp.body < o.body]
        if outer:
            lp.parent = min(outer, key=lambda o: len(o.body))
            lp.parent.children.append(lp)
    return loops


# ------------------------------------------------------------------------------------------------------------------
# the tile loops and their iteration paths
# ------------------------------------------------------------------------------------------------------------------
def mma_shape(i: Ins):
    """``(m, n, k, a_in_registers)`` of an HGMMA (``HGMMA.64x32x16.F32.BF16 R88, gdesc[UR20], ...``: A and B
    from shared memory; ``HGMMA.64x128x16.F32.BF16 R24, R104, gdesc[UR16].tnspB, ...``: A in registers)."""
    m, n, k = (int(x) for x in i.opcode.split(".")[1].split("x"))
    ops = [o.strip() for o in i.operands.split(",")]
    return m, n, k, len(ops) > 1 and re.match(r"^R\d+$", ops[1]) is not None


def hmma_macs(i: Ins) -> int:
    """Multiply-adds of one warp's ``mma.sync`` (``HMMA.16816.F32.BF16``: m16 n8 k16; ``HMMA.1688``: k8)."""
    shape = i.opcode.split(".")[1]
    m, n, k = {"16816": (16, 8, 16), "1688": (16, 8, 8), "884": (8, 8, 4)}[shape]
    return m * n * k


def _block_ins(blocks, body):
    return [n for b in sorted(body) for n in range(blocks[b].first, blocks[b].last + 1)]


def loop_tree(loops: list, blocks: list, ins: list) -> str:
    lines = []
    for lp in sorted(loops, key=lambda x: blocks[x.header].first):
        idx = _block_ins(blocks, lp.body)
        mma = sum(1 for n in idx if ins[n].base == "HGMMA")
        lines.append(f"{'  ' * lp.depth}loop @{ins[blocks[lp.header].first].addr:#x}: {len(idx)} instructions, "
                     f"{len(lp.latches)} latch(es), {mma} HGMMA{' [' + lp.role + ']' if lp.role else ''}")
    return "\n".join(lines) or "(no loops)"


def find_pass_loops(ins: list, kind: str, block_m: int, block_n: int, head_dim: int, warps: int):
    """``(blocks, loops, {role: Loop})`` for ``kind`` ``"softmax"`` or ``"entmax"`` (module docstring, step 2)."""
    blocks = blocks_of(ins)
    loops = natural_loops(blocks)

    def has_mma(lp):
        return any(ins[n].base == "HGMMA" for n in _block_ins(blocks, lp.body))

    def fail(msg):
        raise LoopError(f"{msg}\nloop tree:\n{loop_tree(loops, blocks, ins)}")

    tile = [lp for lp in loops if has_mma(lp) and not any(has_mma(c) for c in lp.children)]
    tile.sort(key=lambda lp: blocks[lp.header].first)
    for lp in tile:
        macs_qk = macs_pv = 0
        for n in _block_ins(blocks, lp.body):
            if ins[n].base == "HGMMA":
                m, n_, k, a_reg = mma_shape(ins[n])
                if a_reg:
                    macs_pv += m * n_ * k * warps // SMSP
                else:
                    macs_qk += m * n_ * k * warps // SMSP
        want = block_m * block_n * head_dim
        lp.pv = macs_pv > 0
        # (the training forward's value loop multiplies U V too: twice P V's work)
        if macs_qk != want or macs_pv not in (0, want, 2 * want):
            fail(f"tile loop @{ins[blocks[lp.header].first].addr:#x}: HGMMA work {macs_qk} (QK^T) + {macs_pv} (PV) "
                 f"multiply-adds per iteration, not one {block_m}x{block_n} key tile at head dim {head_dim} "
                 f"({want} each)")
    roles = {}
    if kind == "softmax":
        if len(tile) != 1 or not tile[0].pv:
            fail(f"softmax class: expected one tile loop with both products, found {len(tile)}")
        roles["softmax"] = tile[0]
    else:
        if len(tile) == 4 and tile[2].pv and tile[3].pv:
            # the general class's inference build holds two value loops: the fast log2 (alpha - 1 >= 1 / 256) and
            # the accurate one (nearer to 1); the shorter, the fast one, is the one priced
            n_ins = [len(_block_ins(blocks, lp.body)) for lp in tile[2:]]
            tile = tile[:2] + [tile[2 + n_ins.index(min(n_ins))]]
        if len(tile) != 3:
            fail(f"entmax class: expected 3 tile loops (grid, candidate, value), found {len(tile)}")
        grid, cand, value = tile
        if grid.pv or cand.pv or not value.pv:
            fail("entmax class: expected the P V product in the third tile loop only")
        if grid.parent is not None:
            fail("entmax class: the grid loop is nested in another loop")
        outer = cand
        while outer.parent is not None:
            outer = outer.parent
        if outer is cand:
            fail("entmax class: the candidate loop is not nested in a while loop")
        if grid.body <= outer.body or value.body <= outer.body:
            fail("entmax class: the while loop around the candidate loop holds another tile loop")
        roles.update(grid=grid, cand=cand, value=value)
    for role, lp in roles.items():
        lp.role = role
    return blocks, loops, roles


_IMM = re.compile(r"^-?(0x[0-9a-f]+|\d+)$")


def _imm(text: str):
    text = text.strip()
    if text == "RZ":
        return 0
    return int(text, 0) if _IMM.match(text) else None


def _barrier_wait(blocks: list, lp: Loop, ins: list) -> bool:
    """Whether ``lp`` spins on an mbarrier: one latch branching back on a predicate last written in the body by a
    ``SYNCS`` try-wait (``SYNCS.PHASECHK... P[addr], R``), the body nothing but that wait, moves of its phase into a
    register and the branch."""
    body = _block_ins(blocks, lp.body)
    if len(lp.latches) != 1:
        return False
    br = ins[blocks[lp.latches[0]].last]
    if br.base != "BRA" or not br.conditional:
        return False
    preg = br.pred.lstrip("@!")
    writers = [n for n in body if n < blocks[lp.latches[0]].last
               and ins[n].operands.split(",")[0].split("[")[0] == preg]
    moves = ("MOV", "IMAD", "NOP", "BRA", "SYNCS")
    return (bool(writers) and ins[writers[-1]].base == "SYNCS"
            and all(ins[n].base in moves and (ins[n].base != "IMAD" or ins[n].opcode == "IMAD.U32") for n in body))


def trip_count(blocks: list, lp: Loop, ins: list) -> int:
    """The constant trip count of a counted loop nested in a tile loop (e.g. a point loop ``for s in range(K)``
    that the compiler kept rolled), or ``LoopError``. Recognized: one latch ending in ``@[!]P BRA header``; ``P``
    last written in the body by ``ISETP.<cmp>[.U32].AND P, PT, Rc, <imm>, PT``; ``Rc`` written in the body only by
    ``IADD3 Rc, Rc, <imm>, RZ`` (or ``VIADD``); ``Rc`` set to a constant by ``MOV`` / ``IMAD.MOV.U32`` / ``CS2R``
    in the one block that enters the loop. The count is found by running the counter."""
    where = f"nested loop @{ins[blocks[lp.header].first].addr:#x}"
    body = _block_ins(blocks, lp.body)
    if all(ins[n].base in ("SYNCS", "BRA", "NOP") for n in body) or _barrier_wait(blocks, lp, ins):
        return 1  # a barrier wait (TMA: try-wait on the load's mbarrier until it completes): issued once when ready
    if len(lp.latches) != 1:
        raise LoopError(f"{where}: {len(lp.latches)} latches, not a counted loop")
    latch = blocks[lp.latches[0]]
    br = ins[latch.last]
    if br.base != "BRA" or not br.conditional or br.pred.startswith("@U") or br.pred.startswith("@!U"):
        raise LoopError(f"{where}: its back edge is not a conditional branch on a predicate register")
    negated, preg = br.pred.startswith("@!"), br.pred.lstrip("@!")
    setp = [n for n in body if n < latch.last and ins[n].operands.split(",")[0] == preg]
    if not setp or ins[setp[-1]].base != "ISETP":
        raise LoopError(f"{where}: the exit predicate {preg} is not set by an integer compare")
    cmp_ins = ins[setp[-1]]
    ops = [o.strip() for o in cmp_ins.operands.split(",")]
    mods = cmp_ins.opcode.split(".")
    if len(ops) != 5 or ops[1] != "PT" or ops[4] != "PT" or "AND" not in mods or _imm(ops[3]) is None:
        raise LoopError(f"{where}: unsupported exit compare {cmp_ins.opcode} {cmp_ins.operands}")
    counter, limit = ops[2], _imm(ops[3])
    writes = [n for n in body if ins[n].operands.split(",")[0] == counter]
    step = None
    if len(writes) == 1:
        w = ins[writes[0]]
        wops = [o.strip() for o in w.operands.split(",")]
        if w.base == "IADD3" and len(wops) == 4 and wops[1] == counter and wops[3] == "RZ":
            step = _imm(wops[2])
        elif w.base == "VIADD" and len(wops) == 3 and wops[1] == counter:
            step = _imm(wops[2])
    if not step:
        raise LoopError(f"{where}: the counter {counter} is not stepped by one constant add")
    enter = [p for p in blocks[lp.header].pred if p not in lp.body]
    init = None
    if len(enter) == 1:
        blk = blocks[enter[0]]
        for n in range(blk.last, blk.first - 1, -1):
            wops = [o.strip() for o in ins[n].operands.split(",")]
            base = ins[n].base
            if base == "CS2R" and wops[0] in (counter, f"R{int(counter[1:]) - 1}") and wops[1] == "SRZ":
                init = 0
            elif wops[0] == counter and base == "MOV" and len(wops) == 2:
                init = _imm(wops[1])
            elif wops[0] == counter and ins[n].opcode.startswith("IMAD.MOV") and wops[1:3] == ["RZ", "RZ"]:
                init = _imm(wops[3])
            elif wops[0] != counter:
                continue
            break
    if init is None:
        raise LoopError(f"{where}: the counter {counter} does not start at a constant in the block entering it")
    post = writes[0] < setp[-1]  # compared after its update in the same iteration
    unsigned = "U32" in mods
    test = {"EQ": lambda a, b: a == b, "NE": lambda a, b: a != b, "LT": lambda a, b: a < b,
            "LE": lambda a, b: a <= b, "GT": lambda a, b: a > b, "GE": lambda a, b: a >= b}[mods[1]]
    for k in range(1, 4097):
        v = init + step * (k if post else k - 1)
        a, b = (v % 2**32, limit % 2**32) if unsigned else (v, limit)
        if test(a, b) == negated:  # the back edge is not taken: the loop ends after iteration k
            return k
    raise LoopError(f"{where}: more than 4096 iterations")


def iteration_paths(blocks: list, lp: Loop, ins: list, avoid=frozenset()) -> dict:
    """The longest (``live``) and shortest (``dead``) paths of one iteration of ``lp`` from its header to a
    latch, by instructions, as lists of instruction indices; a nested loop on the path counts its own path times
    its trip count (``trip_count``). Module docstring, step 3. Blocks in ``avoid`` are never entered."""
    owner = {}  # block -> the nested loop (direct child) holding it
    for child in lp.children:
        for b in child.body:
            owner[b] = child
    trips = {id(c): trip_count(blocks, c, ins) for c in lp.children}
    inner = {(id(c), pick): iteration_paths(blocks, c, ins)[name] for c in lp.children
             for pick, name in ((max, "live"), (min, "dead"))}
    where = f"loop @{ins[blocks[lp.header].first].addr:#x}"

    def node_of(b):
        return owner.get(b, b)

    def succ_nodes(node):
        if isinstance(node, Loop):  # leave a nested loop: its exits inside lp
            outs = {s for b in node.body for s in blocks[b].succ if s not in node.body}
        else:
            outs = set(blocks[node].succ)
        out = []
        for s in outs:
            if s not in lp.body or s == lp.header or s in avoid:
                continue
            t = node_of(s)
            if isinstance(t, Loop) and s != t.header:
                raise LoopError(f"{where}: a nested loop is entered other than at its header")
            out.append(t)
        return out

    def ins_of(node, pick):
        if isinstance(node, Loop):
            return inner[(id(node), pick)] * trips[id(node)]
        return list(range(blocks[node].first, blocks[node].last + 1))

    def best_path(pick):
        memo, active = {}, set()

        def walk(node):  # (instructions to the end of the iteration, path) from node; None if no latch is reached
            key = id(node) if isinstance(node, Loop) else node
            if key in memo:
                return memo[key]
            if key in active:
                raise LoopError(f"{where}: a cycle that is not a natural loop")
            active.add(key)
            here = ins_of(node, pick)
            options = [(0, [])] if not isinstance(node, Loop) and node in lp.latches else []
            options += [r for r in map(walk, succ_nodes(node)) if r is not None]
            active.discard(key)
            res = None
            if options:
                c, path = pick(options, key=lambda o: o[0])
                res = (c + len(here), here + path)
            memo[key] = res
            return res

        r = walk(lp.header)
        if r is None:
            raise LoopError(f"{where}: no path from the header to a latch")
        return r[1]

    best = {"live": best_path(max), "dead": best_path(min)}
    best["nested"] = [(ins[blocks[c.header].first].addr, trips[id(c)]) for c in lp.children]
    return best


# ------------------------------------------------------------------------------------------------------------------
# counts and cycles
# ------------------------------------------------------------------------------------------------------------------
def _smem_bytes(i: Ins) -> int:
    """Shared-memory bytes one warp's instruction moves (32 lanes, no broadcast, no bank conflicts)."""
    mods = i.opcode.split(".")[1:]
    if i.base in ("LDSM", "STSM"):
        return 128 * next((int(x[1:]) for x in mods if x in ("x1", "x2", "x4")),
                          next((int(x) for x in mods if x in ("1", "2", "4")), 1))
    if i.base in ("LDS", "STS", "ATOMS", "LDGSTS"):
        width = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}
        return 32 * next((width[x] for x in mods if x in width), 4)
    return 0


def count_path(ins: list, path: list, warps: int) -> dict:
    """Per-warp instruction counts of one path by class, opcode and pipe; the CTA's tensor multiply-adds and
    shared-memory bytes for one iteration."""
    by_class, by_op, by_pipe = collections.Counter(), collections.Counter(), collections.Counter()
    macs = smem = 0
    for n in path:
        i = ins[n]
        by_class[i.cls] += 1
        by_op[i.opcode] += 1
        by_pipe[i.pipe] += 1
        smem += warps * _smem_bytes(i)
        if i.base == "HGMMA":
            m, n_, k, a_reg = mma_shape(i)
            groups = warps / SMSP  # every warp of a warpgroup issues the instruction; the work is the group's
            macs += groups * m * n_ * k
            smem += groups * 2 * (n_ * k + (0 if a_reg else m * k))  # bf16 operands from shared memory
        elif i.base == "HMMA":
            macs += warps * hmma_macs(i)  # each warp its own m16n8k16 (operands from registers, loaded by LDSM)
        elif i.cls == "tensor":
            raise LoopError(f"{i.opcode} at {i.addr:#x}: only HGMMA and HMMA are modelled")
    return dict(total=len(path), by_class=by_class, by_op=by_op, by_pipe=by_pipe, macs=macs, smem=smem)


def cycles(cnt: dict, warps: int) -> dict:
    """SM cycles of one iteration per resource (module docstring, step 4) and the binding one."""
    p = cnt["by_pipe"]
    fma_all = p["fma"] + p["fmaheavy"]
    bounds = dict(
        issue=warps * cnt["total"] / RATES["issue"],
        fma=warps * max(fma_all / RATES["fma"], p["fmaheavy"] / RATES["fmaheavy"]),
        alu=warps * p["alu"] / RATES["alu"],
        xu=warps * p["xu"] / RATES["xu"],
        shuffle=warps * p["shuffle"] / RATES["shuffle"],
        redux=warps * p["redux"] / RATES["redux"],
        tensor=cnt["macs"] / TENSOR_FMA_PER_CLK,
        smem=cnt["smem"] / SMEM_BYTES_PER_CLK,
    )
    bound = max(bounds, key=bounds.get)
    return dict(bounds=bounds, cycles=bounds[bound], bound=bound)


# ------------------------------------------------------------------------------------------------------------------
# builds
# ------------------------------------------------------------------------------------------------------------------
def default_n() -> int:
    """The sequence length ``sm90_build.fwd_case`` builds with by default."""
    return inspect.signature(sm90_build.fwd_case).parameters["n"].default


def keep_build(folder: str, stem: str, compiled, an: dict) -> None:
    """``--keep``: a build's cubin and loop tree as ``folder/stem.cubin`` and ``.loops.txt``."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, stem + ".cubin"), "wb") as f:
        f.write(compiled.asm["cubin"])
    with open(os.path.join(folder, stem + ".loops.txt"), "w") as f:
        f.write(an["tree"] + "\n")


def compiled_by(case, *args, **kwargs):
    """``(result, [compiled])``: an ``sm90_build`` case function's result and every kernel it compiled."""
    kept = []
    orig = sm90_build.compile_like_launch

    def keep(kernel, launch_args, launch_kwargs):
        compiled = orig(kernel, launch_args, launch_kwargs)
        kept.append(compiled)
        return compiled

    sm90_build.compile_like_launch = keep
    try:
        result = case(*args, **kwargs)
    finally:
        sm90_build.compile_like_launch = orig
    return result, kept


def build(head_dim: int, alpha_class: str, causal: bool, n: int | None = None, config: tuple | None = None,
          need_out_u: bool = False):
    """``(compiled, info)``: the forward of one class built as ``sm90_build.fwd_case`` builds it (bf16, no mask;
    ``n`` keys, default ``default_n()``; ``config`` ``(block_m, block_n, num_warps)`` instead of the pinned one;
    ``need_out_u``: the training forward); ``info`` is its analysis dict (regs, spills, block, warps, ...)."""
    cfg = {} if config is None else dict(block=config[:2], config=(config[2], 2))
    info, kept = compiled_by(sm90_build.fwd_case, head_dim, alpha_class, causal=causal,
                             n=default_n() if n is None else n, need_out_u=need_out_u, **cfg)
    if not kept:
        raise RuntimeError("sm90_build.fwd_case compiled nothing")
    return kept[-1], info


def analyse_build(compiled, info: dict, alpha_class: str, head_dim: int) -> dict:
    """Find the pass loops of one build and cost their paths."""
    warps = compiled.metadata.num_warps
    block_m, block_n = (int(x) for x in info["block"].split("x"))
    ins = disassemble(compiled.asm["cubin"])
    kind = "softmax" if alpha_class == "softmax" else "entmax"
    blocks, loops, roles = find_pass_loops(ins, kind, block_m, block_n, head_dim, warps)
    out = {}
    for role, lp in roles.items():
        paths = iteration_paths(blocks, lp, ins)
        region = mask_region(blocks, lp, ins)
        if region:  # a full tile skips the per-score mask (``_masking.score_mod``'s ``inside``)
            paths["interior"] = iteration_paths(blocks, lp, ins, avoid=region)["live"]
        for name in ("live", "interior", "dead"):
            path = paths.get(name)
            if path is None or name == "dead" and (role != "grid" or len(path) == len(paths["live"])):
                continue
            key = role if name == "live" else f"{role}_{name}"
            cnt = count_path(ins, path, warps)
            out[key] = dict(addr=ins[blocks[lp.header].first].addr, depth=lp.depth, count=cnt,
                            cost=cycles(cnt, warps), nested=paths["nested"] if name == "live" else [])
    if kind == "entmax" and "grid_dead" not in out:
        raise LoopError("the grid loop has no skippable block (no dead-tile path)")
    return dict(ins=len(ins), warps=warps, block_m=block_m, block_n=block_n, loops=out,
                tree=loop_tree(loops, blocks, ins))


# ------------------------------------------------------------------------------------------------------------------
# the per-class model and the report
# ------------------------------------------------------------------------------------------------------------------
def full_tile_cycles(an: dict, role: str):
    """Cycles of loop ``role`` on a full key tile: its interior path where it has one (``analyse_build``), else its one
    path; None when the build has no such loop."""
    loops = an["loops"]
    lp = loops.get(role + "_interior", loops.get(role))
    return None if lp is None else lp["cost"]["cycles"]


def class_model(an: dict, soft: float, c: float, dead: list) -> dict:
    """Cycles per visible key tile of one build and the ratios to the softmax loop ``soft`` (docstring, step 5)."""
    cyc = {k: v["cost"]["cycles"] for k, v in an["loops"].items()}
    # a visible key tile is priced as a full one (its interior path where the loop has one): all but the diagonal
    # and ragged tiles are (one in N / BLOCK_N / 2 causal, none of N 16384 non-causal)
    tile = {k: full_tile_cycles(an, k) for k in ("softmax", "grid", "cand", "value")}
    if "softmax" in cyc:
        dense, gd = tile["softmax"], tile["softmax"]
    else:
        dense, gd = tile["grid"] + c * tile["cand"] + tile["value"], cyc["grid_dead"]
    per_dead = [(1 - d) * dense + d * gd for d in dead]
    return dict(cycles=cyc, dense=dense, dead=per_dead, ratio=dense / soft, ratio_dead=[x / soft for x in per_dead])


def table(header: list, rows: list, markdown: bool) -> str:
    rows = [[str(x) for x in r] for r in rows]
    if markdown:
        return "\n".join(["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)] +
                         ["| " + " | ".join(r) + " |" for r in rows])
    width = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(header)]
    text = [any(not r[k][:1].isdigit() and r[k] != "-" for r in rows) for k in range(len(header))]

    def fmt(r):
        return "  ".join(x.ljust(w) if t else x.rjust(w) for x, w, t in zip(r, width, text))

    return "\n".join([fmt(header)] + [fmt(r) for r in rows])


def rates_text() -> str:
    return (f"H100 SM model: issue {RATES['issue']:g} warp-instr/clk (4 SMSPs), fma {RATES['fma']:g} "
            f"(fmaheavy/IMAD {RATES['fmaheavy']:g}), alu {RATES['alu']:g}, xu/MUFU {RATES['xu']:g}, "
            f"SHFL {RATES['shuffle']:g}, REDUX {RATES['redux']:g} warp-instr/clk/SM; tensor "
            f"{TENSOR_FMA_PER_CLK:g} bf16 FMA/clk/SM; shared memory {SMEM_BYTES_PER_CLK:g} B/clk/SM")


def _tag(r: dict, key: str = "") -> str:
    return f"d{r['d']} {'causal' if r['causal'] else 'non-causal'} {r['cls']}" + (f" {key}" if key else "")


def grid_point_work(r: dict) -> str:
    """The grid pass's live-only instructions (live path minus dead path) per score and grid point, by opcode."""
    from sparse_attn.kernels._args import ALPHA_CLASSES, CLASS_POW
    from sparse_attn.kernels.attn._threshold import FWD_POINTS

    loops = r["an"]["loops"]
    extra = loops["grid"]["count"]["by_op"] - loops["grid_dead"]["count"]["by_op"]
    per_thread = r["an"]["block_m"] * r["an"]["block_n"] / (32 * r["an"]["warps"])
    k = FWD_POINTS[CLASS_POW[ALPHA_CLASSES[r["cls"]]]][0]
    unit = per_thread * k
    return (f"{_tag(r, 'grid')}: live-only work {sum(extra.values())} instructions per warp per tile = "
            f"{sum(extra.values()) / unit:.1f} per score per grid point ({per_thread:.0f} scores per thread, GRID_K "
            f"{k}): " + ", ".join(f"{op} {v / unit:.2f}" for op, v in extra.most_common(10)))


def print_mix(results: list, markdown: bool) -> None:
    rows = [[_tag(r, key), lp["count"]["total"]] + [lp["count"]["by_class"].get(c, 0) for c in MIX_CLASSES]
            for r in results for key, lp in r["an"]["loops"].items()]
    print("\n## Instruction mix: instructions per warp per key tile, by class (`_dead`: the grid pass on a dead "
          "tile)")
    print(table(["build / loop", "total"] + list(MIX_CLASSES), rows, markdown))
    print("\nTop opcodes per loop path (per warp per key tile):")
    for r in results:
        for key, lp in r["an"]["loops"].items():
            print(f"- {_tag(r, key)}: " + ", ".join(f"{op} {k}" for op, k in lp["count"]["by_op"].most_common(14)))
        if "grid_dead" in r["an"]["loops"]:
            print(f"- {grid_point_work(r)}")
    unknown = sorted({op for r in results for lp in r["an"]["loops"].values() for op in lp["count"]["by_op"]
                      if Ins(0, op, "", "").cls == "unknown"})
    if unknown:
        print(f"- opcodes without a class (an issue slot only): {', '.join(unknown)}")


def points_arg(text: str) -> tuple:
    """``"K,P"`` -> ``(K, P)``: powers of two, K >= 2 (the grid step is ``1 / (K - 1)``), P >= 1."""
    k, p = (int(x) for x in text.split(","))
    if k < 2 or k & (k - 1) or p < 1 or p & (p - 1):
        raise argparse.ArgumentTypeError(f"--points: expected K,P powers of two with K >= 2, got {text!r}")
    return k, p


def set_points(points: tuple) -> None:
    """Build every entmax class with ``points = (GRID_K, CAND_P)``: the launcher reads ``FWD_POINTS`` at each launch."""
    for pow_ in sm90_build.fwd.FWD_POINTS:
        sm90_build.fwd.FWD_POINTS[pow_] = tuple(points)


# ------------------------------------------------------------------------------------------------------------------
# the backward: one tile loop per kernel
# ------------------------------------------------------------------------------------------------------------------
# tensor-core products per visited tile of each backward kernel, and their multiply-adds in units of
# BLOCK_M * BLOCK_N * (BLOCK_D, BLOCK_DV) (equal head dims in these builds): dQ kernel s, dP, dQ; dK/dV kernel s^T,
# dP^T, dV, dK (and dQ with the atomic dQ)
BWD_PRODUCTS = {"bwd_dq": 3, "bwd_dkdv": 4, "bwd_dkdv+dq": 5}


def build_bwd(head_dim: int, alpha_class: str, causal: bool, n: int | None = None, deterministic: bool = True,
              need_dalpha: bool = False):
    """``[(compiled, info)]``: the backward's dQ and dK/dV kernels of one class built as ``sm90_build.bwd_cases``
    builds them (bf16, no mask, d alpha with ``need_dalpha``; ``n`` keys), with their tile loops: the deterministic
    backward's dQ kernel and dK/dV kernel, or (``deterministic=False``) the dK/dV kernel with the atomic dQ."""
    infos, kept = compiled_by(sm90_build.bwd_cases, head_dim, need_dalpha=need_dalpha, mask=None, causal=causal,
                              n=default_n() if n is None else n, kernels=("dq", "dkdv"), alpha_class=alpha_class,
                              deterministic=deterministic)
    return [(c, i) for c, i in zip(kept, infos) if i["kernel"] in BWD_PRODUCTS]


def analyse_bwd(compiled, info: dict, head_dim: int) -> dict:
    """The one tile loop of a backward kernel (a loop holding tensor-core instructions, HGMMA or HMMA, with no such
    loop nested in it), checked to do exactly one tile's products per iteration, and the cost of its longest path
    (``boundary``: a tile that needs the per-score mask) and of the longest path that skips the mask
    (``interior``: a tile inside the sequence and the structural mask, ``mask_region``)."""
    warps = compiled.metadata.num_warps
    block_m, block_n = (int(x) for x in info["block"].split("x"))
    ins = disassemble(compiled.asm["cubin"])
    blocks = blocks_of(ins)
    loops = natural_loops(blocks)

    def has_mma(lp):
        return any(ins[n].cls == "tensor" for n in _block_ins(blocks, lp.body))

    tile = [lp for lp in loops if has_mma(lp) and not any(has_mma(c) for c in lp.children)]
    if len(tile) != 1:
        raise LoopError(f"{info['kernel']}: expected one tile loop, found {len(tile)}\n"
                        f"{loop_tree(loops, blocks, ins)}")
    lp = tile[0]
    lp.role = info["kernel"]
    paths = iteration_paths(blocks, lp, ins)
    paths["interior"] = iteration_paths(blocks, lp, ins, avoid=mask_region(blocks, lp, ins))["live"]
    want = BWD_PRODUCTS[info["kernel"]] * block_m * block_n * _common_head_dim_block(head_dim)
    out = {}
    for name, key in (("live", "boundary"), ("interior", "interior")):
        cnt = count_path(ins, paths[name], warps)
        if cnt["macs"] != want:
            raise LoopError(f"{info['kernel']} @{ins[blocks[lp.header].first].addr:#x}: {cnt['macs']:.0f} tensor "
                            f"multiply-adds per iteration, not one {block_m} x {block_n} tile's {want} "
                            f"({BWD_PRODUCTS[info['kernel']]} products)\n{loop_tree(loops, blocks, ins)}")
        out[key] = dict(addr=ins[blocks[lp.header].first].addr, depth=lp.depth, count=cnt, cost=cycles(cnt, warps),
                        nested=paths["nested"])
    return dict(ins=len(ins), warps=warps, block_m=block_m, block_n=block_n, loops=out,
                hmma=sum(1 for i in ins if i.base == "HMMA"), tree=loop_tree(loops, blocks, ins))


_KEEPS_WORK = ("LDG", "STG", "RED", "REDG", "ATOM", "ATOMG", "LDGSTS", "UTMALDG", "HGMMA", "HMMA", "BAR", "SYNCS")


def mask_region(blocks: list, lp: Loop, ins: list) -> set:
    """The blocks an interior tile skips in a backward tile loop: those the first forward branch inside the loop
    jumps over that hold only arithmetic (the per-score mask of ``_masking.score_mod`` behind ``if inside``); empty
    when the compiler kept no such branch. Other skippable blocks (the guards of masked atomics or stores) run on
    every interior tile and stay on its path."""
    for b in sorted(lp.body):
        last = ins[blocks[b].last]
        if last.base != "BRA" or not last.conditional or last.target is None or last.target <= last.addr:
            continue
        region = {x for x in lp.body if last.addr < ins[blocks[x].first].addr < last.target}
        if region and all(ins[n].base not in _KEEPS_WORK for x in region
                          for n in range(blocks[x].first, blocks[x].last + 1)):
            return region
    return set()


def _common_head_dim_block(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


SCORES_UNIT = 64 * 64  # the backward's costs are per 64 x 64 scores: the kernels' tiles differ


def bwd_main(args, triton) -> int:
    """``--bwd``: the backward's tile loops per class, head dim and causality (module docstring, "The backward")."""
    t0 = time.time()
    print(f"# sass_cost --bwd{' --dalpha' if args.dalpha else ''}: triton {triton.__version__}, sm_90, bf16, "
          f"n {args.n}; {rates_text()}", flush=True)
    classes = ["softmax"] + [c for c in args.classes if c != "softmax"]
    modes = [True] + ([False] if args.nondet else [])
    results = []
    for d in args.d:
        for causal in args.causal:
            for cls in classes:
                for det in modes:
                    per = {}
                    for compiled, info in build_bwd(d, cls, causal, args.n, det, args.dalpha):
                        an = analyse_bwd(compiled, info, d)
                        per[info["kernel"]] = dict(info=info, an=an)
                        if args.keep:
                            keep_build(args.keep, f"{info['kernel']}_{cls}_d{d}_c{int(causal)}", compiled, an)
                        lps = an["loops"]
                        print(f"# built d{d} {'causal' if causal else 'non-causal'} {cls} {info['kernel']}: block "
                              f"{info['block']}, {an['warps']} warps, regs {info['regs']}, spill {info['spill']} B "
                              f"(in loops {info['loop_ldst']}), HMMA {an['hmma']}; tile loop: "
                              f"{lps['boundary']['count']['total']} / {lps['interior']['count']['total']} "
                              f"instructions per warp (boundary / interior)", flush=True)
                    results.append(dict(d=d, causal=causal, cls=cls, det=det, kernels=per))

    rows = []
    for r in results:
        for name, k in r["kernels"].items():
            for key, lp in k["an"]["loops"].items():
                b = lp["cost"]["bounds"]
                rows.append([f"d{r['d']} {'causal' if r['causal'] else 'non-causal'} {r['cls']} {name} {key}",
                             lp["count"]["total"]] + [f"{b[x]:.0f}" for x in ("issue", "fma", "alu", "xu", "shuffle",
                                                                               "tensor", "smem")] +
                            [f"{lp['cost']['cycles']:.0f}", lp["cost"]["bound"]])
    print("\n## Backward tile loops: instructions per warp and SM cycles per iteration (one tile) by resource")
    print(table(["build / kernel / path", "instr", "issue", "fma", "alu", "xu", "shfl", "tensor", "smem", "cycles",
                 "bound"], rows, args.markdown))

    def per_unit(k, key):
        an = k["an"]
        return k["an"]["loops"][key]["cost"]["cycles"] * SCORES_UNIT / (an["block_m"] * an["block_n"])

    rows = []
    for r in results:
        ks = r["kernels"]
        total = {key: sum(per_unit(k, key) for k in ks.values()) for key in ("interior", "boundary")}
        r["model"] = total
        products = sum(BWD_PRODUCTS[name] for name in ks)
        floor = products * SCORES_UNIT * _common_head_dim_block(r["d"]) / TENSOR_FMA_PER_CLK
        soft = next(x for x in results if (x["d"], x["causal"], x["cls"], x["det"]) == (r["d"], r["causal"],
                                                                                          "softmax", True))
        r["ratio"] = total["interior"] / soft["model"]["interior"]
        r["floor"] = total["interior"] / floor
        per = " + ".join(f"{per_unit(k, 'interior'):.0f} ({per_unit(k, 'boundary'):.0f})" for k in ks.values())
        tiles = ", ".join(f"{k['info']['block']}/{k['an']['warps']}w" for k in ks.values())
        regs = ", ".join(f"{k['info']['regs']}/{k['info']['spill']}/{k['info']['loop_ldst']}" for k in ks.values())
        rows.append([r["d"], "yes" if r["causal"] else "no", LABEL[r["cls"]], "yes" if r["det"] else "no (atomic dQ)",
                     per, f"{total['interior']:.0f}", f"{r['ratio']:.2f}x", f"{products}: {floor:.0f}",
                     f"{r['floor']:.2f}x", tiles, regs])
    print(f"\n## Backward cycles per {SCORES_UNIT} scores (a 64 x 64 block), bf16 (triton {triton.__version__}): per "
          f"kernel interior tile (boundary tile), their sum over interior tiles, as a ratio to the deterministic "
          f"softmax-class backward of the same head dim and causality and to the tensor-only floor (the products "
          f"at the tensor cores' peak)")
    print(table(["d", "causal", "class", "deterministic", "dQ + dK/dV kernels", "total", "x softmax",
                 "products: floor", "x floor", "tiles / warps", "regs / spill B / loop ld-st"], rows, args.markdown))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(triton=triton.__version__, n=args.n, rates=RATES, tensor_fma_per_clk=TENSOR_FMA_PER_CLK,
                           builds=[dict(d=r["d"], causal=r["causal"], cls=r["cls"], deterministic=r["det"],
                                        total=r["model"], ratio=r["ratio"], floor_ratio=r["floor"],
                                        kernels={name: dict(info=k["info"], warps=k["an"]["warps"],
                                                            loops={key: dict(instructions=lp["count"]["total"],
                                                                             by_pipe=dict(lp["count"]["by_pipe"]),
                                                                             tensor_macs=lp["count"]["macs"],
                                                                             **lp["cost"])
                                                                   for key, lp in k["an"]["loops"].items()})
                                                 for name, k in r["kernels"].items()})
                                   for r in results]), f, indent=1)
    print(f"\n# {len(results)} backward builds analysed in {time.time() - t0:.0f} s")
    for r in results:
        print(f"sass_cost --bwd: d{r['d']} {'causal' if r['causal'] else 'non-causal'} {r['cls']}"
              f"{'' if r['det'] else ' atomic dQ'}: {r['ratio']:.2f}x the softmax-class backward, {r['floor']:.2f}x "
              f"the tensor-only floor")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128], help="head dims (default 64 128)")
    ap.add_argument("--classes", nargs="+", default=["softmax", "entmax15", "sparsemax", "general"],
                    choices=["softmax", "entmax15", "sparsemax", "general"])
    ap.add_argument("--causal", dest="causal", action="store_const", const=[True], default=[False, True],
                    help="causal builds only (default: both)")
    ap.add_argument("--no-causal", dest="causal", action="store_const", const=[False],
                    help="non-causal builds only")
    ap.add_argument("--cand-passes", type=float, default=1.0,
                    help="candidate passes per query tile in the dense model (bf16: 1, docs/kernels.md)")
    ap.add_argument("--dead", type=float, nargs="+", default=[0.6, 0.9], help="dead key-tile fractions")
    ap.add_argument("--n", type=int, default=None,
                    help="sequence length of the builds (default: sm90_build.fwd_case's; the JIT specializes "
                         "n_words == 1, one bitmap word, up to 32 key tiles)")
    ap.add_argument("--markdown", action="store_true", help="markdown tables (docs/kernels.md)")
    ap.add_argument("--json", help="write every number to this file")
    ap.add_argument("--mix", action="store_true", help="also the instruction mix of each loop path")
    ap.add_argument("--keep", help="write each build's cubin and loop tree here")
    ap.add_argument("--smoke", action="store_true", help="softmax and 1.5-entmax, head dim 64, not causal (CI)")
    ap.add_argument("--config", type=int, nargs=3, default=None, metavar=("BLOCK_M", "BLOCK_N", "WARPS"),
                    help="build every class with these tiles and warps (2 stages) instead of the pinned config")
    ap.add_argument("--train", action="store_true",
                    help="the training forward (need_out_u: the value loop also multiplies U V) of the fused kernel")
    ap.add_argument("--bwd", action="store_true", help="the backward's tile loops instead of the forward's")
    ap.add_argument("--dalpha", action="store_true",
                    help="with --bwd: every kernel with the gradient w.r.t. alpha (a learnable alpha), softmax too")
    ap.add_argument("--nondet", action="store_true",
                    help="with --bwd: also the backward with the atomic dQ (deterministic=False)")
    ap.add_argument("--points", type=points_arg, default=None, metavar="K,P",
                    help="grid points K and candidate points P for every entmax class (default: the kernel's _POINTS)")
    ap.add_argument("--no-tma", action="store_true",
                    help="pointer loads everywhere instead of TMA descriptors (as with SPARSE_ATTN_TMA=0)")
    args = ap.parse_args(argv)
    sm90_build.TMA = not args.no_tma
    if args.points is not None:
        set_points(args.points)
    if args.smoke:
        args.d, args.classes, args.causal = [64], ["softmax", "entmax15"], [False]
    classes = ["softmax"] + [c for c in args.classes if c != "softmax"]  # the ratios need the softmax build
    args.n = default_n() if args.n is None else args.n
    import triton

    if args.bwd:
        return bwd_main(args, triton)

    t0 = time.time()
    print(f"# sass_cost{' --train' if args.train else ''}: triton {triton.__version__}, sm_90, bf16, n {args.n}; "
          f"{rates_text()}" +
          (f"; points GRID_K, CAND_P = {args.points}" if args.points else ""), flush=True)
    results = []
    for d in args.d:
        for causal in args.causal:
            for cls in classes:
                t = time.time()
                compiled, info = build(d, cls, causal, args.n, args.config, need_out_u=args.train)
                an = analyse_build(compiled, info, cls, d)
                r = dict(d=d, causal=causal, cls=cls, info=info, an=an)
                if args.keep:
                    keep_build(args.keep, f"fwd_{cls}_d{d}_c{int(causal)}", compiled, an)
                results.append(r)
                loops = ", ".join(f"{k}@{v['addr']:#x} {v['count']['total']}" + "".join(
                    f" (nested loop @{a:#x} x{n})" for a, n in v["nested"]) for k, v in an["loops"].items())
                print(f"# built {_tag(r)}: block {info['block']}, {an['warps']} warps, {info['stages']} stages, "
                      f"regs {info['regs']}, spill {info['spill']} B, {an['ins']} SASS; loop paths (instructions "
                      f"per warp per key tile): {loops} ({time.time() - t:.1f} s)", flush=True)

    rows = []
    for r in results:
        for key, lp in r["an"]["loops"].items():
            b = lp["cost"]["bounds"]
            rows.append([_tag(r, key), lp["count"]["total"]] +
                        [f"{b[k]:.0f}" for k in ("issue", "fma", "alu", "xu", "shuffle", "tensor", "smem")] +
                        [f"{lp['cost']['cycles']:.0f}", lp["cost"]["bound"]])
    print("\n## Loop paths: instructions per warp and SM cycles per key tile by resource (`_dead`: the grid pass "
          "on a dead tile; `_interior`: a full tile, the per-score mask skipped; the plain name: the longest path, a "
          "boundary tile)")
    print(table(["build / loop", "instr", "issue", "fma", "alu", "xu", "shfl", "tensor", "smem", "cycles", "bound"],
                rows, args.markdown))

    dead_cols = [f"{round(100 * d)}% dead" for d in args.dead]
    rows = []
    for r in results:
        soft = next(x for x in results if x["d"] == r["d"] and x["causal"] == r["causal"] and x["cls"] == "softmax")
        m = r["model"] = class_model(r["an"], full_tile_cycles(soft["an"], "softmax"), args.cand_passes, args.dead)
        cyc = m["cycles"]
        if r["cls"] == "softmax":
            loops, dead = f"one loop: {full_tile_cycles(r['an'], 'softmax'):.0f}", ["1.00x"] * len(args.dead)
        else:
            loops = " / ".join(f"{full_tile_cycles(r['an'], k):.0f}" for k in ("grid", "cand", "value"))
            loops += f" ({cyc['grid_dead']:.0f})"
            dead = [f"{x:.2f}x" for x in m["ratio_dead"]]
        rows.append([r["d"], "yes" if r["causal"] else "no", LABEL[r["cls"]], loops, f"{m['dense']:.0f}",
                     f"{m['ratio']:.2f}x"] + dead + [r["info"]["block"], f"{r['info']['regs']} / {r['info']['spill']}"])
    print(f"\n## Cycles per key tile, bf16 (triton {triton.__version__}): grid / candidate / value (dead tile: the "
          f"grid pass's dead path); dense = grid + {args.cand_passes:g} x candidate + value, each on a full tile; "
          f"ratios to the softmax loop of the same head dim and causality")
    print(table(["d", "causal", "class", "grid / cand / value (dead tile)", "dense cycles", "dense"] + dead_cols +
                ["block", "regs / spill"], rows, args.markdown))

    if args.mix:
        print_mix(results, args.markdown)

    if args.json:
        def plain(lp):
            c = lp["count"]
            return dict(addr=hex(lp["addr"]), depth=lp["depth"], nested=[[hex(a), n] for a, n in lp["nested"]],
                        instructions=c["total"], by_class=dict(c["by_class"]), by_pipe=dict(c["by_pipe"]),
                        by_op=dict(c["by_op"]), tensor_macs=c["macs"], smem_bytes=c["smem"], **lp["cost"])

        with open(args.json, "w") as f:
            json.dump(dict(triton=triton.__version__, n=args.n, rates=RATES, tensor_fma_per_clk=TENSOR_FMA_PER_CLK,
                           smem_bytes_per_clk=SMEM_BYTES_PER_CLK, cand_passes=args.cand_passes, dead=args.dead,
                           builds=[dict(d=r["d"], causal=r["causal"], cls=r["cls"], info=r["info"],
                                        warps=r["an"]["warps"], model=r["model"],
                                        loops={k: plain(v) for k, v in r["an"]["loops"].items()})
                                   for r in results]), f, indent=1)
    print(f"\n# {len(results)} builds analysed in {time.time() - t0:.0f} s")
    for r in results:
        if r["cls"] != "softmax":
            m = r["model"]
            print(f"sass_cost: {_tag(r)}: dense {m['ratio']:.2f}x the softmax loop, " +
                  ", ".join(f"{c} {x:.2f}x" for c, x in zip(dead_cols, m["ratio_dead"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
