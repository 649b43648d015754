"""`python -m jaxstation ...` is `jaxstation ...`."""

import sys

from jaxstation.cli import main

sys.exit(main())
