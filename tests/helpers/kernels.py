"""The kernel paths (afd/kernels/paths.py) this machine can run, for parametrizing tests: every
path is tested on every machine that executes it, so none is tested on one CPU kind only."""

from __future__ import annotations

import pytest

from afd.kernels import paths

ALL = list(paths.runnable())
NATIVE = [name for name in ALL if paths.PATHS[name].native]
NO_NATIVE = pytest.mark.skip(reason="no native kernel path here (not built, or no AVX2/FMA)")
