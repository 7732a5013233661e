"""Moved to `labkit.techniques.accumulation` (the chapters' techniques); this old name will be removed.

Importing it warns (DeprecationWarning) and gives the same module object as `labkit.techniques.accumulation`.
"""

import sys
import warnings

from labkit.techniques import accumulation as _moved

warnings.warn("labkit.accumulation moved to labkit.techniques.accumulation; import it from there", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
