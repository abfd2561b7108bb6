"""The pure core of ttile: what a problem is, how it is scheduled, and how a schedule
becomes a compiled kernel.

``spec`` (the problem) -> ``scheme`` (the schedule, and its lowering to a loop tree) ->
``codegen`` (C with AVX-512 intrinsics) -> ``cbuild`` (the system compiler). ``reference``
is the float64 oracle every kernel is checked against, ``cpuinfo`` the CPU fingerprint
that keys every measurement, ``kinds`` the enums shared by the layers above, ``fileio``
the one way files are written atomically.

Depends on nothing else in ttile but the compiled extension: the tuning layer, the
generator and the runtime all build on it, never the other way round.
"""
