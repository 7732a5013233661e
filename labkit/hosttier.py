"""Moved to `labkit.techniques.hosttier` (the chapters' techniques); this old name will be removed.

Importing it warns (DeprecationWarning) and gives the same module object as `labkit.techniques.hosttier`.
"""

import sys
import warnings

from labkit.techniques import hosttier as _moved

warnings.warn("labkit.hosttier moved to labkit.techniques.hosttier; import it from there", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
