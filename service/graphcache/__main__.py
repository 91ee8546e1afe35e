"""`python -m graphcache` = the `graphcache` command."""

import sys

from graphcache.cli import main

if __name__ == "__main__":
    sys.exit(main())
