"""Code generation (TTile paper, section 6): Scheme + ConvSpec -> C with vector intrinsics.

One generator writes every vector family (:mod:`ttile.core.vectors`): AVX-512F (16-lane
``__m512``, 32 registers) and AVX2 + FMA (8-lane ``__m256``, 16 registers). The loop nest
is the same; what changes is the width of ``V k`` (and of the weight panels), the
register budget the block was checked against, and how a K tail is masked.

The generator walks the lowered scheme tree (:func:`ttile.scheme.lower`) and builds the
code innermost-out in one pass: each loop wraps the code of its sub-scheme, which refers
to the index of its dimension by a name the loop defines as ``inner = outer + i * step``.
Nothing is re-analysed afterwards, so what the scheme says is what the C does.

Where the generated code goes beyond a literal reading of the scheme, it is to keep the
microkernel at full speed without copying tensors:

* **Accumulators in registers.** The block's accumulators are loaded (or zeroed) before
  the innermost band of reduction loops (c, r, s) above the block and stored after it,
  not on every iteration. They are zeroed rather than loaded when that band covers the
  whole reduction; otherwise the output is cleared once at entry and accumulated into.
* **Zero padding without a padded copy.** Around the innermost band of c/k loops the
  code checks whether the block reads only inside the input. If so (the common,
  interior case) it addresses x from one base pointer with constant offsets. If not, it
  builds one pointer per unrolled input pixel, pointing either into x or at a static row
  of zeros, so the reduction loop stays branch-free. The check is omitted when the
  problem has no padding in that direction.
* **K tails by masks.** When K is not a multiple of the vector width, the k vectors of
  the block get masks for loading and storing outputs: AVX-512 mask registers
  (``maskz_loadu`` / ``mask_storeu``), or in AVX2 integer-vector masks for ``vmaskmovps``
  (``maskload`` / ``maskstore``, which fault on no lane left out), computed at the load
  and at the store so that no mask holds a ymm register through the reduction. The
  weight panels are zero-filled past K, so weight loads need none.
* **Canonical operation order in the block.** Within the unrolled block, the weight
  vectors of one (c, r, s) step are loaded once and each broadcast input feeds all k
  vectors (an outer product). The order of the U specifiers changes only the numbering,
  not the register use: ``accumulators + k vectors + 1`` registers are live, the budget
  :class:`ttile.scheme.Block` checks. An empty asm with a memory clobber separates the
  steps so the compiler cannot stretch values across them (it would, and spill).
* **Epilogue at the store.** The kernel's last argument is a ``ttile_epilogue`` (bias,
  residual, activation; see kernels/ttile_epilogue.h), NULL for a bare convolution.
  Where the accumulators are stored for the last time (the whole reduction done: at
  once when the block's reduction region is complete, else when every reduction loop
  outside it is at its last step), the block's just-stored outputs are rewritten as
  ``act(y + bias + residual)`` while they are in L1: no second pass over the output,
  and no epilogue temporaries on top of the live accumulators (they spilled).
* **Dilation.** Kernel taps are ``dilation`` input pixels apart; the offsets are
  constants like the strides.
* **Parallel band.** Consecutive parallel loops (``PT``/``PR``) become one
  ``#pragma omp parallel for collapse(m)`` whose thread count is a kernel argument.

The generated function is
``void NAME(const float *x, const float *w, float *y, int nthreads, const ttile_epilogue *ep)``
over x[N][H][W][C]
and y[N][Ho][Wo][K] (its NCHW entry point ``NAME_nchw``, where the scheme has one: x[N][C][H][W]
and y[N][K][Ho][Wo], see :func:`tile_regions`), with every size a constant, and weights packed in panels
w[K/P][R][S][C][P] where P is the block's width along k (16 per unrolled vector in
AVX-512F, 8 in AVX2; see
``ttile._kernels.pack_weights``): in RSCK the weights of consecutive (r, s, c) steps are K
floats apart, and the generated kernels ran at a third of their speed on that stride.
"""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass

from .kinds import Isa
from .scheme import Block, Loop, Node, Scheme, Seq, lower
from .spec import DIMS, REDUCTION_DIMS, ConvSpec
from .vectors import VectorIsa, vector_isa

#: Version of the generated loop nests: tuning records measured with another version are
#: not used. Kept at 3 when the fused epilogue was added: a bare call runs the same loops
#: and stores, past one untaken branch per block store (``ep != NULL``), so the records'
#: timings still describe the kernels (the Fig. 8 benchmark re-measured them).
GENERATOR_VERSION = 3

def kernel_cflags(isa: Isa = Isa.AVX512F) -> tuple[str, ...]:
    """Flags a generated kernel of family ``isa`` is compiled with: that family's ISA
    flags only (AVX-512F + FMA, or AVX2 + FMA), so a kernel runs on any x86-64 CPU
    that has its family, and an AVX2 kernel holds no AVX-512 instruction."""
    return ("-O3", *vector_isa(isa).cflags, "-fopenmp", "-fno-math-errno", "-fPIC")


#: Flags of the AVX-512F family's kernels (see :func:`kernel_cflags`).
KERNEL_CFLAGS = kernel_cflags(Isa.AVX512F)

_SPATIAL = ("n", "h", "w", "r", "s")  # dimensions that move the input pixel


@dataclass(frozen=True)
class KernelSource:
    """A generated C translation unit defining one kernel function ``name``."""

    name: str
    spec: ConvSpec
    scheme: Scheme
    code: str
    panel: int = 0   # k width of the weight panels the kernel reads (see pack_weights)
    isa: Isa = Isa.AVX512F   # its vector family: the flags it is compiled with
    nchw_name: "str | None" = None   # its NCHW-output entry point (None: the scheme has none)

    def weight_shape(self) -> tuple[int, ...]:
        return self.spec.packed_weight_shape(self.panel)


#: How far ahead of its reads a kernel with weight prefetching (``generate``'s
#: ``weight_prefetch``) asks for the weights: this many reduction steps of its panel, and
#: at least 2 KiB. Inside a network each layer's weights come from memory (MobileNetV2's
#: 14 MB and ResNet-50's 100 MB outgrow the caches between two inferences), and a kernel
#: reading its panels with plain loads waited for every line. The schemes run-time tuning
#: picks for those networks' weight-heavy 1x1 layers ran 1.02-1.18x faster with their
#: weights flushed before the call, and the same with them warm (Xeon model 167, 1 thread,
#: benchmarks/bench_weight_prefetch.py); a k-outer scheme on C=960 K=160 7x7: 127 -> 97 us.
WEIGHT_PREFETCH_STEPS = 16
WEIGHT_PREFETCH_MIN_FLOATS = 512


def kernel_name(scheme: Scheme, spec: ConvSpec, isa: Isa = Isa.AVX512F,
                weight_prefetch: bool = False) -> str:
    """``ttile_f32_conv2d_<hash>__<isa>``: one grammar for every generated kernel (the
    AVX-512F hash leaves the family out, as it did before there were two; a kernel that
    prefetches its weights hashes that in, so the two never share a name)."""
    vectors = vector_isa(isa)
    text = f"{GENERATOR_VERSION}|{spec.key()}|{scheme}"
    if vectors.isa is not Isa.AVX512F:
        text += f"|{vectors.isa.value}"
    if weight_prefetch:
        text += "|weight-prefetch|residual-prefetch"
    digest = hashlib.sha1(text.encode()).hexdigest()
    return f"ttile_f32_conv2d_{digest[:12]}{vectors.suffix}"


@dataclass
class _Code:
    """C lines plus the names the code expects its enclosing code to define, per dim."""

    lines: list[str]
    names: dict[str, str]


def _indent(lines: list[str]) -> list[str]:
    return ["    " + line if line else line for line in lines]


class _Generator:
    def __init__(self, spec: ConvSpec, name: str, vectors: VectorIsa, nchw: bool = False,
                 weight_prefetch: bool = False):
        self.spec = spec
        self.name = name
        self.weight_prefetch = weight_prefetch
        self.nchw = nchw            # the NCHW entry point: blocks store into tile buffers
        self.y = "yt" if nchw else "y"
        self.region: "TileRegion | None" = None   # the tile buffer being emitted into
        self.v = vectors
        self.lanes = vectors.lanes
        self.counter = itertools.count()
        self.k_tail = spec.k % vectors.lanes != 0
        self.row_guard = spec.needs_row_guard()
        self.col_guard = spec.needs_col_guard()
        self.uses_zeros = False
        self.clears_output = False
        self.totals = spec.iteration_extents(vectors.lanes)
        # floats between two pixels of x and of y: a group's channels are a slice of
        # each pixel's (ConvSpec.groups), read and written where they are
        self.x_pixel = spec.c * spec.groups
        self.y_pixel = spec.k * spec.groups

    def fresh(self, prefix: str) -> str:
        return f"{prefix}{next(self.counter)}"

    # -- the family's spelling of vector operations ----------------------------------

    def op(self, name: str) -> str:
        """An intrinsic of the family: ``op('fmadd_ps')`` is ``_mm512_fmadd_ps``."""
        return f"{self.v.prefix}_{name}"

    def mask(self, kv: int, k_name: str) -> str:
        """The tail mask of k vector ``kv``: a mask register (AVX-512) named once per
        block, or an AVX2 integer-vector mask computed where it is used."""
        if self.v.isa is Isa.AVX512F:
            return f"m{kv}"
        return f"ttile_tail_mask256({self.spec.k} - ({k_name} + {kv * self.lanes}))"

    def full_mask(self) -> str:
        return "(__mmask16)0xFFFF" if self.v.isa is Isa.AVX512F else "_mm256_set1_epi32(-1)"

    def masked_load(self, mask: str, address: str) -> str:
        if self.v.isa is Isa.AVX512F:
            return f"_mm512_maskz_loadu_ps({mask}, {address})"
        return f"_mm256_maskload_ps({address}, {mask})"

    def masked_store(self, mask: str, address: str, value: str) -> str:
        if self.v.isa is Isa.AVX512F:
            return f"_mm512_mask_storeu_ps({address}, {mask}, {value});"
        return f"_mm256_maskstore_ps({address}, {mask}, {value});"

    @property
    def bits(self) -> int:
        """The vector width in bits, as the epilogue helpers are named (512, 256)."""
        return 32 * self.lanes

    # -- loops ---------------------------------------------------------------------

    def wrap_loop(self, loop: Loop, *inners: _Code) -> list[_Code]:
        """Wrap each of ``inners`` (codes sharing their names) in the same loop header."""
        counter, outer = self.fresh("i"), self.fresh(loop.dim)
        wrapped = []
        for inner in inners:
            names = dict(inner.names)
            names[loop.dim] = outer
            lines = [f"for (int {counter} = 0; {counter} < {loop.count}; {counter}++) {{",
                     f"    const int {inner.names[loop.dim]} = {outer} + {counter} * {loop.step};",
                     *_indent(inner.lines),
                     "}"]
            wrapped.append(_Code(lines, names))
        return wrapped

    def wrap_parallel_band(self, band: list[Loop], inner: _Code) -> _Code:
        """Collapse consecutive parallel loops (outermost first) into one OpenMP loop."""
        names = dict(inner.names)
        counters, definitions = [], []
        for loop in reversed(band):  # innermost first: rename outward
            counter, outer = self.fresh("i"), self.fresh(loop.dim)
            counters.append((counter, loop.count))
            definitions.append(
                f"const int {names[loop.dim]} = {outer} + {counter} * {loop.step};")
            names[loop.dim] = outer
        counters.reverse()
        definitions.reverse()
        lines = [f"#pragma omp parallel for collapse({len(band)}) schedule(static) "
                 f"num_threads(nthreads)"]
        lines += [f"for (int {c} = 0; {c} < {n}; {c}++)" for c, n in counters]
        lines += ["{", *_indent(definitions), *_indent(inner.lines), "}"]
        return _Code(lines, names)

    def wrap_chain(self, chain: list[Loop], inner: _Code) -> _Code:
        code, i = inner, len(chain) - 1
        while i >= 0:
            if chain[i].parallel:
                j = i
                while j > 0 and chain[j - 1].parallel:
                    j -= 1
                code = self.wrap_parallel_band(chain[j:i + 1], code)
                i = j - 1
            else:
                (code,) = self.wrap_loop(chain[i], code)
                i -= 1
        return code

    # -- tree walk -----------------------------------------------------------------

    def emit(self, node: Node) -> _Code:
        chain: list[Loop] = []
        while isinstance(node, Loop):
            chain.append(node)
            node = node.body
        if isinstance(node, Block):
            return self.emit_tail(chain, node)
        if isinstance(node, TileRegion):
            return self.wrap_chain(chain, self.emit_region(node))
        return self.wrap_chain(chain, self.emit_seq(node))

    def emit_region(self, region: "TileRegion") -> _Code:
        """A tile of the output computed into a buffer on the stack (NHWC order, local
        coordinates from the tile's origin ``bo_*``), then stored to the NCHW output by
        ``ttile_store_nchw512`` through the epilogue. The buffer is cleared first when the
        blocks inside accumulate into it (a reduction split above a block)."""
        outer_region, outer_clears = self.region, self.clears_output
        self.region, self.clears_output = region, False
        body = self.emit(region.body)
        clears = self.clears_output
        self.region, self.clears_output = outer_region, outer_clears or clears
        en, eh, ew, ek = region.extents
        spec = self.spec
        size = en * eh * ew * ek
        # TTILE_CHECK_SPILLS (the tests' assembly check) moves the buffer off the stack,
        # so that any vector store to the stack left is a spill
        lines = ["#ifdef TTILE_CHECK_SPILLS",
                 f"static float yt[{size}] __attribute__((aligned(64)));",
                 "#else",
                 f"float yt[{size}] __attribute__((aligned(64)));",
                 "#endif",
                 *(f"const int bo_{d} = {body.names[d]};" for d in "nhwk")]
        if clears:
            lines.append(f"memset(yt, 0, sizeof(float) * {size});")
        lines += body.lines
        stream = int(4 * spec.n * spec.k * spec.ho * spec.wo > NCHW_STREAM_BYTES)
        lines.append(f"ttile_store_nchw512(yt, {en}, {eh}, {ew}, {ek}, y, bo_n, bo_h, bo_w, "
                     f"bo_k, {spec.k}, {spec.ho}, {spec.wo}, ep, {stream});")
        return _Code(["{", *_indent(lines), "}"], body.names)

    def emit_seq(self, seq: Seq) -> _Code:
        branches = [self.emit(branch) for branch in seq.branches]
        names = {d: self.fresh(d) for d in DIMS}
        lines: list[str] = []
        for offset, code in zip(seq.offsets, branches):
            defs = []
            for d in DIMS:
                value = f"{names[d]} + {offset}" if d == seq.dim and offset else names[d]
                defs.append(f"const int {code.names[d]} = {value};")
            lines += ["{", *_indent(defs), *_indent(code.lines), "}"]
        return _Code(lines, names)

    # -- microkernel region --------------------------------------------------------

    def emit_tail(self, chain: list[Loop], block: Block) -> _Code:
        """The loops right above a block: accumulator and input-pointer regions."""
        acc_len = _suffix_len(chain, lambda lp: lp.dim in REDUCTION_DIMS and not lp.parallel)
        ptr_len = _suffix_len(chain, lambda lp: lp.dim in ("c", "k") and not lp.parallel)
        extents = {d: block.count(d) * _product(lp.count for lp in chain[len(chain) - acc_len:]
                                                if lp.dim == d)
                   for d in REDUCTION_DIMS}
        complete = all(extents[d] == self.totals[d] for d in REDUCTION_DIMS)
        if not complete:
            self.clears_output = True

        names = {d: self.fresh(d) for d in DIMS}
        guarded = self.row_guard or self.col_guard
        fast = _Code(self.block_body(block, names, guarded=False), dict(names))
        slow = _Code(self.block_body(block, names, guarded=True), dict(names)) if guarded else None

        position = 0
        while True:
            if position == ptr_len:
                fast = self.pointer_region(block, fast, slow)
                slow = None
            if position == acc_len:
                fast = self.accumulator_region(block, fast, complete, extents)
                if slow is not None:
                    slow = self.accumulator_region(block, slow, complete, extents)
            if position == len(chain):
                return fast
            if position == max(acc_len, ptr_len):
                return self.wrap_chain(chain[:len(chain) - position], fast)
            loop = chain[len(chain) - 1 - position]
            if slow is None:
                (fast,) = self.wrap_loop(loop, fast)
            else:
                fast, slow = self.wrap_loop(loop, fast, slow)
            position += 1

    def accumulator_region(self, block: Block, inner: _Code, complete: bool,
                           extents: dict[str, int]) -> _Code:
        """Accumulators loaded (or zeroed) around ``inner`` and stored after it, through
        the epilogue when this store is the last one (see the module docstring)."""
        spec, names, lanes, vt = self.spec, inner.names, self.lanes, self.v.vector_type
        lines: list[str] = []
        kvs = range(block.count("k"))
        if self.k_tail and self.v.isa is Isa.AVX512F:
            for kv in kvs:
                lines.append(f"const __mmask16 m{kv} = ttile_tail_mask({spec.k} - "
                             f"({names['k']} + {kv * lanes}));")
        stores: list[str] = []
        fused: list[str] = []
        # the epilogues whose constants fit beside this block's accumulators at the store
        # (the others go through memory like silu)
        free = self.v.registers - len(_out_combos(block)) * block.count("k")
        column = 0 if self.v.isa is Isa.AVX512F else 1
        in_registers: dict[str, list[str]] = {
            kind: [] for kind, (*constants, _) in _REGISTER_EPILOGUES.items()
            if constants[column] < free}
        for out in _out_combos(block):
            for kv in kvs:
                acc = _acc(out, kv)
                offset = self.y_offset(names, out, kv)
                addr = f"{self.y} + {offset}"
                mask = self.mask(kv, names["k"]) if self.k_tail else self.full_mask()
                k = f"{names['k']} + {kv * lanes}"
                fused.append(f"ttile_epilogue_apply{self.bits}(ep, y, {offset}, {k}, {mask});")
                load = (lambda a: self.masked_load(mask, a)) if self.k_tail else \
                    (lambda a: f"{self.op('loadu_ps')}({a})")
                store = (lambda a, v: self.masked_store(mask, a, v)) if self.k_tail else \
                    (lambda a, v: f"{self.op('storeu_ps')}({a}, {v});")
                biased = f"{self.op('add_ps')}({acc}, {load(f'ep->bias + {k}')})"
                for kind in in_registers:
                    value = _REGISTER_EPILOGUES[kind][-1]
                    in_registers[kind].append(store(addr, value(
                        self, biased, load(f"ep->residual + {offset}"))))
                if complete:
                    lines.append(f"{vt} {acc} = {self.op('setzero_ps')}();")
                else:
                    lines.append(f"{vt} {acc} = {load(addr)};")
                stores.append(store(addr, acc))
        if self.nchw:   # the epilogue is applied by the tile's NCHW store
            return _Code(["{", *_indent(lines + inner.lines + stores), "}"], inner.names)
        # the condition of the store that applies the epilogue ("": every store)
        last = " && ".join(f"{names[d]} + {extents[d]} == {self.totals[d]}"
                           for d in sorted(REDUCTION_DIMS) if extents[d] != self.totals[d])
        kind = f"({last}) ? epk : TTILE_EPK_NONE" if last else "epk"
        if self.weight_prefetch:
            lines = self.residual_prefetch(block, names, last) + lines
        # one branch per block store: the common epilogues in registers, the others
        # from memory after the stores (see ttile_epilogue_apply512)
        store = [f"switch ({kind}) {{"]
        for name, code in in_registers.items():
            store += [f"case {name}:", *_indent(code), "    break;"]
        store += [*(f"case {kind}:" for kind in _REGISTER_EPILOGUES if kind not in in_registers),
                  "case TTILE_EPK_OTHER:", *_indent(stores),
                  '    __asm__ volatile("" ::: "memory");', *_indent(fused), "    break;",
                  "default:", *_indent(stores), "}"]
        return _Code(["{", *_indent(lines + inner.lines + store), "}"], inner.names)

    def residual_prefetch(self, block: Block, names: dict[str, str], last: str) -> list[str]:
        """Before the reduction of a block whose store adds a residual, a prefetch of each
        line of the residual it will read. Those lines are a few pixels' channels, rows
        of the map apart, which the hardware's streams do not see coming: a load at the
        store waited for every one (1x1 64->256 on 56x56 with a residual took 1.3x the
        time without, 2 threads, Xeon model 167). The block's reduction covers the wait."""
        lines = []
        for out in _out_combos(block):
            for kv in range(block.count("k")):
                if (kv * self.lanes) % 16 == 0:   # one per 64-byte line
                    lines.append(f"_mm_prefetch((const char *)(rp + "
                                 f"{self.y_offset(names, out, kv)}), _MM_HINT_T0);")
        condition = "rp != NULL" + (f" && {last}" if last else "")
        return [f"if ({condition}) {{", *_indent(lines), "}"]

    def pointer_region(self, block: Block, fast: _Code, slow: _Code | None) -> _Code:
        """Input addressing for the c/k band: base pointer, or guarded per-pixel pointers."""
        spec, names = self.spec, fast.names
        dh, dw = spec.dilation_h, spec.dilation_w
        first_h = f"{names['h']} * {spec.stride_h} + {names['r']} * {dh} - {spec.pad_top}"
        first_w = f"{names['w']} * {spec.stride_w} + {names['s']} * {dw} - {spec.pad_left}"
        base = self.x_address(names["n"], first_h, first_w)
        fast_lines = [f"const float *restrict xb = {base};", *fast.lines]
        if slow is None:
            return _Code(["{", *_indent(fast_lines), "}"], names)

        conditions = []
        h_first = f"{names['h']} * {spec.stride_h} + {names['r']} * {dh} - {spec.pad_top}"
        w_first = f"{names['w']} * {spec.stride_w} + {names['s']} * {dw} - {spec.pad_left}"
        h_span = (block.count("h") - 1) * spec.stride_h + (block.count("r") - 1) * dh
        w_span = (block.count("w") - 1) * spec.stride_w + (block.count("s") - 1) * dw
        if self.row_guard:
            conditions += [f"{h_first} >= 0", f"{h_first} + {h_span} < {spec.h}"]
        if self.col_guard:
            conditions += [f"{w_first} >= 0", f"{w_first} + {w_span} < {spec.w}"]

        self.uses_zeros = True
        setup = []
        for pix in _pixel_combos(block):
            n_u, h_u, w_u, r_u, s_u = pix
            ih = (f"({names['h']} + {h_u}) * {spec.stride_h} + ({names['r']} + {r_u}) * {dh} - "
                  f"{spec.pad_top}")
            iw = (f"({names['w']} + {w_u}) * {spec.stride_w} + ({names['s']} + {s_u}) * {dw} - "
                  f"{spec.pad_left}")
            checks = []
            if self.row_guard:
                checks.append(f"(unsigned)({ih}) < {spec.h}u")
            if self.col_guard:
                checks.append(f"(unsigned)({iw}) < {spec.w}u")
            addr = self.x_address(f"{names['n']} + {n_u}", ih, iw)
            valid = " && ".join(checks)
            setup.append(f"const float *restrict {_xp(pix)} = ({valid}) ? {addr} : {self.zeros};")
            if self.nchw:   # channels a plane apart; the zero row is read at stride 0
                setup.append(f"const int64_t {_xs(pix)} = ({valid}) ? "
                             f"{spec.h * spec.w} : 0;")
        lines = [f"if ({' && '.join(conditions)}) {{", *_indent(fast_lines), "} else {",
                 *_indent(setup + slow.lines), "}"]
        return _Code(lines, names)

    def x_address(self, n: str, ih: str, iw: str) -> str:
        """The address of input pixel (n, ih, iw), channel 0: NHWC, or NCHW in the NCHW
        entry point (its channels then a plane, H*W floats, apart)."""
        spec = self.spec
        if self.nchw:
            return (f"x + ((int64_t)({n}) * {spec.c * spec.h} + ({ih})) * {spec.w} + ({iw})")
        return f"x + (((int64_t)({n}) * {spec.h} + ({ih})) * {spec.w} + ({iw})) * {self.x_pixel}"

    @property
    def zeros(self) -> str:
        return f"zeros_{self.name}"

    # -- the unrolled block --------------------------------------------------------

    def y_offset(self, names: dict[str, str], out: tuple[int, int, int], kv: int) -> str:
        """Offset from y of accumulator ``out``, vector ``kv`` (NHWC); in the NCHW entry
        point, from the tile buffer, in the tile's coordinates."""
        spec = self.spec
        n_u, h_u, w_u = out
        if self.nchw:
            _, eh, ew, ek = self.region.extents
            return (f"((int64_t)({names['n']} + {n_u} - bo_n) * {eh} + ({names['h']} + {h_u} "
                    f"- bo_h)) * {ew * ek} + ({names['w']} + {w_u} - bo_w) * {ek} + "
                    f"{names['k']} - bo_k + {kv * self.lanes}")
        return (f"(((int64_t)({names['n']} + {n_u}) * {spec.ho} + ({names['h']} + {h_u})) "
                f"* {spec.wo} + ({names['w']} + {w_u})) * {self.y_pixel} + {names['k']} + "
                f"{kv * self.lanes}")

    def block_body(self, block: Block, names: dict[str, str], guarded: bool) -> list[str]:
        """Outer-product body: per reduction step, load k vectors, broadcast each pixel."""
        spec = self.spec
        lines: list[str] = []
        kvs = range(block.count("k"))
        steps = list(itertools.product(range(block.count("c")), range(block.count("r")),
                                       range(block.count("s"))))
        for index, (c_u, r_u, s_u) in enumerate(steps):
            if index or self.nchw:
                # (in the NCHW entry point also at the first step: with channels a plane
                # apart, gcc unrolled a short c loop and hoisted its weight loads, and
                # spilled)
                # Keeps the compiler from merging equal broadcasts of different steps
                # (with r unrolled, pixel h+1 at r=0 is pixel h at r=1): keeping those
                # alive across steps took more registers than there are, and spilled.
                lines.append('__asm__ volatile("" ::: "memory");')
            step = ["{"]
            panel = self.lanes * block.count("k")
            w_row = (f"w + (((int64_t)({names['k']} / {panel}) * {spec.r} + ({names['r']} + {r_u})) "
                     f"* {spec.s} + ({names['s']} + {s_u})) * {spec.c} * {panel} + "
                     f"(int64_t)({names['c']} + {c_u}) * {panel}")
            vt = self.v.vector_type
            for kv in kvs:  # panels are zero-filled past K: no mask needed on weights
                step.append(f"    const {vt} wv{kv} = {self.op('loadu_ps')}({w_row} + "
                            f"{kv * self.lanes});")
            if self.weight_prefetch:
                # the panels are read in storage order (c, then s, r, then the next
                # panel), so the line this far ahead is one the kernel reads soon; one
                # prefetch per 64-byte line (AVX2 vectors are half a line); past the last
                # panel a prefetch reads nothing and faults on nothing
                ahead = max(WEIGHT_PREFETCH_STEPS * panel, WEIGHT_PREFETCH_MIN_FLOATS)
                for offset in range(0, panel, 16):
                    step.append(f"    _mm_prefetch((const char *)({w_row} + "
                                f"{offset + ahead}), _MM_HINT_T0);")
            for out in _out_combos(block):
                n_u, h_u, w_u = out
                pix = (n_u, h_u, w_u, r_u, s_u)
                ih = h_u * spec.stride_h + r_u * spec.dilation_h
                iw = w_u * spec.stride_w + s_u * spec.dilation_w
                if self.nchw and guarded:
                    x = f"{_xp(pix)}[(int64_t)({names['c']} + {c_u}) * {_xs(pix)}]"
                elif self.nchw:
                    plane = spec.h * spec.w
                    offset = n_u * spec.c * plane + c_u * plane + ih * spec.w + iw
                    x = f"xb[(int64_t){names['c']} * {plane} + {offset}]"
                elif guarded:
                    x = f"{_xp(pix)}[{names['c']} + {c_u}]"
                else:
                    offset = ((n_u * spec.h + ih) * spec.w + iw) * self.x_pixel + c_u
                    x = f"xb[{names['c']} + {offset}]"
                broadcast = f"b{'_'.join(map(str, out))}"
                step.append(f"    const {vt} {broadcast} = {self.op('set1_ps')}({x});")
                for kv in kvs:
                    acc = _acc(out, kv)
                    step.append(f"    {acc} = {self.op('fmadd_ps')}({broadcast}, wv{kv}, "
                                f"{acc});")
            step.append("}")
            lines += step
        return lines


#: The epilogues applied in registers at the store (TTILE_EPK_*): the vector registers
#: each needs beside the accumulators in AVX-512F and in AVX2 (constants and
#: temporaries: AVX2's leaky ReLU blends through a compare mask held in a ymm register,
#: where AVX-512 has mask registers; with one register too few it spilled), and the
#: stored value from ``biased`` (acc + bias) and ``residual`` (its load), as C
#: expressions in the generator ``g``'s vector family.
_REGISTER_EPILOGUES = {
    "TTILE_EPK_BIAS": (0, 0, lambda g, biased, residual: biased),
    "TTILE_EPK_BIAS_RELU": (1, 1, lambda g, biased, residual:
                            f"{g.op('max_ps')}({biased}, {g.op('setzero_ps')}())"),
    "TTILE_EPK_BIAS_RESIDUAL": (0, 0, lambda g, biased, residual:
                                f"{g.op('add_ps')}({biased}, {residual})"),
    "TTILE_EPK_BIAS_RESIDUAL_RELU": (1, 1, lambda g, biased, residual:
                                     f"{g.op('max_ps')}({g.op('add_ps')}({biased}, "
                                     f"{residual}), {g.op('setzero_ps')}())"),
    "TTILE_EPK_BIAS_RELU6": (2, 2, lambda g, biased, residual:
                             f"{g.op('min_ps')}({g.op('max_ps')}({biased}, "
                             f"{g.op('setzero_ps')}()), {g.op('set1_ps')}(6.0f))"),
    "TTILE_EPK_BIAS_LEAKY_RELU": (2, 4, lambda g, biased, residual:
                                  f"ttile_leaky{g.bits}({biased}, ep->negative_slope)"),
}


def _suffix_len(chain: list[Loop], keep) -> int:
    length = 0
    for loop in reversed(chain):
        if not keep(loop):
            break
        length += 1
    return length


def _product(values) -> int:
    total = 1
    for v in values:
        total *= v
    return total


def _out_combos(block: Block) -> list[tuple[int, int, int]]:
    return list(itertools.product(range(block.count("n")), range(block.count("h")),
                                  range(block.count("w"))))


def _pixel_combos(block: Block) -> list[tuple[int, int, int, int, int]]:
    return list(itertools.product(*(range(block.count(d)) for d in _SPATIAL)))


def _acc(out: tuple[int, int, int], kv: int) -> str:
    return f"acc_{'_'.join(map(str, out))}_{kv}"


def _xp(pix: tuple[int, ...]) -> str:
    return f"xp_{'_'.join(map(str, pix))}"


def _xs(pix: tuple[int, ...]) -> str:
    return f"xs_{'_'.join(map(str, pix))}"


#: Largest tile buffer of an NCHW entry point: on the stack of each thread, and kept in
#: L2 between the blocks that fill it and the transposing store (1-2 MB L2 per core on
#: the CPUs seen; 128 KB holds a 544-wide row of 32 channels).
NCHW_TILE_BYTES = 128 * 1024

#: Outputs larger than this are stored with non-temporal stores where whole aligned
#: lines allow (ttile_store_nchw512): they would leave the caches before being read.
NCHW_STREAM_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class TileRegion:
    """Where an NCHW entry point buffers its output: ``body`` covers a tile of
    ``extents`` (n, h, w, k; k in whole vectors) holding the whole reduction."""

    extents: tuple[int, int, int, int]
    body: Node


def _has_parallel(node: Node) -> bool:
    if isinstance(node, Loop):
        return node.parallel or _has_parallel(node.body)
    if isinstance(node, Seq):
        return any(_has_parallel(b) for b in node.branches)
    return False


def tile_regions(node: Node, extents: dict[str, int], budget: int = NCHW_TILE_BYTES
                 ) -> "Node | None":
    """``node`` with a :class:`TileRegion` around the outermost sub-trees whose output
    tile fits ``budget`` bytes, hold the whole reduction (no c/r/s loop above them) and
    run on one thread (no parallel loop inside); None when some block has no such
    region above it (the scheme then has no NCHW entry point). ``extents`` is what
    ``node`` covers along n, h, w and k."""
    size = 4 * extents["n"] * extents["h"] * extents["w"] * extents["k"]
    if size <= budget and not _has_parallel(node):
        return TileRegion(tuple(extents[d] for d in "nhwk"), node)
    if isinstance(node, Loop):
        if node.dim in REDUCTION_DIMS:
            return None
        body = tile_regions(node.body, {**extents, node.dim: node.step}, budget)
        return None if body is None else Loop(node.dim, node.count, node.step, node.parallel,
                                              body)
    if isinstance(node, Seq):
        branches = []
        for branch in node.branches:   # each a loop along node.dim (see scheme.lower)
            covered = branch.count * branch.step if isinstance(branch, Loop) else extents[node.dim]
            marked = tile_regions(branch, {**extents, node.dim: covered}, budget)
            if marked is None:
                return None
            branches.append(marked)
        return Seq(node.dim, node.offsets, tuple(branches))
    return None


def _regions(node) -> list[TileRegion]:
    if isinstance(node, TileRegion):
        return [node]
    if isinstance(node, Loop):
        return _regions(node.body)
    if isinstance(node, Seq):
        return [r for b in node.branches for r in _regions(b)]
    return []


def nchw_name(name: str) -> str:
    """The NCHW entry point of kernel ``name``: ``..._<hash>_nchw`` before the family
    suffix."""
    stem, sep, family = name.rpartition("__")
    return f"{stem}_nchw__{family}" if sep else f"{name}_nchw"


def generate(scheme: Scheme, spec: ConvSpec, command: str = "ttile.codegen.generate",
             isa: Isa = Isa.AVX512F, weight_prefetch: bool = False) -> KernelSource:
    """Generate the C source of ``scheme`` applied to ``spec`` in the vector family
    ``isa`` (the scheme is validated against that family's lanes and registers first).

    With ``weight_prefetch``, every reduction step also prefetches the weights
    :data:`WEIGHT_PREFETCH_STEPS` steps ahead (see there), and a block whose store adds
    a residual first prefetches the residual's lines (``_Generator.residual_prefetch``):
    run-time tuning generates its kernels so. The offline search's do not yet: its
    records, and the sets built from them, were measured without it.

    The unit defines the kernel (NHWC in, NHWC out) and, where the scheme allows
    (:func:`tile_regions`), its NCHW entry point ``nchw_name(name)``: the same loops and
    blocks, NHWC input, the output stored to NCHW tile by tile through the epilogue."""
    vectors = vector_isa(isa)
    tree = lower(scheme, spec, vectors.isa)
    name = kernel_name(scheme, spec, vectors.isa, weight_prefetch)
    gen = _Generator(spec, name, vectors, weight_prefetch=weight_prefetch)
    body = gen.emit(tree)
    totals = spec.iteration_extents(vectors.lanes)
    # AVX-512F only: the AVX2 family's NCHW entry points (a scalar tile store; NCHW
    # input read 8 lanes at a time) ran 1.2-2.2x slower than converting around the NHWC
    # kernel on Yolo9000-9, -13, -18, -19 and ResNet18-7 (Zen 5, 1 thread)
    # (a grouped problem has none: its calls convert NCHW around the NHWC kernel)
    regions = (tile_regions(tree, {d: totals[d] for d in "nhwk"}, NCHW_TILE_BYTES)
               if vectors.isa is Isa.AVX512F and spec.groups == 1 else None)
    if regions is not None and any(r.extents[2] < min(16, spec.wo) for r in _regions(regions)):
        # tiles narrower than a vector along w (blocks unrolled along h): their NCHW rows
        # are a few floats long, and storing them cost twice the transposing second pass
        # (Yolo9000-2, 11 x 1 x 32 tiles: 22 ms against 12)
        regions = None
    nchw = None
    if regions is not None:
        nchw = _Generator(spec, name, vectors, nchw=True, weight_prefetch=weight_prefetch)
        nchw_body = nchw.emit(regions)

    out: list[str] = [
        "/* Generated by ttile, do not edit.",
        f" * scheme:  {scheme}",
        f" * problem: {spec.key()} (K={spec.k} C={spec.c} H={spec.h} W={spec.w} "
        f"R={spec.r} S={spec.s}, output {spec.ho}x{spec.wo}"
        + (f", dilation {spec.dilation_h}x{spec.dilation_w}" if spec.dilated else "") + ")",
        f" * command: {command}",
        f" * generator version {GENERATOR_VERSION}; vector family {vectors.isa.value} "
        f"(compile with {' '.join(vectors.cflags)})"
        + ("; weights prefetched ahead" if weight_prefetch else ""),
        " */",
        "#include <immintrin.h>",
        "#include <stdint.h>",
        "#include <string.h>",
        '#include "ttile_epilogue.h"',
        "",
    ]
    if gen.k_tail and vectors.isa is Isa.AVX512F:  # guarded: kernels may share a file
        out += ["#ifndef TTILE_TAIL_MASK_DEFINED",
                "#define TTILE_TAIL_MASK_DEFINED",
                "static inline __mmask16 ttile_tail_mask(int remaining)",
                "{",
                "    return remaining >= 16 ? (__mmask16)0xFFFF",
                "                           : (__mmask16)((1u << remaining) - 1u);",
                "}",
                "#endif",
                ""]
    if gen.uses_zeros:
        out += [f"static const float {gen.zeros}[{spec.c}] __attribute__((aligned(64)));", ""]
    signature = ("(const float *restrict x, const float *restrict w, float *restrict y, "
                 "int nthreads, const ttile_epilogue *restrict ep)")
    entry = [f"const int {body.names[d]} = 0;" for d in DIMS]
    grouped = spec.groups > 1
    out += [f"{'static void ' + name + '_group' if grouped else 'void ' + name}{signature}",
            "{",
            "    (void)nthreads;",
            "    const int epk = ttile_epilogue_kind(ep);"]
    if weight_prefetch:
        out += ["    const float *const rp = ep != NULL ? ep->residual : NULL;",
                "    (void)rp;"]
    if gen.clears_output and not grouped:
        size = spec.n * spec.ho * spec.wo * spec.k
        out.append(f"    memset(y, 0, sizeof(float) * (size_t){size});")
    elif gen.clears_output:   # this group's channels of each pixel, not the others'
        out += [f"    for (int64_t p = 0; p < {spec.n * spec.ho * spec.wo}; p++)",
                f"        memset(y + p * {gen.y_pixel}, 0, sizeof(float) * {spec.k});"]
    out += _indent(entry) + _indent(body.lines) + ["}", ""]
    panel = vectors.lanes * _block_of(tree).count("k")
    if grouped:
        out += _group_loop(name, signature, spec, panel, across=not _has_parallel(tree))
    if nchw is not None:
        entry = [f"const int {nchw_body.names[d]} = 0;" for d in DIMS]
        out += [f"/* NCHW output, tile by tile (see ttile_store_nchw512). */",
                f"void {nchw_name(name)}{signature}",
                "{",
                "    (void)nthreads;",
                *_indent(entry), *_indent(nchw_body.lines), "}", ""]
    return KernelSource(name=name, spec=spec, scheme=scheme, code="\n".join(out), panel=panel,
                        isa=vectors.isa, nchw_name=None if nchw is None else nchw_name(name))


def _group_loop(name: str, signature: str, spec: ConvSpec, panel: int,
                across: bool) -> list[str]:
    """The entry point of a grouped problem: the group's kernel on each group, its input,
    weights, output, bias and residual offset to that group's channels. A scheme with
    parallel loops parallelises within each group, the groups one after the other; a
    scheme without (``across``) runs on one thread a group, the groups shared among the
    threads: the group loop is then the parallel one. At 2 threads ResNeXt-50's 32
    groups of 16 channels on 14x14 ran at 133 GFLOP/s so, against the grouped kernel's
    105, and its groups of 32 at stride 2 at 282 against the generic kernel's 172, where
    no scheme parallel within a group had won (Xeon model 207, run-time tuning)."""
    weights = -(-spec.k // panel) * spec.r * spec.s * spec.c * panel
    how = "shared among the threads" if across else "one after the other"
    return [f"/* {spec.groups} groups of the kernel above, {how}. */",
            f"void {name}{signature}",
            "{",
            *(["#pragma omp parallel for schedule(static) num_threads(nthreads) "
               "if (nthreads > 1)"] if across else []),
            f"    for (int g = 0; g < {spec.groups}; g++) {{",
            "        ttile_epilogue e;",
            "        const ttile_epilogue *eg = NULL;",
            "        if (ep != NULL) {",
            "            e = *ep;",
            f"            if (e.bias != NULL) e.bias += (int64_t)g * {spec.k};",
            f"            if (e.residual != NULL) e.residual += (int64_t)g * {spec.k};",
            "            eg = &e;",
            "        }",
            f"        {name}_group(x + (int64_t)g * {spec.c}, w + (int64_t)g * {weights}, "
            f"y + (int64_t)g * {spec.k}, {'1' if across else 'nthreads'}, eg);",
            "    }",
            "}",
            ""]


def _block_of(node: Node) -> Block:
    while not isinstance(node, Block):
        node = node.body if isinstance(node, Loop) else node.branches[0]
    return node
