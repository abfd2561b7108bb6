"""The offline generator: the full TTile search, from microkernels measured on this CPU
to C kernels compiled into the wheel.

Step 1 ``microkernels`` (measured register blocks, grouped into classes); step 2
``costmodel`` (the IOOpt data-movement model over ``iomodel``'s math and
``polyhedral``'s ISL/Barvinok footprints, with ``machine``'s measured bandwidths);
steps 3-4 ``search`` (scheme space, pruning, parallel variants); step 5 ``autotune``
(measurements through ``ttile.tuning``); ``emit`` writes ``kernels/gen``. ``networks``
holds the paper's layers, ``data`` finds the tables the steps read, ``plot`` draws Fig. 7.

Imports islpy, sympy and scipy (the ``generate`` or ``jit`` extra); nothing here is
loaded by ``import ttile``. Depends on ``ttile.core`` and ``ttile.tuning`` only.
"""
