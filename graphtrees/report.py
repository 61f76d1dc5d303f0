"""``python -m graphtrees.report [--json] -- script.py [args...]``: runs the script, then prints
:func:`graphtrees.report` (the work is graphtrees/_report.py's; the package's ``report``
attribute is that function)."""

import sys

from graphtrees._report import main

if __name__ == "__main__":
    sys.exit(main())
