"""The run-time path of every ``conv2d`` call, one role per module, in the order a call
meets them:

* ``api``: the public ``conv2d`` and ``plan``, each a short pipeline of the rest;
* ``settings``: the vector family that serves calls, tuned kernels on or off;
* ``arguments``: checking and normalising arrays, shapes and options into a ConvSpec;
* ``call_plan``: what a call's signature determines (family, output shape, threads),
  computed once per signature;
* ``epilogue``: the bias / residual / activation fused into the store, and ``out``;
* ``routes``: the one selector of kernel and route, shared by ``conv2d`` and ``plan``;
  ``dispatch`` behind it (the ``registry`` of kernels compiled in, the disk ``cache`` of
  kernels tuned here, run-time tuning, the generic kernel);
* ``packing``: weights in the kernel's format, per call (``weight_cache`` reuses them);
* ``execute``: one runner per route;
* ``conv_layer``: ``Conv2d``, the same pipeline with weights packed once;
* ``jit``: the quick search that tunes an unseen shape (borrows the generator's search
  and the tuning layer's runner; imported only when a shape is tuned).

``import ttile`` loads all but ``jit`` and ``cache``: numpy and the extension, nothing
heavier.
"""
