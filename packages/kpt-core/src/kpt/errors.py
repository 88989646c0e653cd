"""The errors every backend raises, so that callers can catch them whatever backend runs."""

from __future__ import annotations


class KernelInputError(ValueError):
    """Bad input to a kernel: wrong rank, shape, dtype or device, or an out-of-range argument."""


class KernelNotSupportedError(NotImplementedError):
    """A valid argument combination that this backend does not implement."""


class BackendError(RuntimeError):
    """A backend could not be found, loaded, or used."""
