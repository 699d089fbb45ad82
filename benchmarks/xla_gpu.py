"""XLA:GPU without a GPU (the hub): compile for a described H200 and read the program.

jax's CUDA plugin compiles ahead of time for a described device: :func:`compile_for` gives
the real GPU program of a function, and :func:`analyse` reads it into a :class:`Program`:
the kernels of one step (a ``conditional`` counts its thunk and costliest branch, a
``while`` or ``call`` what it runs, once), the bytes each moves (operands plus outputs; a
cuBLAS call's workspace, 4 MiB of scratch it uses a part of, is in the temp memory only),
XLA's temp memory, matrix FLOPs by operand dtype and a roofline time. GEMMs keep XLA's
default configurations (autotuning needs a device); the rest is the compiler's own, and
deterministic. Needs ``jax-amp[gpu-compile]``, ``ptxas`` on ``PATH`` and
``JAX_PLATFORMS=cpu``: the plugin must not open a device (``docs/benchmarks.md``).
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import jax

# --------------------------------------------------------------------- targets


_H200 = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
runtime_version { major: 13 minor: 0 patch: 0 }
device_description_str: "NVIDIA H200"
"""


@dataclass(frozen=True, eq=False)  # hashed by identity: mesh() caches by target
class Target:
    """A described GPU: its ``GpuTargetConfigProto`` and the peaks of its roofline."""

    name: str
    config: str
    bandwidth: float  # bytes / s
    # Dense matrix-product peaks, FLOP/s, by operand dtype (float32 products run as TF32).
    peaks: dict = field(default_factory=dict)


_HOPPER_PEAKS = {"bf16": 989e12, "f16": 989e12, "f8": 1979e12, "f32": 494e12, "f64": 67e12}
TARGETS = {"H200": Target("H200", _H200, 4.8e12, _HOPPER_PEAKS)}


def unavailable() -> str | None:
    """Why this process cannot compile for a GPU target, or ``None`` if it can."""
    try:
        mesh(TARGETS["H200"])
        compile_for(lambda x: x + 1, jax.ShapeDtypeStruct((8,), "float32"))
    except Exception as e:  # noqa: BLE001 - any failure means: not here
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (
            f"no XLA:GPU compiler here ({type(e).__name__}: {first[:200]}); "
            "pip install \"jax-amp[gpu-compile]\" (jax's CUDA plugin) and put a CUDA toolkit's "
            "ptxas on PATH, with JAX_PLATFORMS=cpu"
        )
    return None


@functools.cache
def mesh(target: Target, devices: int = 1, axis: str = "x") -> jax.sharding.Mesh:
    """A mesh of ``devices`` described GPUs ``target`` on one host (topology ``1x1xN``),
    over the one axis ``axis``; one device by default (the suite's programs)."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", target_config=target.config,
                                        topology=f"1x1x{devices}")  # fmt: skip
    return topologies.make_mesh(topo, (devices,), (axis,))


def placed(tree: Any, mesh: jax.sharding.Mesh, spec: Any) -> Any:
    """``tree``'s arrays (or shape structs) as ``ShapeDtypeStruct``s on ``mesh``, each
    sharded as ``spec(leaf)`` says (a ``PartitionSpec``)."""

    def one(x: Any) -> Any:
        if not hasattr(x, "shape"):
            return x
        sharding = jax.sharding.NamedSharding(mesh, spec(x))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree_util.tree_map(one, tree)


def specs(tree: Any, target: Target = TARGETS["H200"]) -> Any:
    """``tree``'s arrays (or shape structs) as ``ShapeDtypeStruct``s placed on ``target``."""
    sharding = jax.sharding.NamedSharding(mesh(target), jax.sharding.PartitionSpec())

    def one(x: Any) -> Any:
        if not hasattr(x, "shape"):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree_util.tree_map(one, tree)


def compile_for(
    fun: Any, *args: Any, donate_argnums: tuple[int, ...] = (), target: Target = TARGETS["H200"]
) -> Any:
    """``jax.jit(fun, donate_argnums=...)`` compiled for ``target``, on the shapes and dtypes
    of ``args`` (arrays, shape structs or pytrees of them)."""
    placed = [specs(a, target) for a in args]
    return compile_lowered(jax.jit(fun, donate_argnums=donate_argnums).lower(*placed))


def compile_lowered(lowered: Any) -> Any:
    """``lowered.compile()`` for a GPU target without a device (a persistent compilation
    cache's entry cannot load without a device client: JAX warns and compiles anew, as wanted)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Error reading persistent compilation cache entry")
        return lowered.compile()


# --------------------------------------------------------------------- parsing

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "f8e3m4": 1,
    "f8e4m3b11fnuz": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "token": 0,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
# `%name = shape opcode(operands), attributes`; the shape may be a tuple.
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s+=\s+(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%(\S+)\s+\(.*\)\s+->\s+.*\{\s*$")

# Instructions that launch nothing: they name, view or group buffers.
FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "opt-barrier", "partition-id", "replica-id", "add-dependency", "domain",
}  # fmt: skip
# Calls whose called computations are what runs (each of their kernels counted once).
CALLS = {"call", "while", "async-start", "async-update", "async-done"}


@dataclass
class Instr:
    name: str
    shape: str  # the result's shape text, e.g. "f32[1024]{0}" or "(f32[2], s8[64])"
    opcode: str
    operands: list[str]
    attrs: str  # everything after the operand list

    @property
    def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        """The result's arrays, as (dtype, dims)."""
        return [
            (d, tuple(int(n) for n in dims.split(",") if n))
            for d, dims in _ARRAY.findall(self.shape)
        ]

    @property
    def nbytes(self) -> float:
        return sum(_DTYPE_BYTES.get(d, 4) * math.prod(dims) for d, dims in self.arrays)

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{re.escape(key)}=([^\s,]+)", self.attrs)
        return m.group(1) if m else None

    def called(self) -> list[str]:
        """Names of the computations this instruction calls."""
        return re.findall(r"\b(?:calls|to_apply|body|condition)=%?([^\s,}]+)", self.attrs) + (
            self.branches()
        )

    def branches(self) -> list[str]:
        m = re.search(r"branch_computations=\{([^}]*)\}", self.attrs)
        if m:
            return [n.strip().lstrip("%") for n in m.group(1).split(",") if n.strip()]
        names = [self.attr(k) for k in ("true_computation", "false_computation")]
        return [n.lstrip("%") for n in names if n]

    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""


def _split_operands(rest: str) -> tuple[list[str], str]:
    """The operand names of ``rest`` (the text after the opcode's '('), and what follows."""
    depth, i = 1, 0
    while i < len(rest) and depth:
        if rest[i] in "({[":
            depth += 1
        elif rest[i] in ")}]":
            depth -= 1
        i += 1
    inside, after = rest[: i - 1], rest[i:]
    return re.findall(r"%([^\s,()]+)", inside), after


def parse(text: str) -> tuple[dict[str, dict[str, Instr]], str]:
    """The module's computations (name -> {instruction name -> Instr}) and the entry's name."""
    comps: dict[str, dict[str, Instr]] = {}
    entry = ""
    current: dict[str, Instr] | None = None
    for line in text.splitlines():
        if h := _HEADER.match(line):
            current = comps.setdefault(h.group(2), {})
            entry = h.group(2) if h.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None and (m := _INSTR.match(line)):
            name, shape, opcode, rest = m.groups()
            current[name] = Instr(name, shape, opcode, *_split_operands(rest))
    return comps, entry


# --------------------------------------------------------------------- FLOPs


def _dims_of(comp: dict[str, Instr], name: str) -> tuple[str, tuple[int, ...]]:
    arrays = comp[name].arrays if name in comp else []
    return arrays[0] if arrays else ("f32", ())


def _short(dtype: str) -> str:
    return "f8" if dtype.startswith("f8") else dtype


def _matmul(comp: dict[str, Instr], ins: Instr, contract: list[int]) -> tuple[str, float]:
    """(lhs dtype, FLOPs) of a product contracting the lhs dimensions ``contract``."""
    lhs_dtype, lhs = _dims_of(comp, ins.operands[0])
    k = math.prod(lhs[c] for c in contract) if lhs else 1
    return _short(lhs_dtype), 2.0 * math.prod(ins.arrays[0][1]) * k


def _conv_flops(fwd_out: tuple[int, ...], filt: tuple[int, ...], labels: str) -> float:
    """2 * forward-output elements * filter elements per output feature."""
    try:
        rhs = labels.split("_")[1].split("->")[0]
        o = filt[rhs.index("o")]
    except (IndexError, ValueError):
        return float("nan")
    return 2.0 * math.prod(fwd_out) * math.prod(filt) / max(o, 1)


def _forward_conv(comp: dict[str, Instr], ins: Instr) -> tuple[str, float]:
    dtype, filt = _dims_of(comp, ins.operands[0])[0], _dims_of(comp, ins.operands[1])[1]
    return _short(dtype), _conv_flops(ins.arrays[0][1], filt, ins.attr("dim_labels") or "")


def _gemm_flops(comp: dict[str, Instr], ins: Instr) -> tuple[str, float] | None:
    """The (operand dtype, FLOPs) of a library call that is a GEMM or a convolution."""
    target = (ins.attr("custom_call_target") or "").strip('"')
    if "gemm" in target or "matmul" in target:
        m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
        return _matmul(comp, ins, [int(c.strip('"')) for c in m.group(1).split(",") if c.strip()]
                       if m else [])  # fmt: skip
    if "conv" not in target:
        return None
    if "BackwardFilter" in target:  # the filter's gradient from the input and output's
        dtype, fwd_out = _dims_of(comp, ins.operands[0])[0], _dims_of(comp, ins.operands[1])[1]
        filt = ins.arrays[0][1]
    elif "BackwardInput" in target:  # the input's gradient from the output's and the filter
        dtype, fwd_out = _dims_of(comp, ins.operands[0])
        filt = _dims_of(comp, ins.operands[1])[1]
    else:
        return _forward_conv(comp, ins)
    return _short(dtype), _conv_flops(fwd_out, filt, ins.attr("dim_labels") or "")


# --------------------------------------------------------------------- analysis


@dataclass
class Kernel:
    """One launch of the step: its op, bytes moved and matrix FLOPs (by operand dtype)."""

    name: str
    opcode: str
    op_name: str
    bytes: float
    flops: dict[str, float]

    def time(self, target: Target) -> float:
        t = self.bytes / target.bandwidth
        for dtype, f in self.flops.items():
            t = max(t, f / target.peaks.get(dtype, target.peaks["f32"]))
        return t


@dataclass
class Program:
    """What one step of a compiled GPU program launches and moves."""

    kernels: list[Kernel]
    temp_bytes: float
    conditionals: int
    copies: int
    text: str = field(repr=False, default="")

    @property
    def n_kernels(self) -> int:
        return len(self.kernels)

    @property
    def bytes(self) -> float:
        return sum(k.bytes for k in self.kernels)

    @property
    def flops(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for k in self.kernels:
            for d, f in k.flops.items():
                out[d] = out.get(d, 0.0) + f
        return out

    def roofline(self, target: Target = TARGETS["H200"]) -> float:
        """Seconds: per kernel, the larger of FLOPs / peak and bytes / bandwidth, summed."""
        return sum(k.time(target) for k in self.kernels)

    def gemm_dtypes(self) -> set[str]:
        """The operand dtypes of the step's matrix products and convolutions."""
        return {d for k in self.kernels for d, f in k.flops.items() if f > 0}

    def by_op(self, pattern: str) -> list[Kernel]:
        """The kernels whose op name (jax's name stack) matches ``pattern``."""
        return [k for k in self.kernels if re.search(pattern, k.op_name)]


def _flops_in(
    comps: dict[str, dict[str, Instr]], comp: dict[str, Instr], ins: Instr
) -> dict[str, float]:
    flops: dict[str, float] = {}

    def add(d: str, f: float) -> None:
        flops[d] = flops.get(d, 0.0) + f

    if ins.opcode == "custom-call":
        g = _gemm_flops(comp, ins)
        if g:
            add(*g)
    elif ins.opcode == "dot":
        m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
        add(*_matmul(comp, ins, [int(c) for c in m.group(1).split(",") if c] if m else []))
    elif ins.opcode == "convolution":
        add(*_forward_conv(comp, ins))
    elif ins.opcode == "fusion":
        for name in ins.called():
            sub = comps.get(name, {})
            for inner in sub.values():
                if inner.opcode in ("dot", "convolution", "custom-call", "fusion"):
                    for d, f in _flops_in(comps, sub, inner).items():
                        add(d, f)
    return flops


def _walk(comps: dict[str, dict[str, Instr]], name: str, out: list[Kernel], counts: dict) -> None:
    comp = comps[name]
    for ins in comp.values():
        op = ins.opcode
        if op in FREE:
            continue
        if op == "conditional":
            counts["conditionals"] += 1
            best: list[Kernel] = []
            for branch in ins.branches():
                ks: list[Kernel] = []
                _walk(comps, branch, ks, counts)
                if sum(k.bytes for k in ks) >= sum(k.bytes for k in best):
                    best = ks
            pred = comp.get(ins.operands[0]) if ins.operands else None
            out.append(Kernel(ins.name, op, ins.op_name(), pred.nbytes if pred else 0, {}))
            out.extend(best)
            continue
        if op in CALLS:
            for sub in ins.called():
                _walk(comps, sub, out, counts)
            continue
        if op == "copy":
            counts["copies"] += 1
        nbytes = ins.nbytes + sum(comp[o].nbytes for o in ins.operands if o in comp)
        if "cublas" in (ins.attr("custom_call_target") or ""):  # its s8 workspace: scratch
            nbytes -= sum(math.prod(dims) for d, dims in ins.arrays if d == "s8")
        flops = _flops_in(comps, comp, ins)
        out.append(Kernel(ins.name, op, ins.op_name(), nbytes, flops))


def analyse(compiled: Any) -> Program:
    """The kernels, bytes, temp memory and FLOPs of a compiled GPU program (one step)."""
    text = compiled.as_text()
    comps, entry = parse(text)
    kernels: list[Kernel] = []
    counts = {"conditionals": 0, "copies": 0}
    _walk(comps, entry, kernels, counts)
    try:
        temp = float(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - a backend without memory analysis
        temp = float("nan")
    return Program(kernels, temp, counts["conditionals"], counts["copies"], text)


# --------------------------------------------------------------------- collectives

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")


@dataclass(frozen=True)
class Collective:
    """One collective of a compiled program: its kind, the element dtype it moves, the
    elements of its operands (a combined collective: all of them, ``operands`` of them)
    and of its result, per device, and jax's name stack of the op that made it."""

    kind: str
    dtype: str
    elements: int
    out_elements: int
    operands: int
    op_name: str

    def __str__(self) -> str:
        return f"{self.kind} {self.dtype}[{self.elements}]"


def _collective_kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    return base if base in COLLECTIVES and not opcode.endswith("-done") else None


def collectives(text: str) -> list[Collective]:
    """The collectives a compiled program's (optimized HLO) ``text`` runs in one step, in
    program order: an asynchronous one once (its ``-start``), a loop's body once."""
    comps, entry = parse(text)
    out: list[Collective] = []

    def walk(name: str, seen: tuple[str, ...]) -> None:
        comp = comps.get(name, {})
        for ins in comp.values():
            kind = _collective_kind(ins.opcode)
            if kind is not None:
                ops = [comp[o].arrays[0] for o in ins.operands if o in comp and comp[o].arrays]
                ops = ops or ins.arrays[:1]
                result = ins.arrays[len(ops) :] if ins.opcode.endswith("-start") else ins.arrays
                result = result or ins.arrays
                dtype = ops[0][0] if ops else "?"
                n_in = sum(math.prod(d) for _, d in ops)
                n_out = sum(math.prod(d) for _, d in result)
                out.append(Collective(kind, dtype, n_in, n_out, len(ops), ins.op_name()))
            elif ins.opcode != "fusion":
                for sub in ins.called():
                    if sub not in seen:
                        walk(sub, (*seen, sub))

    walk(entry, (entry,))
    return out


def collective_counts(text: str) -> dict[tuple[str, str], tuple[int, int]]:
    """``{(kind, dtype): (collectives, arrays they move)}`` of ``collectives(text)`` (XLA
    combines small collectives: one may move several arrays)."""
    counts: dict[tuple[str, str], tuple[int, int]] = {}
    for c in collectives(text):
        n, arrays = counts.get((c.kind, c.dtype), (0, 0))
        counts[c.kind, c.dtype] = (n + 1, arrays + c.operands)
    return counts


def describe_collectives(text: str) -> str:
    """``collective_counts`` in words, e.g. ``all-gather bf16 x4, reduce-scatter f32 x1 (3
    arrays)``."""
    words = [f"{k} {d} x{n}" + (f" ({a} arrays)" if a != n else "")
             for (k, d), (n, a) in collective_counts(text).items()]  # fmt: skip
    return ", ".join(words) or "none"
