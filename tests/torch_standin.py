"""The torch stand-ins of the tests: :mod:`gpudash.testing` (in the package, so that
notebook 09 runs them where no GPU is, from an installed gpudash)."""

from gpudash.testing import GiB, MiB, ModelTorch, StandInTorch

__all__ = ["GiB", "MiB", "ModelTorch", "StandInTorch"]
