"""Moved to `labkit.techniques.pipeline` (the chapters' techniques); this old name will be removed.

Importing it warns (DeprecationWarning) and gives the same module object as `labkit.techniques.pipeline`.
"""

import sys
import warnings

from labkit.techniques import pipeline as _moved

warnings.warn("labkit.pipeline moved to labkit.techniques.pipeline; import it from there", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
