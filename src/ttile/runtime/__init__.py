"""The run-time path of every ``conv2d`` call: argument checks and layouts (``api``),
layers with packed weights (``conv_layer``), which kernel serves a problem
(``dispatch``: the ``registry`` of kernels compiled in, the disk ``cache`` of kernels
tuned here, the generic kernel), and the quick search that tunes an unseen shape
(``jit``, which borrows the generator's search and the tuning layer's runner, imported
only when a shape is tuned).

``import ttile`` loads ``api``, ``conv_layer``, ``dispatch`` and ``registry``: numpy and
the extension, nothing heavier.
"""
