"""The tuning layer: one way to build, check and time a kernel, one shipping rule, and
the typed records of what was measured.

``bench`` builds candidate kernels, checks each against the float64 reference and times
it (cold-cache protocol, or warm side by side with the generic kernel); ``policy`` holds
:class:`ShipPolicy`, the rule that decides whether a searched kernel beats the generic
one; ``records`` is the tuning database (JSON lines, format-versioned, one file per CPU).

Used by the offline generator and by the run-time tuner alike; depends only on
``ttile.core`` and the compiled extension.
"""
