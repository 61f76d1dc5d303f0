"""``python -m graphtrees.report [--json] [--] script.py [args...]``: runs the script, then prints
:func:`graphtrees.report` (the work is graphtrees/_report.py's).

``graphtrees.report`` is a function of the package and this module's name as well: importing the
module (``import graphtrees.report``, ``from graphtrees.report import main``) makes Python set the
package's ``report`` attribute to the module, so the module is callable and calling it calls the
function -- ``graphtrees.report()`` works after any import.
"""

import sys
import types

from graphtrees._report import main, report


class _CallableModule(types.ModuleType):
    """This module, callable as :func:`graphtrees.report` is."""

    def __call__(self, format: str = "text"):
        return report(format)


__all__ = ["main", "report"]

if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
