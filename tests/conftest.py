"""Test-session setup: without a GPU, Triton kernels run under Triton's CPU interpreter; the
fixture that tests/test_errors_*.py share (``no_compute``, defined in tests/support/error_cases.py)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The checks of the error tests live in tests/support/error_cases.py: their failed asserts explain
# themselves as the tests' do. Imported after TRITON_INTERPRET is set, since it imports orda_tp.
pytest.register_assert_rewrite("tests.support.error_cases")
from tests.support.error_cases import no_compute  # noqa: E402, F401
