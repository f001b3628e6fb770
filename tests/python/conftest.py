"""Fixtures shared by the Python binding tests: the built-in model and its CPU chain."""
import pytest

import samebits


@pytest.fixture(scope="module")
def model():
    return samebits.Model.builtin()


@pytest.fixture(scope="module")
def chain(model):
    return samebits.Chain(model, backend="cpu")
