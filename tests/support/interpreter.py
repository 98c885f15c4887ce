"""Whether Triton's interpreter can run the project's kernels here.

Triton 3.6's interpreter (the GPU machine's triton, run on CPU by ``scripts/torch_check.sh``)
turns a runtime int into a loop bound with ``int()`` of a 1-element numpy array, which
numpy 2.4 refuses: there no kernel runs interpreted. A GPU compiles them instead
(``tests/tools/test_triton_sm90.py`` compiles them for sm_90 here).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["interpreter_unsupported"]


@functools.cache
def interpreter_unsupported() -> str | None:
    """Why the kernels cannot run interpreted here, or None (not interpreting, or they
    can)."""
    from torchtitan_dmuon.optim.kernels import triton_ns

    if not triton_ns.INTERPRET:
        return None
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(standard.cdiv, InterpretedFunction):
        return "triton was imported before TRITON_INTERPRET=1 was set: its own helpers are compiled"
    try:
        triton_ns.sym_gram(torch.ones(16, 16))
    except Exception as error:  # noqa: BLE001 - the interpreter's own failure
        import numpy
        import triton

        return (
            f"triton {triton.__version__}'s interpreter with numpy {numpy.__version__}: "
            f"{type(error).__name__}: {error}"[:300]
        )
    return None
