"""Moved to `labkit.techniques.precision` (the chapters' techniques); this old name will be removed.

Importing it warns (DeprecationWarning) and gives the same module object as `labkit.techniques.precision`.
"""

import sys
import warnings

from labkit.techniques import precision as _moved

warnings.warn("labkit.precision moved to labkit.techniques.precision; import it from there", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
