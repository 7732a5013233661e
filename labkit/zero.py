"""Moved to `labkit.techniques.zero` (the chapters' techniques); this old name will be removed.

Importing it warns (DeprecationWarning) and gives the same module object as `labkit.techniques.zero`.
"""

import sys
import warnings

from labkit.techniques import zero as _moved

warnings.warn("labkit.zero moved to labkit.techniques.zero; import it from there", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
