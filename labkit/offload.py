"""Moved to `labkit.techniques.offload` (the chapters' techniques); this old name will be removed.

Importing it warns (DeprecationWarning) and gives the same module object as `labkit.techniques.offload`.
"""

import sys
import warnings

from labkit.techniques import offload as _moved

warnings.warn("labkit.offload moved to labkit.techniques.offload; import it from there", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
