"""Moved to `labkit.techniques.checkpointing` (the chapters' techniques); this old name will be removed.

Importing it warns (DeprecationWarning) and gives the same module object as `labkit.techniques.checkpointing`.
"""

import sys
import warnings

from labkit.techniques import checkpointing as _moved

warnings.warn("labkit.checkpointing moved to labkit.techniques.checkpointing; import it from there", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
