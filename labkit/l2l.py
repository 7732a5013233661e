"""Moved to `labkit.techniques.l2l` (the chapters' techniques); this old name will be removed.

Importing it warns (DeprecationWarning) and gives the same module object as `labkit.techniques.l2l`.
"""

import sys
import warnings

from labkit.techniques import l2l as _moved

warnings.warn("labkit.l2l moved to labkit.techniques.l2l; import it from there", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
