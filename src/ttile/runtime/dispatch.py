"""Which kernel serves a problem: tuned (compiled into ttile), JIT (tuned here, cached on
disk) or generic; and the run-time tuning policy that fills the JIT cache.

The decision is made once per (problem, layout, threads) and remembered in memory;
everything slow (cache files, compiler, search) happens only on a problem's first call.
Every failure of the run-time path (no compiler, no libraries, unwritable cache, a build
error) degrades to the generic kernel with one warning per cause, never an exception
from ``conv2d``.
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from .. import _kernels
from ..core.kinds import GenericBlocking, Isa, KernelKind
from ..core.spec import ConvSpec
from ..core.vectors import extension_code
from ..tuning.policy import DEFAULT_SHIP_POLICY, ShipPolicy
from . import registry

MODES = ("now", "background", "never")


@dataclass(frozen=True, kw_only=True)
class KernelChoice:
    """A kernel ready to run: what it is, the problem it was made for, and the weight
    panel width it reads.

    ``panel`` 0 means RSCK weights (the portable kernel); ``address`` is a JIT kernel's
    entry point and ``handle`` the loaded library that keeps it valid. A tuned or JIT
    kernel's sizes are compile-time constants: the arrays of a call are checked against
    ``problem`` before it runs.
    """

    kind: KernelKind
    problem: ConvSpec
    panel: int
    index: int = -1                 # registry index of a tuned kernel
    address: int = 0
    scheme: str = ""
    microkernels: str = ""
    gflops: Optional[float] = None  # measured when it was tuned
    note: str = ""
    handle: Any = None
    final: bool = True              # False while a background tuning may replace it
    tuned_cpu: Optional[str] = None     # the CPU the choice was measured on
    tuned_threads: Optional[int] = None  # and the thread count
    warm_gflops: float = 0.0            # a tuned kernel's warm rate, and the generic
    generic_gflops: float = 0.0         # kernel's beside it (0: not compared)
    isa: Isa = Isa.AVX512F              # the vector family (or portable) it runs
    address_nchw: int = 0               # a JIT kernel's NCHW-output entry point (0: none)
    nchw: bool = False                  # the kernel can store an NCHW output itself
    degraded: str = ""                  # what was lost on the way here ("" : nothing)
    tile: int = 0                       # the Winograd kernel's output tile, 4 or 2 (0: other kinds)
    blocking: GenericBlocking = GenericBlocking.DEFAULT   # the vector generic kernel's


@dataclass(frozen=True)
class TuningPolicy:
    """How shapes without a tuned kernel are handled.

    mode: "now" tunes on the first call (the call waits: the learned ranking's first
    picks are compiled and timed, about 2 s; without a ranker the model-ranked search of
    at most ``budget_seconds`` plus compile time), "background" serves the generic kernel
    while a background thread runs the fuller model-ranked search, "never" always serves
    the generic kernel. Problems under ``min_mflops`` are
    not tuned: they run in microseconds either way.
    """

    mode: str = "now"
    budget_seconds: float = 20.0
    min_mflops: float = 1.0
    cache_dir: Optional[Path] = None   # default: $TTILE_CACHE_DIR or the user cache dir
    ship: ShipPolicy = DEFAULT_SHIP_POLICY   # when a tuned kernel replaces the generic one


def _policy_from_environment() -> TuningPolicy:
    mode = os.environ.get("TTILE_TUNING", "now").strip().lower()
    if mode not in MODES:
        warnings.warn(f"TTILE_TUNING={mode!r} is not one of {MODES}; using 'now'",
                      RuntimeWarning, stacklevel=2)
        mode = "now"
    budget = 20.0
    if os.environ.get("TTILE_TUNING_BUDGET"):
        try:
            budget = max(0.5, float(os.environ["TTILE_TUNING_BUDGET"]))
        except ValueError:
            warnings.warn("TTILE_TUNING_BUDGET is not a number; using 20 s", RuntimeWarning,
                          stacklevel=2)
    return TuningPolicy(mode=mode, budget_seconds=budget)


_policy = _policy_from_environment()
_choices: dict[tuple, KernelChoice] = {}
_lock = threading.Lock()
_key_locks: dict[tuple, threading.Lock] = {}
_warned: set[str] = set()
_background = None  # a one-worker ThreadPoolExecutor, made by the first background tuning
_pending: set[tuple] = set()
_memory_dir: Optional[Path] = None


def set_tuning(mode: Optional[str] = None, budget_seconds: Optional[float] = None,
               min_mflops: Optional[float] = None, cache_dir: Optional[os.PathLike] = None,
               ship: Optional[ShipPolicy] = None) -> TuningPolicy:
    """Change the run-time tuning policy (see :class:`TuningPolicy`); returns the previous.

    Arguments left None keep their value. Choices already made in this process stay.
    """
    global _policy
    previous = _policy
    changes: dict[str, Any] = {}
    if mode is not None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        changes["mode"] = mode
    if budget_seconds is not None:
        if isinstance(budget_seconds, bool) or not isinstance(budget_seconds, (int, float)) \
                or not budget_seconds > 0:
            raise ValueError(f"budget_seconds must be a positive number, got {budget_seconds!r}")
        changes["budget_seconds"] = float(budget_seconds)
    if min_mflops is not None:
        if isinstance(min_mflops, bool) or not isinstance(min_mflops, (int, float)) \
                or not min_mflops >= 0:
            raise ValueError(f"min_mflops must be a number >= 0, got {min_mflops!r}")
        changes["min_mflops"] = float(min_mflops)
    if cache_dir is not None:
        changes["cache_dir"] = Path(cache_dir)
    if ship is not None:
        if not isinstance(ship, ShipPolicy):
            raise TypeError(f"ship must be a ttile.ShipPolicy, got {ship!r}")
        changes["ship"] = ship
    _policy = replace(_policy, **changes)
    return previous


def restore_tuning(policy: TuningPolicy) -> None:
    """Put back a policy returned by :func:`set_tuning`."""
    global _policy
    if not isinstance(policy, TuningPolicy):
        raise TypeError("restore_tuning takes the TuningPolicy that set_tuning returned")
    _policy = policy


def tuning_policy() -> TuningPolicy:
    return _policy


def forget_choices() -> None:
    """Drop the in-memory choices and the record of warnings given, so the next call of
    each problem decides (and warns) again."""
    _choices.clear()
    _warned.clear()


def warn_once(cause: str, message: str) -> None:
    """Warn about a degraded path once per cause (``forget_choices`` resets it)."""
    if cause not in _warned:
        _warned.add(cause)
        warnings.warn(f"ttile: {message}", RuntimeWarning, stacklevel=4)


def generic_choice(isa: Isa, spec: ConvSpec, note: str = "", final: bool = True
                   ) -> KernelChoice:
    """The generic kernel of family ``isa``: the vector one reads panels of its own
    width (AVX-512F: 16 x its block's vectors, AVX2: 8 x), the portable one RSCK."""
    if isa.vector:
        return KernelChoice(kind=KernelKind.GENERIC, problem=spec,
                            panel=_kernels.generic_panel(spec.k, spec.wo, extension_code(isa)),
                            note=note, final=final, isa=isa)
    return KernelChoice(kind=KernelKind.GENERIC, problem=spec, panel=0,
                        note=note or "portable C (no AVX-512F, no AVX2)", final=final,
                        isa=Isa.PORTABLE)


def registry_choice(entry: registry.TunedEntry, isa: Isa) -> KernelChoice:
    """What a verdict of the offline search serves: its kernel, or the generic one."""
    where = (f"{entry.layer}, searched on {entry.cpu} at {entry.threads} thread(s)"
             + ("" if entry.isa is Isa.AVX512F else f" in {entry.isa.value}")
             + ("" if entry.cpu == registry.serving_cpu()
                else ", the same microarchitecture as this CPU"))
    if entry.kind is KernelKind.GENERIC:
        return replace(generic_choice(isa, entry.spec, f"the offline search chose the "
                                                       f"generic kernel ({where})"),
                       tuned_cpu=entry.cpu, tuned_threads=entry.threads)
    return KernelChoice(kind=KernelKind.TUNED, problem=entry.spec, panel=entry.panel,
                        index=entry.index, scheme=entry.scheme,
                        microkernels=entry.microkernels, gflops=entry.gflops,
                        note=f"compiled into ttile ({where})", tuned_cpu=entry.cpu,
                        tuned_threads=entry.threads, warm_gflops=entry.warm_gflops,
                        generic_gflops=entry.generic_gflops, isa=entry.isa,
                        nchw=entry.nchw)


#: Data rates that weigh what packing weights costs a per-call conv2d, measured on the
#: AMD EPYC Zen 5 the Zen 5 set was searched on (one thread; taken to grow with the square
#: root of the thread count): weights packed per call for a searched kernel, then read
#: back from that copy, 12 GB/s (ResNet18-10: 0.84 ms for 9.4 MB); the generic kernel's
#: threads packing the caller's weights themselves, 20 GB/s (0.5 ms). The NCHW output is
#: not weighed: a rate model of the searched kernel's second pass against the generic
#: kernel's NCHW stores picked the generic kernel for Yolo9000-5, which then ran 1.4x
#: slower (its input, cold in the caches, costs the generic kernel more than the model says).
PACK_PER_CALL_BYTES_PER_S = 12e9
PACK_IN_KERNEL_BYTES_PER_S = 20e9
#: The weight cache's check of a per-call call's weights against the panels it packed on
#: the first call, both read from L3 (what the layers or engines run in between leave):
#: 512 KB in 26 us at 1 thread, 20 GB/s (ResNet18-11, Zen 5: 0.082 ms per call on its
#: searched kernel, 0.056 pre-packed).
CHECK_PER_CALL_BYTES_PER_S = 20e9
#: Weights smaller than this pack in microseconds: the kernel the tuning chose serves
#: per call as it does packed.
PACK_WEIGHED_MIN_BYTES = 128 << 10


def _weights_stay_in_cache(weight_bytes: int, layout: str, threads: int) -> bool:
    """Whether an NHWC call's weights fit the L2 caches of its threads. A searched
    kernel's per-call NHWC call then checks them against the panels it packed on the
    first call (``weight_cache``), and the check, like the generic kernel's own packing,
    reads from cache at about 50 GB/s a core (0.5-2.3 MB, Zen 5): the rates above, of
    9.4 MB from memory, charged the searched kernel four times what it pays. ResNet18-11
    (512 KB) was served per call by the generic kernel at 0.09 ms (1 thread) and 0.10 ms
    (2 threads), where its searched kernel took 0.057 and 0.037 packed. NCHW calls pack
    torch's KCRS weights, a transpose, and keep the rates. Where the generic kernel reads
    such weights in place, the two are weighed with the check's rate instead: ResNet18-11
    per call then took 0.067 ms by the generic kernel at 1 thread and 0.035 at 2, against
    0.082 and 0.050 by its searched kernel and the check (weights in L3, Zen 5)."""
    return layout == "NHWC" and weight_bytes <= threads * _kernels.cpu_l2_bytes()


def _generic_reads_in_place(spec: ConvSpec, threads: int, isa: Isa) -> bool:
    """Whether the generic kernel reads this NHWC call's RSCK weights where they are (its
    direct path: small outputs, weights at least its cache blocking), packing nothing.
    It then costs a per-call call what it costs pre-packed, while a searched kernel
    still pays the weight cache's check."""
    return _kernels.generic_reads_in_place(
        spec.n, spec.h, spec.w, spec.c, spec.k, spec.r, spec.s, spec.ho, spec.wo,
        spec.stride_h, spec.stride_w, spec.pad_top, spec.pad_left, spec.dilation_h,
        spec.dilation_w, threads, extension_code(isa))


def for_call(choice: KernelChoice, spec: ConvSpec, layout: str, per_call: bool,
             threads: int, isa: Isa) -> KernelChoice:
    """The kernel for one kind of call: a searched kernel of the registry is the faster
    kernel, but a per-call ``conv2d`` must pack its weights for it, where the generic
    kernel packs them in place as its threads go. With both kernels' warm rates in the
    registry, the generic kernel serves a per-call call when its estimated time is lower
    (a 9.4 MB layer: ResNet18-10 at 2 threads took 1.20 ms per call with its searched
    kernel, 0.95 with the generic one). The same holds for a kernel tuned here, whose
    head-to-head with the generic kernel gave both rates (ResNet18-12 at 1 thread on a Zen
    5: 1.66 ms per call with its run-time tuned kernel, 1.25 with the generic one, 0.93
    and 1.07 with the weights packed). (Charging the generic kernel's NCHW call with its
    input conversion, which a searched kernel's NCHW entry point skips, made ResNet18-7
    and -11 slower per call: their inputs convert from cache.)"""
    weight_bytes = 4 * spec.k * spec.c * spec.r * spec.s
    if not per_call or choice.kind not in (KernelKind.TUNED, KernelKind.JIT) \
            or not isa.vector or not (choice.warm_gflops > 0 and choice.generic_gflops > 0) \
            or weight_bytes < PACK_WEIGHED_MIN_BYTES:
        return choice
    in_cache = _weights_stay_in_cache(weight_bytes, layout, threads)
    if in_cache and not _generic_reads_in_place(spec, threads, isa):
        return choice
    scale = threads ** 0.5
    tuned = spec.flops / (choice.warm_gflops * 1e9)
    generic = spec.flops / (choice.generic_gflops * 1e9)
    if in_cache:   # checked by the weight cache, against none packed (ResNet18-11)
        tuned += weight_bytes / (CHECK_PER_CALL_BYTES_PER_S * scale)
    else:
        if choice.panel != spec.k or layout == "NCHW":
            tuned += weight_bytes / (PACK_PER_CALL_BYTES_PER_S * scale)
        generic += weight_bytes / (PACK_IN_KERNEL_BYTES_PER_S * scale)
    if generic >= tuned:
        return choice
    note = (f"the generic kernel, estimated {generic * 1e3:.3f} ms per call with its "
            f"weights against {tuned * 1e3:.3f} ms for the searched kernel {choice.note}")
    return replace(generic_choice(isa, spec, note), tuned_cpu=choice.tuned_cpu,
                   tuned_threads=choice.tuned_threads)


# -- the cache key -------------------------------------------------------------------------
_compiler_id: Optional[str] = None


def compiler_identity() -> Optional[str]:
    """Path and version of the C compiler JIT kernels are built with (None: none found)."""
    global _compiler_id
    from ..core.cbuild import compiler_version, find_compiler
    path = find_compiler()
    if path is None:
        return None
    if _compiler_id is None or not _compiler_id.startswith(path + "|"):
        _compiler_id = path + "|" + compiler_version(path)
    return _compiler_id


def cache_key(spec: ConvSpec, layout: str, threads: int, compiler: str,
              isa: Isa = Isa.AVX512F):
    from .._version import __version__
    from ..core.codegen import GENERATOR_VERSION
    from ..core.cpuinfo import fingerprint
    from .cache import CacheKey
    return CacheKey(problem=spec.key(), layout=layout, threads=threads,
                    cpu=fingerprint().id, compiler=compiler, ttile_version=__version__,
                    generator_version=GENERATOR_VERSION, isa=isa.value)


def _open_cache():
    from .cache import KernelCache
    return KernelCache(_policy.cache_dir)


# -- loading a cached entry ----------------------------------------------------------------
def _load(entry, spec: ConvSpec) -> KernelChoice:
    """A KernelChoice from a cache entry (a JIT entry's library is loaded here)."""
    import ctypes
    if entry.problem != spec:
        raise ValueError(f"cache entry for {entry.problem.key()}, not {spec.key()}")
    isa = Isa(entry.key.isa)
    if entry.kind is not KernelKind.JIT:
        bar = "the generic kernel" if spec.groups == 1 else "the kernel serving its groups"
        return replace(generic_choice(isa, spec, f"tuned here: no scheme beat {bar}"),
                       gflops=entry.generic_gflops or None)
    # Load a private copy of the bytes: the dynamic loader would hand back a library
    # already loaded under the same path (stale once the entry is rebuilt), and the
    # cache file may be replaced or damaged while this process runs. The copy is
    # unlinked at once; the mapping stays.
    payload = entry.payload if entry.payload is not None else Path(entry.library).read_bytes()
    import tempfile
    fd, private = tempfile.mkstemp(dir=_memory_directory(), suffix=".so")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        handle = ctypes.CDLL(private)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(private)
    from ..core.cbuild import symbol_address
    from ..core.codegen import nchw_name
    address = symbol_address(handle, entry.function)
    try:   # libraries built before kernels had NCHW entry points have none
        address_nchw = symbol_address(handle, nchw_name(entry.function))
    except AttributeError:
        address_nchw = 0
    return KernelChoice(kind=KernelKind.JIT, problem=entry.problem, panel=entry.panel,
                        address=address, address_nchw=address_nchw,
                        nchw=address_nchw != 0, scheme=entry.scheme,
                        microkernels=entry.microkernels, gflops=entry.gflops,
                        warm_gflops=entry.gflops, generic_gflops=entry.generic_gflops,
                        tuned_cpu=entry.key.cpu, tuned_threads=entry.key.threads,
                        note=f"tuned here in {entry.search_seconds:.1f} s "
                             f"({entry.library.name})", handle=handle, isa=isa)


def cached_choice(spec: ConvSpec, layout: str, threads: int,
                  isa: Isa = Isa.AVX512F) -> Optional[KernelChoice]:
    """The choice a valid disk cache entry gives, without tuning (None: no entry)."""
    compiler = compiler_identity()
    if compiler is None:
        return None
    cache = _open_cache()
    entry = cache.lookup(cache_key(spec, layout, threads, compiler, isa))
    if entry is None:
        return None
    try:
        return _load(entry, spec)
    except (OSError, AttributeError, ValueError) as exc:
        warn_once("cache-load", f"the cached kernel for {spec.key()} did not load "
                                f"({type(exc).__name__}: {exc})")
        return None


def _memory_directory() -> Path:
    """A private directory for libraries when the cache cannot be written."""
    global _memory_dir
    if _memory_dir is None:
        import atexit
        import shutil
        import tempfile
        _memory_dir = Path(tempfile.mkdtemp(prefix="ttile-jit-"))
        atexit.register(shutil.rmtree, _memory_dir, True)
    return _memory_dir


def _tune_and_store(spec: ConvSpec, layout: str, threads: int, isa: Isa) -> KernelChoice:
    """Look the problem up in the disk cache, else tune it and store the result."""
    from .cache import CacheEntry, CacheUnavailable
    from .jit import JitSettings, JitUnavailable, tune

    compiler = compiler_identity()
    if compiler is None:
        warn_once("compiler", "no C compiler on PATH: shapes without a tuned kernel run "
                              "the generic kernel (set CC or install gcc/clang to tune them)")
        return replace(generic_choice(isa, spec, "no C compiler to tune with"),
                       degraded="not tuned: no C compiler")
    key = cache_key(spec, layout, threads, compiler, isa)
    cache = _open_cache()
    policy = _policy
    persistent = True
    try:
        cache.ensure_writable()
    except CacheUnavailable as exc:
        warn_once("cache", f"{exc}; tuned kernels are kept in memory for this process only")
        persistent = False

    def tune_once() -> KernelChoice:
        entry = cache.lookup(key)
        lost = []
        if cache.rejected:
            lost.append(f"cache entry refused ({cache.rejected})")
            warn_once("cache-entry", f"the cached kernel for {spec.key()} was refused "
                                     f"({cache.rejected}); tuning the shape again")
        if entry is not None:
            try:
                return _load(entry, spec)
            except (OSError, AttributeError, ValueError) as exc:
                lost.append(f"cache entry did not load ({type(exc).__name__})")
                warn_once("cache-load", f"the cached kernel for {spec.key()} did not load "
                                        f"({type(exc).__name__}: {exc}); tuning the shape "
                                        f"again")
        try:
            # "now": the call waits, so the learned ranking picks the few to measure;
            # "background": nobody waits, so the fuller model-ranked search runs
            result = tune(spec, threads,
                          JitSettings(ranked=policy.mode != "background",
                                      budget_seconds=policy.budget_seconds, ship=policy.ship),
                          cache_root=cache.root if persistent else None, isa=isa)
        except JitUnavailable as exc:
            warn_once("jit", f"{exc}; shapes without a tuned kernel run the generic kernel")
            return replace(generic_choice(isa, spec, str(exc)),
                           degraded=f"not tuned: {exc}")
        new = CacheEntry(key=key, problem=result.problem, kind=result.kind,
                         function=result.function, panel=result.panel, scheme=result.scheme,
                         microkernels=result.microkernels, gflops=result.gflops,
                         generic_gflops=result.generic_gflops,
                         search_seconds=result.search_seconds, measured=result.measured,
                         wrong=result.wrong, failed=result.failed)
        if result.wrong:
            warn_once("wrong-kernels", f"{result.wrong} generated kernel(s) for "
                                       f"{spec.key()} computed wrong results and were "
                                       f"discarded (a code generator bug: please report it)")
        if result.failed:
            warn_once("failed-kernels", f"{result.failed} generated kernel(s) for "
                                        f"{spec.key()} did not build or ran past the "
                                        f"compiler's time limit and were not measured")
        if not result.ranked and policy.mode != "background":
            from .jit import ranker_problem
            lost.append(f"tuned without the learned ranking ({ranker_problem()})")
        lost += [f"{n} candidate(s) {what}" for n, what in (
            (result.wrong, "computed wrong results"), (result.failed, "did not build"))
            if n]
        library = result.library
        chosen = None
        if persistent:
            try:
                chosen = _load(cache.store(new, library), spec)
            except CacheUnavailable as exc:
                warn_once("cache", f"{exc}; tuned kernels are kept in memory for this "
                                   f"process only")
        if chosen is None:
            chosen = _load(replace(new, library=library), spec)
        return replace(chosen, degraded="; ".join(lost))

    if not persistent:
        return tune_once()
    try:
        with cache.lock(key):
            return tune_once()
    except CacheUnavailable as exc:
        warn_once("cache", f"{exc}; tuned kernels are kept in memory for this process only")
        persistent = False
        return tune_once()


def _key_lock(key: tuple) -> threading.Lock:
    with _lock:
        return _key_locks.setdefault(key, threading.Lock())


def _tune_safely(spec: ConvSpec, layout: str, threads: int, isa: Isa) -> KernelChoice:
    try:
        return _tune_and_store(spec, layout, threads, isa)
    except Exception as exc:  # tuning must never break a convolution
        warn_once(f"tuning-error:{type(exc).__name__}",
                  f"run-time tuning failed ({type(exc).__name__}: {exc}); "
                  f"using the generic kernel")
        return replace(generic_choice(isa, spec, f"tuning failed: {exc}"),
                       degraded=f"run-time tuning failed ({type(exc).__name__})")


def _background_tune(key: tuple, spec: ConvSpec, layout: str, threads: int, isa: Isa) -> None:
    try:
        with _key_lock(key):
            _choices[key] = _tune_safely(spec, layout, threads, isa)
    finally:
        _pending.discard(key)


def choose(spec: ConvSpec, layout: str, threads: int, isa: Isa, use_tuned: bool,
           tune: bool = True) -> KernelChoice:
    """The kernel for a problem; with ``tune`` False nothing is searched (for ``plan``)."""
    global _background
    if not isa.vector:   # searched and tuned kernels are vector code
        return generic_choice(isa, spec)
    entry = registry.lookup(spec, threads, isa=isa) if use_tuned else None
    if entry is None and use_tuned and spec.n > 1:
        # A batch of a layer searched for one image: its verdict serves image by image
        # (``choice.problem.n`` is 1; the generic kernel takes the whole batch at once).
        entry = registry.lookup(replace(spec, n=1), threads, isa=isa)
    if entry is not None:
        return registry_choice(entry, isa)
    key = (spec, layout, threads, isa)
    choice = _choices.get(key)
    if choice is not None:
        return choice
    policy = _policy
    if policy.mode == "never" or spec.flops < policy.min_mflops * 1e6:
        reason = ("run-time tuning is off" if policy.mode == "never"
                  else f"under {policy.min_mflops:g} MFLOP: not worth tuning")
        return generic_choice(isa, spec, reason)
    if not tune:
        cached = cached_choice(spec, layout, threads, isa)
        return cached or generic_choice(isa, spec, f"not tuned yet (mode {policy.mode!r})",
                                        final=False)
    if policy.mode == "background":
        with _lock:
            if key not in _pending:
                _pending.add(key)
                if _background is None:
                    from concurrent.futures import ThreadPoolExecutor
                    _background = ThreadPoolExecutor(max_workers=1,
                                                     thread_name_prefix="ttile-tuner")
                _background.submit(_background_tune, key, spec, layout, threads, isa)
        return generic_choice(isa, spec, "being tuned in the background", final=False)
    with _key_lock(key):
        choice = _choices.get(key)
        if choice is None:
            choice = _tune_safely(spec, layout, threads, isa)
            _choices[key] = choice
    return choice


def wait_for_background(timeout: Optional[float] = None) -> bool:
    """Wait until background tunings finish; True when none is left (for tests, scripts)."""
    import time
    deadline = None if timeout is None else time.monotonic() + timeout
    while _pending:
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
