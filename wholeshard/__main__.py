"""`python -m wholeshard ...` is the `wholeshard` command."""

import sys

from wholeshard.cli import main

if __name__ == "__main__":
    sys.exit(main())
