"""Alternative Newton-Schulz backends: Triton symmetric kernels (``triton_ns``) and Gram
Newton-Schulz (``gram_ns``).

Both keep the contract of :func:`torchtitan_dmuon.optim.newton_schulz.newton_schulz` and
share its prologue, :func:`~torchtitan_dmuon.optim.newton_schulz.prepare_ns_input`. The
Triton module is not imported here, so that this package imports on machines without
Triton; the backend registry (``optim.ns_backends``) imports it on first use.
"""
