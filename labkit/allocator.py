"""Moved to `labkit.planner.allocator` (the planner's subpackage); this old name will be removed.

Importing it warns (DeprecationWarning) and gives the same module object as `labkit.planner.allocator`.
"""

import sys
import warnings

from labkit.planner import allocator as _moved

warnings.warn("labkit.allocator moved to labkit.planner.allocator; import it from there", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
