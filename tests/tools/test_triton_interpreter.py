"""Without a GPU the suite runs the Triton kernels under Triton's interpreter: triton is
imported in interpreter mode (``tests/conftest.py`` sets ``TRITON_INTERPRET`` before anything
imports it), else the kernels' tests would all be skipped (their probe fails)."""

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles the kernels")
def test_triton_is_imported_in_interpreter_mode_without_a_gpu():
    pytest.importorskip("triton")
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    # triton.jit decorated triton's own helpers when triton was imported.
    assert isinstance(standard.cdiv, InterpretedFunction), (
        "triton was imported before TRITON_INTERPRET=1 was set"
    )
